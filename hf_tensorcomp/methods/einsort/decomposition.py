"""EinSort: sort a tensor's indices before tensorizing it, and undo the sort on reconstruction.

Koike-Akino et al., "EinSort: Sorting is All We Need for Tensorizing LLM". A tensor X is permuted
along one axis by a reversible permutation, optionally replaced by mapped magnitudes f(|X|) whose
signs are kept as one bit per entry (non-negative tensorization), folded, and decomposed by a
tensor network (`tensor_networks`: SVD / TT / TR / CP / Tucker as einsum contractions):

    X ──sort along `sort_axis`──> X_sorted ──f(|.|), signs──> Y ──fold──> network cores
    X_hat = sign ⊙ f^{-1}( unsort( unfold( contract(cores) ) ) )

Which permutation (`sort_axis`, `reduce_over`):
- ``sort_axis``: the axis whose indices are permuted. Every *fibre* along it (one per index of the
  other axes) gets its entries reordered. ``None``: no sorting (the plain decomposition).
- ``reduce_over``: axes the sort metric is reduced over, so that all fibres differing only in those
  axes share one permutation (stored once). ``None``: full sorting — one permutation per fibre
  (the reference; its index storage usually costs more than it saves). For one layer's KV-cache
  segment (batch, kv_heads, tokens, head_dim), ``sort_axis=-1, reduce_over=1`` sorts each token's
  head_dim entries by one permutation shared by all KV heads (the paper's setting).
- The metric: the mapping (``"linear"``, ``("pow", p)``, ``("exp", p)``, ``("add_log", p)``,
  ``("mul_log", p)`` as in the paper's Appendix E: x^p, exp(clamp(p x, -10, 10)),
  log(clamp(x + p, 4.4e-5, 2.2e4)), log(clamp(p x, 4.4e-5, 2.2e4))) applied to |X| (non-negative
  mode) or X (signed; ``pow`` keeps the sign), then the reduction (mean, max, min, median, std,
  prod) over `reduce_over`. ``prod`` is computed as sign(prod) * exp(mean log|.|): the same order as
  the product (a monotone map of it) without under/overflow over long reductions.

Storage (`nbytes`, honest and equal to what `to_dict` holds): factor entries at the factor dtype
(block-identity blocks not stored), pivot indices of gauge-fixed cores, permutation indices and
sign bits bit-packed at exactly ceil(log2 n) bits per index and 1 bit per entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...decompositions.tensor_networks import (
    GAUGES,
    NETWORKS,
    TensorNetwork,
    bond_ranks,
    fit_network,
    index_bits,
    max_rank,
    stored_entries,
)

MAPPINGS = {"linear": 1.0, "pow": 0.5, "exp": 1.0, "add_log": 1.0, "mul_log": 1.0}  # name -> default p
REDUCTIONS = ("mean", "max", "min", "median", "std", "prod")
FORMAT = 1
_LOG_LO, _LOG_HI = 4.4e-5, 2.2e4


def _fail(field: str, got, allowed: str):
    raise ValueError(f"einsort.{field}: got {got!r}; allowed: {allowed}")


# --------------------------------------------------------------------------------------------
# mappings and reductions
# --------------------------------------------------------------------------------------------

def parse_mapping(mapping) -> tuple[str, float]:
    """``"pow"`` | ``("pow", 0.5)`` | ``["exp", 2]`` ... -> (name, p)."""
    allowed = " | ".join(repr(m) for m in MAPPINGS) + ", or (name, p) such as ('pow', 0.5)"
    if isinstance(mapping, str):
        name, p = mapping, None
    elif isinstance(mapping, (list, tuple)) and len(mapping) == 2 and isinstance(mapping[0], str):
        name, p = mapping
    else:
        _fail("mapping", mapping, allowed)
    if name not in MAPPINGS:
        _fail("mapping", mapping, allowed)
    if p is None:
        p = MAPPINGS[name]
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or p <= 0:
        _fail("mapping", mapping, "a power / scale p > 0, e.g. ('pow', 0.5)")
    return name, float(p)


def map_values(x: torch.Tensor, name: str, p: float) -> torch.Tensor:
    """The paper's mappings (float32); on signed input ``pow`` is sign(x) |x|^p."""
    x = x.float()
    if name == "linear":
        return x
    if name == "pow":
        return x.sign() * x.abs().pow(p)
    if name == "exp":
        return x.mul(p).clamp(-10, 10).exp()
    if name == "add_log":
        return x.add(p).clamp(_LOG_LO, _LOG_HI).log()
    return x.mul(p).clamp(_LOG_LO, _LOG_HI).log()


def unmap_values(y: torch.Tensor, name: str, p: float, inplace: bool = False) -> torch.Tensor:
    """Inverse of `map_values` on magnitudes (>= 0 out; exact within the mapping's clamp range).

    ``inplace``: "linear" and "pow" overwrite `y` (no new tensor); the others allocate as usual."""
    if name in ("linear", "pow"):
        y = y.clamp_min_(0) if inplace else y.clamp_min(0)
        return y if name == "linear" else y.pow_(1.0 / p)
    if name == "exp":
        return y.clamp(1.0, math.exp(10)).log().div(p)
    if name == "add_log":
        return y.exp().sub(p).clamp_min(0)
    return y.exp().div(p)


def _axes(ndim: int, axes, field: str) -> tuple[int, ...]:
    if axes is None:
        return ()
    if isinstance(axes, int) and not isinstance(axes, bool):
        axes = (axes,)
    if not isinstance(axes, (list, tuple)) or not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
        _fail(field, axes, f"None, an axis or a tuple of axes in [{-ndim}, {ndim - 1}]")
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            _fail(field, axes, f"axes in [{-ndim}, {ndim - 1}] for a {ndim}-d tensor")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        _fail(field, axes, "distinct axes")
    return tuple(sorted(out))


def reduce(m: torch.Tensor, axes: tuple[int, ...], how: str) -> torch.Tensor:
    """Reduce `m` over `axes` keeping them as size-1 dims (none: `m` itself)."""
    if how not in REDUCTIONS:
        _fail("reduction", how, " | ".join(map(repr, REDUCTIONS)))
    if not axes:
        return m
    keep = [1 if i in axes else s for i, s in enumerate(m.shape)]
    other = [i for i in range(m.ndim) if i not in axes]
    flat = m.permute(*other, *axes).reshape(*[m.shape[i] for i in other], -1)
    if how == "mean":
        r = flat.mean(-1)
    elif how == "max":
        r = flat.amax(-1)
    elif how == "min":
        r = flat.amin(-1)
    elif how == "median":
        r = flat.median(-1).values
    elif how == "std":
        r = flat.std(-1, correction=0)
    else:  # prod, as sign(prod) * geometric mean of |.|: same order as the product, no under/overflow
        neg = (flat < 0).sum(-1) % 2
        r = flat.abs().clamp_min(1e-30).log().mean(-1).exp() * (1 - 2 * neg)
    return r.reshape(keep)


# --------------------------------------------------------------------------------------------
# permutations
# --------------------------------------------------------------------------------------------

def sort_permutation(x: torch.Tensor, sort_axis: int, reduce_over=None, mapping="linear", reduction: str = "mean",
                     nonnegative: bool = False) -> torch.Tensor:
    """The permutation (int64) sorting `x` along `sort_axis` by the reduced metric; shape: x's with `reduce_over` axes 1.

    ``perm[..., j, ...]`` (j along `sort_axis`) is the source index of the j-th smallest metric value.
    """
    name, p = parse_mapping(mapping)
    red = _axes(x.ndim, reduce_over, "reduce_over")
    (ax,) = _axes(x.ndim, sort_axis, "sort_axis")
    if ax in red:
        _fail("reduce_over", reduce_over, f"axes other than sort_axis ({sort_axis})")
    metric = reduce(map_values(x.abs() if nonnegative else x, name, p), red, reduction)
    return torch.argsort(metric, dim=ax, stable=True)


def apply_permutation(x: torch.Tensor, perm: torch.Tensor, axis: int) -> torch.Tensor:
    """x reordered along `axis` by `perm` (broadcast over its size-1 axes)."""
    return torch.take_along_dim(x, perm.expand(x.shape), dim=axis)


def invert_permutation(y: torch.Tensor, perm: torch.Tensor, axis: int) -> torch.Tensor:
    """Undo `apply_permutation`: scatter `y` back to the original order along `axis`."""
    return torch.empty_like(y).scatter_(axis, perm.expand(y.shape), y)


# --------------------------------------------------------------------------------------------
# bit packing (honest storage: an index takes ceil(log2 n) bits, a sign 1 bit)
# --------------------------------------------------------------------------------------------

def to_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative ints -> their `width`-bit big-endian binary digits, flattened (uint8 0/1)."""
    if width == 0:
        return torch.zeros(0, dtype=torch.uint8, device=values.device)
    it = torch.int32 if width < 31 else torch.int64
    v = values.reshape(-1).to(it)
    shifts = torch.arange(width - 1, -1, -1, device=v.device, dtype=it)
    return ((v[:, None] >> shifts) & 1).to(torch.uint8).reshape(-1)


def from_bits(bits: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of `to_bits`: int64 values."""
    if width == 0:
        return torch.zeros(count, dtype=torch.int64, device=bits.device)
    it = torch.int32 if width < 31 else torch.int64
    b = bits[: count * width].reshape(count, width).to(it)
    return (b << torch.arange(width - 1, -1, -1, device=bits.device, dtype=it)).sum(-1, dtype=torch.int64)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """0/1 values -> uint8 bytes, 8 per byte, zero-padded (the last byte may be partial)."""
    bits = bits.reshape(-1).to(torch.uint8)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=bits.device)
    return (bits.reshape(-1, 8) * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    shifts = torch.arange(7, -1, -1, device=packed.device, dtype=torch.uint8)
    return ((packed.reshape(-1, 1) >> shifts) & 1).reshape(-1)[:count]


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per entry of `x` (row-major), set where x < 0."""
    return pack_bits(x.reshape(-1) < 0)


def unpack_signs(packed: torch.Tensor, shape) -> torch.Tensor:
    """+1 / -1 (float32) of the shape packed by `pack_signs`."""
    bits = unpack_bits(packed, math.prod(shape))
    return (1.0 - 2.0 * bits.float()).reshape(shape)


# --------------------------------------------------------------------------------------------
# the fitted object
# --------------------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class EinSortTensor:
    """A sorted, tensorized tensor. Build with `fit`; `reconstruct()` gives the approximation back."""

    shape: tuple[int, ...]
    dtype: torch.dtype  # what reconstruct() returns
    network: TensorNetwork  # cores (at the factor dtype) of the folded, sorted, mapped tensor
    fold_order: tuple[int, ...] | None
    sort_axis: int | None
    reduce_over: tuple[int, ...] | None  # None with a sort_axis: full sorting
    perm: torch.Tensor | None  # int64, shape: `shape` with reduce_over axes 1
    mapping: tuple[str, float]
    reduction: str
    nonnegative: bool
    signs: torch.Tensor | None  # packed uint8 (non-negative mode)

    # -- reconstruction ---------------------------------------------------------------------
    def reconstruct(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        y = self.network.contract(torch.float32)
        order = self.fold_order or tuple(range(len(self.shape)))
        y = y.reshape([self.shape[i] for i in order])
        if self.fold_order is not None:
            y = y.permute(*[order.index(i) for i in range(len(order))])
        if self.perm is not None:
            y = invert_permutation(y, self.perm, self.sort_axis)
        if self.nonnegative:
            y = unmap_values(y, *self.mapping) * unpack_signs(self.signs, self.shape).to(y.device)
        return y.to(dtype or self.dtype)

    # -- storage ------------------------------------------------------------------------------
    @property
    def factor_dtype(self) -> torch.dtype:
        return self.network.cores[0].dtype

    def to_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Flat tensors (``cores``, and as used ``pivots``, ``perm``, ``signs``; the last three packed uint8) + JSON-able metadata."""
        stored, pivots = self.network.stored()
        tensors = {"cores": torch.cat([t.reshape(-1) for t in stored])}
        pivot_cores = [k for k, p in enumerate(pivots) if p is not None]
        if pivot_cores:
            bits = [to_bits(pivots[k], index_bits(math.prod(self.network.cores[k].shape[:-1]))) for k in pivot_cores]
            tensors["pivots"] = pack_bits(torch.cat(bits))
        if self.perm is not None:
            tensors["perm"] = pack_bits(to_bits(self.perm, index_bits(self.shape[self.sort_axis])))
        if self.signs is not None:
            tensors["signs"] = self.signs
        return tensors, self.meta()

    def meta(self) -> dict:
        """The JSON-able metadata `to_dict` returns beside the tensors."""
        pivot_cores = [k for k, p in enumerate(self.network.pivots) if p is not None]
        return {
            "format": FORMAT, "shape": list(self.shape), "dtype": _dtype_name(self.dtype),
            "factor_dtype": _dtype_name(self.factor_dtype), "network": self.network.kind,
            "fold_shape": list(self.network.shape), "fold_order": None if self.fold_order is None else list(self.fold_order),
            "core_shapes": [list(s) for s in self.network.core_shapes], "pivot_cores": pivot_cores,
            "sort_axis": self.sort_axis, "reduce_over": None if self.reduce_over is None else list(self.reduce_over),
            "perm_shape": None if self.perm is None else list(self.perm.shape),
            "mapping": list(self.mapping), "reduction": self.reduction, "nonnegative": self.nonnegative,
        }

    @staticmethod
    def tensor_specs(meta: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of the tensors `to_dict` gives for this metadata (to allocate them before loading)."""
        shapes = [tuple(s) for s in meta["core_shapes"]]
        entries = sum(math.prod(s) for s in shapes)
        bits = 0
        for k in meta["pivot_cores"]:
            rows, r = math.prod(shapes[k][:-1]), shapes[k][-1]
            entries -= r * r
            bits += r * index_bits(rows)
        out = {"cores": ((entries,), _DTYPES[meta["factor_dtype"]])}
        if meta["pivot_cores"]:
            out["pivots"] = ((math.ceil(bits / 8),), torch.uint8)
        if meta["perm_shape"] is not None:
            n = math.prod(meta["perm_shape"]) * index_bits(meta["shape"][meta["sort_axis"]])
            out["perm"] = ((math.ceil(n / 8),), torch.uint8)
        if meta["nonnegative"]:
            out["signs"] = ((math.ceil(math.prod(meta["shape"]) / 8),), torch.uint8)
        return out

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor], meta: dict) -> "EinSortTensor":
        if meta.get("format") != FORMAT:
            _fail("format", meta.get("format"), f"{FORMAT} (written by this hf_tensorcomp)")
        shape = tuple(meta["shape"])
        shapes = [tuple(s) for s in meta["core_shapes"]]
        flat, stored, pos = tensors["cores"], [], 0
        pivots: list[torch.Tensor | None] = [None] * len(shapes)
        piv_bits = unpack_bits(tensors["pivots"], tensors["pivots"].numel() * 8) if meta["pivot_cores"] else None
        bit_pos = 0
        for k, s in enumerate(shapes):
            n = math.prod(s)
            if k in meta["pivot_cores"]:
                rows, r = math.prod(s[:-1]), s[-1]
                n -= r * r
                w = index_bits(rows)
                pivots[k] = from_bits(piv_bits[bit_pos: bit_pos + r * w], w, r).to(flat.device)
                bit_pos += r * w
            stored.append(flat[pos: pos + n])
            pos += n
        net = TensorNetwork.unstore(meta["network"], meta["fold_shape"], shapes, stored, pivots)
        perm = None
        if meta["perm_shape"] is not None:
            count = math.prod(meta["perm_shape"])
            w = index_bits(shape[meta["sort_axis"]])
            perm = from_bits(unpack_bits(tensors["perm"], count * w), w, count).reshape(meta["perm_shape"]).to(flat.device)
        return cls(shape=shape, dtype=_DTYPES[meta["dtype"]], network=net,
                   fold_order=None if meta["fold_order"] is None else tuple(meta["fold_order"]),
                   sort_axis=meta["sort_axis"], reduce_over=None if meta["reduce_over"] is None else tuple(meta["reduce_over"]),
                   perm=perm, mapping=(meta["mapping"][0], float(meta["mapping"][1])), reduction=meta["reduction"],
                   nonnegative=meta["nonnegative"], signs=tensors.get("signs"))

    def check_indices(self) -> str | None:
        """None if the stored indices are valid; else what is wrong (a corrupt permutation would make
        `invert_permutation` scatter into uninitialised memory)."""
        if self.perm is not None:
            n = self.shape[self.sort_axis]
            want = torch.arange(n, device=self.perm.device).view([n if i == self.sort_axis else 1 for i in range(self.perm.ndim)])
            if not torch.equal(self.perm.sort(dim=self.sort_axis).values, want.expand_as(self.perm)):
                return f"the stored permutation indices are not permutations of range({n})"
        for core, piv in zip(self.network.cores, self.network.pivots):
            if piv is not None:
                rows = math.prod(core.shape[:-1])
                if piv.numel() and (int(piv.max()) >= rows or piv.unique().numel() != piv.numel()):
                    return f"the stored pivot indices are not distinct indices below {rows}"
        return None

    def storage(self) -> dict[str, int]:
        """Bytes per part (factors, pivots, permutation, signs) and the total: the sizes of `to_dict`'s tensors."""
        specs = self.tensor_specs(self.meta())
        parts = {k: math.prod(specs[k][0]) * torch.empty(0, dtype=specs[k][1]).element_size() if k in specs else 0
                 for k in ("cores", "pivots", "perm", "signs")}
        parts["factors"] = parts.pop("cores")
        parts["total"] = sum(parts.values())
        return parts

    def nbytes(self) -> int:
        """Honest storage: factors at their dtype + pivot indices + permutation indices + sign bits (bit-packed)."""
        return self.storage()["total"]

    def dense_nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the dense tensor at `dtype` (default: the factor dtype)."""
        return math.prod(self.shape) * torch.empty(0, dtype=dtype or self.factor_dtype).element_size()

    def relative_error(self, reference: torch.Tensor) -> float:
        ref = reference.detach().float()
        return (torch.linalg.vector_norm(ref - self.reconstruct(torch.float32)) / torch.linalg.vector_norm(ref)).item()


# --------------------------------------------------------------------------------------------
# fit
# --------------------------------------------------------------------------------------------

def _fold(shape: tuple[int, ...], network: str, fold, fold_order) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    ndim = len(shape)
    order = None
    if fold_order is not None:
        order = tuple(a % ndim for a in fold_order) if all(isinstance(a, int) for a in fold_order) else None
        if order is None or sorted(order) != list(range(ndim)):
            _fail("fold_order", fold_order, f"a permutation of the axes 0..{ndim - 1}")
    src = [shape[i] for i in (order or range(ndim))]
    if fold is None:
        if network == "svd":
            return (math.prod(src[:-1]), src[-1]), order
        folded = tuple(s for s in src if s != 1)
        return (folded if len(folded) >= 2 else (math.prod(src[:-1]), src[-1])), order
    if not isinstance(fold, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in fold) \
            or sum(1 for s in fold if s == -1) > 1 or any(s < 1 and s != -1 for s in fold):
        _fail("fold", fold, "None or a shape (ints >= 1, at most one -1) with as many entries as the tensor")
    known = math.prod(s for s in fold if s != -1)
    total = math.prod(shape)
    if total % known:
        _fail("fold", fold, f"a shape with {total} entries (the tensor's shape is {shape})")
    folded = tuple(total // known if s == -1 else s for s in fold)
    if math.prod(folded) != total:
        _fail("fold", fold, f"a shape with {total} entries (the tensor's shape is {shape})")
    return folded, order


def overhead_bytes(shape, sort_axis=None, reduce_over=None, nonnegative: bool = False) -> int:
    """Bytes of the permutation and sign bits alone (they do not depend on the rank)."""
    shape = tuple(shape)
    out = math.ceil(math.prod(shape) / 8) if nonnegative else 0
    if sort_axis is not None:
        (ax,) = _axes(len(shape), sort_axis, "sort_axis")
        red = _axes(len(shape), reduce_over, "reduce_over")
        count = math.prod(1 if i in red else s for i, s in enumerate(shape))
        out += math.ceil(count * index_bits(shape[ax]) / 8)
    return out


def network_bytes(network: str, fold_shape, rank, gauge: str | None, factor_dtype: torch.dtype) -> int:
    entries, bits = stored_entries(network, fold_shape, rank, gauge)
    return entries * torch.empty(0, dtype=factor_dtype).element_size() + math.ceil(bits / 8)


def rank_for_budget(budget_bytes: int, network: str, fold_shape, gauge: str | None, factor_dtype: torch.dtype,
                    overhead: int = 0) -> int | None:
    """Largest int rank whose network bytes + `overhead` fit in `budget_bytes`; None if even rank 1 does not."""
    lo, hi = 1, max_rank(network, fold_shape)
    if network_bytes(network, fold_shape, lo, gauge, factor_dtype) + overhead > budget_bytes:
        return None
    while lo < hi:  # bytes grow with the rank (rank caps make them flat, never smaller)
        mid = (lo + hi + 1) // 2
        if network_bytes(network, fold_shape, mid, gauge, factor_dtype) + overhead <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    # the smallest rank giving the same network (past the caps more rank changes nothing)
    ranks = bond_ranks(network, fold_shape, lo)
    while lo > 1 and bond_ranks(network, fold_shape, lo - 1) == ranks:
        lo -= 1
    return lo


def fit(tensor: torch.Tensor, network: str = "svd", rank=8, *, sort_axis: int | None = None, reduce_over=None,
        mapping=("pow", 0.5), reduction: str = "prod", nonnegative: bool = False, gauge: str | None = None,
        fold=None, fold_order=None, dtype: torch.dtype | None = None, steps: int = 0, lr: float = 1e-2,
        n_iter_max: int = 100, tol: float = 1e-7, seed: int = 0) -> EinSortTensor:
    """Sort (optionally), map magnitudes (optionally), fold and decompose `tensor`.

    Args:
        network: ``"svd" | "tt" | "tr" | "cp" | "tucker"``.
        rank: an int (every bond, capped where more cannot help), a list of bond ranks (see
            `tensor_networks.bond_ranks`), or a float in (0, 1]: a byte budget, the fraction of the
            dense tensor's bytes at `dtype` that `nbytes()` may take (permutation and sign bits included);
            the largest rank that fits is used (ValueError if the overhead alone exceeds it).
        sort_axis / reduce_over: see the module doc (``sort_axis=None``: no sorting; ``reduce_over=None``:
            full sorting, one permutation per fibre).
        mapping / reduction: the sort metric (module doc). With ``nonnegative`` the mapping is also what
            is decomposed: f(|x|), with the signs kept as 1 bit per entry.
        gauge: ``None | "canonical" | "block_identity"`` (`tensor_networks.gauge_fix`).
        fold / fold_order: the decomposed tensor is ``sorted.permute(fold_order).reshape(fold)``. Default:
            for SVD all axes but the last become rows; for the others the tensor without its size-1 axes.
        dtype: factor dtype (default: the tensor's). Fitting is always in float32.
        steps / lr: Adam refinement steps after the tensorly / SVD initialisation (0: none).
        n_iter_max / tol / seed: CP-ALS and HOOI settings.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.ndim < 1 or tensor.numel() == 0:
        _fail("tensor", type(tensor).__name__, "a non-empty torch.Tensor")
    if network not in NETWORKS:
        _fail("network", network, " | ".join(map(repr, NETWORKS)))
    if reduction not in REDUCTIONS:
        _fail("reduction", reduction, " | ".join(map(repr, REDUCTIONS)))
    if gauge not in GAUGES:
        _fail("gauge", gauge, " | ".join(map(repr, GAUGES)))
    if not isinstance(nonnegative, bool):
        _fail("nonnegative", nonnegative, "True | False")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        _fail("steps", steps, "an int >= 0")
    mapping = parse_mapping(mapping)
    x = tensor.detach()
    shape = tuple(x.shape)
    ax = None if sort_axis is None else _axes(x.ndim, sort_axis, "sort_axis")[0]
    red = _axes(x.ndim, reduce_over, "reduce_over") if reduce_over is not None else None
    if ax is None and red:
        _fail("reduce_over", reduce_over, "None when sort_axis is None (nothing is sorted)")
    if ax is not None and red and ax in red:
        _fail("reduce_over", reduce_over, f"axes other than sort_axis ({sort_axis})")
    factor_dtype = dtype or (x.dtype if x.dtype.is_floating_point else torch.float32)
    fold_shape, order = _fold(shape, network, fold, fold_order)
    if network == "svd" and len(fold_shape) != 2:
        _fail("fold", fold, "a 2-D shape for network 'svd'")
    if isinstance(rank, float):
        if not 0.0 < rank <= 1.0:
            _fail("rank", rank, "an int >= 1, a list of ints, or a float byte fraction in (0, 1]")
        dense = math.prod(shape) * torch.empty(0, dtype=factor_dtype).element_size()
        over = overhead_bytes(shape, ax, red, nonnegative)
        r = rank_for_budget(int(rank * dense), network, fold_shape, gauge, factor_dtype, over)
        if r is None:
            _fail("rank", rank, f"a byte fraction >= {(over + network_bytes(network, fold_shape, 1, gauge, factor_dtype)) / dense:.4f}: "
                  f"the permutation and sign bits alone take {over} of the {dense} dense bytes")
        rank = r
    elif isinstance(rank, bool) or not isinstance(rank, (int, list, tuple)):
        _fail("rank", rank, "an int >= 1, a list of ints, or a float byte fraction in (0, 1]")
    bond_ranks(network, fold_shape, rank)  # validates

    perm = None
    if ax is not None:
        perm = sort_permutation(x, ax, red, mapping, reduction, nonnegative)
    y = map_values(x.abs(), *mapping) if nonnegative else x.float()
    if perm is not None:
        y = apply_permutation(y, perm, ax)
    if order is not None:
        y = y.permute(*order)
    net = fit_network(y.reshape(fold_shape), network, rank, gauge=gauge, steps=steps, lr=lr,
                      n_iter_max=n_iter_max, tol=tol, seed=seed).to(factor_dtype)
    return EinSortTensor(shape=shape, dtype=x.dtype, network=net, fold_order=order, sort_axis=ax,
                         reduce_over=None if red is None else red, perm=perm, mapping=mapping, reduction=reduction,
                         nonnegative=nonnegative, signs=pack_signs(x) if nonnegative else None)


__all__ = ["EinSortTensor", "MAPPINGS", "REDUCTIONS", "NETWORKS", "GAUGES", "apply_permutation", "fit",
           "invert_permutation", "map_values", "network_bytes", "overhead_bytes", "pack_bits", "pack_signs",
           "parse_mapping", "rank_for_budget", "reduce", "sort_permutation", "unmap_values", "unpack_bits",
           "unpack_signs"]
