"""Column selection by strong rank-revealing QR (Gu & Eisenstat 1996), and the PCA basis of a head.

`strong_rrqr(A, k)` picks k columns of A whose leading triangular factor R11 is well conditioned:
QR with column pivoting (Businger–Golub) gives a first choice, then single swaps of a chosen column i
and a left-out column j are made while some

    rho_ij = sqrt( (R11⁻¹ R12)_ij² + (gamma_j(R22) / omega_i(R11))² ) > f,

gamma_j = 2-norm of column j of R22, omega_i = 1 / (2-norm of row i of R11⁻¹) — each such swap
multiplies |det R11| by rho_ij > f, so the loop ends (Gu & Eisenstat, Lemma 3.1 / Algorithm 4).
The largest rho is swapped first. Only R is ever needed, so the work runs on the n x n R of A.
"""

from __future__ import annotations

import torch


def pivot_order(r: torch.Tensor, k: int) -> list[int]:
    """The first k pivots of QR with column pivoting: greedily the column of largest residual norm.

    On the CPU LAPACK's ``geqp3`` does it (through scipy, which tensorly depends on): blocked, where the loop in
    `_greedy_pivots` — the same rule, kept for tensors on other devices — sweeps the whole matrix once a pivot."""
    if r.device.type == "cpu":
        import scipy.linalg

        return scipy.linalg.qr(r.detach().double().numpy(), mode="r", pivoting=True)[1][:k].tolist()
    return _greedy_pivots(r, k)


def _greedy_pivots(r: torch.Tensor, k: int) -> list[int]:
    y = r.clone()
    order: list[int] = []
    for _ in range(k):
        norms = y.pow(2).sum(0)
        if order:
            norms[order] = -1.0
        j = int(norms.argmax())
        order.append(j)
        nj = norms[j].clamp_min(0).sqrt()
        if nj > 0:
            q = y[:, j] / nj
            y = y - torch.outer(q, q @ y)
    return order


def strong_rrqr(a: torch.Tensor, k: int, f: float = 1.5, max_swaps: int = 200) -> tuple[list[int], int]:
    """Indices (sorted) of k columns of `a` (rows: samples) and the number of swaps made."""
    a = a.double()
    n = a.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"strong_rrqr: k={k} not in [1, {n}]")
    r0 = torch.linalg.qr(a, mode="r").R if a.shape[0] >= n else a
    if k == n:
        return list(range(n)), 0
    first = pivot_order(r0, k)
    perm = first + [j for j in range(n) if j not in first]
    swaps = 0
    while swaps < max_swaps:
        r = torch.linalg.qr(r0[:, perm], mode="r").R
        r11, r12 = r[:k, :k], r[:k, k:]
        d = r11.diagonal().abs()
        if float(d.min()) <= 1e-12 * max(float(d.max()), 1e-300):
            break  # the chosen columns are already dependent: no swap can be measured against R11⁻¹
        eye = torch.eye(k, dtype=r.dtype, device=r.device)
        inv = torch.linalg.solve_triangular(r11, eye, upper=True)
        w = inv @ r12
        gamma = r[k:, k:].norm(dim=0) if r.shape[0] > k else torch.zeros(n - k, dtype=r.dtype, device=r.device)
        rho2 = w.pow(2) + torch.outer(inv.norm(dim=1), gamma).pow(2)  # 1/omega_i = ‖row i of R11⁻¹‖
        best = int(rho2.argmax())
        if float(rho2.view(-1)[best]) <= f * f:
            break
        i, j = divmod(best, n - k)
        perm[i], perm[k + j] = perm[k + j], perm[i]
        swaps += 1
    return sorted(perm[:k]), swaps


def pca_basis(x: torch.Tensor, k: int) -> torch.Tensor:
    """(k x d): the top-k eigenvectors (rows) of the centred covariance of the rows of x."""
    x = x.double()
    x = x - x.mean(0, keepdim=True)
    cov = x.T @ x / max(x.shape[0] - 1, 1)
    _, vecs = torch.linalg.eigh(cov)  # ascending
    return vecs.flip(1)[:, :k].T.contiguous()
