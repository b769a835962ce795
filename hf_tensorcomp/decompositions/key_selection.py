"""The scorers of state reduction: which key/query channels of each linear-attention head to keep.

"The Key to State Reduction in Linear Attention: A Rank-based Perspective" (§3.3
and App. B). All of them choose, per key head, one set of channels shared by queries and keys, the
same number in every head. Shapes: ``wq``, ``wk`` (heads, dk, in) — the q / k projection rows of
each head (the paper's columns of W_Q, W_K); activations (tokens, heads, dk).

- L1 (§3.3, "Weight-Magnitude-based"): s_i = ‖W_Q[:, i]‖₁ + ‖W_K[:, i]‖₁.
- S-Wanda (§3.3): s_i = Σ_j |W_Q,ij| ‖X_j‖₂ + Σ_j |W_K,ij| ‖X_j‖₂, ‖X_j‖₂ the norm of input feature
  j over the calibration tokens.
- Grad (§3.3, "Sensitivity-based", first-order Taylor): s_i = Σ_j |W_Q,ij ∇W_Q,ij| + Σ_j |W_K,ij ∇W_K,ij|,
  ∇ the gradient of the language-modelling loss on the calibration text.
- DRRQR (§3.3, App. B.2): strong rank-revealing QR (`rrqr.strong_rrqr`, tolerance f) on the stacked
  post-convolution queries and keys of the head, A = [Q; K] (a seeded subsample of each).
- Rand (§5): a seeded random subset.
- PCA (§3.2, App. B.4–B.5): not a subset but a semi-orthogonal P (k x dk) per head: the top-k
  eigenvectors of the head's key covariance (centred, on the keys the convolution reads: the
  projections' outputs, where Prop. B.1's decorrelation assumption holds). W_Q, W_K become P W_Q,
  P W_K and each convolution filter the energy-weighted mix (P ∘ P) h (Prop. B.1).

L1, S-Wanda and Grad keep the top-k scores of each head.
"""

from __future__ import annotations

import torch

from .rrqr import pca_basis, strong_rrqr


def top_k(scores: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Per head (rows of `scores`), the sorted indices of the k largest scores."""
    return [s.topk(k).indices.sort().values for s in scores]


def l1_scores(wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    return wq.abs().sum(-1) + wk.abs().sum(-1)


def wanda_scores(wq: torch.Tensor, wk: torch.Tensor, x_norm: torch.Tensor) -> torch.Tensor:
    return (wq.abs() * x_norm).sum(-1) + (wk.abs() * x_norm).sum(-1)


def grad_scores(wq: torch.Tensor, wk: torch.Tensor, gq: torch.Tensor, gk: torch.Tensor) -> torch.Tensor:
    return (wq * gq).abs().sum(-1) + (wk * gk).abs().sum(-1)


def random_subsets(heads: int, dk: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randperm(dk, generator=gen)[:k].sort().values for _ in range(heads)]


def _subsample(x: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    return x if x.shape[0] <= n else x[torch.randperm(x.shape[0], generator=gen)[:n]]


def drrqr_subsets(q: torch.Tensor, k_act: torch.Tensor, k: int, samples: int, f: float,
                  gen: torch.Generator) -> tuple[list[torch.Tensor], int]:
    """Per head, the k columns strong RRQR picks from [Q; K] (post-conv); also the total swaps made."""
    out, swaps = [], 0
    for h in range(q.shape[1]):
        a = torch.cat([_subsample(q[:, h], samples, gen), _subsample(k_act[:, h], samples, gen)])
        idx, s = strong_rrqr(a, k, f=f)
        out.append(torch.tensor(idx))
        swaps += s
    return out, swaps


def pca_projections(keys: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Per head, P (k x dk): the top-k principal directions of the head's keys (tokens, heads, dk)."""
    return [pca_basis(keys[:, h], k) for h in range(keys.shape[1])]
