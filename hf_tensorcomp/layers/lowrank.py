"""`LowRankLinear`: y = U (V x) + b, the factored form of a truncated SVD (LASER) or any rank-r product."""

from __future__ import annotations

import torch
from torch import nn

from .base import FactorizedModule, register_layer


@register_layer
class LowRankLinear(FactorizedModule):
    """Stands in for an ``nn.Linear(in_features, out_features)`` with weight ``U @ V``.

    Both factors live in one parameter, ``weight`` of shape ``(rank, in_features + out_features)``:
    ``weight[:, :in]`` is V (rank x in), ``weight[:, in:]`` is U transposed (rank x out). One tensor
    keeps the checkpoint small and plain, and its shape can never equal the dense ``(out, in)``
    (see `FactorizedModule`). The forward is two thin matmuls: 2 r (in + out) flops per token
    instead of 2 in out, cheaper whenever r < in out / (in + out).
    """

    layer_type = "lowrank"
    spec_fields = {"in_features": "int>=1", "out_features": "int>=1", "rank": "int>=1", "bias": "bool"}

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.weight = nn.Parameter(torch.empty(rank, in_features + out_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_factors(cls, u: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None, dtype=None):
        """u: (out, r), v: (r, in)."""
        out_features, rank = u.shape
        dtype = dtype or u.dtype
        m = cls(v.shape[1], out_features, rank, bias=bias is not None, dtype=dtype, device=u.device)
        with torch.no_grad():
            m.weight.copy_(torch.cat([v, u.T], dim=1).to(dtype))
            if bias is not None:
                m.bias.copy_(bias.to(dtype))
        return m

    @property
    def v(self) -> torch.Tensor:
        return self.weight[:, : self.in_features]

    @property
    def u(self) -> torch.Tensor:
        return self.weight[:, self.in_features :].T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.factor_linear(self.factor_linear(x, "v"), "u", self.bias)

    def dense_weight(self) -> torch.Tensor:
        return self.u @ self.v


    def append_factors(self, u: torch.Tensor, v: torch.Tensor) -> None:
        """Add ``u @ v`` (u: out x k, v: k x in) exactly, by growing the rank by k (used to merge LoRA)."""
        extra = torch.cat([v, u.T], dim=1).to(self.weight)
        self.weight = nn.Parameter(torch.cat([self.weight.data, extra], dim=0), requires_grad=self.weight.requires_grad)
        self.rank = self.weight.shape[0]

    def truncate(self, rank: int) -> None:
        """Drop the factors beyond `rank` (the inverse of `append_factors`)."""
        self.weight = nn.Parameter(self.weight.data[:rank].clone(), requires_grad=self.weight.requires_grad)
        self.rank = rank

    def spec(self) -> dict:
        return {"layer": self.layer_type, "in_features": self.in_features, "out_features": self.out_features,
                "rank": self.rank, "bias": self.bias is not None}

    @classmethod
    def from_spec(cls, spec: dict, dtype=None, root=None) -> "LowRankLinear":
        return cls(spec["in_features"], spec["out_features"], spec["rank"], bias=spec["bias"], dtype=dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, bias={self.bias is not None}"
