"""Matrices that are slices of one CP or Tucker decomposition, sharing its factors.

A 3-way tensor T (n x O x N) stacks n matrices (each O x N, some stored transposed, some repeated)
and is decomposed as T[i] ≈ A M_i B^T with

- CP:     M_i = diag(c_i)                    (A: O x R, B: N x R, c_i: R)
- Tucker: M_i = sum_k C[i, k] G[k]           (A: O x R1, B: N x R2, G: R0 x R1 x R2, C[i]: R0)

`SharedFactors` (one per decomposed group) holds A, B and G; each `TensorSlice` holds its own row
C[i] (named ``weight``, 1-D, so it never matches a dense weight's shape) and a reference to the
shared factors. The forward never builds the dense matrix:

    y = A (M_i (B^T x))          for a slice stored as is,
    y = B (M_i^T (A^T x))        for a slice stored transposed,

i.e. O R1 + R1 R2 + N R2 multiply-adds per token (CP: (O + N + 1) R) instead of O N. It is cheaper
than the dense matrix when that sum is below O N — for CP, when R < O N / (O + N + 1).

Grouped-query attention: a K or V matrix with fewer rows than Q is stacked *repeated* once per query
head of its group (query head h reads KV head h // n_rep, as in transformers); its slice reads back
the mean of the copies, which for the factored form means averaging A's rows over the copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import FactorizedModule, register_layer

KINDS = ("cp", "tucker")


@register_layer
class SharedFactors(FactorizedModule):
    layer_type = "shared_factors"
    build_order = -1
    spec_fields = {"kind": KINDS, "n_slices": "int>=1", "out_dim": "int>=1", "in_dim": "int>=1", "ranks": "ints>=1"}

    def __init__(self, kind: str, n_slices: int, out_dim: int, in_dim: int, ranks: tuple[int, int, int], dtype=None, device=None):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"decomposition: got {kind!r}; allowed: {' | '.join(map(repr, KINDS))}")
        self.kind, self.n_slices, self.out_dim, self.in_dim = kind, n_slices, out_dim, in_dim
        self.ranks = tuple(int(r) for r in ranks)
        r0, r1, r2 = self.ranks
        self.out_factor = nn.Parameter(torch.empty(out_dim, r1, dtype=dtype, device=device))
        self.in_factor = nn.Parameter(torch.empty(in_dim, r2, dtype=dtype, device=device))
        self.core = nn.Parameter(torch.empty(r0, r1, r2, dtype=dtype, device=device)) if kind == "tucker" else None

    def mixing(self, c: torch.Tensor) -> torch.Tensor:
        """M_i for slice coefficients c (R0,): a vector (CP, the diagonal) or an R1 x R2 matrix (Tucker)."""
        return c if self.kind == "cp" else torch.einsum("k,kab->ab", c, self.core)

    def spec(self) -> dict:
        return {"layer": self.layer_type, "new": True, "kind": self.kind, "n_slices": self.n_slices,
                "out_dim": self.out_dim, "in_dim": self.in_dim, "ranks": list(self.ranks)}

    @classmethod
    def from_spec(cls, spec, dtype=None, root=None):
        return cls(spec["kind"], spec["n_slices"], spec["out_dim"], spec["in_dim"], tuple(spec["ranks"]), dtype=dtype)

    def to_dense(self):
        return None

    def extra_repr(self) -> str:
        return f"kind={self.kind}, n_slices={self.n_slices}, out_dim={self.out_dim}, in_dim={self.in_dim}, ranks={self.ranks}"


@register_layer
class TensorSlice(FactorizedModule):
    """One matrix of a decomposed stack; stands in for ``nn.Linear(in_features, out_features)``.

    ``n_rep > 1`` marks a K/V matrix stacked repeated per query head: its rows are laid out
    (kv head, copy, head_dim) in the stack and averaged over the copies.
    """

    layer_type = "tensor_slice"
    spec_fields = {"factors": "str", "index": "int>=0", "transposed": "bool", "n_rep": "int>=1", "head_dim": "int>=1",
                   "in_features": "int>=1", "out_features": "int>=1", "bias": "bool"}

    def __init__(self, factors: SharedFactors, factors_name: str, index: int, transposed: bool = False,
                 n_rep: int = 1, head_dim: int = 1, bias: bool = False, dtype=None, device=None):
        super().__init__()
        object.__setattr__(self, "_factors", factors)  # a reference, not a child: saved once, by its owner
        self.factors_name, self.index, self.transposed = factors_name, index, transposed
        self.n_rep, self.head_dim = n_rep, head_dim
        rows = factors.out_dim // n_rep
        self.out_features, self.in_features = (factors.in_dim, rows) if transposed else (rows, factors.in_dim)
        self.weight = nn.Parameter(torch.empty(factors.ranks[0], dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device)) if bias else None

    @property
    def factors(self) -> SharedFactors:
        return self._factors

    def _out_factor(self) -> torch.Tensor:
        a = self.factors.out_factor
        if self.n_rep == 1:
            return a
        r = a.shape[1]
        return a.view(-1, self.n_rep, self.head_dim, r).mean(1).reshape(-1, r)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.factors
        a, b, m = self._out_factor(), f.in_factor, f.mixing(self.weight)
        if self.transposed:  # W = B M^T A^T
            z = F.linear(x, a.T)
            z = z * m if f.kind == "cp" else F.linear(z, m.T)
            return F.linear(z, b, self.bias)
        z = F.linear(x, b.T)  # W = A M B^T
        z = z * m if f.kind == "cp" else F.linear(z, m)
        return F.linear(z, a, self.bias)

    def dense_weight(self) -> torch.Tensor:
        f = self.factors
        m = f.mixing(self.weight)
        m = torch.diag(m) if f.kind == "cp" else m
        w = self._out_factor() @ m @ f.in_factor.T
        return w.T if self.transposed else w


    def spec(self) -> dict:
        return {"layer": self.layer_type, "factors": self.factors_name, "index": self.index,
                "transposed": self.transposed, "n_rep": self.n_rep, "head_dim": self.head_dim,
                "in_features": self.in_features, "out_features": self.out_features, "bias": self.bias is not None}

    @classmethod
    def from_spec(cls, spec, dtype=None, root=None):
        factors = root.get_submodule(spec["factors"])
        if not isinstance(factors, SharedFactors):
            raise ValueError(f"compressed_modules: {spec['factors']!r} is not a shared-factors module; the checkpoint is corrupt")
        return cls(factors, spec["factors"], spec["index"], spec["transposed"], spec["n_rep"], spec["head_dim"],
                   bias=spec["bias"], dtype=dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, factors={self.factors_name}[{self.index}], "
                f"transposed={self.transposed}, n_rep={self.n_rep}")
