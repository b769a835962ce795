"""`RotorLinear`: the rotor gadget of Pence et al. ("Composing Linear Layers from Irreducibles") as a
stand-in for an ``nn.Linear(in_features, out_features)``.

Architecture (the paper's Appendix C, authors' released configuration by default)::

    x (d_in) -> Ψ_in (d_in -> h) -> perm -> LayerNorm -> PReLU
             -> depth x [ Σ_b β_b · (Ψ_b (h -> h) -> perm_b -> LayerNorm -> PReLU), b = 1..width ]
             -> Ψ_out (h -> d_out)                                                    (-> + bias)

- Ψ (a *rotor map* d -> d', Eq. 7): the input is cut into m_in windows of 2^n coordinates, the
  output into m_out windows; every (input window i, output window j) pair applies its own double
  rotor x -> α_ij · r_ij x s_ij† (``double=False``: r x r†) with x read as a multivector of Cl(n, 0);
  the results are summed into their output windows and divided by how often each output
  coordinate was written (m_in x its window coverage) — the authors' averaging.
- r, s = exp(bivector), each bivector C(n, 2) learnable coefficients; the exponential goes through
  the invariant decomposition into ⌊n/2⌋ simple rotors (`decomposition`). The sandwich runs
  in Cl(n)'s matrix representation (`decomposition.spin_sandwich`): once per forward every rotor becomes
  an N x N matrix (N = 16 for n <= 9); per token each *input window* is turned into its matrix once,
  every (branch, output window) pair is ρ(r) X ρ(s)ᵀ (two small matmuls, all pairs of a level in
  one batched GEMM), the pairs are summed over input windows as matrices and each output window is
  turned back once — O(2^n · N) per window pair, never a dense 2^n x 2^n matrix.
- perm: a fixed random permutation per block (rotor maps preserve grade; the permutation mixes
  grades); LayerNorm without affine parameters; one PReLU slope shared by every block (as the
  authors' code shares one ``nn.PReLU``).

Non-power-of-two widths (``chunking``):

- ``"wrap"`` (default, the authors' rule): h = the largest power of two <= d_in (for q/k/v: the
  model's hidden size rounded down); each map's window is the largest power of two <= min(its d_in,
  d_out); m = ceil(d / window) windows
  start at floor(i d / m) and wrap around the end; overlapping outputs are averaged.
  SmolLM2 (576): h = 512; q 576 -> 576 has 737 parameters, k/v 576 -> 192 935 (k/v's output map
  works in Cl(7) on 128-wide windows).
- ``"pad"``: h = the smallest power of two >= max(d_in, d_out); one window per map, the input
  zero-padded to h, the output cut to d_out (SmolLM2: h = 1024, Cl(10)).

Stored tensors (all in the safetensors file):

- ``weight`` (1-D): every learnable scalar — bivector coefficients, the α per window pair, the β
  per parallel branch, the PReLU slope; ``weight.numel()`` (+ bias) is the parameter count;
- ``perm`` (int32, one row of h per permuted block): the fixed permutations;
- ``warm`` (float32): the last solution of the decomposition's power iteration, the warm start of
  the next one. Not a parameter (it only speeds convergence), but saved so that a reloaded model
  runs exactly the same iterations and gives bit-identical outputs.

The map is not linear (LayerNorm, PReLU), so there is no dense weight: ``to_dense`` / ``dense_weight``
raise, and the `rotor` method refuses ``mode="dense"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import decomposition as cl
from ...layers.base import FactorizedModule, change_key, register_layer

CHUNKINGS = ("wrap", "pad")


def pow2_floor(d: int) -> int:
    return 1 << (int(d).bit_length() - 1)


def pow2_ceil(d: int) -> int:
    return 1 << (int(d) - 1).bit_length()


def hidden_width(d_in: int, d_out: int, chunking: str) -> int:
    """The default h: (wrap) the largest power of two <= d_in — the authors keep one hidden width, the
    model's hidden size rounded down, for q, k and v alike; (pad) the smallest power of two >= max(d_in, d_out)."""
    return pow2_floor(d_in) if chunking == "wrap" else pow2_ceil(max(d_in, d_out))


def windows(d: int, c: int) -> torch.Tensor:
    """(m, c) coordinate windows covering range(d): m = ceil(d / c), starts floor(i d / m), wrap-around.
    If c > d (padding), one window 0..c-1 over the zero-padded vector."""
    if c >= d:
        return torch.arange(c)[None]
    m = math.ceil(d / c)
    return torch.stack([(torch.arange(c) + (i * d) // m) % d for i in range(m)])


@dataclass
class Level:
    """One rotor map Ψ (d_in -> d_out) with `branches` parallel copies."""

    d_in: int
    d_out: int
    chunk: int
    branches: int
    post: bool  # perm -> LayerNorm -> PReLU after it

    @property
    def n(self) -> int:
        return self.chunk.bit_length() - 1

    def __post_init__(self):
        self.m_in = windows(self.d_in, self.chunk).shape[0]
        self.m_out = windows(self.d_out, self.chunk).shape[0]

    @property
    def pairs(self) -> int:
        return self.m_in * self.m_out


def build_levels(d_in: int, d_out: int, h: int, depth: int, width: int, chunking: str) -> list[Level]:
    def chunk(a, b):
        return h if chunking == "pad" else min(pow2_floor(a), pow2_floor(b))

    levels = [Level(d_in, h, chunk(d_in, h), 1, True)]
    levels += [Level(h, h, chunk(h, h), width, True) for _ in range(depth)]
    levels.append(Level(h, d_out, chunk(h, d_out), 1, False))
    return levels


def rotor_param_count(d_in: int, d_out: int, chunk: int | None = None, chunking: str = "wrap", depth: int = 2,
                      width: int = 3, double: bool = True, bias: bool = False) -> int:
    """Learnable scalars of a `RotorLinear` with this layout (bivectors, α, β, PReLU slope, bias)."""
    h = chunk or hidden_width(d_in, d_out, chunking)
    total = 1 + (d_out if bias else 0)
    for lv in build_levels(d_in, d_out, h, depth, width, chunking):
        total += lv.branches * lv.pairs * ((2 if double else 1) * cl.n_bivectors(lv.n) + 1)
        total += lv.branches if lv.branches > 1 else 0
    return total


@register_layer
class RotorLinear(FactorizedModule):
    """Rotor gadget d_in -> d_out; see the module doc. Build trained-from-scratch ones with `create`."""

    layer_type = "rotor"
    spec_fields = {"in_features": "int>=1", "out_features": "int>=1", "chunk": "int>=1", "chunking": CHUNKINGS,
                   "depth": "int>=0", "width": "int>=1", "double": "bool", "bias": "bool", "iters": "int>=1",
                   "grad_steps": "int>=1"}

    def __init__(self, in_features: int, out_features: int, chunk: int | None = None, chunking: str = "wrap",
                 depth: int = 2, width: int = 3, double: bool = True, bias: bool = False, iters: int = 50,
                 grad_steps: int = 1, dtype=None, device=None):
        super().__init__()
        if chunking not in CHUNKINGS:
            raise ValueError(f"RotorLinear.chunking: got {chunking!r}; allowed: {' | '.join(map(repr, CHUNKINGS))}")
        self.in_features, self.out_features = in_features, out_features
        self.chunking, self.depth, self.width, self.double = chunking, depth, width, double
        self.chunk = chunk or hidden_width(in_features, out_features, chunking)
        check_layout(in_features, out_features, self.chunk, chunking)
        self.iters, self.grad_steps = iters, grad_steps
        self.levels = build_levels(in_features, out_features, self.chunk, depth, width, chunking)
        sides = 2 if double else 1
        self._slices = []  # per level: (biv, alpha, beta) offsets into weight
        self._warm_slices = []
        off = woff = 0
        for lv in self.levels:
            nb = lv.branches * lv.pairs * sides * cl.n_bivectors(lv.n)
            na = lv.branches * lv.pairs
            nbeta = lv.branches if lv.branches > 1 else 0
            self._slices.append((off, off + nb, off + nb + na, off + nb + na + nbeta))
            off += nb + na + nbeta
            nw = lv.branches * lv.pairs * sides * (lv.n // 2) * lv.n
            self._warm_slices.append((woff, woff + nw))
            woff += nw
        self._prelu_at = off
        self.weight = nn.Parameter(torch.empty(off + 1, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        n_perm = sum(lv.branches for lv in self.levels if lv.post)
        self.register_buffer("perm", torch.empty(n_perm, self.chunk, dtype=torch.int32, device=device))
        self.register_buffer("warm", torch.empty(woff, dtype=torch.float32, device=device))
        self._tables = None  # per level (input windows, output windows, write counts), built on first use
        self._cache = None

    # ------------------------------------------------------------------------------------ building
    @classmethod
    def create(cls, in_features: int, out_features: int, seed: int = 0, bias_init: torch.Tensor | None = None,
               dtype=torch.float32, device=None, **layout) -> "RotorLinear":
        """A freshly initialised gadget (the authors' init: bivectors ~ N(0, 1), α = β = 1, PReLU 0.25)."""
        m = cls(in_features, out_features, bias=bias_init is not None, dtype=dtype, device=device, **layout)
        m.reset_parameters(seed)
        if bias_init is not None:
            with torch.no_grad():
                m.bias.copy_(bias_init)
        return m

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        w = torch.empty(self.weight.shape)
        for lv, (a, b, c, d) in zip(self.levels, self._slices):
            w[a:b] = torch.randn(b - a, generator=g)
            w[b:d] = 1.0
        w[self._prelu_at] = 0.25
        self.weight.copy_(w)
        if self.bias is not None:
            self.bias.zero_()
        self.perm.copy_(torch.stack([torch.randperm(self.chunk, generator=g) for _ in range(self.perm.shape[0])]))
        self.warm.copy_(torch.randn(self.warm.shape, generator=g))
        self._cache = None

    def num_parameters(self) -> int:
        return self.weight.numel() + (self.bias.numel() if self.bias is not None else 0)

    # ------------------------------------------------------------------------------------ rotors
    def _level_params(self, i: int):
        lv, (a, b, c, d) = self.levels[i], self._slices[i]
        sides = 2 if self.double else 1
        w = self.weight.float()
        biv = w[a:b].view(lv.branches * lv.pairs, sides, cl.n_bivectors(lv.n))
        alpha = w[b:c].view(lv.branches, lv.pairs)
        beta = w[c:d] if d > c else None
        return biv, alpha, beta

    def _rotors(self):
        """Per level: (left rotors, right rotors) as `SimpleRotors` with leading dim branches*pairs."""
        key = change_key((self.weight, self.warm))
        caching = not (self.training and torch.is_grad_enabled())
        if caching and self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        out = []
        for i, lv in enumerate(self.levels):
            biv, _, _ = self._level_params(i)
            a, b = self._warm_slices[i]
            k, n = lv.n // 2, lv.n
            warm = self.warm[a:b].view(*biv.shape[:2], k, n)
            _, rot, new_warm = cl.invariant_decomposition(biv, n, warm=warm, iters=self.iters, grad_steps=self.grad_steps)
            if self.training and torch.is_grad_enabled():
                with torch.no_grad():  # the next step starts from this solution (like BatchNorm's running stats)
                    self.warm[a:b].copy_(new_warm.reshape(-1))
            left = cl.SimpleRotors(rot.cos[:, 0], rot.w[:, 0], rot.v[:, 0])
            right = cl.SimpleRotors(rot.cos[:, 1], rot.w[:, 1], rot.v[:, 1]) if self.double else left
            rm = cl.rotor_matrix(left, n)  # the rotors as N x N matrices of the spinor representation, once per forward
            out.append((left, right, rm, cl.rotor_matrix(right, n) if self.double else rm))
        if caching:
            self._cache = (key, [tuple(t.detach() for t in o) for o in out])
        return out

    # ------------------------------------------------------------------------------------ forward
    def _index_tables(self, device):
        """Per level, fixed and derived from the layout (so neither saved nor built on meta): input window
        indices, the output windows as contiguous runs (window, start in window, start in output, length)
        and how often each output coordinate is written (x m_in)."""
        if self._tables is None or self._tables[0] != device:
            tables = []
            for lv in self.levels:
                out_idx = windows(lv.d_out, lv.chunk)
                count = torch.zeros(max(lv.d_out, lv.chunk)).index_add_(0, out_idx.reshape(-1), torch.ones(out_idx.numel()))
                runs = []
                for j, w in enumerate(out_idx.tolist()):
                    cut = [0] + [p for p in range(1, len(w)) if w[p] != w[p - 1] + 1] + [len(w)]
                    runs += [(j, a, w[a], b - a) for a, b in zip(cut, cut[1:])]
                tables.append((windows(lv.d_in, lv.chunk).to(device), runs, (count.clamp_min(1) * lv.m_in).to(device)))
            self._tables = (device, tables)
        return self._tables[1]

    def _maps(self, xc: torch.Tensor, i: int, rotors, alpha: torch.Tensor) -> torch.Tensor:
        """Σ over input windows of α · r x s† for every (branch, output window): xc (m_in, 2^n, T) ->
        (branches, m_out, 2^n, T). Each input window is turned into its matrix once; the window pairs'
        products are summed as matrices, so each output window is turned back once."""
        lv = self.levels[i]
        _, _, rm, sm = rotors
        nb, big_n, t = rm.shape[1], rm.shape[-1], xc.shape[-1]

        def by_input(m):  # (branches · pairs, blocks, N, N) -> (m_in, blocks, branches · m_out, N, N)
            return m.view(lv.branches, lv.m_in, lv.m_out, nb, big_n, big_n).permute(1, 3, 0, 2, 4, 5).reshape(
                lv.m_in, nb, -1, big_n, big_n)

        xm = cl.spin_encode(xc, lv.n)  # (m_in, blocks, N, N, T)
        rm = by_input(rm * alpha.reshape(-1, 1, 1, 1)).flatten(2, 3)  # every branch and output window as rows of one matmul
        z = (rm @ xm.view(lv.m_in, nb, big_n, big_n * t)).view(lv.m_in, nb, -1, big_n, big_n, t)
        ym = (by_input(sm)[..., None, :, :] @ z).sum(0)  # ρ(r) X ρ(s)ᵀ summed over input windows: (blocks, branches · m_out, N, N, T)
        ym = ym.view(nb, lv.branches, lv.m_out, big_n, big_n, t).permute(1, 2, 0, 3, 4, 5)
        return cl.spin_decode(ym, lv.n)

    def _level(self, x: torch.Tensor, i: int, rotors, perm_row: int) -> torch.Tensor:
        """One rotor map (and its perm / LayerNorm / PReLU), features first: x (d_in, T) -> (d_out, T)."""
        lv = self.levels[i]
        _, alpha, beta = self._level_params(i)
        in_idx, runs, count = self._index_tables(x.device)[i]
        t = x.shape[-1]
        if lv.chunk > lv.d_in:
            x = F.pad(x, (0, 0, 0, lv.chunk - lv.d_in))
        y = self._maps(x[in_idx], i, rotors, alpha)  # (branches, m_out, c, T)
        out = y.new_zeros(lv.branches, count.shape[0], t)
        for j, a, b, n in runs:  # overlapping output windows, summed as contiguous slices
            out[:, b : b + n] += y[:, j, a : a + n]
        out = (out / count[:, None])[:, : lv.d_out]
        if lv.post:
            perm = self.perm[perm_row : perm_row + lv.branches].long()
            perm = (perm + torch.arange(lv.branches, device=perm.device)[:, None] * lv.d_out).reshape(-1)
            out = out.reshape(-1, t).index_select(0, perm).view(lv.branches, lv.d_out, t)
            out = out - out.mean(1, keepdim=True)
            out = out * torch.rsqrt(out.square().mean(1, keepdim=True) + 1e-5)  # LayerNorm over the features, no affine
            out = F.prelu(out, self.weight[self._prelu_at :].float())
        if beta is not None:
            return (out * beta[:, None, None]).sum(0)
        return out[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, self.in_features).float().T  # features first: every gather moves contiguous token rows
        rotors = self._rotors()
        row = 0
        for i, lv in enumerate(self.levels):
            h = self._level(h, i, rotors[i], row)
            row += lv.branches if lv.post else 0
        h = h.T.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return h + self.bias if self.bias is not None else h

    # ------------------------------------------------------------------------------------ framework
    def dense_weight(self) -> torch.Tensor:
        raise ValueError("RotorLinear is not linear (LayerNorm and PReLU between rotor maps): it has no dense weight; "
                         "allowed: mode='factorized'")

    def to_dense(self):
        raise ValueError("TensorCompressionConfig.mode: got 'dense' for a rotor layer, which is not linear (LayerNorm, "
                         "PReLU); allowed: 'factorized'")

    def spec(self) -> dict:
        return {"layer": self.layer_type, "in_features": self.in_features, "out_features": self.out_features,
                "chunk": self.chunk, "chunking": self.chunking, "depth": self.depth, "width": self.width,
                "double": self.double, "bias": self.bias is not None, "iters": self.iters, "grad_steps": self.grad_steps}

    @classmethod
    def from_spec(cls, spec: dict, dtype=None, root=None) -> "RotorLinear":
        return cls(spec["in_features"], spec["out_features"], chunk=spec["chunk"], chunking=spec["chunking"],
                   depth=spec["depth"], width=spec["width"], double=spec["double"], bias=spec["bias"],
                   iters=spec["iters"], grad_steps=spec["grad_steps"], dtype=dtype)

    def _apply(self, fn, *args, **kwargs):
        self._cache = None
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        self._cache = None
        return super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        maps = ", ".join(f"{lv.d_in}->{lv.d_out} Cl({lv.n}) {lv.pairs}x{lv.branches}" for lv in self.levels)
        return (f"in_features={self.in_features}, out_features={self.out_features}, h={self.chunk}, "
                f"chunking={self.chunking}, double={self.double}, params={self.num_parameters()}, maps=[{maps}]")


def check_layout(d_in: int, d_out: int, chunk: int, chunking: str) -> None:
    """Raise ValueError naming ``chunk`` if the hidden width does not fit (before any weight loads)."""
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 4 or chunk & (chunk - 1):
        raise ValueError(f"TensorCompressionConfig.chunk: got {chunk!r}; allowed: None (automatic) or a power of two >= 4 "
                         "(the hidden width h; rotor maps act in Cl(log2 h))")
    if min(d_in, d_out) < 4:
        raise ValueError(f"TensorCompressionConfig.targets: a {d_out}x{d_in} projection is too narrow for rotor maps; "
                         "allowed: projections at least 4 wide on both sides")
    if chunking == "pad" and chunk < max(d_in, d_out):
        raise ValueError(f"TensorCompressionConfig.chunk: got {chunk} with chunking='pad' for a {d_out}x{d_in} projection; "
                         f"allowed: None or a power of two >= {max(d_in, d_out)} (or chunking='wrap')")
