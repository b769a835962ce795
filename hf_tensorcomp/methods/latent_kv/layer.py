"""`LatentKVLinear`: a key or value projection as a down-projection to a latent and the factors back up.

y = up(down x) + b, per group of KV heads: ``down`` (R x in, R = sum of the groups' ranks) gives the latent z
(what the cache keeps); ``weight`` (out_g x R, out_g = the rows of one group of heads) holds each group's
up-projection side by side: group g's rows of y are ``weight[:, cols_g] @ z[cols_g]``. The up-projections
have orthonormal columns (the leading left singular vectors of the whitened projection), so at full rank
up · down is the dense weight up to float rounding.

The forward returns the dense output, as an ``nn.Linear`` would (transformers' attention views, normalises
and rotates it), and leaves its latent z on the module (`take_latent`) for the latent attention
(`methods.latent_kv.attention`), which stores z instead of the keys and values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...layers.base import FactorizedModule, register_layer


class _GroupedLatent(FactorizedModule):
    """What the key and value forms share: a projection (in -> out) whose outputs, in groups of KV heads, each have
    a latent of their own rank, side by side in one latent of ``sum(ranks)`` columns."""

    spec_fields = {"in_features": "int>=1", "out_features": "int>=1", "ranks": "ints>=1", "bias": "bool"}

    def __init__(self, in_features: int, out_features: int, ranks: list[int]):
        super().__init__()
        groups = len(ranks)
        if not ranks or out_features % groups or any(r > out_features // groups for r in ranks):
            raise ValueError(f"{type(self).__name__}.ranks: got {ranks!r} for {out_features} outputs; allowed: one rank "
                             "per group of heads, the groups dividing the outputs evenly, each rank at most its group's rows")
        self.in_features, self.out_features, self.ranks = in_features, out_features, list(ranks)
        self.group_out = out_features // groups

    @property
    def latent_size(self) -> int:
        return sum(self.ranks)

    def group_slices(self) -> list[slice]:
        """The latent columns of each group."""
        out, start = [], 0
        for r in self.ranks:
            out.append(slice(start, start + r))
            start += r
        return out

    def spec(self) -> dict:
        return {"layer": self.layer_type, "in_features": self.in_features, "out_features": self.out_features,
                "ranks": list(self.ranks), "bias": self.bias is not None}

    @classmethod
    def from_spec(cls, spec: dict, dtype=None, root=None):
        return cls(spec["in_features"], spec["out_features"], spec["ranks"], bias=spec["bias"], dtype=dtype)


@register_layer
class LatentKVLinear(_GroupedLatent):
    layer_type = "latent_kv"

    def __init__(self, in_features: int, out_features: int, ranks: list[int], bias: bool = False, dtype=None,
                 device=None):
        super().__init__(in_features, out_features, ranks)
        self.down = nn.Parameter(torch.empty(sum(ranks), in_features, dtype=dtype, device=device))
        self.weight = nn.Parameter(torch.empty(self.group_out, sum(ranks), dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def build(cls, ups: list[torch.Tensor], downs: list[torch.Tensor], bias: torch.Tensor | None, dtype):
        """From each group's up-projection (out_g x r_g) and down-projection (r_g x in)."""
        m = cls(downs[0].shape[1], ups[0].shape[0] * len(ups), [u.shape[1] for u in ups], bias=bias is not None,
                dtype=dtype, device=downs[0].device)
        with torch.no_grad():
            m.down.copy_(torch.cat(downs).to(dtype))
            m.weight.copy_(torch.cat(ups, 1).to(dtype))
            if bias is not None:
                m.bias.copy_(bias.to(dtype))
        return m

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.down)

    def expand(self, z: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """The dense output (..., out) of latents z (..., R); `bias` False leaves the bias out."""
        up = self.weight
        if len(self.ranks) == 1:
            y = F.linear(z, up)
        else:
            y = torch.cat([F.linear(z[..., s], up[:, s]) for s in self.group_slices()], -1)
        return y + self.bias if bias and self.bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.latent(x)
        self.__dict__["_latent"] = z
        return self.expand(z)

    def take_latent(self) -> torch.Tensor | None:
        """The latent of the last forward's input (once: it is dropped here)."""
        return self.__dict__.pop("_latent", None)

    def dense_weight(self) -> torch.Tensor:
        return self.expand(self.down.T, bias=False).T

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, ranks={self.ranks}"


@register_layer
class LatentKeyLinear(_GroupedLatent):
    """A key projection kept dense, with a calibrated basis that takes its keys *after RoPE* to a latent.

    ``keys="rotated"`` (the default): the forward is the dense ``nn.Linear`` (so the model normalises and rotates
    its keys as before); the attention then stores z = down k_rot (per group of KV heads: ``down[cols_g]`` on the
    group's rows of the rotated key) and scores the queries against z directly: q · k_rot ≈ (upᵀ q) · z, so no key
    is ever rebuilt. ``up`` (out_g x R) holds each group's way back side by side, as `LatentKVLinear` does; at
    full rank down and up are inverse to each other and the scores exact up to float rounding.
    """

    layer_type = "latent_kv_key"

    def __init__(self, in_features: int, out_features: int, ranks: list[int], bias: bool = False, dtype=None,
                 device=None):
        super().__init__(in_features, out_features, ranks)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self.down = nn.Parameter(torch.empty(sum(ranks), self.group_out, dtype=dtype, device=device))
        self.up = nn.Parameter(torch.empty(self.group_out, sum(ranks), dtype=dtype, device=device))

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, ups: list[torch.Tensor],
              downs: list[torch.Tensor], dtype):
        """From the dense projection and each group's up (out_g x r_g) and down (r_g x out_g) of the rotated keys."""
        m = cls(weight.shape[1], weight.shape[0], [u.shape[1] for u in ups], bias=bias is not None, dtype=dtype,
                device=weight.device)
        with torch.no_grad():
            m.weight.copy_(weight.to(dtype))
            if bias is not None:
                m.bias.copy_(bias.to(dtype))
            m.down.copy_(torch.cat(downs).to(dtype))
            m.up.copy_(torch.cat(ups, 1).to(dtype))
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def training_form(self) -> bool:
        """While healing, the attention runs the rotated keys through ``up · down`` (`attention._through_latent`),
        so that the loss sees the keys the cache will hold and reaches ``down`` and ``up``; outside it the forward
        keeps the dense keys, as the prompt's prefill does."""
        self.__dict__["through_latent"] = True
        return True

    def storage_form(self, keep: bool = True) -> None:
        self.__dict__.pop("through_latent", None)

    def latent(self, k: torch.Tensor) -> torch.Tensor:
        """Latents (..., R) of rotated keys k (..., out) (the heads side by side, as the projection gives them)."""
        if len(self.ranks) == 1:
            return F.linear(k, self.down)
        rows = k.split(self.group_out, -1)
        return torch.cat([F.linear(kg, self.down[s]) for kg, s in zip(rows, self.group_slices())], -1)

    def expand(self, z: torch.Tensor) -> torch.Tensor:
        """The rotated keys (..., out) the latents z (..., R) stand for."""
        return torch.cat([F.linear(z[..., s], self.up[:, s]) for s in self.group_slices()], -1)

    def dense_weight(self) -> torch.Tensor:
        return self.weight

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, ranks={self.ranks} (after RoPE)"
