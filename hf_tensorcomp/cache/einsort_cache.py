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
- Each compressed segment is held packed, exactly as `EinSortTensor.to_dict` gives it: factor
  entries at the factor dtype (block-identity blocks left out), pivot indices, permutation indices
  and sign bits bit-packed in uint8 tensors. `nbytes()` is the sum of those tensors plus the window
  (and the ordinary layers' states), so it is what the cache holds. By default (``low_memory=True``)
  nothing rebuilt is kept: every step rebuilds all segments (like `QuantizedLayer` dequantizes every
  step), so the cache holds fewer bytes than `DynamicCache` at every length past the first segment;
  ``low_memory=False`` keeps each rebuilt segment (``storage()["rebuilt"]``): faster, but then the
  packed and the rebuilt states together outweigh the dense ones.
- Batch rows are compressed independently (one fit per row and segment), so beam reordering,
  `batch_repeat_interleave` and `batch_select_indices` are exact: they re-index the rows' lists.
  Padded positions are cached like any other (their attention mask still hides them).
- Layers that are not full attention (sliding-window, chunked, linear attention, hybrid) keep the
  ordinary transformers layer that `DynamicCache(config)` would build for them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

from ..validation import is_int
from ..decompositions import einsort
from ..decompositions.tensor_networks import BLOCK_IDENTITY_NETWORKS, GAUGES, NETWORKS

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

    @classmethod
    def build(cls, network="svd", rank=8, segment=64, residual=64, sort="shared", sort_span="channel",
              nonnegative=True, mapping=("pow", 0.5), reduction="prod", gauge="auto", dtype=None, steps=0,
              n_iter_max=100, low_memory=True) -> "EinSortCacheSettings":
        if network not in NETWORKS:
            fail("network", network, " | ".join(map(repr, NETWORKS)))
        if is_int(rank):
            if rank < 1:
                fail("rank", rank, "an int >= 1 (every bond, capped at the full rank) or a float byte fraction in (0, 1]")
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
                   steps=steps, n_iter_max=n_iter_max, low_memory=low_memory)


# --------------------------------------------------------------------------------------------
# the one compressor boundary: a (heads, tokens, head_dim) segment in, a packed segment out
# --------------------------------------------------------------------------------------------

class PackedSegment:
    """One compressed (heads, tokens, head_dim) block, held exactly as `EinSortTensor.to_dict` packs it."""

    __slots__ = ("tensors", "meta", "shape")

    def __init__(self, tensors: dict[str, torch.Tensor], meta: dict, shape: tuple[int, int, int]):
        self.tensors = tensors
        self.meta = meta
        self.shape = shape

    def reconstruct(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return einsort.EinSortTensor.from_dict(self.tensors, self.meta).reconstruct(dtype).reshape(self.shape)

    def storage(self) -> dict[str, int]:
        parts = {"factors": 0, "pivots": 0, "perm": 0, "signs": 0}
        for k, t in self.tensors.items():
            parts["factors" if k == "cores" else k] += t.numel() * t.element_size()
        return parts

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


def segment_rank(shape: tuple[int, int, int], dtype: torch.dtype, settings: EinSortCacheSettings):
    """The rank a (heads, tokens, head_dim) segment of states of `dtype` is fitted at; raises if the budget cannot hold it."""
    rank = settings.rank
    if isinstance(rank, float):  # a budget in bytes of the segment at the *states'* dtype (einsort.fit's is at the factor dtype)
        view, sort_axis, reduce_over, fold = _segment_layout(*shape, settings)
        factor_dtype = settings.dtype or dtype
        overhead = einsort.overhead_bytes(view, sort_axis, reduce_over, settings.nonnegative)
        dense = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        rank = einsort.rank_for_budget(int(rank * dense), settings.network, fold, settings.gauge, factor_dtype, overhead)
        if rank is None:
            least = overhead + einsort.network_bytes(settings.network, fold, 1, settings.gauge, factor_dtype)
            fail("rank", settings.rank, f"a byte fraction >= {least / dense:.4f} for a {shape[0]} x {shape[1]} x {shape[2]} "
                  f"segment of {str(dtype).removeprefix('torch.')} states: the permutation and sign bits alone take "
                  f"{overhead} of its {dense} dense bytes")
    return rank


def compress_segment(x: torch.Tensor, settings: EinSortCacheSettings) -> PackedSegment:
    """Compress one batch row's segment ``x`` (kv_heads, tokens, head_dim) with `einsort.fit`."""
    h, t, d = x.shape
    view, sort_axis, reduce_over, fold = _segment_layout(h, t, d, settings)
    sorted_view = x.reshape(view)
    factor_dtype = settings.dtype or x.dtype
    rank = segment_rank((h, t, d), x.dtype, settings)
    approx = einsort.fit(sorted_view, settings.network, rank, sort_axis=sort_axis, reduce_over=reduce_over,
                         mapping=settings.mapping, reduction=settings.reduction, nonnegative=settings.nonnegative,
                         gauge=settings.gauge, fold=fold, dtype=factor_dtype, steps=settings.steps,
                         n_iter_max=settings.n_iter_max)
    tensors, meta = approx.to_dict()
    return PackedSegment(tensors, meta, (h, t, d))


# --------------------------------------------------------------------------------------------
# the layer
# --------------------------------------------------------------------------------------------

class EinSortLayer(DynamicLayer):
    """A full-attention cache layer: compressed segments (per batch row) + a full-precision window.

    ``keys`` / ``values`` hold the window, (batch, kv_heads, window, head_dim). ``segments[b]`` is
    the list of ``(key_segment, value_segment)`` `PackedSegment` pairs of batch row b, oldest first.
    """

    is_sliding = False
    is_croppable = False  # tokens already compressed cannot be put back exactly

    def __init__(self, settings: EinSortCacheSettings | None = None, **kwargs):
        super().__init__()
        self.settings = settings or EinSortCacheSettings()
        self.segments: list[list[tuple[PackedSegment, PackedSegment]]] = []
        self.cumulative_length = 0
        self.rebuilt: tuple[torch.Tensor, torch.Tensor] | None = None  # segments rebuilt so far (unless low_memory)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        segment_rank((h, self.settings.segment, d), key_states.dtype, self.settings)  # a budget too small fails now
        super().lazy_initialization(key_states, value_states)
        self.segments = [[] for _ in range(b)]
        self.rebuilt = None

    # -- reading ------------------------------------------------------------------------------
    @property
    def compressed_length(self) -> int:
        return self.settings.segment * (len(self.segments[0]) if self.segments else 0)

    def reconstruct(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressed tokens as attention sees them: (batch, kv_heads, compressed_length, head_dim) each.

        Each segment is rebuilt once and kept (`rebuilt`), unless ``low_memory``: then all are rebuilt every call.
        """
        done = 0 if self.rebuilt is None or self.settings.low_memory else self.rebuilt[0].shape[-2] // self.settings.segment
        n = len(self.segments[0])
        if done == n:
            return self.rebuilt
        rows_k, rows_v = [], []
        for row in self.segments:
            rows_k.append(torch.cat([k.reconstruct(self.dtype) for k, _ in row[done:]], dim=-2))
            rows_v.append(torch.cat([v.reconstruct(self.dtype) for _, v in row[done:]], dim=-2))
        new_k, new_v = torch.stack(rows_k).to(self.device), torch.stack(rows_v).to(self.device)
        if self.settings.low_memory:
            return new_k, new_v
        if done:
            new_k, new_v = torch.cat([self.rebuilt[0], new_k], dim=-2), torch.cat([self.rebuilt[1], new_v], dim=-2)
        self.rebuilt = (new_k, new_v)
        return self.rebuilt

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        window_k = torch.cat([self.keys, key_states], dim=-2)
        window_v = torch.cat([self.values, value_states], dim=-2)
        if self.compressed_length:
            old_k, old_v = self.reconstruct()
            out_k, out_v = torch.cat([old_k, window_k], dim=-2), torch.cat([old_v, window_v], dim=-2)
        else:
            out_k, out_v = window_k, window_v
        # then move whole segments out of the window (seen dense by this forward, reconstructed by later ones)
        seg, keep = self.settings.segment, self.settings.residual
        n = (window_k.shape[-2] - keep) // seg if window_k.shape[-2] >= keep + seg else 0
        for i in range(n):
            sl = slice(i * seg, (i + 1) * seg)
            for b, row in enumerate(self.segments):
                row.append((compress_segment(window_k[b, :, sl], self.settings),
                            compress_segment(window_v[b, :, sl], self.settings)))
        if n:
            window_k, window_v = window_k[:, :, n * seg:], window_v[:, :, n * seg:]
        self.keys, self.values = window_k.contiguous(), window_v.contiguous()
        return out_k, out_v

    def get_seq_length(self) -> int:
        return self.cumulative_length if self.is_initialized else 0

    # -- storage --------------------------------------------------------------------------------
    def storage(self) -> dict[str, int]:
        """Bytes held: factors, pivots, perm, signs (packed), the full-precision window, the rebuilt segments."""
        parts = {"factors": 0, "pivots": 0, "perm": 0, "signs": 0}
        for row in self.segments:
            for pair in row:
                for s in pair:
                    for k, v in s.storage().items():
                        parts[k] += v
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
        self.segments = [list(self.segments[i]) for i in idx]
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
        self._select_rows([i for i in range(len(self.segments)) for _ in range(repeats)])
        self.keys = self.keys.repeat_interleave(repeats, dim=0)
        self.values = self.values.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        idx = torch.arange(len(self.segments))[torch.as_tensor(indices).cpu()].reshape(-1).tolist()
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
        self.segments = []
        self.cumulative_length = 0
        self.rebuilt = None

    def offload(self):
        super().offload()
        self.segments = [[(k.to("cpu"), v.to("cpu")) for k, v in row] for row in self.segments]
        self.rebuilt = None if self.rebuilt is None else tuple(t.to("cpu", non_blocking=True) for t in self.rebuilt)

    def prefetch(self):
        super().prefetch()
        if self.is_initialized:
            self.segments = [[(k.to(self.device), v.to(self.device)) for k, v in row] for row in self.segments]
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

    A float ``rank`` too small for one segment (the permutation and sign bits alone exceed it) fails
    here, computed for the config's KV heads and head_dim at the config's dtype (float32 if unset);
    without a config, at the first forward.
    """

    def __init__(self, config=None, network: str = "svd", rank: int | float = 8, segment: int = 64, residual: int = 64,
                 *, sort: str | None = "shared", sort_span: str = "channel", nonnegative: bool = True,
                 mapping=("pow", 0.5), reduction: str = "prod", gauge: str | None = "auto",
                 dtype: torch.dtype | None = None, steps: int = 0, n_iter_max: int = 100, low_memory: bool = True):
        self.settings = EinSortCacheSettings.build(network=network, rank=rank, segment=segment, residual=residual,
                                                   sort=sort, sort_span=sort_span, nonnegative=nonnegative,
                                                   mapping=mapping, reduction=reduction, gauge=gauge, dtype=dtype,
                                                   steps=steps, n_iter_max=n_iter_max, low_memory=low_memory)
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
        """Bytes held, by part: factors, pivots, perm, signs, window, rebuilt (EinSort layers), other_layers, total."""
        parts = {"factors": 0, "pivots": 0, "perm": 0, "signs": 0, "window": 0, "rebuilt": 0, "other_layers": 0}
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
                f"sort={s.sort!r}, layers={len(self.layers)}, einsort_layers={len(self.einsort_layers)})")


__all__ = ["EinSortCache", "EinSortCacheSettings", "EinSortLayer", "PackedSegment", "compress_segment"]
