"""`EinSortCache`: a transformers `Cache` whose older tokens are kept as sorted tensor networks.

Koike-Akino et al., "EinSort: Sorting is All We Need for Tensorizing LLM", Section 3: prefill, then
decompose the KV cache segment by segment (the permutation shared over the KV-head axis), and let
attention see the reconstruction.

Per full-attention layer (`EinSortLayer`), for keys and values alike::

    [ seg 0 | seg 1 | ... | seg n-1 ][ window: the most recent tokens, full precision ]
      compressed, `segment` tokens     between `residual` and `residual + segment - 1` tokens

- ``update`` returns ``cat(reconstruction of the segments, window, new states)`` — the new and
  window tokens exactly as given — and only then moves whole `segment`-token blocks from the
  oldest end of the window into compressed segments while the window holds at least
  ``residual + segment`` tokens. So the forward that fills a segment still sees it dense (the
  paper's "prefill, then compress"), and every later forward sees its reconstruction.
- A segment of one batch row, X of shape (kv_heads H, tokens T, head_dim D), is compressed by one
  function, `compress_segment`, which calls the part-1 library `einsort.fit`. ``sort="shared"``
  (EinSort): X is sorted along one axis by permutations shared by all KV heads (``reduce_over`` the
  head axis; the metric is the mapped magnitudes reduced over heads, default ``("pow", 0.5)`` and
  ``"prod"``). Which axis (``sort_span``): ``"channel"`` (default) sorts the T tokens within each
  head_dim channel — one permutation of T per channel; ``"token"`` sorts the D entries of each
  token; ``"segment"`` sorts all T*D entries of a head at once. ``sort="full"``: the same with one
  permutation per head; ``sort=None``: no sorting (the plain decomposition). Optional non-negative
  tensorization keeps one sign bit per entry. The sorted tensor is folded to (H*T, D) for SVD and
  to (H, T, D) (size-1 modes dropped) for TT/TR/CP/Tucker and decomposed at `rank` (an int, or a
  float: the fraction of the segment's dense bytes, at the states' dtype whatever the factor dtype,
  that the segment may take, permutation and sign bits included). On SmolLM2's KV states at 25 % of the dense bytes, "channel" gave relative errors
  (keys / values) 0.32 / 0.42 against 0.41 / 0.59 unsorted, "token" 0.53 / 0.47 and "segment"
  0.57 / 0.52 (its 12-bit indices leave little for the factors).
- ``error_bits`` (a quantized residual of the fit; named so as not to clash with the window's
  ``residual``): the segment is the fit plus what it misses, quantized by round to nearest at 2 / 3 / 4 / 8
  bits with a float16 scale and an integer zero point per group of ``gcd(tokens, head_dim, 64)`` values —
  keys grouped along the tokens of each channel, values along the channels of each token (KIVI's layout:
  key channels differ in scale by orders of magnitude, value tokens do not). Both groupings give as many
  groups, so keys and values stack alike. A float ``rank`` pays for the quantized error first; rank 0
  (no factors) is quantization alone. On SmolLM2's states (2,048 teacher-forced tokens) 4-bit alone kept
  perplexity within 0.4 % of DynamicCache at 13.7 % of its bytes; a low-rank fit under it helped at 3 and
  2 bits, not at 4; sorting's permutation and sign bits (11 % of the bytes) cost more than they gave.
- Each compressed segment is held packed, exactly as `EinSortTensor.to_dict` gives it: factor
  entries at the factor dtype (block-identity blocks left out), pivot indices, permutation indices
  and sign bits bit-packed in uint8 tensors. All segments of a layer share one layout (the same
  shape, ranks and gauge give the same tensor sizes), so a layer keeps them stacked, one tensor per
  part of shape (batch, segments, 2 for keys/values, bytes or entries) (`packed`; `segments` gives
  per-segment views). `nbytes()` is the sum of those tensors plus the window (and the ordinary
  layers' states, and rebuilt segments where kept), so it is what the cache holds.
- Memory against time, the choice made here. The `Cache` contract makes ``update`` return dense
  keys and values for *every* cached token, and attention reads them all at each step, so each
  decode step does O(length) work with any cache (DynamicCache copies its whole cache into a new
  tensor every step; QuantizedCache dequantizes everything every step). A cache that holds fewer
  bytes than DynamicCache cannot keep a dense copy of its old tokens, so it must decompress them at
  every step too. What matters is how much that costs per step. The previous change kept every
  rebuilt segment (attention then cost what DynamicCache costs, but packed + rebuilt bytes exceeded
  the dense ones: 41,244 against 32,256 after 63 tokens of a 2-layer model). Rebuilding segment by
  segment instead (one `EinSortTensor.from_dict` + contraction per segment, batch row, key/value and
  layer) made the step cost grow with the number of segments in Python calls (over 10 s a token at
  1,024 tokens of SmolLM2-135M on 2 cores). Computing attention on the factors directly is not
  possible here: the reconstruction is sign ⊙ f⁻¹(unsort(U Vᵀ)) with a per-channel permutation and a
  non-linear unmapping, and attention lives outside the cache. So the default (``low_memory=True``)
  keeps nothing rebuilt and rebuilds *all* segments of a layer at once with a fixed number of
  batched tensor operations (`rebuild_segments`: one gather for the block-identity cores, one batched
  contraction, one bit-unpacking of the permutations, one scatter along the flattened (tokens,
  head_dim) axes, one sign pass), written straight into the tensor the layer returns to attention (no
  concatenation after it) — a constant number of kernel calls per layer and step whatever the length.
  Each still streams over the whole cache, so the time per token grows with the length, several times
  faster than DynamicCache's own copy and attention do (measured in `benchmarks/kv_cache.py --scaling`).
  ``low_memory=False`` still keeps each rebuilt segment (``storage()["rebuilt"]``) and rebuilds only
  new ones (the same batched function): a little faster, but then the packed and the rebuilt states
  together outweigh the dense ones.
- Batch rows are compressed independently (one fit per row and segment), so beam reordering,
  `batch_repeat_interleave` and `batch_select_indices` are exact: they re-index the rows' lists.
  Padded positions are cached like any other (their attention mask still hides them).
- Layers that are not full attention (sliding-window, chunked, linear attention, hybrid) keep the
  ordinary transformers layer that `DynamicCache(config)` would build for them.
"""

from __future__ import annotations

import functools
import math
import string
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

from ..validation import is_int
from ..decompositions import einsort
from ..decompositions.quantize import BITS, code_bytes, pack, quantize_rtn, unpack
from ..decompositions.tensor_networks import BLOCK_IDENTITY_NETWORKS, GAUGES, NETWORKS, equation, index_bits

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
            x = x + _error(self.tensors, self.meta["error"], self.shape, self.keys).to(x.dtype)
        return x

    def storage(self) -> dict[str, int]:
        return _storage(self.tensors)

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


def _error(tensors: dict[str, torch.Tensor], spec: tuple[int, int], shape, keys: bool) -> torch.Tensor:
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


def _storage(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
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
    tensors = {k: t.reshape(-1, t.shape[-1]) for k, t in tensors.items()}
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


# --------------------------------------------------------------------------------------------
# the layer
# --------------------------------------------------------------------------------------------

class EinSortLayer(DynamicLayer):
    """A full-attention cache layer: compressed segments (per batch row) + a full-precision window.

    ``keys`` / ``values`` hold the window, (batch, kv_heads, window, head_dim). ``packed[part]``
    (part: cores, and as used pivots, perm, signs) holds every compressed segment of the layer,
    (batch, segments, 2 — keys then values —, length of the part), oldest segment first; all share
    the layout ``meta``. ``segments[b]`` gives batch row b's ``(key_segment, value_segment)``
    `PackedSegment` pairs as views of it.
    """

    is_sliding = False
    is_croppable = False  # tokens already compressed cannot be put back exactly

    def __init__(self, settings: EinSortCacheSettings | None = None, **kwargs):
        super().__init__()
        self.settings = settings or EinSortCacheSettings()
        self.packed: dict[str, torch.Tensor] = {}
        self.meta: dict | None = None
        self.cumulative_length = 0
        self.rebuilt: tuple[torch.Tensor, torch.Tensor] | None = None  # segments rebuilt so far (low_memory=False)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        segment_rank((h, self.settings.segment, d), key_states.dtype, self.settings)  # a budget too small fails now
        super().lazy_initialization(key_states, value_states)
        self.packed, self.meta, self.rebuilt = {}, None, None

    # -- reading ------------------------------------------------------------------------------
    @property
    def n_segments(self) -> int:
        return next(iter(self.packed.values())).shape[1] if self.packed else 0

    @property
    def compressed_length(self) -> int:
        return self.settings.segment * self.n_segments

    @property
    def segments(self) -> list[list[tuple[PackedSegment, PackedSegment]]]:
        """Per batch row, its ``(key_segment, value_segment)`` pairs, oldest first (views of `packed`)."""
        if not self.packed:
            return [[] for _ in range(self.keys.shape[0])] if self.is_initialized and self.keys.ndim == 4 else []
        b, n = next(iter(self.packed.values())).shape[:2]
        shape = self._segment_shape()
        return [[tuple(PackedSegment({k: t[i, j, s] for k, t in self.packed.items()}, self.meta, shape, s == 0) for s in (0, 1))
                 for j in range(n)] for i in range(b)]

    def _segment_shape(self) -> tuple[int, int, int]:
        h, seg = self.meta["shape"][0], self.settings.segment
        return h, seg, math.prod(self.meta["shape"]) // (h * seg)

    def _rebuild_into(self, dest: torch.Tensor, start: int = 0) -> None:
        """Segments ``start:`` of every row rebuilt into ``dest``: (2 — keys, values —, batch, kv_heads, tokens, head_dim)."""
        b, n = next(iter(self.packed.values())).shape[:2]
        view = dest.unflatten(3, (n - start, self.settings.segment)).permute(1, 3, 0, 2, 4, 5)  # (batch, segments, k/v, h, t, d)
        packed = {k: t[:, start:] for k, t in self.packed.items()}
        if "cores" in packed:  # the fitted view of each segment: a view, never a copy
            rebuild_segments(packed, self.meta, self.dtype, out=view.view(b, n - start, 2, *self.meta["shape"]))
        else:
            view.zero_()
        if "error" in self.meta:
            for s in (0, 1):
                view[:, :, s] += _error({k: packed[k][:, :, s] for k in ERROR_PARTS}, self.meta["error"],
                                        self._segment_shape(), s == 0).to(view.dtype)

    def _new_states(self, tokens: int) -> torch.Tensor:
        return self.keys.new_empty(2, self.keys.shape[0], self.keys.shape[1], tokens, self.keys.shape[-1])

    def reconstruct(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressed tokens as attention sees them: (batch, kv_heads, compressed_length, head_dim) each.

        All segments are rebuilt at once (`rebuild_segments`) at every call; with ``low_memory=False`` each is
        rebuilt once and kept (`rebuilt`).
        """
        n, seg = self.n_segments, self.settings.segment
        done = 0 if self.settings.low_memory or self.rebuilt is None else self.rebuilt[0].shape[-2] // seg
        if done == n:
            return self.rebuilt
        kv = self._new_states((n - done) * seg)
        self._rebuild_into(kv, done)
        if self.settings.low_memory:
            return kv[0], kv[1]
        if done:
            kv = torch.cat([torch.stack(self.rebuilt), kv], dim=-2)
        self.rebuilt = (kv[0], kv[1])
        return self.rebuilt

    def _append(self, window_k: torch.Tensor, window_v: torch.Tensor, n: int) -> None:
        """Compress the first `n` whole segments of the window (every batch row) and stack them onto `packed`."""
        seg = self.settings.segment
        new = []  # [row][segment] -> (key PackedSegment, value PackedSegment)
        for b in range(window_k.shape[0]):
            new.append([(compress_segment(window_k[b, :, i * seg: (i + 1) * seg], self.settings, keys=True),
                         compress_segment(window_v[b, :, i * seg: (i + 1) * seg], self.settings, keys=False)) for i in range(n)])
        for row in new:
            for pair in row:
                for s in pair:
                    if self.meta is None:
                        self.meta = s.meta
                    elif s.meta != self.meta:  # cannot happen: the layout follows from the shape and settings alone
                        raise RuntimeError(f"EinSortLayer: a segment's layout {s.meta} differs from the layer's {self.meta}")
        for k in new[0][0][0].tensors:
            t = torch.stack([torch.stack([torch.stack([pair[0].tensors[k], pair[1].tensors[k]]) for pair in row]) for row in new])
            self.packed[k] = torch.cat([self.packed[k], t], dim=1) if k in self.packed else t

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        c = self.compressed_length
        if c and self.settings.low_memory:
            w = self.keys.shape[-2]
            # one tensor for what attention reads: the segments rebuilt straight into it, then the window and the new states
            kv = self._new_states(c + w + key_states.shape[-2])
            self._rebuild_into(kv[..., :c, :])
            kv[0, :, :, c: c + w], kv[1, :, :, c: c + w] = self.keys, self.values
            kv[0, :, :, c + w:], kv[1, :, :, c + w:] = key_states, value_states
            out_k, out_v = kv[0], kv[1]
            # the window is a view of what attention gets: copied below, so it does not keep that alive
            window_k, window_v = out_k[:, :, c:], out_v[:, :, c:]
        else:
            window_k = torch.cat([self.keys, key_states], dim=-2)
            window_v = torch.cat([self.values, value_states], dim=-2)
            out_k, out_v = window_k, window_v
            if c:
                old_k, old_v = self.reconstruct()
                out_k, out_v = torch.cat([old_k, window_k], dim=-2), torch.cat([old_v, window_v], dim=-2)
        # then move whole segments out of the window (seen dense by this forward, reconstructed by later ones)
        seg, keep = self.settings.segment, self.settings.residual
        n = (window_k.shape[-2] - keep) // seg if window_k.shape[-2] >= keep + seg else 0
        if n:
            self._append(window_k, window_v, n)
            window_k, window_v = window_k[:, :, n * seg:], window_v[:, :, n * seg:]
        fused = c and self.settings.low_memory
        self.keys, self.values = (window_k.clone(), window_v.clone()) if fused else (window_k.contiguous(), window_v.contiguous())
        return out_k, out_v

    def get_seq_length(self) -> int:
        return self.cumulative_length if self.is_initialized else 0

    # -- storage --------------------------------------------------------------------------------
    def storage(self) -> dict[str, int]:
        """Bytes held: factors, pivots, perm, signs, error (packed), the full-precision window, the rebuilt segments."""
        parts = _storage(self.packed)
        parts["window"] = 0
        if self.is_initialized:
            parts["window"] = sum(t.numel() * t.element_size() for t in (self.keys, self.values))
        parts["rebuilt"] = sum(t.numel() * t.element_size() for t in self.rebuilt or ())
        return parts

    def nbytes(self) -> int:
        return sum(self.storage().values())

    def dense_nbytes(self) -> int:
        """Bytes a `DynamicLayer` would hold for the same tokens."""
        if not self.is_initialized:
            return 0
        b, h, _, d = self.keys.shape
        return 2 * b * h * self.cumulative_length * d * self.keys.element_size()

    # -- batch manipulation (exact: rows are independent) -----------------------------------------
    def _select_rows(self, idx: list[int]) -> None:
        self.packed = {k: t[torch.as_tensor(idx, device=t.device)] for k, t in self.packed.items()}
        if self.rebuilt is not None:
            self.rebuilt = tuple(t[torch.as_tensor(idx, device=t.device)] for t in self.rebuilt)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self.is_initialized:
            return
        self._select_rows(beam_idx.tolist())
        self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
        self.values = self.values.index_select(0, beam_idx.to(self.values.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not self.is_initialized:
            return
        self._select_rows([i for i in range(self.keys.shape[0]) for _ in range(repeats)])
        self.keys = self.keys.repeat_interleave(repeats, dim=0)
        self.values = self.values.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        idx = torch.arange(self.keys.shape[0])[torch.as_tensor(indices).cpu()].reshape(-1).tolist()
        self._select_rows(idx)
        self.keys = self.keys[indices, ...]
        self.values = self.values[indices, ...]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"EinSortLayer.crop: got {tokens_to_remove}; allowed: a negative number of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        if -tokens_to_remove > self.keys.shape[-2]:
            raise ValueError(f"EinSortLayer.crop: got {tokens_to_remove}; allowed: at most the {self.keys.shape[-2]} "
                             "window tokens (compressed segments cannot be cropped)")
        self.keys = self.keys[..., :tokens_to_remove, :]
        self.values = self.values[..., :tokens_to_remove, :]
        self.cumulative_length += tokens_to_remove

    def reset(self) -> None:
        super().reset()
        self.packed, self.meta = {}, None
        self.cumulative_length = 0
        self.rebuilt = None

    def offload(self):
        super().offload()
        self.packed = {k: t.to("cpu", non_blocking=True) for k, t in self.packed.items()}
        self.rebuilt = None if self.rebuilt is None else tuple(t.to("cpu", non_blocking=True) for t in self.rebuilt)

    def prefetch(self):
        super().prefetch()
        if self.is_initialized:
            self.packed = {k: t.to(self.device, non_blocking=True) for k, t in self.packed.items()}
            if self.rebuilt is not None:
                self.rebuilt = tuple(t.to(self.device, non_blocking=True) for t in self.rebuilt)


# --------------------------------------------------------------------------------------------
# the cache
# --------------------------------------------------------------------------------------------

def _state_bytes(layer) -> int:
    """Bytes of the cached states of an ordinary transformers layer (K/V, conv and recurrent states)."""
    out = 0
    for name in ("keys", "values"):
        t = getattr(layer, name, None)
        if isinstance(t, torch.Tensor):
            out += t.numel() * t.element_size()
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        for states in (layer.conv_states, layer.recurrent_states):
            out += sum(t.numel() * t.element_size() for t in states.values() if isinstance(t, torch.Tensor))
    return out


class EinSortCache(Cache):
    """A KV cache that keeps a full-precision window of recent tokens and compresses older ones by EinSort.

    Args:
        config: the model's config (its text config's ``layer_types`` decide which layers are full
            attention; the others keep their ordinary `DynamicCache` layers). ``None``: every layer
            is an `EinSortLayer`, created as the model calls it.
        network: ``"svd" | "tt" | "tr" | "cp" | "tucker"``.
        rank: an int (every bond; capped where more cannot help, so a large int is lossless for
            SVD/TT/TR/Tucker) or a float in (0, 1]: each segment's byte budget as a fraction of its
            dense bytes, permutation and sign bits included (the largest rank that fits).
        segment: tokens per compressed segment.
        residual: tokens always kept in full precision (the window holds residual .. residual+segment-1).
        sort: ``"shared"`` (EinSort: one permutation shared over the KV heads), ``"full"`` (one per
            head), ``None`` (no sorting).
        sort_span: which entries one permutation orders: ``"channel"`` (the tokens of each head_dim
            channel), ``"token"`` (the head_dim entries of each token) or ``"segment"`` (all tokens x
            head_dim entries of a head).
        nonnegative: decompose the mapped magnitudes and keep one sign bit per entry.
        mapping / reduction: the sort metric (and, with ``nonnegative``, the map decomposed), as in
            `einsort.fit`. gauge: ``"auto"`` (block identity where the network has one), ``None``,
            ``"canonical"`` or ``"block_identity"``.
        dtype: factor dtype (default: the states' dtype). steps / n_iter_max: `einsort.fit` settings.
        low_memory: True (default): only the packed segments are kept and all are rebuilt at every
            step, as `QuantizedCache` dequantizes every step (memory: the packed bytes, always fewer
            than `DynamicCache` holds; time per token: one rebuild of every segment, linear in the
            length like attention itself). False: each segment is also kept rebuilt once attention
            first needs it (time per token like `DynamicCache`, but the cache then holds the packed
            and the rebuilt states, *more* bytes than `DynamicCache`; only for speed comparisons).
        error_bits: None (default: the factors alone) or 2 / 3 / 4 / 8: what the factors miss is also
            kept, quantized at that many bits (round to nearest, a float16 scale and an integer zero point
            per 64 values: keys grouped along the tokens of each channel, values along the channels of each
            token, as KIVI). A float ``rank`` then counts those bytes first and fits the largest rank the
            rest holds — 0 (quantization alone) when it holds none; an int ``rank`` may be 0.

    A float ``rank`` too small for one segment (the permutation and sign bits alone exceed it) fails
    here, computed for the config's KV heads and head_dim at the config's dtype (float32 if unset);
    without a config, at the first forward.
    """

    def __init__(self, config=None, network: str = "svd", rank: int | float = 8, segment: int = 64, residual: int = 64,
                 *, sort: str | None = "shared", sort_span: str = "channel", nonnegative: bool = True,
                 mapping=("pow", 0.5), reduction: str = "prod", gauge: str | None = "auto",
                 dtype: torch.dtype | None = None, steps: int = 0, n_iter_max: int = 100, low_memory: bool = True,
                 error_bits: int | None = None):
        self.settings = EinSortCacheSettings.build(network=network, rank=rank, segment=segment, residual=residual,
                                                   sort=sort, sort_span=sort_span, nonnegative=nonnegative,
                                                   mapping=mapping, reduction=reduction, gauge=gauge, dtype=dtype,
                                                   steps=steps, n_iter_max=n_iter_max, low_memory=low_memory,
                                                   error_bits=error_bits)
        if config is None:
            super().__init__(layer_class_to_replicate=functools.partial(EinSortLayer, self.settings))
            return
        if not hasattr(config, "get_text_config"):
            fail("config", type(config).__name__, "a transformers PreTrainedConfig (model.config) or None")
        text = config.get_text_config(decoder=True)
        heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
        head_dim = getattr(text, "head_dim", None) or (text.hidden_size // text.num_attention_heads
                                                        if getattr(text, "num_attention_heads", None) else None)
        if heads and head_dim:  # a budget too small for a segment fails here, not mid-generate
            states = getattr(text, "dtype", None)
            states = getattr(torch, states, None) if isinstance(states, str) else states
            segment_rank((heads, segment, head_dim), states if isinstance(states, torch.dtype) else torch.float32, self.settings)
        layer_types, per_layer_kwargs = get_layer_types_and_kwargs(text)
        layers = []
        for layer_type, kwargs in zip(layer_types, per_layer_kwargs):
            if layer_type == "full_attention":
                layers.append(EinSortLayer(self.settings))
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs))
        super().__init__(layers=layers)

    @property
    def einsort_layers(self) -> list[int]:
        """Indices of the layers compressed by EinSort."""
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, EinSortLayer)]

    def storage(self) -> dict[str, int]:
        """Bytes held, by part: factors, pivots, perm, signs, error, window, rebuilt (EinSort layers), other_layers, total."""
        parts = {**_storage({}), "window": 0, "rebuilt": 0, "other_layers": 0}
        for layer in self.layers:
            if isinstance(layer, EinSortLayer):
                for k, v in layer.storage().items():
                    parts[k] += v
            else:
                parts["other_layers"] += _state_bytes(layer)
        parts["total"] = sum(parts.values())
        return parts

    def nbytes(self) -> int:
        """What the cache holds, in bytes: packed factors, permutations, sign bits, windows, other layers' states."""
        return self.storage()["total"]

    def dense_nbytes(self) -> int:
        """What a `DynamicCache(config)` would hold for the same tokens (other layers as they are)."""
        return sum(layer.dense_nbytes() if isinstance(layer, EinSortLayer) else _state_bytes(layer)
                   for layer in self.layers)

    def __repr__(self) -> str:
        s = self.settings
        return (f"EinSortCache(network={s.network!r}, rank={s.rank!r}, segment={s.segment}, residual={s.residual}, "
                f"sort={s.sort!r}, error_bits={s.error_bits}, layers={len(self.layers)}, einsort_layers={len(self.einsort_layers)})")


__all__ = ["EinSortCache", "EinSortCacheSettings", "EinSortLayer", "PackedSegment", "compress_segment", "rebuild_segments"]
