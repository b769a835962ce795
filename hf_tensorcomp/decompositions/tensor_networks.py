"""SVD, TT, TR, CP and Tucker as einsum contractions: fit, refine, gauge-fix, count.

A `TensorNetwork` is a list of cores plus the einsum equation that contracts them back into the
tensor (opt_einsum picks the contraction order; the compiled expression is cached per shape):

    svd     "ar,rb->ab"                         U (m, r), V (r, n)
    tt      "aib,bjc,ckd->ijk"                  G_k (r_{k-1}, n_k, r_k), r_0 = r_N = 1
    tr      "aib,bjc,cka->ijk"                  the same with the ring closed (r_N = r_0)
    cp      "ir,jr,kr->ijk"                     A_k (n_k, R)
    tucker  "abc,ia,jb,kc->ijk"                 core (r_0, .., r_{N-1}), U_k (n_k, r_k)

Initialisation: SVD by `truncated_svd`, TT by tensorly's TT-SVD (`tensor_train`), TR by tensorly's
TR-SVD (`tensor_ring`, first matricisation at the largest mode), CP and Tucker by `cp_als` /
`tucker_hooi` (tensorly ALS / HOOI). `refine` then takes optional Adam steps on all cores against
the squared error (the einsum is differentiable) and keeps the best iterate.

Gauge (`gauge_fix`): a network's value is unchanged when a junction S S^{-1} is put on a bond.
- ``"canonical"``: QR sweep (left-orthogonal TT/TR cores and SVD U, orthonormal Tucker factors,
  unit-norm CP columns but the first) — better conditioned, same parameter count.
- ``"block_identity"`` (Koike-Akino et al., the paper's Appendix G, LU route): after the canonical
  sweep, each gauge-able core M (unfolded to rows x r: SVD's U, TT/TR cores over all but the last
  bond, Tucker factors) is split with a row-pivoted LU, M = P L U; with S = M[pivots] (= L_1 U, the
  r pivot rows), M S^{-1} has an r x r identity at the pivot rows, and S moves into the next core
  (the bond's other side; for Tucker, the core's mode). Only the r pivot indices and the other
  rows - r rows are stored: r^2 entries fewer per fixed bond. The LU pivots are then improved by
  maxvol (`_maxvol`) so that |M S^{-1}| <= ~1, which limits how much half-precision rounding of the
  stored factors grows (it still grows somewhat: S carries the whole scale into the next core).
  CP has only a diagonal (scaling) gauge, so no block identity; a tensor ring keeps one bond (the
  ring closure) unfixed.

Written here rather than taken from tensorly: the einsum form (one generic contraction, refinement
by autograd), the rank bookkeeping that lets a byte budget pick a rank before fitting, and the
gauge fixing — tensorly has none of the three.
"""

from __future__ import annotations

import functools
import math
import string
import warnings
from dataclasses import dataclass, field

import opt_einsum
import tensorly as tl
import torch
from tensorly.decomposition import tensor_ring, tensor_train

from .cp_tucker import cp_als, tucker_hooi
from .svd import truncated_svd

NETWORKS = ("svd", "tt", "tr", "cp", "tucker")
GAUGES = (None, "canonical", "block_identity")
BLOCK_IDENTITY_NETWORKS = ("svd", "tt", "tr", "tucker")


def index_bits(n: int) -> int:
    """Bits one index into ``range(n)`` needs (0 for n <= 1)."""
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


# --------------------------------------------------------------------------------------------
# shapes and ranks (analytic: a byte budget can choose a rank before anything is fitted)
# --------------------------------------------------------------------------------------------

def _check_shape(kind: str, shape: tuple[int, ...]) -> None:
    if kind not in NETWORKS:
        raise ValueError(f"network: got {kind!r}; allowed: {' | '.join(map(repr, NETWORKS))}")
    if kind == "svd" and len(shape) != 2:
        raise ValueError(f"network 'svd': folded shape {tuple(shape)} is not a matrix; allowed: a 2-D fold")
    if kind != "svd" and len(shape) < 2:
        raise ValueError(f"network {kind!r}: folded shape {tuple(shape)} has fewer than 2 modes; allowed: 2 or more modes")


def _tr_mode(shape) -> int:
    return max(range(len(shape)), key=lambda i: shape[i])


def _ring_split(n: int, rest: int, r: int) -> tuple[int, int]:
    """Ring rank r0 and first bond r1 of TR-SVD's first matricisation (n x rest): r0 r1 <= min(n, rest).

    r0 is the largest divisor of that limit up to min(r, sqrt(limit)), so that a large enough `r`
    reaches r0 r1 = the limit (an exact first split).
    """
    lim = min(n, rest)
    r0 = max(d for d in range(1, min(r, math.isqrt(lim)) + 1) if lim % d == 0)
    return r0, min(r, lim // r0)


def bond_ranks(kind: str, shape, rank) -> list[int]:
    """The ranks a fit with `rank` uses, capped where more could not help.

    svd: [r]; tt: [1, r_1, .., r_{N-1}, 1]; tr: [r_0, r_1, .., r_{N-1}, r_0] (original mode order);
    cp: [R]; tucker: [r_0, .., r_{N-1}]. `rank`: an int (every bond) or a list (svd/cp: one int;
    tt: N-1 inner bonds; tr: N bonds r_0..r_{N-1}; tucker: N mode ranks).
    """
    shape = tuple(int(s) for s in shape)
    _check_shape(kind, shape)
    n = len(shape)
    if isinstance(rank, (list, tuple)):
        want = {"svd": 1, "cp": 1, "tt": n - 1, "tr": n, "tucker": n}[kind]
        if len(rank) != want:
            raise ValueError(f"rank: got {list(rank)} for network {kind!r} on shape {shape}; allowed: an int or {want} ints")
        ranks = [int(r) for r in rank]
    else:
        ranks = [int(rank)]
    if any(r < 1 for r in ranks):
        raise ValueError(f"rank: got {rank!r}; allowed: ints >= 1")
    if kind == "svd":
        return [min(ranks[0], *shape)]
    if kind == "cp":
        return [ranks[0]]
    if kind == "tucker":  # r_k <= n_k, and r_k <= prod of the other ranks (the mode-k unfolding's rank)
        ranks = [min(r, s) for r, s in zip(ranks * n if len(ranks) == 1 else ranks, shape)]
        while True:
            capped = [min(r, math.prod(ranks[:k] + ranks[k + 1:])) for k, r in enumerate(ranks)]
            if capped == ranks:
                return ranks
            ranks = capped
    if kind == "tt":
        inner = ranks * (n - 1) if len(ranks) == 1 else ranks
        out = [1]
        for k in range(n - 1):
            out.append(min(inner[k], out[k] * shape[k], math.prod(shape[k + 1:])))
        return out + [1]
    # tr: tensorly's TR-SVD. Bond i sits left of mode i (bond N = bond 0). The first matricisation, at
    # mode m (the largest), splits n_m into bonds m and m+1 (r0 r1 <= n_m); later bonds follow TT-SVD's caps
    m = _tr_mode(shape)
    want = ranks * n if len(ranks) == 1 else ranks
    w = [want[(m + j) % n] for j in range(n)]
    rolled = shape[m:] + shape[:m]
    lim = min(rolled[0], math.prod(rolled[1:]))
    if len(ranks) == 1:
        r0, r1 = _ring_split(rolled[0], math.prod(rolled[1:]), w[0])
    else:
        r0 = min(w[0], lim)
        r1 = min(w[1], lim // r0)
    out = [r0, r1]
    for k in range(1, n - 1):
        out.append(min(w[k + 1], out[k] * rolled[k], math.prod(rolled[k + 1:]) * r0))
    bonds = [out[(i - m) % n] for i in range(n)]
    return bonds + [bonds[0]]


def core_shapes(kind: str, shape, ranks: list[int]) -> list[tuple[int, ...]]:
    shape = tuple(int(s) for s in shape)
    if kind == "svd":
        (r,) = ranks
        return [(shape[0], r), (r, shape[1])]
    if kind == "cp":
        return [(s, ranks[0]) for s in shape]
    if kind == "tucker":
        return [tuple(ranks)] + [(s, r) for s, r in zip(shape, ranks)]
    return [(ranks[k], s, ranks[k + 1]) for k, s in enumerate(shape)]


def gauge_cores(kind: str, n_cores: int) -> list[int]:
    """Indices of the cores a block-identity gauge fixes (each then has an r x r identity block)."""
    if kind == "svd":
        return [0]
    if kind in ("tt", "tr"):
        return list(range(n_cores - 1))
    if kind == "tucker":
        return list(range(1, n_cores))
    return []


def _gauge_block(core_shape) -> tuple[int, int]:
    """(rows, r) of a core unfolded for gauge fixing: all axes but the last are rows."""
    return math.prod(core_shape[:-1]), core_shape[-1]


def stored_entries(kind: str, shape, rank, gauge: str | None = None) -> tuple[int, int]:
    """(factor entries, pivot-index bits) a network stores — what `nbytes` will count, without fitting."""
    shapes = core_shapes(kind, shape, bond_ranks(kind, shape, rank))
    entries, bits = sum(math.prod(s) for s in shapes), 0
    if gauge == "block_identity":
        for k in gauge_cores(kind, len(shapes)):
            rows, r = _gauge_block(shapes[k])
            if rows >= r:
                entries -= r * r
                bits += r * index_bits(rows)
    return entries, bits


def max_rank(kind: str, shape) -> int:
    """A rank past which the network cannot store more (every bond at its cap); for CP: prod / max dim."""
    shape = tuple(int(s) for s in shape)
    if kind == "svd":
        return min(shape)
    if kind == "cp":
        return max(1, math.prod(shape) // max(shape))
    if kind == "tucker":
        return max(shape)
    return max(1, math.prod(shape))


# --------------------------------------------------------------------------------------------
# the network
# --------------------------------------------------------------------------------------------

def equation(kind: str, n_modes: int) -> str:
    letters = iter(string.ascii_letters)
    modes = [next(letters) for _ in range(n_modes)]
    out = "".join(modes)
    if kind == "svd":
        return "ar,rb->ab"
    if kind == "cp":
        r = next(letters)
        return ",".join(m + r for m in modes) + "->" + out
    if kind == "tucker":
        ranks = [next(letters) for _ in range(n_modes)]
        return "".join(ranks) + "," + ",".join(m + r for m, r in zip(modes, ranks)) + "->" + out
    bonds = [next(letters) for _ in range(n_modes + 1)]
    if kind == "tr":
        bonds[-1] = bonds[0]
    return ",".join(bonds[k] + modes[k] + bonds[k + 1] for k in range(n_modes)) + "->" + out


@functools.lru_cache(maxsize=512)
def _expression(eq: str, shapes: tuple[tuple[int, ...], ...]):
    return opt_einsum.contract_expression(eq, *shapes, optimize="auto")


@dataclass
class TensorNetwork:
    """Cores of one network and how they contract; `pivots[k]` marks a block-identity core (see module doc)."""

    kind: str
    shape: tuple[int, ...]
    cores: list[torch.Tensor]
    pivots: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self):
        self.shape = tuple(int(s) for s in self.shape)
        if not self.pivots:
            self.pivots = [None] * len(self.cores)

    @property
    def equation(self) -> str:
        return equation(self.kind, len(self.shape))

    @property
    def core_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(c.shape) for c in self.cores]

    def contract(self, dtype=torch.float32) -> torch.Tensor:
        cores = [c.to(dtype) for c in self.cores]
        return _expression(self.equation, tuple(tuple(c.shape) for c in cores))(*cores, backend="torch")

    def stored(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """What is kept: per core, all entries, or (block identity) only the rows off the pivots; and the pivots."""
        out = []
        for c, piv in zip(self.cores, self.pivots):
            if piv is None:
                out.append(c)
            else:
                rows, r = _gauge_block(c.shape)
                keep = torch.ones(rows, dtype=torch.bool, device=c.device)
                keep[piv] = False
                out.append(c.reshape(rows, r)[keep])
        return out, list(self.pivots)

    @staticmethod
    def unstore(kind: str, shape, core_shapes, stored: list[torch.Tensor], pivots: list[torch.Tensor | None]) -> "TensorNetwork":
        """Inverse of `stored`: put the identity blocks back."""
        cores = []
        for s, data, piv in zip(core_shapes, stored, pivots):
            if piv is None:
                cores.append(data.reshape(s))
                continue
            rows, r = _gauge_block(s)
            full = torch.zeros(rows, r, dtype=data.dtype, device=data.device)
            keep = torch.ones(rows, dtype=torch.bool, device=data.device)
            keep[piv] = False
            full[keep] = data.reshape(rows - r, r)
            full[piv, torch.arange(r, device=data.device)] = 1
            cores.append(full.reshape(s))
        return TensorNetwork(kind, tuple(shape), cores, list(pivots))

    def entries_and_bits(self) -> tuple[int, int]:
        stored, pivots = self.stored()
        entries = sum(t.numel() for t in stored)
        bits = sum(p.numel() * index_bits(_gauge_block(c.shape)[0]) for c, p in zip(self.cores, pivots) if p is not None)
        return entries, bits

    def to(self, dtype) -> "TensorNetwork":
        return TensorNetwork(self.kind, self.shape, [c.to(dtype) for c in self.cores], list(self.pivots))


# --------------------------------------------------------------------------------------------
# fitting
# --------------------------------------------------------------------------------------------

def decompose(y: torch.Tensor, kind: str, rank, *, n_iter_max: int = 100, tol: float = 1e-7, seed: int = 0) -> TensorNetwork:
    """Initial fit of `y` (any float dtype; computed in float32) by SVD / TT-SVD / TR-SVD / CP-ALS / HOOI."""
    y = y.detach().float()
    shape = tuple(y.shape)
    ranks = bond_ranks(kind, shape, rank)
    if kind == "svd":
        u, v = truncated_svd(y, ranks[0])
        return TensorNetwork(kind, shape, [u, v])
    if kind == "cp":
        for init in ("svd", "random"):  # ALS can diverge when the rank exceeds the modes' sizes; retry once
            factors = cp_als(y, ranks[0], n_iter_max=n_iter_max, tol=tol, init=init, seed=seed).weights_folded
            if all(torch.isfinite(f).all() for f in factors):
                return TensorNetwork(kind, shape, factors)
        raise ValueError(f"rank: CP-ALS diverged at rank {ranks[0]} on shape {shape}; allowed: a lower rank or n_iter_max")
    if kind == "tucker":
        t = tucker_hooi(y, ranks, n_iter_max=n_iter_max, tol=tol, seed=seed)
        return TensorNetwork(kind, shape, [t.core, *t.factors])
    with tl.backend_context("pytorch"):
        if kind == "tt":
            factors = tensor_train(y, rank=list(ranks)).factors
        else:
            factors = tensor_ring(y, rank=list(ranks), mode=_tr_mode(shape)).factors
    return TensorNetwork(kind, shape, [f.clone() for f in factors])


def refine(net: TensorNetwork, y: torch.Tensor, steps: int, lr: float = 1e-2) -> TensorNetwork:
    """Adam on all cores against ||y - net||^2; per-core step size `lr` x the core's RMS; keeps the best iterate."""
    if steps <= 0:
        return net
    y = y.detach().float()
    params = [c.detach().float().clone().requires_grad_(True) for c in net.cores]
    groups = [{"params": [p], "lr": lr * max(p.detach().pow(2).mean().sqrt().item(), 1e-12)} for p in params]
    opt = torch.optim.Adam(groups)
    expr = _expression(net.equation, tuple(tuple(p.shape) for p in params))
    norm = y.pow(2).sum().clamp_min(1e-30)
    best, best_loss = [p.detach().clone() for p in params], float("inf")
    with torch.enable_grad():
        for _ in range(steps + 1):
            opt.zero_grad()
            loss = (expr(*params, backend="torch") - y).pow(2).sum() / norm
            if loss.item() < best_loss:
                best_loss, best = loss.item(), [p.detach().clone() for p in params]
            loss.backward()
            opt.step()
    return TensorNetwork(net.kind, net.shape, best)


def _push(net: TensorNetwork, k: int, s: torch.Tensor) -> None:
    """Multiply core k's outgoing bond by `s` (r x r) on the receiving side: core k's M becomes M s^{-1} elsewhere."""
    if net.kind == "tucker":  # factor U_k (k >= 1) feeds mode k-1 of the core: core x_{k-1} s
        m = k - 1
        net.cores[0] = torch.movedim(torch.tensordot(s, net.cores[0], dims=([1], [m])), 0, m)
    else:  # chains: the next core's first axis
        nxt = net.cores[k + 1]
        net.cores[k + 1] = (s @ nxt.reshape(nxt.shape[0], -1)).reshape(nxt.shape)


def _maxvol(m: torch.Tensor, piv: torch.Tensor, tol: float = 1.05, max_iter: int = 200) -> torch.Tensor:
    """Improve LU's pivot rows towards a dominant r x r submatrix (maxvol: every |entry| of M M[piv]^{-1} <= tol).

    Partial pivoting bounds L, not B = M S^{-1}; entries of B above 1 amplify the rounding of the
    stored (half-precision) factors. Each step swaps in the row holding B's largest entry, with the
    rank-one update of B (Goreinov et al.'s maxvol).
    """
    piv = piv.clone()
    b = torch.linalg.solve(m[piv], m, left=False)
    for _ in range(max_iter):
        i, j = divmod(int(b.abs().argmax()), b.shape[1])
        if b[i, j].abs() <= tol:
            break
        row = b[i].clone()
        row[j] -= 1
        b -= torch.outer(b[:, j] / b[i, j], row)
        piv[j] = i
    return piv


def gauge_fix(net: TensorNetwork, gauge: str | None) -> TensorNetwork:
    """Return a gauge-fixed copy (float32): ``None`` (as is), ``"canonical"`` or ``"block_identity"``."""
    if gauge not in GAUGES:
        raise ValueError(f"gauge: got {gauge!r}; allowed: {' | '.join(map(repr, GAUGES))}")
    net = TensorNetwork(net.kind, net.shape, [c.detach().float().clone() for c in net.cores])
    if gauge is None:
        return net
    if gauge == "block_identity" and net.kind not in BLOCK_IDENTITY_NETWORKS:
        raise ValueError(f"gauge: got 'block_identity' for network {net.kind!r}; allowed: 'block_identity' for "
                         f"{' | '.join(BLOCK_IDENTITY_NETWORKS)} (CP has only a scaling gauge), None or 'canonical'")
    if net.kind == "cp":  # unit columns in every factor but the first, which takes the norms
        for k in range(1, len(net.cores)):
            norms = net.cores[k].norm(dim=0).clamp_min(1e-30)
            net.cores[k] = net.cores[k] / norms
            net.cores[0] = net.cores[0] * norms
        return net
    fixable = gauge_cores(net.kind, len(net.cores))
    for k in fixable:  # canonical: QR sweep
        c = net.cores[k]
        rows, r = _gauge_block(c.shape)
        if rows < r:
            continue
        q, rr = torch.linalg.qr(c.reshape(rows, r))
        net.cores[k] = q.reshape(c.shape)
        _push(net, k, rr)
    if gauge == "canonical":
        return net
    for k in fixable:
        c = net.cores[k]
        rows, r = _gauge_block(c.shape)
        if rows < r:
            continue
        m = c.reshape(rows, r)
        p, _, _ = torch.linalg.lu(m)
        piv = _maxvol(m, p[:, :r].argmax(0))  # row piv[i] becomes e_i
        s = m[piv]
        new = torch.linalg.solve(s, m, left=False)  # m s^{-1}
        new[piv] = torch.eye(r, dtype=new.dtype, device=new.device)
        net.cores[k] = new.reshape(c.shape)
        net.pivots[k] = piv
        _push(net, k, s)
    return net


def fit_network(y: torch.Tensor, kind: str, rank, *, gauge: str | None = None, steps: int = 0, lr: float = 1e-2,
                n_iter_max: int = 100, tol: float = 1e-7, seed: int = 0) -> TensorNetwork:
    """decompose → refine → gauge_fix, all in float32."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        net = decompose(y, kind, rank, n_iter_max=n_iter_max, tol=tol, seed=seed)
    net = refine(net, y, steps, lr)
    return gauge_fix(net, gauge)
