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

from ...decompositions.allocation import water_fill_widths
from ...decompositions.hadamard import rotate, rotation_signs, unrotate
from ...decompositions.quantize import BITS, GRIDS, quantize_rtn
from ...layout import find_decoder_layers, head_dim
from .layer import LatentKeyLinear, LatentKVLinear


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


def _parts(bits: int) -> list[tuple[int, int]]:
    """(shift, width) of the parts a `bits`-bit code is stored in: widths that divide a byte, widest first (3 bits:
    a 2-bit part and a 1-bit part)."""
    out, s = [], 0
    while s < bits:
        w = max(p for p in (1, 2, 4, 8) if p <= bits - s)
        out.append((s, w))
        s += w
    return out


def _pack_part(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (rows, group) of a width dividing a byte into (rows, group * bits / 8) bytes, in planes: byte j holds
    the codes of tokens j, j + group / per, ... (per = 8 / bits codes a byte)."""
    per = 8 // bits
    planes = codes.view(codes.shape[0], per, -1).to(torch.uint8)
    out = planes[:, 0].clone()
    for i in range(1, per):
        out |= planes[:, i] << (i * bits)
    return out


def _pack_planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (rows, group) uint8 into bytes (rows, group * bits / 8): each part of `_parts` packed in planes
    (`_pack_part`), the parts side by side, so that every plane comes back with one shift or mask (`_planes`)."""
    return torch.cat([_pack_part((codes >> s) & (2**w - 1), w) for s, w in _parts(bits)], -1)


def _split(codes: torch.Tensor, bits: int) -> list[torch.Tensor]:
    per, mask = 8 // bits, 2**bits - 1
    return [codes & mask if i == 0 else codes >> (i * bits) if i == per - 1 else (codes >> (i * bits)) & mask
            for i in range(per)]


def _planes(codes: torch.Tensor, bits: int, group: int) -> list[torch.Tensor]:
    """The codes of `_pack_planes`, (b, n, R, bytes), as uint8 (b, n, R, group / per) tensors, one per plane in
    token order (their concatenation is the group's tokens); widths that do not divide a byte: one tensor, its
    parts shifted and added."""
    parts = _parts(bits)
    if len(parts) == 1:
        return _split(codes, bits)
    c, at = None, 0
    for s, w in parts:
        n = group * w // 8
        part = torch.cat(_split(codes[..., at:at + n], w), -1)
        at += n
        c = part if c is None else c | (part << s)
    return [c]


KERNEL_GROUPS = (32, 64, 128, 256)  # the group sizes the CPU int4 kernel takes
CHUNK = 1024  # tokens a closed chunk of the kernel layout holds (a multiple of every group in KERNEL_GROUPS)


class _Latents:
    """One stream of latents (the keys' or the values'): the first `sink` tokens in 16 bits, quantized groups of
    tokens, then a 16-bit tail (the window)."""

    def __init__(self, bits: int, group: int, window: int, sink: int = 0, grid: str = "minmax"):
        self.bits, self.group, self.window, self.sink, self.grid = bits, group, window, sink, grid
        self.head: torch.Tensor | None = None  # (b, <= sink, R)
        self.codes = self.scale = self.zero = None  # (b, groups, R, group*bits/8) uint8; (b, groups, R) f16 / uint8
        self.tail: torch.Tensor | None = None  # (b, tokens, R): float16 beside codes, else the model's dtype

    @property
    def n_head(self) -> int:
        return 0 if self.head is None else self.head.shape[1]

    @property
    def n_quantized(self) -> int:
        """Tokens held as codes (`_KernelValues`: its open groups; its closed chunks are `n_chunked`)."""
        return 0 if self.codes is None else self.codes.shape[1] * self.group

    @property
    def n_chunked(self) -> int:
        return 0

    def __len__(self) -> int:
        return self.n_head + self.n_chunked + self.n_quantized + (0 if self.tail is None else self.tail.shape[1])

    def append(self, z: torch.Tensor) -> None:
        if self.bits < 16 and z.dtype == torch.float32:
            z = z.to(torch.float16)  # the window of a quantized cache: 16-bit, as a bf16 cache's values are
        self.tail = z if self.tail is None else torch.cat([self.tail, z], 1)
        if self.bits >= 16:
            return
        if self.n_head < self.sink and self.n_quantized + self.n_chunked == 0:  # the first tokens (sinks): never quantized
            n = min(self.sink - self.n_head, self.tail.shape[1])
            self.head = self.tail[:, :n] if self.head is None else torch.cat([self.head, self.tail[:, :n]], 1)
            self.tail = self.tail[:, n:]
        while self.tail.shape[1] >= self.window + self.group:
            self._quantize(self.tail[:, : self.group])
            self.tail = self.tail[:, self.group:]

    def _quantize(self, chunk: torch.Tensor) -> None:
        b, g, r = chunk.shape
        q = quantize_rtn(chunk.transpose(1, 2).reshape(b * r, g), self.bits, g, self.grid)
        codes = _pack_planes(q.codes.view(b * r, g), self.bits).view(b, 1, r, -1)
        self._keep(codes, q.scale.view(b, 1, r), q.zero.view(b, 1, r))

    def _keep(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """Append newly quantized tokens' codes, scales and zero points (along dim 1) to those held."""
        if self.codes is None:
            self.codes, self.scale, self.zero = codes, scale, zero
            return
        for name, new in (("codes", codes), ("scale", scale), ("zero", zero)):
            old = getattr(self, name)  # a tensor, or a list of them (`_PromptLatents`: one per run)
            setattr(self, name, [torch.cat([t, x], 1) for t, x in zip(old, new)] if isinstance(old, list)
                    else torch.cat([old, new], 1))

    def read(self, start: int, end: int, dtype) -> torch.Tensor:
        """Latents of tokens [start, end) (indices into what is held), (b, end - start, R), in `dtype`."""
        parts, h = [], self.n_head
        if start < h:
            parts.append(self.head[:, start:min(end, h)].to(dtype))
        if end > h:
            parts.append(self._read_body(max(start - h, 0), end - h, dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)

    def _read_body(self, start: int, end: int, dtype) -> torch.Tensor:
        """Latents [start, end) of the open codes and the tail (indices past the head)."""
        parts, nq = [], self.n_quantized
        if start < nq:
            parts.append(self._read_codes(start, min(end, nq), dtype))
        if end > nq:
            parts.append(self.tail[:, max(start - nq, 0): end - nq].to(dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)

    def _read_codes(self, start: int, end: int, dtype) -> torch.Tensor:
        """Latents [start, end) of the open codes (indices into them), de-quantized."""
        g0, g1 = start // self.group, -(-end // self.group)
        z = _decode(self.codes[:, g0:g1], self.scale[:, g0:g1], self.zero[:, g0:g1], self.bits, self.group, dtype)
        return z[:, start - g0 * self.group: end - g0 * self.group]

    def pieces(self, dtype) -> list[tuple]:
        """Everything held, oldest first, in the form the attention multiplies without a dense copy of the
        latents: ``("dense", z)`` (b, t, R) for the 16-bit head and tail, ``("codes", planes, scale, zero)`` for the
        quantized groups — planes: the codes as numbers, (b, n, R, group / per) each, whose concatenation is
        c (b, n, R, group); scale and zero (b, n, R), z ≈ (c - zero) · scale."""
        out = []
        if self.head is not None:
            out.append(("dense", self.head.to(dtype)))
        if self.codes is not None:
            out.append(self._codes_piece(dtype))
        if self.tail is not None and self.tail.shape[1]:
            out.append(("dense", self.tail.to(dtype)))
        return out

    def _codes_piece(self, dtype) -> tuple:
        return ("codes", [p.to(dtype) for p in _planes(self.codes, self.bits, self.group)], self.scale.to(dtype),
                self.zero.to(dtype))

    def dense_end(self) -> int:
        """How many of the newest tokens are held in 16 bits (the tail; the head too while nothing is quantized):
        those `crop` can forget."""
        tail = 0 if self.tail is None else self.tail.shape[1]
        return tail + (self.n_head if self.n_quantized + self.n_chunked == 0 else 0)

    def crop(self, keep: int) -> None:
        """Forget all but the first `keep` tokens held: the newest ones, as if they had never been appended (the
        caller checked `dense_end`)."""
        n = len(self) - keep
        tail = 0 if self.tail is None else self.tail.shape[1]
        if n > tail:
            self.head = self.head[:, :self.n_head - (n - tail)] if self.n_head > n - tail else None
        if n > 0 and self.tail is not None:
            self.tail = self.tail[:, :max(tail - n, 0)]

    def drop(self, tokens: int) -> int:
        """Forget up to `tokens` of the oldest tokens, in whole pieces (the head, quantized groups; unquantized:
        whole groups of the tail); returns how many were forgotten."""
        done = 0
        if self.head is not None and self.n_head <= tokens:
            done, self.head = self.n_head, None
        n = (tokens - done) // self.group
        if self.bits < 16:
            n = min(n, self.n_quantized // self.group)
        if n > 0:
            self.drop_groups(n)
        return done + max(n, 0) * self.group

    def drop_groups(self, n: int) -> None:
        """Forget the oldest `n` quantized groups (or, unquantized, the oldest `n * group` tokens)."""
        if self.codes is not None:
            self._map(("codes", "scale", "zero"), lambda t: t[:, n:])
        else:
            self.tail = self.tail[:, n * self.group:]

    HELD = ("head", "codes", "scale", "zero", "tail")  # the tensors held, each with the batch first (or lists of them)

    def _map(self, names, fn) -> None:
        """Replace each tensor held under `names` (a tensor, or a list of them) by `fn` of it."""
        for name in names:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, [fn(x) for x in t] if isinstance(t, list) else fn(t))

    def select(self, fn) -> None:
        """Apply `fn` to the batch dimension of every tensor held (beam reorder, repeat, select)."""
        self._map(self.HELD, fn)

    def tensors(self) -> list[torch.Tensor]:
        held = [getattr(self, name) for name in self.HELD]
        return [x for t in held if t is not None for x in (t if isinstance(t, list) else [t])]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _decode(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int, dtype) -> torch.Tensor:
    """Codes (b, n, R, bytes) of `_pack_planes` with their scales and zero points (b, n, R): the latents of the
    n groups' tokens, (b, n * group, R) in `dtype`."""
    b, n, r, _ = codes.shape
    c = torch.cat(_planes(codes, bits, group), -1).to(dtype)
    z = (c - zero[..., None].to(dtype)) * scale[..., None].to(dtype)
    return z.transpose(2, 3).reshape(b, n * group, r)


class _PromptLatents(_Latents):
    """A stream whose latent channels each have a code width of their own (``widths="prompt"``), averaging ``mean``
    bits: chosen when its first group of tokens is quantized, from the variance of every token seen so far (in
    practice the prompt), by reverse water-filling over the widths of `BITS` (`water_fill_widths`: a channel's
    squared round-trip error taken as its variance · 4^-width). The widths come from the text being decoded, not
    from the calibration text: fixed at the fit from calibration statistics they measured worse than one width a
    stream. The channels of one width form a run, quantized and stored as a `_Latents` stream's codes are; the
    quantized groups are the piece ``("runs", [(channels, planes, scale, zero), ...])``, which the attention
    multiplies run by run, each over its own channels."""

    def __init__(self, mean: float, group: int, window: int, sink: int = 0, grid: str = "minmax"):
        super().__init__(int(mean), group, window, sink, grid)  # `bits` < 16: the window is kept in 16 bits
        self.mean = mean
        self.runs: list[tuple[torch.Tensor, int]] = []  # (channels (int64), width) per width, the widest first
        # codes, scale, zero: lists, one tensor per run, as `_Latents` holds one

    @property
    def n_quantized(self) -> int:
        return 0 if self.codes is None else self.codes[0].shape[1] * self.group

    def _quantize(self, chunk: torch.Tensor) -> None:
        b, g, r = chunk.shape
        if not self.runs:  # every token seen so far (the tail holds `chunk`)
            seen = self.tail if self.head is None else torch.cat([self.head, self.tail], 1)
            widths = torch.tensor(water_fill_widths(seen.float().var(1).mean(0), self.mean, BITS))
            self.runs = [((widths == w).nonzero().view(-1).to(chunk.device), w)
                         for w in sorted(set(widths.tolist()), reverse=True)]
        codes, scale, zero = [], [], []
        for idx, bits in self.runs:
            n = len(idx)
            q = quantize_rtn(chunk[..., idx].transpose(1, 2).reshape(b * n, g), bits, g, self.grid)
            codes.append(_pack_planes(q.codes.view(b * n, g), bits).view(b, 1, n, -1))
            scale.append(q.scale.view(b, 1, n))
            zero.append(q.zero.view(b, 1, n))
        self._keep(codes, scale, zero)

    def _read_codes(self, start: int, end: int, dtype) -> torch.Tensor:
        g0, g1 = start // self.group, -(-end // self.group)
        b = self.codes[0].shape[0]
        out = torch.empty(b, (g1 - g0) * self.group, sum(len(idx) for idx, _ in self.runs), dtype=dtype,
                          device=self.codes[0].device)
        for (idx, bits), c, s, z in zip(self.runs, self.codes, self.scale, self.zero):
            out[..., idx] = _decode(c[:, g0:g1], s[:, g0:g1], z[:, g0:g1], bits, self.group, dtype)
        return out[:, start - g0 * self.group: end - g0 * self.group]

    def _codes_piece(self, dtype) -> tuple:
        return ("runs", [(idx, [p.to(dtype) for p in _planes(c, bits, self.group)], s.to(dtype), z.to(dtype))
                         for (idx, bits), c, s, z in zip(self.runs, self.codes, self.scale, self.zero)])


def _int4_product(x: torch.Tensor, packed: torch.Tensor, group: int, sz: torch.Tensor) -> torch.Tensor:
    """x (b, M, K) times the codes `packed` (b, N, K/2, the CPU int4 kernel's layout of N rows of K codes),
    de-quantized by `sz` (b, K / group, N, 2; `_int4_scales`): (b, M, N) in x's dtype. PyTorch's
    ``_weight_int4pack_mm_for_cpu`` reads the codes in place (bfloat16 products); no float copy of them is made."""
    xb = x.to(torch.bfloat16)
    return torch.stack([torch.ops.aten._weight_int4pack_mm_for_cpu(xb[j].contiguous(), packed[j], group, sz[j])
                        for j in range(x.shape[0])]).to(x.dtype)


def _int4_scales(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The kernel's (scale, offset) pairs, bfloat16 (..., 2), for codes read as (q - zero) · scale: its
    de-quantization is (q - 8) · s + z, so z = (8 - zero) · s."""
    s = scale.to(torch.bfloat16)
    return torch.stack([s, (8 - zero.to(torch.bfloat16)) * s], -1)


def _int4_pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes (b, N, K) (values 0..15, N a multiple of 16) into the CPU int4 kernel's layout (b, N, K/2)."""
    c = codes.to(torch.int32)
    return torch.stack([torch.ops.aten._convert_weight_to_int4pack_for_cpu(c[i].contiguous(), 1) for i in range(len(c))])


def kernel_ready(bits: int, group: int, device) -> bool:
    """Whether the streams of a full-attention layer use the CPU int4 kernel (4-bit codes, a group it takes)."""
    return bits == 4 and group in KERNEL_GROUPS and torch.device(device).type == "cpu"


class _KernelValues(_Latents):
    """The value stream of a full-attention layer with 4-bit codes on the CPU: the same codes (per channel, groups
    of ``group`` tokens), and every CHUNK tokens of them are moved into the layout of PyTorch's CPU int4 kernel
    (channels as its rows, padded to a multiple of 16 whose codes read as zero; tokens along its reduction
    axis), so that the attention's weighted sum over a closed chunk is one kernel call (`chunk_product`). The
    kernel's layout does not extend along the tokens, hence chunks; the open groups are multiplied as before."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunk = CHUNK  # tokens a closed chunk holds
        self.width = 0  # R, the latent's channels (the kernel's rows are R padded to a multiple of 16)
        # (packed codes (b, R16, chunk / 2), the kernel's scales (b, chunk / group, R16, 2) bfloat16: one byte more a
        # group and channel than a float16 scale and a uint8 zero point, built once rather than at every step)
        self.chunks: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def n_chunked(self) -> int:
        return len(self.chunks) * self.chunk

    def _quantize(self, chunk: torch.Tensor) -> None:
        super()._quantize(chunk)
        if self.n_quantized == self.chunk:
            b, n, r, _ = self.codes.shape
            c = torch.cat(_planes(self.codes, self.bits, self.group), -1).permute(0, 2, 1, 3).reshape(b, r, n * self.group)
            pad = -r % 16
            c = torch.nn.functional.pad(c, (0, 0, 0, pad), value=8)
            sz = torch.nn.functional.pad(_int4_scales(self.scale, self.zero), (0, 0, 0, pad))
            self.chunks.append((_int4_pack(c), sz))
            self.width, self.codes, self.scale, self.zero = r, None, None, None

    def chunk_product(self, i: int, x: torch.Tensor, cols: slice) -> torch.Tensor:
        """x (b, M, chunk) times chunk `i`'s latents (chunk, R), columns `cols`: (b, M, R_cols)."""
        packed, sz = self.chunks[i]
        return _int4_product(x, packed, self.group, sz)[..., :self.width][..., cols]

    def _read_body(self, start: int, end: int, dtype) -> torch.Tensor:
        parts, nc, c = [], self.n_chunked, self.chunk
        for i in range(start // c, min(-(-end // c), len(self.chunks))):  # through the kernel, times an identity
            eye = torch.eye(c, dtype=dtype).expand(self.chunks[i][0].shape[0], -1, -1)
            parts.append(self.chunk_product(i, eye, slice(None))[:, max(start - i * c, 0): min(end - i * c, c)])
        if end > nc:
            parts.append(super()._read_body(max(start - nc, 0), end - nc, dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)

    def pieces(self, dtype) -> list[tuple]:
        """`_Latents.pieces`, with ``("chunk", i)`` for each closed chunk after the head."""
        out = super().pieces(dtype)
        at = int(self.head is not None)
        return out[:at] + [("chunk", i) for i in range(len(self.chunks))] + out[at:]

    def drop(self, tokens: int) -> int:
        raise RuntimeError("_KernelValues.drop: a full-attention layer's stream forgets nothing")

    def select(self, fn) -> None:
        super().select(fn)
        self.chunks = [tuple(fn(t) for t in chunk) for chunk in self.chunks]

    def tensors(self) -> list[torch.Tensor]:
        return super().tensors() + [t for chunk in self.chunks for t in chunk]


def key_group(r: int) -> int:
    """The channels of one token sharing a scale and zero point in `_KernelKeys` for R = `r` latent channels: of the
    kernel's groups, the one storing the fewest bytes a token (codes of R padded to whole groups, and a bfloat16
    scale pair, 4 bytes, a group)."""
    return min(KERNEL_GROUPS, key=lambda g: (-(-r // g) * (g / 2 + 4), g))


class _KernelKeys(_Latents):
    """The stream of keys latent after RoPE of a full-attention layer with 4-bit codes on the CPU, quantized per
    token so that a query's scores against every quantized token are one call of PyTorch's CPU int4 kernel
    (`scores`; tokens as its rows, latent channels along its reduction axis). The latent channels' ranges differ
    by orders of magnitude (why `_Latents` quantizes keys per channel, as KIVI does), so each channel is first
    divided by a fixed norm (its RMS over every token seen when the first group is quantized: the prompt, in
    practice; float16, per batch row), the channels padded with zeros to whole groups of `key_group` and rotated
    by a random block-Hadamard of that size (QuaRot's incoherence: a token's few large channels spread over their
    group), then quantized per token and group. The query is multiplied by the norm and rotated the same way,
    which leaves its products with the keys unchanged. The speed costs accuracy: on SmolLM2 at 2,048 tokens of
    context (every channel at 4 bits, 1,536 tokens scored) the kernel layouts hold 0.323 of the bf16 bytes at
    ×1.025 ± 0.007 the DynamicCache perplexity, per-channel codes for both streams 0.300 at ×1.010 ± 0.004."""

    HELD = _Latents.HELD + ("norm",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.norm: torch.Tensor | None = None  # (b, R) float16
        self.signs: torch.Tensor | None = None  # the rotation's (R_pad,) int8, the same for every stream of its width
        self.key_group = 0  # channels sharing a scale pair (`key_group`), fixed when the first group is quantized
        # codes (b, tokens, R_pad / 2) uint8 in the kernel's layout; scale: the kernel's scales (b, R_pad / key_group,
        # tokens, 2) bfloat16 (4 bytes a token and group, against 3 for a float16 scale and a uint8 zero point; built
        # once rather than at every step); zero: None

    @property
    def n_quantized(self) -> int:
        return 0 if self.codes is None else self.codes.shape[1]

    def _quantize(self, chunk: torch.Tensor) -> None:
        b, g, r = chunk.shape
        if self.norm is None:  # every token seen so far (the tail holds `chunk`)
            seen = self.tail if self.head is None else torch.cat([self.head, self.tail], 1)
            self.norm = seen.float().pow(2).mean(1).sqrt().clamp_min(1e-6).to(torch.float16)
        kg = self.key_group = key_group(r)
        rp = -(-r // kg) * kg
        if self.signs is None:
            self.signs = rotation_signs(rp)
        u = rotate(torch.nn.functional.pad(chunk.float() / self.norm.float()[:, None], (0, rp - r)), self.signs, kg)
        q = quantize_rtn(u.reshape(-1, kg), self.bits, kg, self.grid)
        codes = _int4_pack(q.codes.view(b, g, rp))
        sz = _int4_scales(q.scale.view(b, g, -1), q.zero.view(b, g, -1)).transpose(1, 2).contiguous()
        self.codes = codes if self.codes is None else torch.cat([self.codes, codes], 1)
        self.scale = sz if self.scale is None else torch.cat([self.scale, sz], 2)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, M, R_pad) times the quantized tokens' normalised latents: (b, M, tokens)."""
        return _int4_product(x, self.codes, self.key_group, self.scale)

    def scores(self, ql: torch.Tensor, cols: slice) -> torch.Tensor:
        """ql (b, M, R_cols), queries in the latent columns `cols`, against every quantized token: (b, M, tokens)."""
        x = ql.new_zeros(ql.shape[0], ql.shape[1], self.codes.shape[2] * 2)
        x[..., cols] = ql * self.norm[:, None, cols].to(ql.dtype)
        return self._product(rotate(x, self.signs, self.key_group))

    def _read_codes(self, start: int, end: int, dtype) -> torch.Tensor:
        b, r = self.norm.shape
        eye = torch.eye(self.codes.shape[2] * 2, dtype=dtype).expand(b, -1, -1)
        z = unrotate(self._product(eye).transpose(1, 2), self.signs, self.key_group)
        return z[:, start:end, :r] * self.norm[:, None].to(dtype)

    def pieces(self, dtype) -> list[tuple]:
        """The head and the tail as in `_Latents.pieces`; the quantized tokens as ``("tokens",)`` (`scores`)."""
        out = [("dense", t.to(dtype)) for t in (self.head,) if t is not None]
        if self.codes is not None:
            out.append(("tokens",))
        if self.tail is not None and self.tail.shape[1]:
            out.append(("dense", self.tail.to(dtype)))
        return out

    def drop(self, tokens: int) -> int:
        raise RuntimeError("_KernelKeys.drop: a full-attention layer's stream forgets nothing")


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
        _check_settings(self.settings, "LatentKVCache")
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


def _check_settings(s: dict, who: str = "TensorCompressionConfig") -> None:
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
