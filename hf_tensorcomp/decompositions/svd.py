"""Truncated SVD, the one piece of math LASER needs (and the baseline every method is compared with)."""

from __future__ import annotations

import torch


def truncated_svd(w: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-`rank` approximation of a matrix (Eckart-Young), as factors ``u @ v``.

    Computed in float32 whatever ``w``'s dtype (torch has no fp16/bf16 SVD kernels), and returned in
    float32; the singular values are split evenly (``u = U sqrt(S)``, ``v = sqrt(S) V^T``) so neither
    factor carries all the scale when cast back to half precision.
    Returns u: (out, rank), v: (rank, in).
    """
    if w.ndim != 2:
        raise ValueError(f"truncated_svd: expected a matrix, got shape {tuple(w.shape)}")
    full = min(w.shape)
    if not 1 <= rank <= full:
        raise ValueError(f"truncated_svd: rank {rank} outside [1, {full}] for shape {tuple(w.shape)}")
    U, S, Vh = torch.linalg.svd(w.detach().float(), full_matrices=False)
    s = S[:rank].sqrt()
    return U[:, :rank] * s, s[:, None] * Vh[:rank]


def relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """||reference - approx||_F / ||reference||_F, in float32, rounded to 6 digits."""
    ref = reference.detach().float()
    diff, norm = torch.linalg.vector_norm(ref - approx.detach().float()), torch.linalg.vector_norm(ref)
    if norm == 0:  # an all-zero weight: exact if the approximation is zero too
        return 0.0 if diff == 0 else float("inf")
    return round((diff / norm).item(), 6)
