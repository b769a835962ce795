"""The latent stores of `LatentKVCache` (`hf_tensorcomp.methods.latent_kv.cache`): one stream (the key or the value
latents of a layer) each, and how their codes are laid out.

- bit packing: widths that do not divide a byte (3, 5, 6) stored as parts that do (`_pack_planes`, `_planes`);
- `_Latents`: per-channel codes over groups of tokens behind a 16-bit window and sink; `_PromptLatents`: a width
  per latent channel, chosen from the prompt;
- the CPU int4 kernel's layouts: `_KernelValues` (the values' codes moved into the kernel's layout every CHUNK
  tokens) and `_KernelKeys` (keys latent after RoPE, quantized per token after a norm and a rotation), with
  `kernel_ready` saying where they apply.
"""

from __future__ import annotations

import torch

from ...decompositions.allocation import water_fill_widths
from ...decompositions.hadamard import rotate, rotation_signs, unrotate
from ...decompositions.quantize import BITS, quantize_rtn


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
