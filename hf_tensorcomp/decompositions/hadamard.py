"""The fast Walsh-Hadamard transform (Sylvester order), the fixed mixing of the block-Hadamard baseline."""

from __future__ import annotations

import math

import torch


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """``x @ H.T / sqrt(N)`` along the last dim (N a power of two, H the Sylvester Hadamard matrix):
    orthonormal and its own inverse; O(N log N) butterflies, H never built."""
    n = x.shape[-1]
    if n & (n - 1) or n == 0:
        raise ValueError(f"hadamard_transform: last dim {n} is not a power of two")
    lead = x.shape[:-1]
    h = 1
    y = x
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2)
        h *= 2
    return y.reshape(*lead, n) / math.sqrt(n)
