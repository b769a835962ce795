"""Attention projections that are slices of one Tucker decomposition with factors shared by all heads.

TensorLLM stacks, per attention head i, the d_model x d_head matrices W_i^Q, W_i^K, W_i^V, (W_i^O)^T
into W_all (d_model x d_head x m x h; m = 4 when all four projections are decomposed) and fits

    W_all ≈ G ×1 U1 ×2 U2 ×3 U3        U1: d_model x R1, U2: d_head x R2, U3: m x R3, G: R1 x R2 x R3 x h

(mode 4, the heads, keeps an identity factor: every head has its own core G[..., i]).
Matrix j of head i is then W_{j,i} = U1 C_{j,i} U2^T with C_{j,i} = sum_r U3[j, r] G[:, :, r, i] (R1 x R2).

`HeadTuckerFactors` (one per layer) holds U1, U2 and G; each `HeadTuckerProjection` holds its own rows
of U3 (named ``weight``, 1-D, so it never matches a dense weight's shape): one row, or ``slots`` rows
when the projection's heads fill several mode-3 slots of every slab (below). The forward never
builds a dense matrix:

    q/k/v:  y_i = U2 C_i^T (U1^T x)            per token: d_model R1 + g R1 R2 + g R2 d_head
    o:      y   = U1 sum_i C_i (U2^T a_i)      per token: h d_head R2 + h R2 R1 + R1 d_model

(g: heads of the projection's output) instead of d_model g d_head: cheaper when R1 << d_model and
R2 << d_head.

Grouped-query attention, two layouts (TensorLLM's ``gqa``): one slab per KV group (the factors'
``n_heads`` counts the KV heads; q and o fill n_rep slots of each slab, ``slots=n_rep``: query head
i = slab * n_rep + slot, as transformers reads KV head i // n_rep), or one slab per query head with
K and V entered once per query head (``n_rep > 1`` on k/v: KV head g's map is the mean of the cores
C_{j,i} of its query heads, exact at full rank where the copies are identical).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import FactorizedModule, register_layer

ROLES = ("q", "k", "v", "o")


@register_layer
class HeadTuckerFactors(FactorizedModule):
    layer_type = "head_tucker_factors"
    build_order = -1
    spec_fields = {"d_model": "int>=1", "head_dim": "int>=1", "n_heads": "int>=1", "ranks": "ints>=1"}

    def __init__(self, d_model: int, head_dim: int, n_heads: int, ranks: tuple[int, int, int], dtype=None, device=None):
        super().__init__()
        self.d_model, self.head_dim, self.n_heads = d_model, head_dim, n_heads  # n_heads: the core's slabs
        self.ranks = tuple(int(r) for r in ranks)
        r1, r2, r3 = self.ranks
        self.u1 = nn.Parameter(torch.empty(d_model, r1, dtype=dtype, device=device))
        self.u2 = nn.Parameter(torch.empty(head_dim, r2, dtype=dtype, device=device))
        self.core = nn.Parameter(torch.empty(r1, r2, r3, n_heads, dtype=dtype, device=device))

    def head_maps(self, u3_rows: torch.Tensor) -> torch.Tensor:
        """C for every slab and slot ((slabs * slots) x R1 x R2, slab-major), for a matrix's rows of U3
        (slots x R3)."""
        return torch.einsum("abrh,sr->hsab", self.core, u3_rows).flatten(0, 1)

    def spec(self) -> dict:
        return {"layer": self.layer_type, "new": True, "d_model": self.d_model, "head_dim": self.head_dim,
                "n_heads": self.n_heads, "ranks": list(self.ranks)}

    @classmethod
    def from_spec(cls, spec, dtype=None, root=None):
        return cls(spec["d_model"], spec["head_dim"], spec["n_heads"], tuple(spec["ranks"]), dtype=dtype)

    def to_dense(self):
        return None

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, head_dim={self.head_dim}, n_heads={self.n_heads}, ranks={self.ranks}"


@register_layer
class HeadTuckerProjection(FactorizedModule):
    """One of q_proj / k_proj / v_proj / o_proj, read from a `HeadTuckerFactors`; stands in for ``nn.Linear``."""

    layer_type = "head_tucker_projection"
    spec_fields = {"factors": "str", "role": ROLES, "n_rep": "int>=1", "in_features": "int>=1", "out_features": "int>=1",
                   "bias": "bool"}
    optional_fields = {"slots": "int>=1"}

    def __init__(self, factors: HeadTuckerFactors, factors_name: str, role: str, n_rep: int = 1, bias: bool = False,
                 dtype=None, device=None, slots: int = 1):
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"role: got {role!r}; allowed: {' | '.join(map(repr, ROLES))}")
        object.__setattr__(self, "_factors", factors)  # a reference, not a child: saved once, by its owner
        self.factors_name, self.role, self.n_rep, self.slots = factors_name, role, n_rep, slots
        width = factors.n_heads * slots // n_rep * factors.head_dim
        self.out_features, self.in_features = (factors.d_model, width) if role == "o" else (width, factors.d_model)
        self.weight = nn.Parameter(torch.empty(slots * factors.ranks[2], dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device)) if bias else None

    @property
    def factors(self) -> HeadTuckerFactors:
        return self._factors

    def maps(self) -> torch.Tensor:
        """C per output head (g x R1 x R2); KV heads average the maps of the query heads that read them."""
        c = self.factors.head_maps(self.weight.view(self.slots, -1))
        if self.n_rep > 1:
            c = c.view(-1, self.n_rep, *c.shape[1:]).mean(1)
        return c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # plain matmuls (no einsum path search per call: decode at batch 1 is overhead-bound)
        f, c = self.factors, self.maps()
        g, r1, r2 = c.shape
        if self.role == "o":  # a_i (hd) -> U2^T a_i (R2) -> sum_i C_i (.) (R1) -> U1 (.) (d_model)
            z = torch.matmul(x.view(*x.shape[:-1], g, f.head_dim), f.u2).flatten(-2)
            return F.linear(F.linear(z, c.transpose(1, 2).reshape(g * r2, r1).T), f.u1, self.bias)
        z = F.linear(F.linear(x, f.u1.T), c.transpose(0, 1).reshape(r1, g * r2).T)  # (..., g*R2)
        y = F.linear(z.view(*z.shape[:-1], g, r2), f.u2).flatten(-2)
        return y if self.bias is None else y + self.bias

    def dense_weight(self) -> torch.Tensor:
        f, c = self.factors, self.maps()
        if self.role == "o":  # columns of head i: U1 C_i U2^T
            return torch.einsum("ea,hab,db->ehd", f.u1, c, f.u2).reshape(self.out_features, self.in_features)
        return torch.einsum("db,hab,ea->hde", f.u2, c, f.u1).reshape(self.out_features, self.in_features)

    def spec(self) -> dict:
        return {"layer": self.layer_type, "factors": self.factors_name, "role": self.role, "n_rep": self.n_rep,
                "in_features": self.in_features, "out_features": self.out_features, "bias": self.bias is not None,
                **({"slots": self.slots} if self.slots != 1 else {})}

    @classmethod
    def from_spec(cls, spec, dtype=None, root=None):
        factors = root.get_submodule(spec["factors"])
        if not isinstance(factors, HeadTuckerFactors):
            raise ValueError(f"compressed_modules: {spec['factors']!r} is not a head-Tucker factors module; the checkpoint is corrupt")
        return cls(factors, spec["factors"], spec["role"], spec["n_rep"], bias=spec["bias"], dtype=dtype,
                   slots=spec.get("slots", 1))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, role={self.role}, "
                f"factors={self.factors_name}, n_rep={self.n_rep}, slots={self.slots}")
