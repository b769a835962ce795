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


# ---------------------------------------------------------------- a random block-Hadamard rotation of the inputs
# R = D · blockdiag(H_b, ..., H_b): D a fixed diagonal of random signs, H_b the orthonormal b x b Hadamard matrix.
# A weight quantized as W R (each group's outliers spread over its block, QuIP# / QuaRot's incoherence) computes
# W x = (W R)(Rᵀ x): the layer rotates its input, x ↦ x R (row vectors), before the quantized product.

def rotation_block(n: int, cap: int = 128) -> int:
    """The block of the rotation of an n-wide input: the largest power of two <= `cap` dividing n (1: none fits)."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def rotation_signs(n: int, seed: int = 0) -> torch.Tensor:
    """The rotation's random signs (int8, ±1), the same for every n-wide input of a model (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (n,), generator=g, dtype=torch.int8) * 2 - 1)


_H: dict = {}


def _hadamard(b: int, dtype, device: torch.device) -> torch.Tensor:
    """The orthonormal b x b Hadamard matrix, built once per (b, dtype, device) (keyed on the device object: no
    string per call on the forward's path)."""
    key = (b, dtype, device)
    h = _H.get(key)
    if h is None:
        h = _H[key] = hadamard_transform(torch.eye(b, dtype=torch.float64)).to(dtype=dtype, device=device)
    return h


def _per_block(x: torch.Tensor, signs: torch.Tensor, block: int, signs_first: bool) -> torch.Tensor:
    """Signs and a Hadamard per block along the last dim, in the order asked (H_b is symmetric, so one routine
    serves ``x R`` and ``x Rᵀ``). A half-precision input on CPU is transformed in float32 and returned in its
    dtype: a bfloat16 product of these shapes costs ~5x the float32 one on CPUs without native bfloat16
    (measured at 1536 inputs, one thread). The int8 signs multiply as they are (type promotion): no float copy
    of them to keep in step with the buffer."""
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        return _per_block(x.float(), signs, block, signs_first).to(x.dtype)
    if signs_first:
        x = x * signs
    y = (x.reshape(-1, block) @ _hadamard(block, x.dtype, x.device)).reshape(x.shape)
    return y if signs_first else y * signs


def rotate(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """``x R`` along the last dim (rows of a weight, or a layer's inputs): signs, then a Hadamard per block."""
    return _per_block(x, signs, block, signs_first=True)


def unrotate(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """``x Rᵀ`` (the inverse of `rotate`): a Hadamard per block, then the signs."""
    return _per_block(x, signs, block, signs_first=False)


def rotate_gram(gram: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """Rᵀ G R: the Gram matrix of the rotated inputs x R, from that of the inputs (G symmetric)."""
    return rotate(rotate(gram, signs, block).T, signs, block).T
