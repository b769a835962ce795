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

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

from .segments import (ERROR_PARTS, EinSortCacheSettings, PackedSegment, compress_segment, dequantize_error, fail,
                       rebuild_segments, segment_rank, storage_bytes)


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
                view[:, :, s] += dequantize_error({k: packed[k][:, :, s] for k in ERROR_PARTS}, self.meta["error"],
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
        parts = storage_bytes(self.packed)
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
        parts = {**storage_bytes({}), "window": 0, "rebuilt": 0, "other_layers": 0}
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
