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
    _check_rank("truncated_svd", w, rank)
    U, S, Vh = torch.linalg.svd(w.detach().float(), full_matrices=False)
    s = S[:rank].sqrt()
    return U[:, :rank] * s, s[:, None] * Vh[:rank]


def _check_rank(fn: str, w: torch.Tensor, rank: int) -> None:
    if w.ndim != 2:
        raise ValueError(f"{fn}: expected a matrix, got shape {tuple(w.shape)}")
    if not 1 <= rank <= min(w.shape):
        raise ValueError(f"{fn}: rank {rank} outside [1, {min(w.shape)}] for shape {tuple(w.shape)}")


def relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """||reference - approx||_F / ||reference||_F, in float32, rounded to 6 digits."""
    ref = reference.detach().float()
    diff, norm = torch.linalg.vector_norm(ref - approx.detach().float()), torch.linalg.vector_norm(ref)
    if norm == 0:  # an all-zero weight: exact if the approximation is zero too
        return 0.0 if diff == 0 else float("inf")
    return round((diff / norm).item(), 6)


WHITEN_FLOAT64_UP_TO = 2048  # inputs up to which the whitening factor is computed in float64 (above: float32 first)


def whitening_factor(gram: torch.Tensor, damping: float = 1e-4) -> torch.Tensor:
    """Lower-triangular S with S Sᵀ = G + λI (SVD-LLM's whitening), returned in float64 (computed in float32 above
    `WHITEN_FLOAT64_UP_TO` inputs, where the products it feeds are float32 too; float64 if that Cholesky fails).

    ``G`` is XᵀX of the inputs (in x in). λ = ``damping`` x mean(diag G) keeps S invertible when some
    channels are (nearly) constant; if the Cholesky still fails λ grows tenfold, up to five times.
    With ``damping=0`` and a positive definite G, ‖(W - W') S‖_F = ‖(W - W') Xᵀ‖_F exactly.
    """
    g = gram.detach().double()
    scale = g.diagonal().mean().clamp_min(1e-12)
    lam = damping
    for _ in range(6):
        damped = g.clone()  # G + λ·mean(diag G)·I without an identity matrix beside it (memory: two Grams, not four)
        damped.diagonal().add_(lam * scale)
        if damped.shape[0] > WHITEN_FLOAT64_UP_TO:  # float32 first (a 7B down_proj's: a third of the time)
            s, info = torch.linalg.cholesky_ex(damped.float())
            if int(info) == 0 and bool(torch.isfinite(s.diagonal()).all()):
                return s.double()
        s, info = torch.linalg.cholesky_ex(damped)
        del damped
        if int(info) == 0:
            return s
        lam = max(lam * 10, 1e-6)
    raise ValueError("whitening: the input Gram matrix is not positive definite even with damping "
                     f"{lam / 10:g} x mean(diag); the calibration text is too short or the inputs are degenerate")


def unwhiten_factor(s: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """S⁻ᵀ F (float64): an input-side factor fitted in whitened coordinates, back in the original ones.

    A matrix W (out x in) reads x through its input side; with S Sᵀ = XᵀX (+ λI), ‖(W - W') Xᵀ‖ =
    ‖(W - W') S‖, so one fits W S ≈ U Fᵀ (F: in x r) and keeps W' = U (S⁻ᵀ F)ᵀ: the same shapes.
    """
    return torch.linalg.solve_triangular(s.T, f.double(), upper=True)


def whiten_mode(t: torch.Tensor, s: torch.Tensor, mode: int) -> torch.Tensor:
    """T ×_mode Sᵀ (float64): every slice along `mode` multiplied by Sᵀ there, i.e. each matrix that
    reads its input through that mode becomes W S (see `unwhiten_factor` for the way back)."""
    moved = torch.movedim(t.double(), mode, 0)
    return torch.movedim((s.T @ moved.reshape(moved.shape[0], -1)).reshape(moved.shape), 0, mode)


def whitened_svd(w: torch.Tensor, rank: int, s: torch.Tensor | None,
                 d: torch.Tensor | None = None, energy: bool = False) -> tuple:
    """Best rank-`rank` W' for the output error ‖(W - W') Xᵀ‖ (SVD-LLM): SVD of W S, S⁻¹ folded in.

    ``s``: the whitening factor (lower triangular, `whitening_factor`) or, for ASVD, a 1-D vector of
    per-input-channel scales (diag S). Returns u (out x r), v (r x in) with W' = u @ v — the same
    shapes, hence the same factored forward cost, as plain `truncated_svd` — and all singular values
    of W S (float64), whose tail beyond `rank` squared and summed is the whitened truncation loss.
    ``d`` (optional, 1-D over output channels): weights of the output error as well, ‖D (W - W') Xᵀ‖
    (Fisher-weighted SVD with d = sqrt of the outputs' mean squared loss gradient). ``energy=True``: ‖D W S‖² as a
    fourth value (a float), so that the loss the fit leaves, ‖D (W - W') S‖² = ‖D W S‖² - Σ_{i < rank} σ_i², needs no
    product of its own (exact for every way `_svd` takes: W' is D W S's projection on its top directions found).
    """
    _check_rank("whitened_svd", w, rank)
    s, d = _beside(w, s, d)
    # float32 above `EXACT_SPECTRUM` singular values, where `_svd` works in float32 anyway (a 7B matrix: half the time)
    ws = _weighted(w, s, d, torch.float32 if min(w.shape) > EXACT_SPECTRUM else torch.float64)
    U, S, Vh = _svd(ws, rank)
    root = S[:rank].sqrt()
    u = U[:, :rank] * root
    if d is not None:
        u = u / d.double()[:, None]
    b = root[:, None] * Vh[:rank]  # = v S
    if s is None:
        v = b
    elif s.ndim == 1:
        v = b / s
    else:  # v = b S⁻¹  <=>  vᵀ = S⁻ᵀ bᵀ
        v = unwhiten_factor(s, b.T).T
    if energy:
        return u.float(), v.float(), S, float(ws.double().pow(2).sum())
    return u.float(), v.float(), S


def _svd(m: torch.Tensor, rank: int, oversample: int = 16, power: int = 4, seed: int = 0):
    """(U[:, :rank], singular values, Vh[:rank]) of `m` (float64; float32 above the threshold), float64 results, by the
    cheapest way that is exact enough:
    LAPACK's SVD up to `EXACT_SPECTRUM` singular values; above it, for a rank under a quarter of them, a randomized
    range finder (`spectrum_tails`' parameters; the values then only the top rank + `oversample`), else the
    eigenvectors of the smaller Gram in float32 (a third of float64's SVD's time on a 4096-wide matrix; directions
    whose σ² are within float32's rounding of each other mix, which leaves the energy a rank captures as it was)."""
    small = min(m.shape)
    if small <= EXACT_SPECTRUM:
        U, S, Vh = torch.linalg.svd(m, full_matrices=False)
        return U[:, :rank], S, Vh[:rank]
    if rank + oversample < small // 4:
        mf = m.float()
        gen = torch.Generator(device=m.device).manual_seed(seed)
        q = torch.linalg.qr(mf @ torch.randn(m.shape[1], rank + oversample, generator=gen, device=m.device)).Q
        for _ in range(power):
            q = torch.linalg.qr(mf @ torch.linalg.qr(mf.T @ q).Q).Q
        U, S, Vh = torch.linalg.svd((q.T @ mf).double(), full_matrices=False)
        return (q.double() @ U)[:, :rank], S, Vh[:rank]
    tall = m.shape[0] >= m.shape[1]
    mf = m.float()
    ev, vec = torch.linalg.eigh(mf.T @ mf if tall else mf @ mf.T)
    S, vec = ev.double().flip(0).clamp_min(0).sqrt(), vec.flip(1)[:, :rank]
    other = (mf @ vec if tall else mf.T @ vec).double()  # U_r S_r (tall) or V_r S_r
    vec = vec.double()
    other = torch.where(S[:rank] > S[0] * 1e-12, other / S[:rank].clamp_min(1e-300), 0.0)
    return (other, S, vec.T) if tall else (vec, S, other.T)


def _beside(w: torch.Tensor, *stats):
    """`stats` (whitening factors, scales; None passes) on `w`'s device: statistics may be gathered on the host."""
    return tuple(None if t is None else t.to(w.device) for t in stats)


def lower_product(w: torch.Tensor, s: torch.Tensor, leaf: int = 512) -> torch.Tensor:
    """W S for a lower-triangular S, by halves ([W1 W2] [[S11, 0], [S21, S22]] = [W1 S11 + W2 S21, W2 S22]): half the
    arithmetic of the full product (PyTorch has no triangular product, BLAS's trmm)."""
    n = s.shape[0]
    if n <= leaf:
        return w @ s
    h = n // 2
    out = torch.empty(w.shape[0], n, dtype=torch.promote_types(w.dtype, s.dtype), device=w.device)
    out[:, :h] = lower_product(w[:, :h], s[:h, :h], leaf).addmm_(w[:, h:], s[h:, :h])
    out[:, h:] = lower_product(w[:, h:], s[h:, h:], leaf)
    return out


def gram_of(x: torch.Tensor, leaf: int = 256) -> torch.Tensor:
    """XᵀX by halves ([X1 X2]: X1ᵀX1 and X2ᵀX2 by halves, X2ᵀX1 once, its transpose above the diagonal): three
    quarters of the arithmetic of the full product at each split (PyTorch has no symmetric product, BLAS's syrk);
    a quarter less time at 576 and 1,536 inputs."""
    n = x.shape[1]
    if n <= leaf:
        return x.T @ x
    h = n // 2
    out = x.new_empty(n, n)
    out[:h, :h], out[h:, h:] = gram_of(x[:, :h], leaf), gram_of(x[:, h:], leaf)
    out[h:, :h] = x[:, h:].T @ x[:, :h]
    out[:h, h:] = out[h:, :h].T
    return out


def gram_energy(w: torch.Tensor, gram: torch.Tensor) -> float:
    """tr(W G Wᵀ) = ‖W Xᵀ‖² for G = XᵀX symmetric, in `w`'s dtype: 2 tr(W L Wᵀ) + Σ_j G_jj ‖W_:j‖² with L the strict lower
    triangle (`lower_product`: half the arithmetic of W G)."""
    g = gram.to(w.device, w.dtype)
    return (2 * float((lower_product(w, g.tril(-1)) * w).double().sum())
            + float((w.double().pow(2).sum(0) * g.diagonal().double()).sum()))


def _weighted(w: torch.Tensor, s: torch.Tensor | None, d: torch.Tensor | None, dtype=torch.float64) -> torch.Tensor:
    """D W S in `dtype` (S: whitening factor or 1-D scales; either side may be None; a lower-triangular S, as
    `whitening_factor` gives, by `lower_product`)."""
    wd = w.detach().to(dtype)
    if s is not None:
        s = s.to(dtype)
        wd = wd * s if s.ndim == 1 else lower_product(wd, s) if not bool(s.triu(1).any()) else wd @ s
    if d is not None:
        wd = d.to(dtype)[:, None] * wd
    return wd


def whitened_spectrum(w: torch.Tensor, s: torch.Tensor | None, d: torch.Tensor | None = None) -> torch.Tensor:
    """Singular values (float64) of D W S (see `whitened_svd`; None on a side: no weighting there): above
    `EXACT_SPECTRUM` of them, the square roots of the smaller Gram's eigenvalues in float32 (no vectors: a fraction of
    the SVD's time; a value is off by about 1e-7 of the largest σ², which moves a tail sum by as little)."""
    if min(w.shape) <= EXACT_SPECTRUM:
        return torch.linalg.svdvals(_weighted(w, s, d))
    m = _weighted(w, s, d, torch.float32)
    return torch.linalg.eigvalsh(m.T @ m if m.shape[0] >= m.shape[1] else m @ m.T).double().flip(0).clamp_min(0).sqrt()


EXACT_SPECTRUM = 1024  # `spectrum_tails`: the whole spectrum below this many singular values, the top ones above


def spectrum_tails(m: torch.Tensor, ranks, oversample: int = 16, power: int = 4, seed: int = 0) -> list[float]:
    """For each r of `ranks`: Σ_{i >= r} σ_i² of `m`, the squared error its best rank-r approximation leaves.

    At most `EXACT_SPECTRUM` singular values: all of them (the eigenvalues of the smaller Gram, float64). Above: the
    total ‖m‖² less the top max(ranks) σ² of a randomized range finder (Halko et al.: `oversample` extra directions,
    `power` power iterations, float32, re-orthonormalised each pass); its subspace captures at most what the best
    one does, so a tail is over- never under-estimated: a ladder of ranks up to 256 on a 4096-wide matrix costs ten
    thin products (`power` 4; six with 2) instead of the whole SVD. On the whitened 4-bit error of a 4096 x 2048
    matrix (inputs of decaying energy, as a `qlr` ladder prices them) 0.02 % of rank 256's gain is lost with 4 passes,
    0.07 % with 2; on a slowly decaying spectrum 2 passes over-estimate a tail by up to 2 %, 4 by under 1 %."""
    k = max(ranks)
    small = min(m.shape)
    if small <= EXACT_SPECTRUM or k + oversample >= small // 2:
        md = m.double()
        g = md.T @ md if m.shape[0] >= m.shape[1] else md @ md.T
        sv2 = torch.linalg.eigvalsh(g).flip(0).clamp_min(0)
        total = float(g.diagonal().sum())
    else:
        mf = m.float()
        gen = torch.Generator(device=m.device).manual_seed(seed)
        q = torch.linalg.qr(mf @ torch.randn(m.shape[1], k + oversample, generator=gen, device=m.device)).Q
        for _ in range(power):
            q = torch.linalg.qr(mf @ torch.linalg.qr(mf.T @ q).Q).Q
        sv2 = torch.linalg.svdvals((q.T @ mf).double()).pow(2)
        total = float(sum(r.double().pow(2).sum() for r in mf.split(1 << 12)))  # rows a block at a time
    head = torch.cat([sv2.new_zeros(1), sv2.cumsum(0)]).tolist()
    return [max(total - head[min(r, len(head) - 1)], 0.0) for r in ranks]


def output_basis(w: torch.Tensor, s: torch.Tensor | None, a: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The output directions of W (out x in) on its inputs, best first, and their singular values (float64).

    U, σ of the SVD of A W S (S: the whitening factor, `whitening_factor`; A: a metric on the outputs, a matrix or
    a 1-D vector of per-output weights; None: no whitening / weighting on that side). For every r, the latent
    z = U_rᵀ A W x and its way back A⁻¹ U_r z minimise ‖A (W - W') Xᵀ‖ among rank-r maps that pass through an
    r-dim latent (Σ σ[r:]² is the loss): the down- and up-projections of Palu / Eigen Attention, with A = I the
    plain output error.
    """
    (s,) = _beside(w, s)
    wa = w.detach().double()
    if a is not None:
        a = a.to(w.device).double()
        wa = a[:, None] * wa if a.ndim == 1 else a @ wa
    u, sv, _ = torch.linalg.svd(_weighted(wa, s, None), full_matrices=False)
    return u, sv
