"""`BlockHadamardLinear`: W ≈ B H, a learnable block-diagonal B after a fixed Hadamard transform H
(the BH1 baseline of Pence et al., after Zeng et al.'s block-Hadamard layers).

x (d_in) is zero-padded to the next power of two N, mixed by the orthonormal Walsh-Hadamard
transform (O(N log N), `decompositions.hadamard`), cut into ``blocks`` slices of N / blocks and each
slice mapped by its own (d_out / blocks) x (N / blocks) block. Parameters: N · d_out / blocks.
The paper's setting is 64 blocks (its Table 5). The map is linear: `dense_weight` is exact.
"""

from __future__ import annotations

import torch
from torch import nn

from ..decompositions.hadamard import hadamard_transform
from .base import FactorizedModule, register_layer


def padded(d: int) -> int:
    return 1 << (int(d) - 1).bit_length()


def check_blocks(d_in: int, d_out: int, blocks) -> None:
    n = padded(d_in)
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1 or n % blocks or d_out % blocks:
        divisors = [b for b in range(1, min(n, d_out) + 1) if n % b == 0 and d_out % b == 0]
        raise ValueError(f"TensorCompressionConfig.blocks: got {blocks!r} for a {d_out}x{d_in} projection (input padded "
                         f"to {n}); allowed: a common divisor of {n} and {d_out}: {divisors}")


@register_layer
class BlockHadamardLinear(FactorizedModule):
    layer_type = "block_hadamard"
    spec_fields = {"in_features": "int>=1", "out_features": "int>=1", "blocks": "int>=1", "bias": "bool"}

    def __init__(self, in_features: int, out_features: int, blocks: int = 64, bias: bool = False, dtype=None, device=None):
        super().__init__()
        check_blocks(in_features, out_features, blocks)
        self.in_features, self.out_features, self.blocks = in_features, out_features, blocks
        self.padded = padded(in_features)
        self.weight = nn.Parameter(torch.empty(blocks, out_features // blocks, self.padded // blocks, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def create(cls, in_features: int, out_features: int, blocks: int = 64, seed: int = 0,
               bias_init: torch.Tensor | None = None, dtype=torch.float32, device=None) -> "BlockHadamardLinear":
        """Random init like nn.Linear's scale (U(±1/sqrt(fan_in)) with fan_in = N / blocks)."""
        m = cls(in_features, out_features, blocks, bias=bias_init is not None, dtype=dtype, device=device)
        g = torch.Generator().manual_seed(seed)
        bound = (blocks / m.padded) ** 0.5
        with torch.no_grad():
            m.weight.copy_((torch.rand(m.weight.shape, generator=g) * 2 - 1) * bound)
            if bias_init is not None:
                m.bias.copy_(bias_init)
        return m

    def num_parameters(self) -> int:
        return self.weight.numel() + (self.bias.numel() if self.bias is not None else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, self.in_features)
        if self.padded > self.in_features:
            h = torch.nn.functional.pad(h, (0, self.padded - self.in_features))
        h = hadamard_transform(h).view(-1, self.blocks, self.padded // self.blocks)
        y = torch.einsum("tbi,boi->tbo", h, self.weight).reshape(*shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y

    def dense_weight(self) -> torch.Tensor:
        eye = torch.eye(self.in_features, dtype=self.weight.dtype, device=self.weight.device)
        w = self.forward(eye)
        return (w - self.bias if self.bias is not None else w).T

    def spec(self) -> dict:
        return {"layer": self.layer_type, "in_features": self.in_features, "out_features": self.out_features,
                "blocks": self.blocks, "bias": self.bias is not None}

    @classmethod
    def from_spec(cls, spec: dict, dtype=None, root=None) -> "BlockHadamardLinear":
        return cls(spec["in_features"], spec["out_features"], spec["blocks"], bias=spec["bias"], dtype=dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, blocks={self.blocks}, "
                f"padded={self.padded}, bias={self.bias is not None}")
