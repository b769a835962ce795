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

Grouped-query attention, two layouts (TRAWL's option ``gqa``):

- grouped: the slices are n_kv * head_dim rows tall (K's and V's shape), and Q and O^T (whose rows
  are query heads) each fill ``slots = n_rep`` consecutive slices — slice r of Q holds the query
  heads g * n_rep + r of every KV group g. Such a matrix reads C[i .. i + slots) (its ``weight`` is
  1-D, slots * R0) and its rows (or, stored transposed, its columns) interleave the slots per head:
  y = A M_r Bᵀ x gives the rows of heads g * n_rep + r. Every weight enters the tensor once.
- repeated: a K or V matrix with fewer rows than Q is stacked once per query head of its group
  (query head h reads KV head h // n_rep, as in transformers); its slice reads back the mean of the
  copies, which for the factored form means averaging A's rows over the copies.
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
    (kv head, copy, head_dim) in the stack and averaged over the copies. ``slots > 1`` marks a
    matrix spread over that many consecutive slices, its rows (kv head, slot, head_dim) in the model.
    """

    layer_type = "tensor_slice"
    spec_fields = {"factors": "str", "index": "int>=0", "transposed": "bool", "n_rep": "int>=1", "head_dim": "int>=1",
                   "in_features": "int>=1", "out_features": "int>=1", "bias": "bool"}
    optional_fields = {"slots": "int>=1"}

    def __init__(self, factors: SharedFactors, factors_name: str, index: int, transposed: bool = False,
                 n_rep: int = 1, head_dim: int = 1, bias: bool = False, dtype=None, device=None, slots: int = 1):
        super().__init__()
        if n_rep > 1 and slots > 1:
            raise ValueError(f"tensor_slice: n_rep={n_rep} and slots={slots}; allowed: at most one of them above 1")
        object.__setattr__(self, "_factors", factors)  # a reference, not a child: saved once, by its owner
        self.factors_name, self.index, self.transposed = factors_name, index, transposed
        self.n_rep, self.head_dim, self.slots = n_rep, head_dim, slots
        rows = factors.out_dim // n_rep * slots
        self.out_features, self.in_features = (factors.in_dim, rows) if transposed else (rows, factors.in_dim)
        self.weight = nn.Parameter(torch.empty(slots * factors.ranks[0], dtype=dtype, device=device))
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

    def _interleave(self, y: torch.Tensor) -> torch.Tensor:
        """(..., slots, n_kv * head_dim) -> (..., n_kv * slots * head_dim): the model's head order."""
        return y.unflatten(-1, (-1, self.head_dim)).transpose(-3, -2).flatten(-3)

    def _forward_slots(self, x: torch.Tensor) -> torch.Tensor:
        f = self.factors
        a, b, c = f.out_factor, f.in_factor, self.weight.view(self.slots, -1)
        m = c if f.kind == "cp" else torch.einsum("sk,kab->sab", c, f.core)  # M_r for each slot r
        if self.transposed:  # y = sum_r B M_r^T A^T x_r, x_r: the inputs of the heads in slot r
            z = x.unflatten(-1, (-1, self.slots, self.head_dim)).transpose(-3, -2).flatten(-2) @ a
            z = z * m if f.kind == "cp" else torch.einsum("...sa,sab->...sb", z, m)
            return F.linear(z.sum(-2), b, self.bias)
        z = F.linear(x, b.T)  # y_r = A M_r B^T x
        z = z.unsqueeze(-2) * m if f.kind == "cp" else torch.einsum("...b,sab->...sa", z, m)
        y = self._interleave(F.linear(z, a))
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slots > 1:
            return self._forward_slots(x)
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
        ms = [f.mixing(c) for c in self.weight.view(self.slots, -1)]
        w = torch.stack([self._out_factor() @ (torch.diag(m) if f.kind == "cp" else m) @ f.in_factor.T for m in ms])
        w = self._interleave(w.permute(2, 0, 1)).T if self.slots > 1 else w[0]  # rows in the model's head order
        return w.T if self.transposed else w

    def spec(self) -> dict:
        return {"layer": self.layer_type, "factors": self.factors_name, "index": self.index,
                "transposed": self.transposed, "n_rep": self.n_rep, "head_dim": self.head_dim,
                "in_features": self.in_features, "out_features": self.out_features, "bias": self.bias is not None,
                **({"slots": self.slots} if self.slots != 1 else {})}

    @classmethod
    def from_spec(cls, spec, dtype=None, root=None):
        factors = root.get_submodule(spec["factors"])
        if not isinstance(factors, SharedFactors):
            raise ValueError(f"compressed_modules: {spec['factors']!r} is not a shared-factors module; the checkpoint is corrupt")
        return cls(factors, spec["factors"], spec["index"], spec["transposed"], spec["n_rep"], spec["head_dim"],
                   bias=spec["bias"], dtype=dtype, slots=spec.get("slots", 1))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, factors={self.factors_name}[{self.index}], "
                f"transposed={self.transposed}, n_rep={self.n_rep}, slots={self.slots}")
