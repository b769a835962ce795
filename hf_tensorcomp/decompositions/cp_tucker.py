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
from tensorly.decomposition import parafac, partial_tucker, tucker


@dataclass
class CP:
    weights_folded: list[torch.Tensor]  # factor matrices, one per mode (the CP weights folded into mode 0)

    def reconstruct(self) -> torch.Tensor:
        a, b, c = self.weights_folded
        return torch.einsum("ir,jr,kr->ijk", a, b, c)


@dataclass
class Tucker:
    core: torch.Tensor
    factors: list[torch.Tensor]  # one per decomposed mode
    modes: list[int] | None = None  # the decomposed modes (None: all); the others keep their full size in the core

    def reconstruct(self) -> torch.Tensor:
        out = self.core
        for f, m in zip(self.factors, self.modes or range(self.core.ndim)):
            out = torch.movedim(torch.tensordot(out, f, dims=([m], [1])), -1, m)
        return out


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


def tucker_hooi(tensor: torch.Tensor, ranks, n_iter_max: int = 100, tol: float = 1e-7,
                init: str = "svd", seed: int = 0, modes: list[int] | None = None) -> Tucker:
    """Tucker decomposition by higher-order orthogonal iteration; orthonormal factors.

    ``modes``: decompose only these modes (tensorly.partial_tucker; ``ranks`` has one entry per listed
    mode) — the other modes keep an identity factor, i.e. every index of them gets its own core slice
    (TensorLLM's per-head cores). ``None``: all modes (tensorly.tucker).
    """
    state = _seeded(seed)
    t = tensor.detach().float()
    try:
        with tl.backend_context("pytorch"):
            if modes is None:
                core, factors = tucker(t, list(ranks), n_iter_max=n_iter_max, tol=tol, init=init, random_state=seed)
            else:
                (core, factors), _ = partial_tucker(t, list(ranks), modes=list(modes), n_iter_max=n_iter_max, tol=tol,
                                                    init=init, random_state=seed)
    finally:
        torch.random.set_rng_state(state)
    return Tucker(core.clone(), [f.clone() for f in factors], None if modes is None else list(modes))


def fit_core(t: torch.Tensor, a: torch.Tensor, b: torch.Tensor, pl: torch.Tensor | None = None,
             pr: torch.Tensor | None = None, diagonal: bool = False) -> torch.Tensor:
    """The core M minimising ‖Lᵀ (T - A M Bᵀ) R‖_F for fixed factors, in float64.

    ``pl = L Lᵀ`` and ``pr = R Rᵀ`` (None: identity) are metrics on T's rows and columns: for a
    matrix that reads x through its columns, ``pr`` = XᵀX makes this the output error ‖(T - T') Xᵀ‖.
    M = (AᵀPl A)⁻¹ Aᵀ Pl T Pr B (Bᵀ Pr B)⁻¹; ``diagonal=True`` (CP): the best M = diag(c),
    c = ((AᵀPl A) ∘ (Bᵀ Pr B))⁻¹ diag(Aᵀ Pl T Pr B). When B has s times A's R columns (s blocks side by
    side), ``diagonal`` fits M = [diag(c_0) ... diag(c_{s-1})] and returns the s x R coefficients, s R
    unknowns at once: the Gram of the unknowns is (AᵀPl A) tiled s x s, times Bᵀ Pr B elementwise.
    """
    a, b, t = a.double(), b.double(), t.double()
    pa = a if pl is None else pl.double() @ a
    pb = b if pr is None else pr.double() @ b
    rhs = pa.T @ t @ pb
    if diagonal:
        r = a.shape[1]
        s = b.shape[1] // r
        c = torch.linalg.solve((a.T @ pa).repeat(s, s) * (b.T @ pb), rhs.view(r, s, r).diagonal(0, 0, 2).reshape(-1))
        return c if b.shape[1] == r else c.view(s, r)
    return torch.linalg.solve(b.T @ pb, torch.linalg.solve(a.T @ pa, rhs).T).T


def slice_scales(tensor: torch.Tensor, mode: int, spans: dict[str, tuple[int, int]], weight) -> torch.Tensor:
    """Each index of `tensor`'s `mode` scaled for a weighted fit (TRAWL's and TensorLLM's ``slice_weight``).

    spans: {module name: (first index, count)} along `mode`; weight: None (all 1), ``"balanced"`` (each
    matrix 1 / the RMS norm of its slices, so a fit of the scaled tensor minimises the sum of the matrices'
    squared relative errors) or {last part of a module name, e.g. "k_proj": w} (names absent weigh 1). Fit
    ``tensor * scale`` along `mode`, then divide that mode's factor rows by the scale: the model's matrices are
    unchanged in form."""
    scale = torch.ones(tensor.shape[mode], dtype=tensor.dtype, device=tensor.device)
    for name, (i, n) in spans.items():
        if weight == "balanced":
            part = tensor.narrow(mode, i, n).movedim(mode, 0)
            scale[i:i + n] = part.square().flatten(1).sum(1).mean().clamp_min(1e-30).rsqrt()
        elif isinstance(weight, dict) and (short := name.rpartition(".")[2]) in weight:
            scale[i:i + n] = weight[short]
    return scale
