"""`LatentKVCache`: a transformers `Cache` that keeps the latents of `LatentKVLinear` projections, not keys and values.

Per layer and per batch row it holds the key latent and the value latent of every token (R_k and R_v numbers a
token, the projections' summed ranks): the most recent ones in 16 bits (float16 in a float32 model; a window of
between ``window`` and ``window + group - 1`` tokens), the older ones as integer codes (``key_bits`` bits for the keys,
``bits`` for the values), quantized per latent channel over groups of ``group`` consecutive tokens (one float16
scale and one uint8 zero point per channel and group). Per channel because the latent channels are the
projection's singular directions, whose ranges differ by orders of magnitude (KIVI quantizes keys per channel for
the same reason). Each group's range is searched for the least round-trip error (``grid="search"``: clipping its
extremes buys a finer step for the rest; at 2 bits it took SmolLM2 at 2,048 tokens of context from ×1.21 to ×1.08
perplexity) or is its min and max (``grid="minmax"``, what checkpoints written before the option use). Widths
that do not divide a byte (3, 5, 6) are stored as parts that do (3 = 2 + 1), so each comes back with shifts and
masks. ``bits=16``: no codes, every latent kept in the model's dtype (the exact form). ``widths="prompt"``: a width
per latent channel, ``bits`` / ``key_bits`` being a stream's average, chosen from the prompt (`_PromptLatents`).
The stores and the int4 kernel's layouts are in `stores`.

On the CPU, with 4-bit codes in groups PyTorch's int4 kernel takes (32, 64, 128, 256 tokens), the streams of a
full-attention layer are laid out for that kernel, so that decoding reads the codes in place, one kernel call
per stretch of tokens, instead of converting them to floats at every step: the values keep their codes and move
into the kernel's layout every CHUNK tokens (`_KernelValues`); keys latent after RoPE are quantized per token
instead, after a fixed per-channel norm and a block-Hadamard rotation (`_KernelKeys`). The products are
bfloat16 with float32 sums. SmolLM2 at 4,096 tokens of context: see the KV-cache page of the docs.

The cache also keeps each token's position (int32, once for all layers): keys are rebuilt from their latent and
rotated (RoPE) inside attention, at the positions they were seen at (left padding included).

`update` does not return keys and values: it returns the layer itself, which the registered attention
(`methods.latent_kv.attention`) reads. Sliding-window layers drop whole groups of tokens that no query can
reach any more.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from ...decompositions.quantize import BITS, GRIDS
from ...layout import find_decoder_layers, head_dim
from .layer import LatentKeyLinear, LatentKVLinear
from .stores import _KernelKeys, _KernelValues, _Latents, _PromptLatents, kernel_ready


class _Positions:
    """The positions of every cached token, (batch, tokens) int32: shared by the layers of one cache."""

    def __init__(self):
        self.ids: torch.Tensor | None = None

    def extend(self, upto: int, position_ids: torch.Tensor) -> None:
        """Make sure positions cover `upto` tokens, the last ``position_ids.shape[1]`` of which are `position_ids`."""
        have = 0 if self.ids is None else self.ids.shape[1]
        if have >= upto:
            return
        new = position_ids[:, position_ids.shape[1] - (upto - have):].to(torch.int32)
        self.ids = new if self.ids is None else torch.cat([self.ids, new.to(self.ids.device)], 1)

    def nbytes(self) -> int:
        return 0 if self.ids is None else self.ids.numel() * self.ids.element_size()


class LatentKVLayer(CacheLayerMixin):
    """One decoder layer's latents (see the module docstring)."""

    is_compileable = False
    is_croppable = True

    def __init__(self, positions: _Positions, bits: int = 4, group: int = 64, window: int = 64, sink: int = 16,
                 grid: str = "search", key_bits: int | None = None, sliding_window: int | None = None,
                 rotated_keys: bool = False, widths: str = "stream"):
        super().__init__()
        self.positions, self.bits, self.group, self.window, self.sink = positions, bits, group, window, sink
        self.grid, self.key_bits = grid, bits if key_bits is None else key_bits
        self.widths = widths  # "stream": every channel of a stream at its bits; "prompt": bits is the channels' average
        self.rotated_keys = rotated_keys  # keys latent after RoPE (scored in place; before RoPE they are rebuilt)
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        self.reset()

    def reset(self) -> None:
        self.keys = self.values = None
        stream = _PromptLatents if self.widths == "prompt" else _Latents
        self.k = stream(self.key_bits, self.group, self.window, self.sink, self.grid)
        self.v = stream(self.bits, self.group, self.window, self.sink, self.grid)
        self.offset = 0  # tokens forgotten at the front (sliding-window layers)
        self.seen = 0  # every token ever added
        self.pending = None  # the dense states of the tokens being added, until the attention takes them
        self.is_initialized = False

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        if self.is_sliding or self.widths == "prompt":
            return
        if self.rotated_keys and kernel_ready(self.key_bits, self.group, self.device):
            self.k = _KernelKeys(self.key_bits, self.group, self.window, self.sink, self.grid)
        if kernel_ready(self.bits, self.group, self.device):
            self.v = _KernelValues(self.bits, self.group, self.window, self.sink, self.grid)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending = (key_states, value_states)
        return self, self

    def add(self, zk: torch.Tensor, zv: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        """Store the latents of the tokens `update` announced (called by the attention); their positions too
        where the keys are rebuilt and rotated later (None: keys latent after RoPE, no position needed)."""
        self.pending = None
        self.seen += zk.shape[1]
        if position_ids is not None:
            self.positions.extend(self.seen, position_ids)
        self.k.append(zk)
        self.v.append(zv)

    def held(self) -> int:
        return self.seen - self.offset

    def forget(self) -> None:
        """Sliding-window layers: drop the whole groups that no later query can reach (after a step's attention,
        so that the mask of the step, made before it, still matches what is held)."""
        if not self.is_sliding:
            return
        n = max(self.seen - self.sliding_window - self.offset, 0)
        if n > 0:
            done = self.k.drop(n)
            self.v.drop(n)  # the same pieces: both streams hold the same tokens alike
            self.offset += done

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise ValueError, in one line, where `crop` cannot forget the newest ``-tokens_to_remove`` tokens exactly."""
        if tokens_to_remove > 0:  # transformers' dynamic layers refuse it alike
            raise ValueError(f"LatentKVCache.crop: got {tokens_to_remove}; allowed: a negative int, the number of "
                             "newest tokens to remove (crop(-n)), or 0")
        n = min(-tokens_to_remove, self.seen)
        if not self.is_initialized or n == 0:
            return
        dense = min(self.k.dense_end(), self.v.dense_end())
        if n > dense:
            raise ValueError(f"LatentKVCache.crop: removing {n} tokens reaches tokens already held as codes (the newest "
                             f"{dense} are in 16 bits); allowed: at most the window's tokens (window={self.window}), or "
                             "bits=16")
        if self.is_sliding and self.offset > max(self.seen - n - self.sliding_window + 1, 0):
            raise ValueError(f"LatentKVCache.crop: removing {n} tokens would need tokens this sliding-window layer "
                             f"already forgot (the first {self.offset}); allowed: crops before the window "
                             f"({self.sliding_window} tokens) moves past a group (group={self.group})")

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the newest ``-tokens_to_remove`` tokens (assisted decoding's rejected drafts): exactly as if they
        had never been added, where they are held in 16 bits (`check_crop`)."""
        self.check_crop(tokens_to_remove)
        n = min(-tokens_to_remove, self.seen)
        if not self.is_initialized or n == 0:
            return
        self.seen -= n
        self.k.crop(self.held())
        self.v.crop(self.held())

    def token_positions(self) -> torch.Tensor:
        return self.positions.ids[:, self.offset: self.seen]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.held() + query_length, self.offset

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def _select(self, fn) -> None:
        self.k.select(fn)
        self.v.select(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda t: t[indices])

    def nbytes(self) -> int:
        return self.k.nbytes() + self.v.nbytes()

    def offload(self):
        pass

    def prefetch(self):
        pass


class LatentKVCache(Cache):
    """The cache `generate` uses for a model with `LatentKVLinear` projections (made for it automatically; pass
    ``past_key_values=LatentKVCache(model, bits=...)`` to choose other settings). Layers whose projections are
    not latent get transformers' own dynamic layers."""

    def __init__(self, model, bits: int | None = None, group: int | None = None, window: int | None = None,
                 sink: int | None = None, grid: str | None = None, key_bits: int | None = None,
                 widths: str | None = None):
        found = latent_layers(model)
        given = {"bits": bits, "group": group, "window": window, "sink": sink, "grid": grid, "key_bits": key_bits,
                 "widths": widths}
        self.settings = {k: v if given[k] is None else given[k] for k, v in latent_settings(model).items()}
        if bits is not None and key_bits is None:  # one width given: both streams at it
            self.settings["key_bits"] = bits
        check_settings(self.settings, "LatentKVCache")
        self.token_positions = _Positions()
        self.layout = model_layout(model)  # what the cache is checked against where it is used (`check`)
        latent_sliding = {latent is not None for _, sliding, latent in self.layout if sliding is not None}
        if len(latent_sliding) > 1:  # transformers makes one mask for all sliding layers, from the first one's sizes
            raise ValueError("LatentKVCache: some sliding-window layers have latent projections and others not; "
                             "allowed: latent_kv on all of a model's sliding-window layers or on none (layers=)")
        layers = []
        for i, (_, sliding, latent) in enumerate(self.layout):
            if latent is not None:
                layers.append(LatentKVLayer(self.token_positions, sliding_window=sliding, **self.settings,
                                            rotated_keys=isinstance(found[i].k_proj, LatentKeyLinear)))
            elif sliding is not None:
                layers.append(DynamicSlidingWindowLayer(sliding_window=sliding))
            else:
                layers.append(DynamicLayer())
        super().__init__(layers=layers)

    def check(self, model) -> None:
        """Raise ValueError, in one line, if this cache was built for a model of other layers than `model` (their
        count, attention kinds and windows, KV heads, head size, latent ranks): it would attend with another
        model's windows, or fail on its shapes. The model's forward calls it (`attention.enable`)."""
        if self.__dict__.get("_checked") == id(model):
            return
        mine, theirs = self.layout, model.__dict__.get("_latent_layout") or model_layout(model)
        if mine != theirs:
            if len(mine) != len(theirs):
                what = f"{len(mine)} decoder layers, this model has {len(theirs)}"
            else:
                i = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
                what = f"layer {i}: {_describe(mine[i])}; this model's: {_describe(theirs[i])}"
            raise ValueError(f"LatentKVCache: built for another model ({what}); allowed: a cache made for the model it "
                             "is used with, LatentKVCache(model, ...)")
        self.__dict__["_checked"] = id(model)

    def _positions_too(self, fn) -> None:
        if self.token_positions.ids is not None:
            self.token_positions.ids = fn(self.token_positions.ids)

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self._positions_too(lambda t: t.index_select(0, beam_idx.to(t.device)))
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int):
        self._positions_too(lambda t: t.repeat_interleave(repeats, dim=0))
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor):
        self._positions_too(lambda t: t[indices])
        super().batch_select_indices(indices)

    def reset(self):
        self.token_positions.ids = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the newest ``-tokens_to_remove`` tokens of every layer and their positions (assisted decoding,
        prompt lookup); refused before any layer changes where a latent layer cannot (`LatentKVLayer.check_crop`)."""
        for layer in self.layers:
            if isinstance(layer, LatentKVLayer):
                layer.check_crop(tokens_to_remove)
        super().crop(tokens_to_remove)
        ids = self.token_positions.ids
        if ids is not None and tokens_to_remove < 0:
            self.token_positions.ids = ids[:, :max(ids.shape[1] + tokens_to_remove, 0)]

    def nbytes(self) -> int:
        """Bytes held: every layer's codes, scales, zero points and full-precision latents (dense layers' keys and
        values where a layer is not latent), and the positions."""
        total = self.token_positions.nbytes()
        for layer in self.layers:
            if isinstance(layer, LatentKVLayer):
                total += layer.nbytes()
            elif getattr(layer, "keys", None) is not None and layer.keys.numel():
                total += (layer.keys.numel() + layer.values.numel()) * layer.keys.element_size()
        return total


def dense_cache_bytes(config, tokens: int, batch: int = 1, dtype=torch.bfloat16) -> int:
    """What transformers' DynamicCache holds for `tokens` tokens of `batch` rows in `dtype` (sliding-window
    layers: their last ``sliding_window - 1`` tokens): the reference of every KV byte ratio."""
    cfg = config.get_text_config(decoder=True)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    per_token = 2 * cfg.num_key_value_heads * head_dim(cfg) * batch * torch.empty(0, dtype=dtype).element_size()
    return sum(per_token * (min(tokens, cfg.sliding_window - 1) if kind == "sliding_attention" else tokens)
               for kind in types)


def model_layout(model: nn.Module) -> list[tuple]:
    """Per decoder layer what its cache layer is built from: (attention kind, sliding window or None, and for
    a layer with latent projections (key form, KV heads, head size, key ranks, value ranks), else None)."""
    cfg = model.config.get_text_config(decoder=True)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    found = latent_layers(model)
    out = []
    for i, kind in enumerate(types):
        sliding = getattr(cfg, "sliding_window", None) if kind == "sliding_attention" else None
        attn = found.get(i)
        latent = None if attn is None else (type(attn.k_proj).__name__, cfg.num_key_value_heads, head_dim(cfg),
                                            tuple(attn.k_proj.ranks), tuple(attn.v_proj.ranks))
        out.append((kind, sliding, latent))
    return out


def _describe(entry: tuple) -> str:
    kind, sliding, latent = entry
    said = kind + ("" if sliding is None else f" (window {sliding})")
    if latent is None:
        return said + ", not latent"
    keys, heads, dim, k_ranks, v_ranks = latent
    return f"{said}, {heads} KV heads of {dim}, key ranks {list(k_ranks)}, value ranks {list(v_ranks)} ({keys})"


def latent_layers(model: nn.Module) -> dict[int, nn.Module]:
    """{decoder layer index: its attention module} of the layers whose k_proj and v_proj are both latent."""
    _, layer_list = find_decoder_layers(model)
    out = {}
    for i, layer in enumerate(layer_list):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and isinstance(getattr(attn, "k_proj", None), (LatentKVLinear, LatentKeyLinear)) \
                and isinstance(getattr(attn, "v_proj", None), LatentKVLinear):
            out[i] = attn
    return out


#: the cache settings a model uses when its config says nothing
CACHE_DEFAULTS = {"bits": 4, "group": 64, "window": 64, "sink": 16, "grid": "search", "key_bits": None,
                  "widths": "stream"}
WIDTHS = ("stream", "prompt")


def latent_settings(model: nn.Module) -> dict:
    """The cache settings of the model's latent_kv entry (its options ``bits``, ``group``, ``window``, ``sink``,
    ``grid``, ``key_bits``: None, the same as ``bits``; ``widths``)."""
    cfg = getattr(model.config, "quantization_config", None)
    for e in getattr(cfg, "entries", None) or ():
        if getattr(e, "method", None) == "latent_kv":
            return {k: e.options.get(k, v) for k, v in CACHE_DEFAULTS.items()}
    return dict(CACHE_DEFAULTS)


BITS_ALLOWED = BITS + (16,)  # the quantizer's widths, and 16: no codes


def check_settings(s: dict, who: str = "TensorCompressionConfig") -> None:
    """Raise ValueError naming the first bad setting of `s`, as `who`'s field (the config's, or the cache's own)."""
    from ...validation import fail as named_fail, is_int, is_number

    def fail(field, got, allowed):
        named_fail(field, got, allowed, who)

    if s["widths"] not in WIDTHS:
        fail("widths", s["widths"], "'stream' (every latent channel of a stream at its bits) | 'prompt' (a width per "
             "channel from the prompt's variances, averaging bits)")
    if s["widths"] == "prompt":
        for name in ("bits", "key_bits"):
            x = s[name]
            if not (x is None and name == "key_bits") and (not is_number(x) or not BITS[0] <= x <= BITS[-1]):
                fail(name, x, f"a number in [{BITS[0]}, {BITS[-1]}] with widths='prompt' (the average code width "
                     f"of a stream's channels, each one of {', '.join(map(str, BITS))})")
    else:
        if type(s["bits"]) is not int or s["bits"] not in BITS_ALLOWED:
            fail("bits", s["bits"], " | ".join(map(str, BITS_ALLOWED)) + " (bits per latent value; 16: kept in the "
                 "model's dtype); an average such as 2.5 with widths='prompt'")
        kb = s["key_bits"]
        if kb is not None and (type(kb) is not int or kb not in BITS_ALLOWED or (kb >= 16) != (s["bits"] >= 16)):
            fail("key_bits", kb, "None (the same as bits) | " + " | ".join(map(str, BITS)) + " (bits per key latent "
                 "value; 16 only with bits=16: both streams quantized or neither)")
    if not is_int(s["group"], 8) or s["group"] % 8 or s["group"] > 4096:
        fail("group", s["group"], "a multiple of 8 in [8, 4096] (tokens sharing one scale and zero point per channel)")
    if not is_int(s["window"], 0):
        fail("window", s["window"], "an int >= 0 (recent tokens kept in full precision)")
    if not is_int(s["sink"], 0):
        fail("sink", s["sink"], "an int >= 0 (the first tokens, attention sinks, kept in 16 bits)")
    if s["grid"] not in GRIDS:
        fail("grid", s["grid"], " | ".join(map(repr, GRIDS)) + " (each group's range: searched for the least round-trip "
             "error, or its min and max)")
