"""The segment codec of `EinSortCache` (`cache`): its settings, one (heads, tokens, head_dim) block of
keys or values compressed into a `PackedSegment` (`compress_segment`), and all packed segments of a layer
rebuilt at once with a fixed number of batched tensor operations (`rebuild_segments`). What is stored and
why is told in `cache`'s docstring; nothing here knows about transformers.
"""

from __future__ import annotations

import functools
import math
import string
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...validation import is_int
from ...decompositions.quantize import BITS, code_bytes, pack, quantize_rtn, unpack
from ...decompositions.tensor_networks import BLOCK_IDENTITY_NETWORKS, GAUGES, NETWORKS, equation, index_bits
from . import decomposition as einsort

SORTS = ("shared", "full", None)
SORT_SPANS = ("segment", "token", "channel")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def fail(field: str, got, allowed: str):
    raise ValueError(f"EinSortCache.{field}: got {got!r}; allowed: {allowed}")


@dataclass(frozen=True)
class EinSortCacheSettings:
    """Validated settings shared by all `EinSortLayer`s of one cache (see `EinSortCache`)."""

    network: str = "svd"
    rank: int | float = 8
    segment: int = 64
    residual: int = 64
    sort: str | None = "shared"
    sort_span: str = "channel"
    nonnegative: bool = True
    mapping: tuple[str, float] = ("pow", 0.5)
    reduction: str = "prod"
    gauge: str | None = "block_identity"
    dtype: torch.dtype | None = None
    steps: int = 0
    n_iter_max: int = 100
    low_memory: bool = True
    error_bits: int | None = None

    @classmethod
    def build(cls, network="svd", rank=8, segment=64, residual=64, sort="shared", sort_span="channel",
              nonnegative=True, mapping=("pow", 0.5), reduction="prod", gauge="auto", dtype=None, steps=0,
              n_iter_max=100, low_memory=True, error_bits=None) -> "EinSortCacheSettings":
        if network not in NETWORKS:
            fail("network", network, " | ".join(map(repr, NETWORKS)))
        if error_bits is not None and (not is_int(error_bits) or error_bits not in BITS):
            fail("error_bits", error_bits, "None (the factors alone) | " + " | ".join(map(str, BITS))
                 + " (the fit's error quantized at that many bits)")
        if is_int(rank):
            if rank < (0 if error_bits else 1):
                fail("rank", rank, "an int >= 1 (every bond, capped at the full rank; 0 too with error_bits: "
                     "quantization alone) or a float byte fraction in (0, 1]")
        elif isinstance(rank, float):
            if not 0.0 < rank <= 1.0:
                fail("rank", rank, "an int >= 1 or a float byte fraction in (0, 1] (of each segment's dense bytes)")
        else:
            fail("rank", rank, "an int >= 1 or a float byte fraction in (0, 1]")
        if not is_int(segment) or segment < 1:
            fail("segment", segment, "an int >= 1 (tokens per compressed segment)")
        if not is_int(residual) or residual < 0:
            fail("residual", residual, "an int >= 0 (tokens always kept in full precision)")
        if sort not in SORTS:
            fail("sort", sort, "'shared' (one permutation shared over KV heads) | 'full' (one per head) | None")
        if sort_span not in SORT_SPANS:
            fail("sort_span", sort_span, "'segment' (a head's tokens x head_dim entries) | 'token' (each token's "
                  "head_dim entries) | 'channel' (each head_dim channel's tokens)")
        if not isinstance(nonnegative, bool):
            fail("nonnegative", nonnegative, "True | False")
        try:
            mapping = einsort.parse_mapping(mapping)
        except ValueError as e:
            fail("mapping", mapping, str(e).split("allowed: ", 1)[-1])
        if reduction not in einsort.REDUCTIONS:
            fail("reduction", reduction, " | ".join(map(repr, einsort.REDUCTIONS)))
        if gauge == "auto":
            gauge = "block_identity" if network in BLOCK_IDENTITY_NETWORKS else "canonical"
        if gauge not in GAUGES:
            fail("gauge", gauge, "'auto' | " + " | ".join(map(repr, GAUGES)))
        if gauge == "block_identity" and network not in BLOCK_IDENTITY_NETWORKS:
            fail("gauge", gauge, f"'auto', None or 'canonical' for network {network!r} "
                  f"('block_identity' needs one of {', '.join(BLOCK_IDENTITY_NETWORKS)})")
        if dtype is not None and dtype not in _FLOAT_DTYPES:
            fail("dtype", dtype, "None (the states' dtype) | " + " | ".join(map(str, _FLOAT_DTYPES)))
        if not is_int(steps) or steps < 0:
            fail("steps", steps, "an int >= 0 (Adam refinement steps per segment)")
        if not is_int(n_iter_max) or n_iter_max < 1:
            fail("n_iter_max", n_iter_max, "an int >= 1 (CP-ALS / HOOI iterations)")
        if not isinstance(low_memory, bool):
            fail("low_memory", low_memory, "True (default: rebuild the segments at every step, hold only the packed "
                 "bytes) | False (also keep each rebuilt segment: faster, but more bytes than DynamicCache)")
        return cls(network=network, rank=rank, segment=segment, residual=residual, sort=sort, sort_span=sort_span,
                   nonnegative=nonnegative, mapping=mapping, reduction=reduction, gauge=gauge, dtype=dtype,
                   steps=steps, n_iter_max=n_iter_max, low_memory=low_memory, error_bits=error_bits)


# --------------------------------------------------------------------------------------------
# the one compressor boundary: a (heads, tokens, head_dim) segment in, a packed segment out
# --------------------------------------------------------------------------------------------

class PackedSegment:
    """One compressed (heads, tokens, head_dim) block, held exactly as `EinSortTensor.to_dict` packs it
    (no factors at rank 0), plus, with ``error_bits``, the fit's error quantized (`ERROR_PARTS`; grouped
    along the tokens of each channel for keys, along the channels of each token for values: ``keys``)."""

    __slots__ = ("tensors", "meta", "shape", "keys")

    def __init__(self, tensors: dict[str, torch.Tensor], meta: dict, shape: tuple[int, int, int], keys: bool = True):
        self.tensors = tensors
        self.meta = meta
        self.shape = shape
        self.keys = keys

    def reconstruct(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if "cores" in self.tensors:
            fit = {k: t for k, t in self.tensors.items() if k not in ERROR_PARTS}
            x = einsort.EinSortTensor.from_dict(fit, self.meta).reconstruct(dtype).reshape(self.shape)
        else:
            x = torch.zeros(self.shape, dtype=dtype or torch.float32, device=self.tensors["ecodes"].device)
        if self.meta.get("error"):
            x = x + dequantize_error(self.tensors, self.meta["error"], self.shape, self.keys).to(x.dtype)
        return x

    def storage(self) -> dict[str, int]:
        return storage_bytes(self.tensors)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def to(self, device) -> "PackedSegment":
        return PackedSegment({k: t.to(device, non_blocking=True) for k, t in self.tensors.items()}, self.meta, self.shape)


def _segment_layout(h: int, t: int, d: int, settings: EinSortCacheSettings):
    """(shape of the sorted view, sort_axis, reduce_over, fold) for an (h, t, d) segment."""
    # the view sorted along its axis `sort_axis`; the head axis (0) is reduced over for a shared permutation
    view, sort_axis = ((h, t * d), 1) if settings.sort_span == "segment" else ((h, t, d), 2 if settings.sort_span == "token" else 1)
    if settings.network == "svd":
        fold = (h * t, d)
    else:
        fold = tuple(s for s in (h, t, d) if s > 1)
        if len(fold) < 2:
            fold = (h * t, d)
    return view, None if settings.sort is None else sort_axis, 0 if settings.sort == "shared" else None, fold


ERROR_PARTS = ("ecodes", "escale", "ezero")  # the quantized error: packed codes, float16 scales, uint8 zero points
ERROR_GROUP = 64  # at most this many values share a scale and zero point


def error_layout(shape: tuple[int, int, int], bits: int) -> tuple[int, int]:
    """(group size, stored bytes) of an (h, t, d) segment's quantized error: groups of ``gcd(t, d, 64)`` values,
    so the keys' groups (along tokens) and the values' (along channels) are as many and stack alike."""
    h, t, d = shape
    g = math.gcd(t, d, ERROR_GROUP)
    n = h * t * d
    return g, code_bytes(n, bits) + (n // g) * 3


def _quantize_error(e: torch.Tensor, bits: int, group: int, keys: bool) -> dict[str, torch.Tensor]:
    """An (h, t, d) error as `ERROR_PARTS`: per group of `group` values, round to nearest on a min-max grid.
    Keys are grouped along the tokens of each channel (their channels differ in scale by orders of magnitude:
    KIVI, Liu et al. 2024), values along the channels of each token."""
    rows = (e.transpose(1, 2) if keys else e).reshape(-1, group)
    q = quantize_rtn(rows, bits, group)
    return {"ecodes": pack(q.codes, bits), "escale": q.scale, "ezero": q.zero}


def dequantize_error(tensors: dict[str, torch.Tensor], spec: tuple[int, int], shape, keys: bool) -> torch.Tensor:
    """The quantized errors of `tensors` (parts of shape (*batch, length)) de-quantized: (*batch, h, t, d), float32."""
    bits, group = spec
    h, t, d = shape
    codes, scale, zero = (tensors[k] for k in ERROR_PARTS)
    batch = codes.shape[:-1]
    n = h * t * d
    rows = codes.reshape(-1, codes.shape[-1])
    if (n * bits) % 8 == 0 and (8 % bits == 0 or rows.shape[-1] % bits == 0):  # rows end on whole packing units
        c = unpack(rows.reshape(-1), bits).view(rows.shape[0], -1)
    else:
        c = torch.stack([unpack(r, bits)[:n] for r in rows])
    c = c[:, :n]
    x = (c.float().view(-1, n // group, group) - zero.reshape(-1, n // group, 1).float()) * scale.reshape(-1, n // group, 1).float()
    x = x.view(*batch, h, d, t).transpose(-1, -2) if keys else x.view(*batch, h, t, d)
    return x


def storage_bytes(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Bytes by part: factors (the cores), pivots, perm, signs, error (the quantized error's parts)."""
    parts = {"factors": 0, "pivots": 0, "perm": 0, "signs": 0, "error": 0}
    for k, t in tensors.items():
        parts["factors" if k == "cores" else "error" if k in ERROR_PARTS else k] += t.numel() * t.element_size()
    return parts


def segment_rank(shape: tuple[int, int, int], dtype: torch.dtype, settings: EinSortCacheSettings):
    """The rank a (heads, tokens, head_dim) segment of states of `dtype` is fitted at (0: no factors, the
    quantized error alone); raises if the budget cannot hold it."""
    rank = settings.rank
    if isinstance(rank, float):  # a budget in bytes of the segment at the *states'* dtype (einsort.fit's is at the factor dtype)
        view, sort_axis, reduce_over, fold = _segment_layout(*shape, settings)
        factor_dtype = settings.dtype or dtype
        overhead = einsort.overhead_bytes(view, sort_axis, reduce_over, settings.nonnegative)
        dense = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        budget = int(rank * dense)
        if settings.error_bits:
            err = error_layout(shape, settings.error_bits)[1]
            if err > budget:
                fail("rank", settings.rank, f"a byte fraction >= {err / dense:.4f} for a {shape[0]} x {shape[1]} x {shape[2]} "
                     f"segment of {str(dtype).removeprefix('torch.')} states: its error at {settings.error_bits} bits "
                     f"alone takes {err} of its {dense} dense bytes")
            budget -= err
            rank = einsort.rank_for_budget(budget, settings.network, fold, settings.gauge, factor_dtype, overhead)
            return rank or 0
        rank = einsort.rank_for_budget(budget, settings.network, fold, settings.gauge, factor_dtype, overhead)
        if rank is None:
            least = overhead + einsort.network_bytes(settings.network, fold, 1, settings.gauge, factor_dtype)
            fail("rank", settings.rank, f"a byte fraction >= {least / dense:.4f} for a {shape[0]} x {shape[1]} x {shape[2]} "
                  f"segment of {str(dtype).removeprefix('torch.')} states: the permutation and sign bits alone take "
                  f"{overhead} of its {dense} dense bytes")
    return rank


def compress_segment(x: torch.Tensor, settings: EinSortCacheSettings, keys: bool = True) -> PackedSegment:
    """Compress one batch row's segment ``x`` (kv_heads, tokens, head_dim) with `einsort.fit`; with
    ``error_bits``, what the fit misses (all of ``x`` at rank 0) is quantized too (`_quantize_error`;
    `keys`: which grouping)."""
    h, t, d = x.shape
    view, sort_axis, reduce_over, fold = _segment_layout(h, t, d, settings)
    sorted_view = x.reshape(view)
    factor_dtype = settings.dtype or x.dtype
    rank = segment_rank((h, t, d), x.dtype, settings)
    tensors, meta = {}, {"shape": list(view)}
    if rank:
        approx = einsort.fit(sorted_view, settings.network, rank, sort_axis=sort_axis, reduce_over=reduce_over,
                             mapping=settings.mapping, reduction=settings.reduction, nonnegative=settings.nonnegative,
                             gauge=settings.gauge, fold=fold, dtype=factor_dtype, steps=settings.steps,
                             n_iter_max=settings.n_iter_max)
        tensors, meta = approx.to_dict()
    seg = PackedSegment(tensors, meta, (h, t, d), keys)
    if settings.error_bits:
        group = error_layout((h, t, d), settings.error_bits)[0]
        fitted = seg.reconstruct(x.dtype).float() if rank else 0.0
        tensors.update(_quantize_error(x.float() - fitted, settings.error_bits, group, keys))
        meta["error"] = (settings.error_bits, group)
    return seg


# --------------------------------------------------------------------------------------------
# batched rebuild: N packed segments of one layout at once, a fixed number of tensor operations
# --------------------------------------------------------------------------------------------

PARTS = ("cores", "pivots", "perm", "signs")


@dataclass(frozen=True)
class _Layout:
    """What `EinSortTensor.from_dict` + ``reconstruct`` read from a segment's metadata (no tensors)."""

    shape: tuple[int, ...]  # the fitted (sorted) view
    network: str
    cores: tuple  # per core: (core shape, stored entries, None or (rows, r, index bits, first bit))
    fold_order: tuple[int, ...] | None
    sort_axis: int | None
    perm: tuple | None  # (perm shape, count, index bits)
    nonnegative: bool
    mapping: tuple[str, float]
    equation: str  # the network's contraction with a leading batch index


@functools.lru_cache(maxsize=64)
def _layout(key: tuple) -> _Layout:
    meta = dict(key)
    shapes = [tuple(c) for c in meta["core_shapes"]]
    cores, bit = [], 0
    for k, c in enumerate(shapes):
        n = math.prod(c)
        piv = None
        if k in meta["pivot_cores"]:
            rows, r = math.prod(c[:-1]), c[-1]
            w = index_bits(rows)
            n -= r * r
            piv = (rows, r, w, bit)
            bit += r * w
        cores.append((c, n, piv))
    perm = None
    if meta["perm_shape"] is not None:
        perm = (tuple(meta["perm_shape"]), math.prod(meta["perm_shape"]), index_bits(meta["shape"][meta["sort_axis"]]))
    eq = equation(meta["network"], len(meta["fold_shape"]))
    z = next(c for c in reversed(string.ascii_letters) if c not in eq)
    ins, out = eq.split("->")
    batched = ",".join(z + t for t in ins.split(",")) + "->" + z + out
    return _Layout(shape=tuple(meta["shape"]), network=meta["network"], cores=tuple(cores),
                   fold_order=None if meta["fold_order"] is None else tuple(meta["fold_order"]),
                   sort_axis=meta["sort_axis"], perm=perm, nonnegative=meta["nonnegative"],
                   mapping=(meta["mapping"][0], float(meta["mapping"][1])), equation=batched)


def _meta_key(meta: dict) -> tuple:
    return tuple(sorted((k, _frozen(v)) for k, v in meta.items()))


def _frozen(v):
    return tuple(_frozen(x) for x in v) if isinstance(v, (list, tuple)) else v


_BIT_TABLE = ((torch.arange(256).unsqueeze(1) >> torch.arange(7, -1, -1)) & 1).to(torch.uint8)  # byte -> its 8 bits


_SIGN_TABLE = 1.0 - 2.0 * _BIT_TABLE.float()  # byte -> its 8 signs (bit 1: -1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """(N, bytes) uint8 -> (N, 8 * bytes) 0/1 uint8, big-endian within each byte (as `einsort.pack_bits`)."""
    table = _BIT_TABLE.to(packed.device)
    return table.index_select(0, packed.reshape(-1).int()).reshape(packed.shape[0], -1)


def _ints(bits: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """(N, >= count * width) bits -> (N, count) int64 (as `einsort.from_bits`, per row).

    The bits are weighted and summed by one float matrix product: exact while ``width`` <= 24."""
    b = bits[:, : count * width].reshape(bits.shape[0], count, width)
    if width > 24:
        it = torch.int64
        return (b.to(it) << torch.arange(width - 1, -1, -1, device=bits.device, dtype=it)).sum(-1)
    weights = torch.exp2(torch.arange(width - 1, -1, -1, device=bits.device, dtype=torch.float32))
    return (b.to(torch.float32) @ weights).to(torch.int64)


def _unpack(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """(N, bytes) uint8 of `width`-bit indices packed from bit 0 -> (N, count) int64 (as ``_ints(_bits(...))``).

    Where a whole number of indices fills a whole number of bytes in at most 31 bits (width 1-4, 6, 8,
    12, 16, 24: e.g. 4 six-bit indices in 3 bytes), each group of bytes is read as one integer and the
    indices shifted out of it: a few operations on the packed bytes instead of one byte per bit."""
    if width == 0:
        return torch.zeros(packed.shape[0], count, dtype=torch.int64, device=packed.device)
    g = math.lcm(width, 8)
    if g > 31:
        return _ints(_bits(packed), width, count)
    n, nb, per = packed.shape[0], g // 8, g // width
    groups = -(-count // per)
    p = packed[:, : groups * nb]
    if p.shape[1] < groups * nb:
        p = F.pad(p, (0, groups * nb - p.shape[1]))
    p = p.reshape(n, groups, nb).to(torch.int32)
    word = p[..., 0]
    for j in range(1, nb):  # big-endian: the first byte holds the highest bits
        word = (word << 8) | p[..., j]
    shifts = torch.arange(g - width, -1, -width, device=packed.device, dtype=torch.int32)
    vals = (word.unsqueeze(-1) >> shifts) & ((1 << width) - 1)
    return vals.reshape(n, -1)[:, :count].to(torch.int64)


def _expand_pivots(data: torch.Tensor, piv_bits: torch.Tensor, piv: tuple) -> torch.Tensor:
    """A block-identity core (N, rows, r) from its stored entries: rows ``idx`` are e_0 .. e_{r-1}, the
    others are the stored rows in order. One gather from [stored rows; identity] (no boolean masks)."""
    rows, r, w, first = piv
    n, dev = data.shape[0], data.device
    idx = _ints(piv_bits[:, first: first + r * w], w, r)
    mark = torch.zeros(n, rows, dtype=torch.int64, device=dev).scatter_(1, idx, 1)
    src = torch.arange(rows, device=dev) - mark.cumsum(1) + mark  # a stored row: its place among the stored rows
    src.scatter_(1, idx, torch.arange(rows - r, rows, device=dev).expand(n, r))  # pivot j: identity row j
    ext = torch.cat([data.reshape(n, rows - r, r), torch.eye(r, dtype=data.dtype, device=dev).expand(n, r, r)], 1)
    return ext.gather(1, src.unsqueeze(-1).expand(n, rows, r))


def _unsort_into(dest: torch.Tensor, y: torch.Tensor, perm_bytes: torch.Tensor, lay: "_Layout") -> None:
    """``dest`` (*batch, *shape) gets ``y`` (N, *shape), sorted along the layout's sort axis, in its original order.

    One scatter along the sort axis and the axes after it, flattened (a scatter along an inner axis of a
    4-d tensor is several times slower than along the last one), with the flat index ``perm * inner +
    offset`` built in one operation; straight into ``dest`` where its strides allow."""
    pshape, count, w = lay.perm
    n, shape, a = y.shape[0], lay.shape, lay.sort_axis
    batch, inner, tail = dest.shape[: dest.ndim - len(shape)], math.prod(shape[a + 1:]), math.prod(shape[a:])
    vals = _unpack(perm_bytes, w, count).view(n, *pshape).expand(n, *pshape[:a], *shape[a:])  # a permutation shared over trailing axes: broadcast
    offsets = torch.arange(inner, dtype=vals.dtype, device=y.device).view(shape[a + 1:])
    idx = torch.add(offsets, vals, alpha=inner).view(*batch, *pshape[:a], tail)
    src = y.reshape(*batch, *shape[:a], tail)
    flat = _view(dest, src.shape) if dest.dtype == src.dtype else None
    if flat is not None:
        flat.scatter_(-1, idx.expand(src.shape), src)
    else:
        dest.copy_(torch.empty_like(src).scatter_(-1, idx.expand(src.shape), src).view(dest.shape))


def _view(t: torch.Tensor, shape) -> torch.Tensor | None:
    """``t.view(shape)``, or None where its strides need a copy."""
    try:
        return t.view(shape)
    except RuntimeError:
        return None


def rebuild_segments(tensors: dict[str, torch.Tensor], meta: dict, dtype: torch.dtype,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Reconstruct packed segments sharing `meta` at once: ``tensors[part]`` is (*batch, length of that part).

    Gives (*batch, *meta["shape"]) at `dtype` — entry i is what ``PackedSegment({k: t[i]}, meta,
    ...).reconstruct(dtype)`` gives, as the fitted view — written into `out` when given (any strides: a
    view of the tensor attention reads saves a copy). A fixed number of batched tensor operations, however
    many segments.
    """
    lay = _layout(_meta_key(meta))
    batch = tensors["cores"].shape[:-1]
    # explicit row count: a part may be empty (segment=1 sorted by channel: each channel's one token needs no
    # permutation bits), and -1 cannot be inferred from 0 entries
    tensors = {k: t.reshape(batch.numel(), t.shape[-1]) for k, t in tensors.items()}
    flat = tensors["cores"].float()  # contracted in float32, as `TensorNetwork.contract`
    n = flat.shape[0]
    piv_bits = _bits(tensors["pivots"]) if "pivots" in tensors else None
    cores, pos = [], 0
    for shape, count, piv in lay.cores:
        data = flat[:, pos: pos + count]
        pos += count
        cores.append((data if piv is None else _expand_pivots(data, piv_bits, piv)).reshape(n, *shape))
    y = torch.bmm(*cores) if lay.network == "svd" else torch.einsum(lay.equation, *cores)
    order = lay.fold_order or tuple(range(len(lay.shape)))
    y = y.reshape(n, *[lay.shape[i] for i in order])
    if lay.fold_order is not None:
        y = y.permute(0, *[1 + order.index(i) for i in range(len(order))])
    if lay.nonnegative:  # entrywise, so before the unsorting as well as after; in place on the fresh contraction
        y = einsort.unmap_values(y, *lay.mapping, inplace=True)
    if out is None:
        out = torch.empty(*batch, *lay.shape, dtype=dtype, device=y.device)
    if lay.perm is not None:
        _unsort_into(out, y, tensors["perm"], lay)
    else:
        out.copy_(y.reshape(out.shape))
    if lay.nonnegative:  # sign bit 1: negative
        signs = _SIGN_TABLE.to(y.device).index_select(0, tensors["signs"].reshape(-1).int()).view(n, -1)
        out.mul_(signs[:, : math.prod(lay.shape)].reshape(out.shape))
    return out
