"""Group-wise integer quantization: round to nearest, GPTQ, and the packed storage both share.

Format (own, plain safetensors; chosen over the libraries' formats because none of them saves and
reloads on CPU with transformers 5 here, see the README): each row of a tensor (its last dim; a 1-D
tensor is one row) is cut into groups of ``group_size`` consecutive values, the last one padded (for
an ``(out, in)`` weight: groups along each row, the usual layout). Each group has a float16 ``scale`` and
an **integer** zero point ``zero`` in ``[0, 2^bits - 1]``; a value is ``(code - zero) * scale``.
Integer zero points are what GPTQ / compressed-tensors loaders expect, and they do not reproduce the
GGUF Q4_1 blocks (float minimum) of the bundled models by accident. Codes of 2, 4 or 8 bits are packed
``8 // bits`` to a byte, 3-bit codes eight to three bytes; lowest bits first (a little-endian bit stream).

GPTQ (Frantar et al., 2022) is written here rather than taken from GPTQModel: that package pins its
own torch, needs a worker-pool workaround on 2 cores and quantizes whole models through its own
loader, while the pipeline already has each layer's input Gram, which is all GPTQ reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZE_RANGE = (16, 8192)  # the group sizes a config (``group_size``, ``embedding_group_size``) and a saved spec allow


@dataclass
class QTensor:
    """A quantized tensor: codes (unpacked uint8, row by row) with a scale and a zero point per group of
    each row (the last group of a row may be short); rows are the tensor's leading dims flattened (a 1-D
    tensor is one row)."""

    codes: torch.Tensor  # (rows * cols,) uint8 (at least; extra trailing codes from packing are ignored)
    scale: torch.Tensor  # (rows * groups_per_row,) float16
    zero: torch.Tensor  # (rows * groups_per_row,) uint8
    bits: int
    group_size: int
    shape: tuple[int, ...]

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        rows, cols = _rows_cols(self.shape)
        g = _groups(self.codes[: rows * cols].view(rows, cols).to(dtype), self.group_size)
        w = (g - self.zero.to(dtype)[:, None]) * self.scale.to(dtype)[:, None]
        return w.view(rows, -1)[:, :cols].reshape(self.shape)


def _rows_cols(shape) -> tuple[int, int]:
    cols = shape[-1] if len(shape) else 1
    return math.prod(shape) // max(cols, 1), cols


def n_groups(shape, group_size: int) -> int:
    """Groups of a tensor of `shape`: each row (the last dim) cut into groups, the last one padded."""
    rows, cols = _rows_cols(tuple(shape))
    return rows * -(-cols // group_size)


def code_bytes(numel: int, bits: int) -> int:
    """Bytes of `numel` packed codes (`pack`)."""
    return -(-numel * bits // 8)


def stored_bytes(shape, bits: int, group_size: int) -> int:
    """Bytes of a quantized tensor as saved: packed codes (rows not padded: a short last group costs no
    codes) + a float16 scale and a uint8 zero per group."""
    return code_bytes(math.prod(shape), bits) + n_groups(shape, group_size) * 3


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """(groups, group_size) view of `w`, each row padded with zeros to whole groups. A group longer than a row
    is the row (the same groups, scales and values: zero padding changes neither a grid nor a code), so no
    group size, whatever a file says, makes this allocate more than `w`."""
    rows, cols = _rows_cols(tuple(w.shape))
    group_size = min(group_size, max(cols, 1))
    flat = w.reshape(rows, cols)
    pad = -cols % group_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(rows, pad)], 1)
    return flat.reshape(-1, group_size)


def _grid(w: torch.Tensor, bits: int, shrink=1.0, lo=None, hi=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `w` (groups x group_size): the asymmetric min-max scale and integer zero point (of the range
    shrunk by `shrink`, a number or one per row: that of ``w * shrink``; `lo` / `hi`: the rows' clamped minima
    and maxima, when already known)."""
    top = 2**bits - 1
    lo = (w.amin(1).clamp(max=0) if lo is None else lo) * shrink
    hi = (w.amax(1).clamp(min=0) if hi is None else hi) * shrink
    scale = ((hi - lo) / top).clamp(min=1e-8)
    zero = (-lo / scale).round().clamp(0, top)
    # the integer zero shifts the grid by up to half a step: widen the step so both ends stay within
    # half a step of a code (round-trip error <= scale / 2 everywhere)
    scale = torch.maximum(scale, torch.maximum(hi / (top - zero + 0.499), -lo / (zero + 0.499)))
    scale = scale.half().float().clamp(min=2**-24)  # the float16 value that is stored, so codes use it
    scale = torch.where((hi / scale + zero > top + 0.5) | (zero - (-lo) / scale < -0.5), scale * (1 + 2**-10), scale)
    return scale, zero


def _codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    return (w / scale[:, None]).round().add(zero[:, None]).clamp(0, 2**bits - 1)


GRIDS = ("minmax", "search")
SHRINKS = torch.linspace(1.0, 0.8, 21).tolist()  # the range factors ``grid="search"`` tries


def _search_grid(w: torch.Tensor, bits: int, norm: float = 2.4, chunk: int = 1 << 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `w`: the grid of the min-max range shrunk by the factor in `SHRINKS` whose round-trip
    error Σ |w - q(w)|^norm is least (GPTQ's reference ``mse`` grid: clipping a few outliers buys a finer
    step for the rest; the same 2.4-norm). Values outside the shrunk range are clipped, so the round-trip
    bound of `_grid` (half a step) no longer holds for them. Coarse to fine: every fourth factor, then the three on
    each side of a row's best (12 of the 21 factors tried; the same choice wherever a row's error has one minimum
    over the factors, ties to the larger factor as before). Rows are searched `chunk` values at a time, every factor on
    a chunk before the next (it stays in cache), in place in one buffer."""
    shrinks = torch.tensor(SHRINKS, device=w.device)
    scales, zeros = torch.empty(w.shape[0], device=w.device), torch.empty(w.shape[0], device=w.device)
    step = max(1, chunk // max(w.shape[1], 1))
    for r0 in range(0, w.shape[0], step):
        x = w[r0: r0 + step]
        u, e = torch.empty_like(x), torch.empty_like(x)
        lo, hi = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
        best = None

        def trial(k):  # k: an index into SHRINKS, for all rows or per row
            scale, zero = _grid(x, bits, shrinks[k] if isinstance(k, torch.Tensor) else SHRINKS[k], lo, hi)
            # Σ |(q - z) s - w|^norm = s^norm Σ |q - z - w / s|^norm
            torch.div(x, scale[:, None], out=u)
            torch.round(u, out=e).add_(zero[:, None]).clamp_(0, 2**bits - 1).sub_(zero[:, None]).sub_(u)
            err = e.abs_().pow_(norm).sum(1) * scale.pow(norm)
            k = k if isinstance(k, torch.Tensor) else torch.full_like(err, k, dtype=torch.long)
            nonlocal best
            if best is None:
                best = [err, k, scale, zero]
            else:
                better = (err < best[0]) | ((err == best[0]) & (k < best[1]))
                best = [torch.where(better, a, b) for a, b in zip((err, k, scale, zero), best)]

        for k in range(0, len(SHRINKS), 4):
            trial(k)
        centre = best[1].clone()
        for d in (-3, -2, -1, 1, 2, 3):
            trial((centre + d).clamp(0, len(SHRINKS) - 1))
        scales[r0: r0 + step], zeros[r0: r0 + step] = best[2], best[3]
    return scales, zeros


def grid_for(w: torch.Tensor, bits: int, grid: str = "minmax") -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and integer zero point per row of `w` (groups x group_size): ``"minmax"`` (every value within
    half a step) or ``"search"`` (`_search_grid`)."""
    if grid not in GRIDS:
        raise ValueError(f"grid: got {grid!r}; allowed: {' | '.join(map(repr, GRIDS))}")
    return _grid(w, bits) if grid == "minmax" else _search_grid(w, bits)


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int, grid: str = "minmax") -> QTensor:
    """Round to nearest on each group's grid (`grid_for`; min-max: the plain quantizer)."""
    if bits not in BITS:
        raise ValueError(f"bits: got {bits!r}; allowed: {' | '.join(map(str, BITS))}")
    groups = _groups(w.detach().float(), group_size)
    scale, zero = grid_for(groups, bits, grid)
    rows, cols = _rows_cols(tuple(w.shape))
    codes = _codes(groups, scale, zero, bits).view(rows, -1)[:, :cols]
    return QTensor(codes.to(torch.uint8).reshape(-1), scale.half(), zero.to(torch.uint8), bits, group_size, tuple(w.shape))


GPTQ_BLOCK_BYTES = 256 << 20  # rows of a matrix GPTQ works on at once: this many bytes of them (float32)


STATIC_BLOCK = 128  # columns GPTQ updates one at a time before one product for the rest (static groups; 32: 1.5x the
# time of 5 widths of a 4096-wide matrix stacked, 8,192 rows each: the product for the rest re-reads them all)
PLAN_FLOAT64_UP_TO = 2048  # inputs up to which GPTQ's plan is made in float64; above, float32 (GPTQ's reference's)


def gptq_inverse(gram: torch.Tensor, damping: float = 0.01, perm: torch.Tensor | None = None) -> torch.Tensor:
    """The upper Cholesky factor of the damped inverse Gram GPTQ spreads errors with, of the Gram with its rows and
    columns in the order `perm` if given; float64 up to `PLAN_FLOAT64_UP_TO` inputs, float32 above (half the time
    of the three n³ steps at a 7B down_proj's 11,008; the damping keeps the Gram far from singular; float64 again if
    a float32 factor fails). Dead inputs (zero diagonal) get a unit diagonal. Holds two in x in matrices at a time
    beside `gram` (each step's input released before the next; at Llama-2-7B's down_proj one is 0.97 GB in float64)."""
    if gram.shape[0] > PLAN_FLOAT64_UP_TO:
        try:
            return _gptq_inverse(gram, damping, perm, torch.float32)
        except torch.linalg.LinAlgError:
            pass
    return _gptq_inverse(gram, damping, perm, torch.float64)


def _gptq_inverse(gram, damping, perm, dtype) -> torch.Tensor:
    H = gram.detach().to(dtype)
    H = H.clone() if perm is None else H[perm][:, perm]  # never the caller's Gram, changed in place below
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    H.diagonal().add_(damping * H.diagonal().mean())
    # H⁻¹ = Uᵀ U with U upper: with J the reversal, J H J = L Lᵀ gives H = R Rᵀ, R = J L J upper, so U = R⁻¹ = J L⁻¹ J
    # (positive diagonal: the factor itself). One Cholesky and one triangular inverse (2/3 of the arithmetic of the
    # Cholesky, inverse and second Cholesky it replaces, in products: half their time at 4,096 inputs)
    L = torch.linalg.cholesky(H.flip(0, 1))
    del H
    U = _lower_inverse(L).flip(0, 1)
    if not bool(torch.isfinite(U.diagonal()).all()):
        raise torch.linalg.LinAlgError("non-finite factor")
    return U


def _lower_inverse(L: torch.Tensor, leaf: int = 256) -> torch.Tensor:
    """L⁻¹ of a lower-triangular L, by halves: [[A, 0], [C, D]]⁻¹ = [[A⁻¹, 0], [-D⁻¹ C A⁻¹, D⁻¹]]. PyTorch has no
    triangular inverse (LAPACK's trtri); `solve_triangular` against the identity takes three times the arithmetic."""
    n = L.shape[0]
    if n <= leaf:
        return torch.linalg.solve_triangular(L, torch.eye(n, dtype=L.dtype, device=L.device), upper=False)
    h = n // 2
    out = L.new_zeros(n, n)
    out[:h, :h], out[h:, h:] = _lower_inverse(L[:h, :h], leaf), _lower_inverse(L[h:, h:], leaf)
    out[h:, :h] = -(out[h:, h:] @ (L[h:, :h] @ out[:h, :h]))
    return out


def gptq_plan(gram: torch.Tensor, damping: float = 0.01, act_order: bool = False):
    """What GPTQ needs of the Gram, computed once for a matrix quantized in several calls (a table a block of
    rows at a time, a ladder's widths, an alternation's rounds): (the upper Cholesky factor of the damped
    inverse of the Gram in the order the columns are quantized, that order — None for column order, else the
    inputs by decreasing Gram diagonal)."""
    perm = torch.argsort(gram.diagonal(), descending=True, stable=True) if act_order else None
    return gptq_inverse(gram, damping, perm), perm


def quantize_gptq(w: torch.Tensor, gram: torch.Tensor | None, bits: int, group_size: int, damping: float = 0.01,
                  grid: str = "minmax", act_order: bool = False, plan: tuple | None = None) -> QTensor:
    """GPTQ: quantize the columns of ``w`` (out x in) in order, spreading each column's rounding error
    over the columns not yet quantized so that ‖(W - Q) Xᵀ‖ stays small (``gram`` = XᵀX, in x in).

    Each group's grid (`grid_for`) is taken from the (updated) weights when the quantizer reaches the
    group, as in the reference implementation (the last group of a row may be shorter). Dead inputs (zero Gram diagonal)
    get a unit diagonal and their weights are quantized as they are. Every row is quantized on its own (the
    error spreads along a row), so the rows are worked on a block at a time (``GPTQ_BLOCK_BYTES`` of them
    in float32): an embedding table of 262k rows costs a block's working memory, not the table's five times.

    ``act_order=True`` (GPTQ's "activation order" with static groups): the columns are quantized in the
    order of decreasing Gram diagonal (the inputs with the most energy first, while the most columns
    remain to absorb their error), each group's grid taken from the original weights before any update
    (groups stay contiguous in the stored layout, so the format and kernels do not change).
    `plan`: `gptq_plan(gram, damping, act_order)`, given by a caller quantizing one matrix in several calls
    (``gram``, ``damping`` and ``act_order`` are then the plan's and not read).
    """
    if plan is None and gram is None:
        raise ValueError("quantize_gptq: gram: got None; allowed: the inputs' Gram XᵀX (in x in), or plan=gptq_plan(gram)")
    plan = plan if plan is not None else gptq_plan(gram.to(w.device), damping, act_order)
    return quantize_gptq_widths(w, [bits], group_size, grid, plan)[0][0]


def quantize_gptq_widths(w: torch.Tensor, widths, group_size: int, grid: str, plan: tuple,
                         errors: torch.dtype | None = None) -> list[tuple[QTensor, torch.Tensor | None]]:
    """`quantize_gptq` of `w` at each width of `widths` (one plan): [(QTensor, Err)]. With `errors` (a dtype) Err is
    GPTQ's scaled error (out x in, that dtype, its columns in the plan's order), whitened by the plan itself: W - Q =
    Err U with H⁻¹ = Uᵀ U (H the plan's damped Gram), so Err = (W - Q) U⁻¹ and U⁻¹ U⁻ᵀ = H: ‖Err‖ and its singular
    values are those of (W - Q) S for any S Sᵀ = H — a byproduct of the sweep (held in the working copy's place), no
    product; else None. With static groups (the plan's order, ``act_order=True``) the widths are swept together, their
    rows stacked (rows are independent: the same codes as one call per width, a column's Python work shared)."""
    for bits in widths:
        if bits not in BITS:
            raise ValueError(f"bits: got {bits!r}; allowed: {' | '.join(map(str, BITS))}")
    out_f, in_f = w.shape
    # the sweep in float32, as GPTQ's reference (the plan is made in float64): half the bytes and twice the
    # arithmetic rate of float64 on CPU
    Hinv, perm = plan
    Hinv, perm = Hinv.to(w.device, torch.float32), None if perm is None else perm.to(w.device)
    groups = None if perm is None else _groups(w.detach().float(), group_size)
    together = [list(widths)] if perm is not None else [[b] for b in widths]
    results = []
    for ws in together:
        step = max(1, GPTQ_BLOCK_BYTES // (4 * in_f * len(ws)))
        parts = []
        errs = [torch.empty(out_f, in_f, dtype=errors, device=w.device) for _ in ws] if errors is not None else None
        for r0 in range(0, out_f, step):
            rows = w[r0: r0 + step]
            static = None
            if perm is not None:
                n = rows.shape[0] * -(-in_f // group_size)
                g = groups[r0 * (n // rows.shape[0]): r0 * (n // rows.shape[0]) + n]
                grids = [grid_for(g, b, grid) for b in ws]
                static = tuple(torch.cat([t[k].view(rows.shape[0], -1) for t in grids]) for k in range(2))
            top = torch.tensor([2**b - 1 for b in ws], dtype=torch.float32, device=w.device).repeat_interleave(rows.shape[0])
            *made, err = _gptq_rows(rows, Hinv, top, group_size, grid, static, perm, bits=ws[0], copies=len(ws))
            parts.append(made)
            for k in range(len(ws) if errs is not None else 0):  # each width's rows into its own matrix, as they come
                errs[k][r0: r0 + rows.shape[0]].copy_(err.view(len(ws), -1, in_f)[k])
            del err
        for k, bits in enumerate(ws):  # the rows of width `bits` out of each block's stack
            mine = [tuple(t.view(len(ws), -1, *t.shape[1:])[k] for t in p) for p in parts]
            codes, scales, zeros = (torch.cat([m[j] for m in mine]) for j in range(3))
            results.append((QTensor(codes.reshape(-1), scales.reshape(-1), zeros.reshape(-1), bits, group_size, (out_f, in_f)),
                            None if errs is None else errs[k]))
        del parts, errs
    order = [b for ws in together for b in ws]
    return [results[order.index(b)] for b in widths]


def _gptq_rows(w: torch.Tensor, Hinv: torch.Tensor, top: torch.Tensor, group_size: int, grid: str,
               static: tuple | None = None, perm: torch.Tensor | None = None, bits: int = 4, copies: int = 1):
    """`quantize_gptq` on a block of rows, given the upper Cholesky factor of the damped inverse Gram
    (of the permuted Gram, with `perm`; float32): (codes uint8, scales float16, zero points uint8, Err float32: GPTQ's
    scaled errors, columns in the order quantized), each (copies x rows, ...). `copies`: the rows swept that many
    times at once, stacked (one per width; `top`: each stacked row's largest code; several need `static`); `bits`: the
    width of grids made on the way (no `static`). `static`: (scales, zeros) per (row, group) fixed beforehand (act
    order); `perm`: the order the columns are quantized in (codes come back in the original order). The weights are
    held transposed (a column contiguous) and worked in blocks of columns: within a block each column's error goes to
    the block's later columns (one rank-1 update), then to all later columns at once (one product); a quantized column
    keeps its scaled error in its place."""
    W = w.detach().float().t()
    W = W[perm] if perm is not None else W
    if copies > 1:
        W = W.repeat(1, copies)
    elif perm is None or not W.is_contiguous():
        W = W.clone(memory_format=torch.contiguous_format)  # (in, rows), contiguous, never the caller's
    in_f, out_f = W.shape
    group = ((perm if perm is not None else torch.arange(in_f, device=W.device)) // group_size).tolist()  # each column's group
    codes = torch.empty(in_f, out_f, dtype=torch.uint8, device=W.device)
    if static is not None:
        scales, zeros = (t.t().contiguous() for t in static)  # (groups, rows)
    else:
        scales = torch.zeros(-(-in_f // group_size), out_f, dtype=torch.float32, device=W.device)
        zeros = torch.zeros_like(scales)
    diag = Hinv.diagonal().tolist()
    # whole groups per block where grids are made on the way (a group's grid sees its updated weights)
    block = STATIC_BLOCK if static is not None else group_size * max(1, 128 // group_size)
    q, deq = torch.empty(out_f, device=W.device), torch.empty(out_f, device=W.device)
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        W1, Hinv1 = W[i1:i2], Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = group[col]
            if static is None and col % group_size == 0:
                s, z = grid_for(W1[i:i + group_size].t(), bits, grid)
                scales[g], zeros[g] = s, z
            s, z, x = scales[g], zeros[g], W1[i]
            torch.div(x, s, out=q).round_().add_(z).clamp_(min=0)
            torch.minimum(q, top, out=q)
            codes[col] = q
            torch.sub(q, z, out=deq).mul_(s)
            x.sub_(deq).div_(diag[col])  # the column's scaled error (x - (q - z) s) / d, in its place
            if i + 1 < i2 - i1:
                W1[i + 1:].addr_(Hinv1[i, i + 1:], x, alpha=-1)
        if i2 < in_f:
            W[i2:].addmm_(Hinv[i1:i2, i2:].t(), W1, alpha=-1)
    if perm is not None:
        codes = torch.empty_like(codes).index_copy_(0, perm, codes)
    return codes.t().contiguous(), scales.t().half(), zeros.t().to(torch.uint8), W.t()


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int,
                    shape: tuple[int, int], rows: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Rows `rows` of a packed (n, cols) quantized matrix, de-quantized: (len(rows), cols) — an embedding
    lookup that reads only the rows it needs. Where a row's codes do not fill whole bytes, the whole
    matrix is de-quantized and indexed."""
    n, cols = shape
    if cols * bits % 8:
        return QTensor(unpack(packed, bits), scale, zero, bits, group_size, tuple(shape)).dequantize(dtype)[rows]
    per_row = -(-cols // group_size)
    codes = unpack(packed.view(n, cols * bits // 8)[rows].reshape(-1), bits)
    return QTensor(codes, scale.view(n, per_row)[rows].reshape(-1), zero.view(n, per_row)[rows].reshape(-1), bits,
                   group_size, (rows.numel(), cols)).dequantize(dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of `bits` bits -> a little-endian bit stream of `code_bytes` bytes: ``8 // bits`` codes
    to a byte where `bits` divides 8, else eight codes to `bits` bytes (lowest bits first either way)."""
    per = 8 // bits if 8 % bits == 0 else 8
    c = codes.reshape(-1)
    n = c.numel()
    if n % per:
        c = torch.cat([c, c.new_zeros(per - n % per)])
    word = torch.int32 if per * bits <= 8 else torch.int64
    c = c.reshape(-1, per).to(word)
    chunk = (c << (torch.arange(per, dtype=word, device=codes.device) * bits)).sum(1)  # per * bits bits each
    if per * bits == 8:
        return chunk.to(torch.uint8)
    out = (chunk[:, None] >> (torch.arange(bits, dtype=word, device=codes.device) * 8)) & 255
    return out.to(torch.uint8).reshape(-1)[: code_bytes(n, bits)]


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack` (codes past the packed ones come out as zeros, as `QTensor` allows)."""
    if 8 % bits == 0:
        per = 8 // bits
        shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
        return ((packed.to(torch.int32)[:, None] >> shifts) & (2**bits - 1)).reshape(-1).to(torch.uint8)
    p = packed.reshape(-1)
    if p.numel() % bits:
        p = torch.cat([p, p.new_zeros(bits - p.numel() % bits)])
    chunk = (p.reshape(-1, bits).to(torch.int64) << (torch.arange(bits, device=p.device) * 8)).sum(1)
    codes = (chunk[:, None] >> (torch.arange(8, device=p.device) * bits)) & (2**bits - 1)
    return codes.reshape(-1).to(torch.uint8)


# --------------------------------------------------------------------------------------------
# PyTorch's CPU int4 kernel (weight-only, bfloat16 activations)
# --------------------------------------------------------------------------------------------

KERNEL_GROUPS = (32, 64, 128, 256)


def int4_kernel_available() -> bool:
    """Whether this PyTorch has the CPU int4 weight-only matmul (private ops; the callers fall back to
    de-quantizing when it is missing or refuses)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def int4pack_rows(packed: torch.Tensor, n_rows: int, width: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The 4-bit codes (uint8, (len(rows), width); all rows when `rows` is None) held in the layout of
    ``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` for an (n_rows, width) matrix: whole blocks of 64
    rows as (width, 32) bytes, the low nibble of byte j row j of the block and the high nibble row j + 32;
    a last block of r < 64 rows as (width, r / 2) bytes, rows 2j and 2j + 1. `int4pack_layout_ok` checks
    this reading against the kernel's own packing once per process."""
    flat = packed.reshape(-1)
    full = n_rows // 64 * 64
    r = n_rows - full
    if rows is None:
        out = torch.empty(n_rows, width, dtype=torch.uint8, device=packed.device)
        if full:
            b = flat[: full * width // 2].view(full // 64, width, 32)
            out[:full] = torch.cat([b & 15, b >> 4], 2).permute(0, 2, 1).reshape(full, width)
        if r:
            b = flat[full * width // 2:].view(width, r // 2)
            out[full:] = torch.stack([b & 15, b >> 4], -1).reshape(width, r).T
        return out
    rows = rows.reshape(-1).long()
    tail = rows >= full
    t = rows - full
    base = torch.where(tail, full * width // 2 + t // 2, rows // 64 * (width * 32) + rows % 32)
    stride = torch.where(tail, torch.full_like(rows, max(r // 2, 1)), torch.full_like(rows, 32))
    shift = torch.where(tail, t % 2, (rows % 64) // 32) * 4
    cols = torch.arange(width, device=packed.device)
    return ((flat[base[:, None] + stride[:, None] * cols] >> shift[:, None].to(torch.uint8)) & 15).to(torch.uint8)


def nibble_pairs(nibbles: torch.Tensor) -> torch.Tensor:
    """(n, 2k) 4-bit values -> (n, k) uint8, value 2j in the high nibble and 2j + 1 in the low one: the input
    of ``torch.ops.aten._convert_weight_to_int4pack`` (CUDA's tinygemm), as torchao's int4 weights build it."""
    v = nibbles.to(torch.uint8)
    return (v[:, ::2] << 4 | v[:, 1::2]).contiguous()


_LAYOUT_OK: list[bool] = []


def int4pack_layout_ok() -> bool:
    """Whether `int4pack_rows` reads this PyTorch's packing (checked once, on a matrix with whole and partial
    row blocks); where it does not, quantized factors are not held in the kernel's layout."""
    if not _LAYOUT_OK:
        ok = int4_kernel_available()
        if ok:
            codes = torch.randint(0, 16, (176, 96), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
            try:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
                ok = torch.equal(int4pack_rows(packed, 176, 96).int(), codes) and torch.equal(
                    int4pack_rows(packed, 176, 96, torch.tensor([175, 0, 70, 33])).int(), codes[[175, 0, 70, 33]])
            except RuntimeError:
                ok = False
        _LAYOUT_OK.append(ok)
    return _LAYOUT_OK[0]


@dataclass
class Int4Kernel:
    """A quantized (out x in) `QTensor` in the layout of ``torch.ops.aten._weight_int4pack_mm_for_cpu``.

    4-bit codes are one kernel call; 2- and 3-bit codes too (4-bit codes that use part of the range: same
    scale and zero point, held at 4 bits in memory while the stored form stays packed at its width).
    8-bit codes are two nibbles: ``c - zero = 16 (hi - zero_hi) + (lo - zero_lo)`` with
    ``hi, lo = c >> 4, c & 15`` (same bytes in memory as the 8-bit codes; PyTorch's own int8 kernel takes
    one scale per row, not per group). 5- and 6-bit codes are two nibbles too (held at 8 bits), of
    ``d = c - zero + 136`` (73..199): ``c - zero = 16 (hi - 8) + (lo - 8)``, both nibbles' zero points 8 and
    their offsets exactly 0. Split as 8-bit codes are, a 6-bit zero point near 32 leaves an offset near
    96 s per group, whose bfloat16 rounding (shared by the whole group) made the product ten times less
    precise than a bfloat16 one. Two nibbles run as ONE call over twice the inputs: ``[x, x] @ [W_hi, W_lo]ᵀ``.

    That kernel computes ``x @ ((c - 8) * s + z)ᵀ`` per group; a part ``(c - zero) * s`` is ``z = (8 - zero) * s``
    (exact in float32; the kernel reads scales and offsets in bfloat16, like its activations: a weight is then
    as precise as a bfloat16 one). A short last group is padded to a whole one with codes equal to its zero
    point (weight 0) and the input with zeros, so the product is unchanged.

    `codes` gives the stored codes back (`int4pack_rows`): a module can hold this layout in place of its
    packed codes and still save, de-quantize or look rows up from it (`FactorizedModule.hold_kernels`).
    """

    packed: torch.Tensor  # the kernel's uint8 layout of the (out, padded * repeats) nibbles
    sz: torch.Tensor  # (groups per row * repeats, out, 2) bfloat16 scales and offsets
    in_features: int
    padded: int
    group_size: int
    bits: int
    repeats: int = 1  # nibbles (5-, 6-, 8-bit codes: 2), run as one call on the input repeated along its width

    @staticmethod
    def fits(bits: int, group_size: int, shape, device="cpu") -> bool:
        """Whether the kernel runs such a factor on `device`: on CPU PyTorch's CPU int4 kernel (its packing needs
        rows in multiples of 16); on CUDA tinygemm (``_weight_int4pack_mm``, the kernel torchao's int4 weights
        run), whose layout `build` checks against the codes before it is used."""
        kind = torch.device(device).type
        ok = bits in BITS and group_size in KERNEL_GROUPS and len(shape) == 2 and shape[0] % 16 == 0
        if kind == "cuda":
            return ok and hasattr(torch.ops.aten, "_weight_int4pack_mm") and hasattr(torch.ops.aten, "_convert_weight_to_int4pack")
        return ok and kind == "cpu" and int4_kernel_available()

    @classmethod
    def build(cls, q: QTensor) -> "Int4Kernel | None":
        if not cls.fits(q.bits, q.group_size, q.shape):
            return None
        out_f, in_f = q.shape
        g = q.group_size
        per_row = -(-in_f // g)
        zero = q.zero.view(out_f, per_row).to(torch.int32)
        codes = q.codes[: out_f * in_f].view(out_f, in_f).to(torch.int32)
        if in_f % g:
            codes = torch.cat([codes, zero[:, -1:].expand(out_f, per_row * g - in_f)], 1)
        scale = q.scale.view(out_f, per_row).float()
        # (codes, zero point, scale) per nibble
        if q.bits <= 4:
            nibbles = [(codes, zero, scale)]
        elif q.bits < 8:  # recentred (see the docstring): both nibbles' zero points 8, no offsets
            d = codes - zero.repeat_interleave(g, 1) + 136  # codes are padded to whole groups above
            eight = torch.full_like(zero, 8)
            nibbles = [(d >> 4, eight, scale * 16), (d & 15, eight, scale)]
        else:
            nibbles = [(codes >> 4, zero >> 4, scale * 16), (codes & 15, zero & 15, scale)]
        c = torch.cat([n[0] for n in nibbles], 1)
        sz = torch.cat([torch.stack([s, (8 - z).float() * s], -1).transpose(0, 1) for _, z, s in nibbles])
        sz = sz.contiguous().to(torch.bfloat16)
        try:
            if c.device.type == "cuda":
                return cls._build_cuda(c, sz, q, per_row * g, len(nibbles))
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(c.contiguous(), 1)
        except RuntimeError:
            return None
        return cls(packed, sz, in_f, per_row * g, g, q.bits, len(nibbles))

    @classmethod
    def _build_cuda(cls, c: torch.Tensor, sz: torch.Tensor, q: QTensor, padded: int, repeats: int) -> "Int4Kernel | None":
        """tinygemm's layout of nibbles `c` (out, padded * repeats), kept only when its codes read back equal
        (`codes`, through the kernel itself) — its packing is not documented, so it is checked, not assumed."""
        kernel = cls(torch.ops.aten._convert_weight_to_int4pack(nibble_pairs(c), 2), sz, q.shape[1], padded, q.group_size,
                     q.bits, repeats)
        return kernel if torch.equal(kernel._nibbles(), c.to(torch.uint8)) else None

    def _nibbles(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The (out or len(rows), padded * repeats) 4-bit values the layout holds."""
        out_f, width = self.sz.shape[1], self.padded * self.repeats
        if self.packed.device.type != "cuda":
            return int4pack_rows(self.packed, out_f, width, rows)
        # tinygemm's layout read through tinygemm: the identity times weights of scale 1 and offset 8 gives the codes
        unit = torch.stack([torch.ones_like(self.sz[..., 0]), torch.full_like(self.sz[..., 0], 8)], -1)
        eye = torch.eye(width, dtype=torch.bfloat16, device=self.packed.device)
        nib = torch.ops.aten._weight_int4pack_mm(eye, self.packed, self.group_size, unit.contiguous()).T.to(torch.uint8)
        return nib if rows is None else nib[rows.reshape(-1).long()]

    def codes(self, zero: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The stored codes (uint8, (len(rows) or out, in_features)) of rows `rows` (all when None); `zero` is
        the stored zero points (5- and 6-bit codes were recentred by them)."""
        out_f = self.sz.shape[1]
        nib = self._nibbles(rows)
        if self.repeats == 1:
            return nib[:, : self.in_features]
        c = nib[:, : self.padded].to(torch.int32) * 16 + nib[:, self.padded:]
        if self.bits < 8:
            z = zero.view(out_f, -1) if rows is None else zero.view(out_f, -1)[rows.reshape(-1).long()]
            c = c + z.to(torch.int32).repeat_interleave(self.group_size, 1) - 136
        return c[:, : self.in_features].to(torch.uint8)

    def nbytes(self) -> int:
        return self.packed.nbytes + self.sz.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ Wᵀ`` for bfloat16 ``x`` (..., in_features)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.padded != self.in_features or self.repeats > 1:  # one copy: padded to whole groups, repeated
            wide = x2.new_zeros(x2.shape[0], self.repeats, self.padded)
            wide[:, :, : self.in_features] = x2[:, None]
            x2 = wide.view(x2.shape[0], -1)
        else:
            x2 = x2.contiguous()
        mm = torch.ops.aten._weight_int4pack_mm if x2.device.type == "cuda" else torch.ops.aten._weight_int4pack_mm_for_cpu
        return mm(x2, self.packed, self.group_size, self.sz).reshape(*lead, -1)
