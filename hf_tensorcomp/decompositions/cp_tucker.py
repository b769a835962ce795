"""CP (ALS) and Tucker (HOOI) of a 3-way tensor through tensorly's PyTorch backend.

Thin wrappers that fix what every caller needs: float32 math whatever the input dtype, a seeded and
deterministic result, a convergence tolerance and an iteration cap, and the relative reconstruction
error. tensorly does the decomposition; nothing here re-implements it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import tensorly as tl
import torch
from tensorly.decomposition import parafac, tucker


@dataclass
class CP:
    weights_folded: list[torch.Tensor]  # factor matrices, one per mode (the CP weights folded into mode 0)

    def reconstruct(self) -> torch.Tensor:
        a, b, c = self.weights_folded
        return torch.einsum("ir,jr,kr->ijk", a, b, c)


@dataclass
class Tucker:
    core: torch.Tensor
    factors: list[torch.Tensor]

    def reconstruct(self) -> torch.Tensor:
        a, b, c = self.factors
        return torch.einsum("pqr,ip,jq,kr->ijk", self.core, a, b, c)


def _seeded(seed: int):
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    return gen_state


def cp_als(tensor: torch.Tensor, rank: int, n_iter_max: int = 100, tol: float = 1e-7, init: str = "svd", seed: int = 0) -> CP:
    """CP decomposition by alternating least squares (tensorly.parafac); weights folded into factor 0."""
    state = _seeded(seed)
    try:
        with tl.backend_context("pytorch"), warnings.catch_warnings():
            # a CP rank above a mode's size is legitimate; tensorly's SVD init pads that mode and says so
            warnings.filterwarnings("ignore", message="Trying to compute SVD with n_eigenvecs")
            cp = parafac(tensor.detach().float(), rank, n_iter_max=n_iter_max, tol=tol, init=init,
                         random_state=seed, normalize_factors=False)
    finally:
        torch.random.set_rng_state(state)
    weights, factors = cp
    factors = [f.clone() for f in factors]
    factors[0] = factors[0] * weights[None, :]
    return CP(factors)


def tucker_hooi(tensor: torch.Tensor, ranks: tuple[int, int, int], n_iter_max: int = 100, tol: float = 1e-7,
                init: str = "svd", seed: int = 0) -> Tucker:
    """Tucker decomposition by higher-order orthogonal iteration (tensorly.tucker); orthonormal factors."""
    state = _seeded(seed)
    try:
        with tl.backend_context("pytorch"):
            core, factors = tucker(tensor.detach().float(), list(ranks), n_iter_max=n_iter_max, tol=tol, init=init,
                                   random_state=seed)
    finally:
        torch.random.set_rng_state(state)
    return Tucker(core.clone(), [f.clone() for f in factors])
