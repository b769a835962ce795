"""``qlr``: a quantized weight plus a calibrated low-rank correction, W ≈ Q(W) + B A.

Per matrix (EoRA / QERA, with LQ-LoRA's and CALDERA's alternation):

1. Q = the quantizer's codes of W: ``quantizer="gptq"`` (default; error-compensating, reads the
   layer's input Gram XᵀX; ``act_order=True``, default: the inputs with the most energy first, each
   group's grid fixed from the original weights) or ``"rtn"`` (round to nearest, data-free; no order,
   ``act_order`` ignored), ``bits`` per value in groups
   of ``group_size`` with a float16 scale and an integer zero point (`decompositions.quantize`); each
   group's range is the shrunk range with the least round-trip error (``grid="search"``, default;
   GPTQ's reference "mse" grid: a few clipped outliers buy a finer step) or its min-max (``"minmax"``).
2. B A = the best rank-``rank`` fit of the quantization error W - Q *in the whitened space of the
   layer's input*: the SVD of (W - Q) S with S Sᵀ = XᵀX + λI, so what is minimised is the output
   error ‖(W - Q - B A) Xᵀ‖ on the calibration inputs (``whiten=False``: plain Frobenius).
3. ``rounds`` more times: re-quantize W - B A, refit B A to what is left.

``rotate=True`` (default): step 1 quantizes W R instead of W, R a random block-Hadamard rotation of the inputs
(`decompositions.hadamard`: random signs, then an orthonormal Hadamard per block of the largest power of
two <= 128 dividing the input width; QuIP# / QuaRot's incoherence processing). A group's few large weights
are spread over its block, so the grid fits the rest better; GPTQ works on the rotated Gram Rᵀ XᵀX R. The
layer rotates its input before the quantized product (one block x block product per token and block) and
stores the signs (one byte per input); the correction is fitted and applied in the unrotated space.

``target_bytes`` (instead of ``rank``): a fraction of the targeted matrices' bf16 bytes, allocated
across all of them — bits (3, 4, 5, 6 or 8, 2 as well when the budget is below 3 bits everywhere; or those of
``bit_choices``) and correction rank per matrix —
by the same greedy rule as LASER's global budget, on the whitened error each setting leaves (estimated with the quantizer itself,
``estimate="quantizer"``, default; or with round to nearest, ``"rtn"``: faster, but it overprices the
correction — SmolLM2 at 0.27 spent rank 6.8 for 1.138x / 1.189x dense perplexity where the quantizer's own
error spent 4.2 for 1.115x / 1.143x), never exceeding it. The correction costs 2 bytes a value (bf16), or ``factor_bits`` if set. What the
rule compares across matrices (``allocation``): ``"auto"`` (default) — ``"fisher"`` in memory with calibration
text, ``"relative"`` when streaming or data-free (settled when compression starts; the saved config records
which); ``"relative"`` — each matrix's whitened error relative
to its output energy, every matrix counting the same (a small matrix's error then weighs as much as a
large one's, so small matrices climb to 8 bits while large ones stay at 2); ``"size"`` — that relative
error times the matrix's parameters (a large matrix's error counts in proportion); ``"fisher"`` — the
loss itself, ½ Σ Fisher × squared output error (needs the dense model's output Fisher, one backward
pass; not while streaming); ``"measured"`` — ``"fisher"``'s ladders, each decoder layer's scaled so that its
matrices' cheapest rungs together cost what they measurably do: the KL divergence of the model's output from
the dense model's with that layer's matrices (alone) on their cheapest rung, on the first calibration batch
(one partial forward pass a layer; the embedding table's by the output head's; not while streaming). Fisher's
second-order estimate can misprice narrow rungs, whose errors are not small; the measurement is taken there.
"""

from __future__ import annotations

from functools import partial

import torch

from ...decompositions.hadamard import rotate, rotate_gram, rotation_block, rotation_signs, unrotate
from ...decompositions.quantize import BITS, GRIDS, PLAN_FLOAT64_UP_TO, gptq_plan, quantize_gptq_widths, quantize_rtn, stored_bytes
from ...decompositions.svd import EXACT_SPECTRUM, gram_energy, lower_product, spectrum_tails, whitened_svd, whitening_factor
from ...validation import choices, fail, is_int, is_number
from ..base import Allocation, Ladder, Method, register_method
from .layer import QuantizedLowRankLinear, share_input_rotations

QUANTIZERS = ("gptq", "rtn")
ALLOCATIONS = ("auto", "relative", "size", "fisher", "measured")
ESTIMATES = ("rtn", "quantizer")
RANK_RUNGS = (0, 8, 16, 32, 64, 128, 256)
# The budget's default widths (`QuantizedLowRank._default_bits`): none narrower than the widest that fits
# everywhere; 2-bit rungs only where 3 bits everywhere would not fit. Measured on both bundled models (groups of
# 128, rotated): the Fisher-weighted score prices a narrower matrix below what it costs the model (0.21 of the
# bytes: 1.309x / 1.356x dense perplexity with 2-bit rungs, 1.266x / 1.303x without, on SmolLM2).
DEFAULT_BITS = tuple(b for b in BITS if b != 2)


def _errors(w: torch.Tensor, layer, s: torch.Tensor | None, fitted: tuple | None = None) -> dict:
    """The report's errors of a built layer against `w` (float32): ``rel_error`` ‖W - W'‖ / ‖W‖, ``whitened_error``
    ‖(W - W') S‖ / ‖W S‖ and ``quant_only_error`` the same without the correction (plain, without `s`), W' = Q + B A.
    `fitted`: (‖E S‖², ‖(E - B A) S‖²) from the correction's fit (E = W - Q; `QuantizedLowRank.fit`), or with no
    correction (‖Err‖², shift) from GPTQ's whitened error, ‖E S‖² = ‖Err‖² - shift ‖E‖²; else E S is formed here;
    W S is the one product of an input-sized width left."""
    w = w.detach().float()
    e = w - layer.base_weight().detach().float()
    a, b = (layer.lora_A.detach().float(), layer.lora_B.detach().float()) if layer.rank else (None, None)
    full = e if a is None else e - b @ a
    out = {"rel_error": float(full.norm() / w.norm().clamp_min(1e-30))}
    if s is None:
        return {**out, "whitened_error": None, "quant_only_error": float(e.norm() / w.norm().clamp_min(1e-30))}
    s = s.float()
    ws = lower_product(w, s).norm().clamp_min(1e-30)  # S: the whitening's Cholesky factor, lower triangular
    if fitted is None:
        es = lower_product(e, s)
        fitted = float(es.pow(2).sum()), float((es if a is None else es - b @ (a @ s)).pow(2).sum())
    elif a is None:  # GPTQ's whitened error, shifted to the whitening's damping
        quant = fitted[0] - fitted[1] * float(e.double().pow(2).sum())
        fitted = quant, quant
    quant, left = (max(v, 0.0) ** 0.5 for v in fitted)
    return {**out, "whitened_error": float(left / ws), "quant_only_error": float(quant / ws)}


@register_method
class QuantizedLowRank(Method):
    name = "qlr"
    per_matrix = True
    byte_budget = True
    default_targets = ("self_attn.*_proj", "mlp.*_proj")
    default_rank = 32
    # 128 windows of 256 tokens (GPTQ's usual count): on SmolLM2 at target_bytes=0.27 calibrated on both corpora,
    # against 32, perplexity vs dense 1.060 / 1.061 (Wikipedia / OpenWebText) against 1.062 / 1.085, and on Bible
    # prose neither corpus holds 1.107 / 1.137 against 1.114 / 1.143 (benchmarks/results/other_prose.md)
    calibration_samples = 128
    supports_target = True
    uses_group_size = True
    layer_types = ("qlr",)
    remedy = "more bits or a larger rank (check the weight: a quantized finite weight is never worse than zeros)"
    option_defaults = {"bits": 4, "quantizer": "gptq", "whiten": True, "rounds": 1, "damping": 1e-4,
                       "gptq_damping": 0.01, "target_bytes": None, "allocation": "auto", "grid": "search",
                       "estimate": "quantizer", "bit_choices": None, "act_order": True, "rotate": True}

    def validate_options(self, options):
        o = super().validate_options(options)
        if type(o["bits"]) is not int or o["bits"] not in BITS:  # not a bool, not 4.0 (== 4, but no code width)
            fail("bits", o["bits"], " | ".join(map(str, BITS)) + " (integer bits per weight)")
        if o["quantizer"] not in QUANTIZERS:
            fail("quantizer", o["quantizer"], choices(QUANTIZERS))
        if not isinstance(o["whiten"], bool):
            fail("whiten", o["whiten"], "True (fit the correction to the output error on the calibration inputs) | False")
        if not is_int(o["rounds"], 0) or o["rounds"] > 20:
            fail("rounds", o["rounds"], "an int in [0, 20] (re-quantize / refit alternations after the first fit)")
        for key in ("damping", "gptq_damping"):
            if not is_number(o[key]) or not 0 <= o[key] <= 10:
                fail(key, o[key], "a number in [0, 10]")
        if o["grid"] not in GRIDS:
            fail("grid", o["grid"], choices(GRIDS) + " (each group's range: min-max, or the clipping with the least error)")
        if not isinstance(o["act_order"], bool):
            fail("act_order", o["act_order"], "True (GPTQ quantizes the inputs with the most energy first, static groups) | False")
        if not isinstance(o["rotate"], bool):
            fail("rotate", o["rotate"], "True (quantize W R, R a random block-Hadamard rotation of the inputs) | False")
        if o["estimate"] not in ESTIMATES:
            fail("estimate", o["estimate"], choices(ESTIMATES) + " (how target_bytes' rungs are scored: round to nearest, "
                 "or the quantizer itself)")
        if o["allocation"] not in ALLOCATIONS:
            fail("allocation", o["allocation"], choices(ALLOCATIONS) + " (what target_bytes' allocation compares)")
        t = o["target_bytes"]
        if t is not None and (not is_number(t) or not 0 < t < 1):
            fail("target_bytes", t, "None, or a float in (0, 1): the fraction of the targeted matrices' bf16 bytes kept")
        c = o["bit_choices"]
        if c is not None:
            if (t is None or not isinstance(c, (list, tuple)) or not c or len(set(c)) != len(c)
                    or any(type(b) is not int or b not in BITS for b in c)):
                fail("bit_choices", c, "None (from the widest of 3, 4, 5, 6, 8 whose codes fit everywhere up; every width "
                     "below 3 bits everywhere), or "
                     f"with target_bytes= a list of distinct widths from {', '.join(map(str, BITS))} (e.g. [3, 4]: one "
                     "int4 kernel call per matrix)")
            o["bit_choices"] = sorted(c)
        return o

    def validate_rank(self, rank, options):
        if options.get("target_bytes") is not None:  # an explicit rank is refused in `Entry` (the default too)
            return None
        if not is_int(rank, 0):
            fail("rank", rank, "an int >= 0 (the correction's rank; 0: the quantizer alone)")
        return rank

    def validate_target(self, target, options):
        fail("target", target, "None: qlr's budget is target_bytes= (a fraction of the bf16 bytes)")

    def check_unit(self, modules, entry, ctx):
        """A rank above every targeted matrix's full rank is refused, as LASER refuses one above any (before any
        weight loads); one above some of them is cut to their full rank there, with a warning naming them and
        what their corrections then cost against the dense bf16 matrices."""
        r = entry.rank
        if not isinstance(r, int) or not modules:
            return
        full = {n: min(m.in_features, m.out_features) for n, m in modules.items()}
        if r > max(full.values()):
            name = max(full, key=full.get)
            m = modules[name]
            raise ValueError(f"TensorCompressionConfig.rank: got {r} but the largest full rank of the targeted matrices "
                             f"is {full[name]} ({ctx.prefix}.{name}: {m.out_features}x{m.in_features}); allowed: an int "
                             f"in [0, {full[name]}] (the low-rank correction's rank)")
        cut = sorted(n.partition(".")[2] for n in full if r > full[n])
        if cut:
            import warnings

            first = {n.partition(".")[2]: m for n, m in modules.items()}
            corr = sum(full[n] * (m.in_features + m.out_features) * 2 for n, m in modules.items() if r > full[n])
            dense = sum(m.in_features * m.out_features * 2 for n, m in modules.items() if r > full[n])
            warnings.warn(f"hf_tensorcomp: qlr rank={r} is above the full rank of {', '.join(cut)} "
                          f"({', '.join(str(min(first[n].in_features, first[n].out_features)) for n in cut)}): cut to it "
                          f"there; their corrections then cost {corr:,} bytes a layer (bf16), the dense bf16 matrices "
                          f"{dense:,}", UserWarning, stacklevel=2)

    def settle(self, entry, calibrated, streaming):
        if entry.options["allocation"] == "auto":
            entry.options["allocation"] = "fisher" if calibrated and not streaming else "relative"

    def needs(self, entry):
        o = entry.options
        return frozenset({"gram"} if o["whiten"] or o["quantizer"] == "gptq" else set())

    def allocates(self, entry):
        return entry.options["target_bytes"] is not None

    def ladder_needs(self, entry):
        o = entry.options
        gptq = o["estimate"] == "quantizer" and o["quantizer"] == "gptq"
        return frozenset(({"gram"} if o["whiten"] or gptq else set())
                         | ({"fisher"} if o["allocation"] in ("fisher", "measured") else set()))

    def start_allocation(self, entry) -> Allocation:
        return Allocation(budget=entry.options["target_bytes"], measured=entry.options["allocation"] == "measured")

    # ------------------------------------------------------------------ the fit
    def _whitening(self, stats, entry):
        if not entry.options["whiten"]:
            return None
        if stats is None or stats.gram is None:
            raise ValueError("TensorCompressionConfig.whiten=True needs calibration statistics; pass calibration=")
        return whitening_factor(stats.gram, entry.options["damping"])

    @staticmethod
    def _rotation(in_features: int, entry, device) -> tuple[torch.Tensor, int] | None:
        """(signs, block) of the input rotation with ``rotate=True`` (None: off, or an odd input width); the signs on
        the weight's `device`."""
        block = rotation_block(in_features) if entry.options["rotate"] else 1
        return (rotation_signs(in_features).to(device), block) if block > 1 else None

    @staticmethod
    def _gptq(entry, estimating=False) -> bool:
        """Whether GPTQ quantizes (`estimating`, a ladder's rung: round to nearest unless ``estimate="quantizer"``)."""
        o = entry.options
        return o["quantizer"] == "gptq" and not (estimating and o["estimate"] == "rtn")

    def _plan(self, stats, entry, rot, device, estimating=False):
        """GPTQ's plan (`gptq_plan`: the damped inverse of the inputs' Gram in the quantizer's basis, Rᵀ XᵀX R with a
        rotation, and the column order), on the weight's `device`, once per matrix for every width and round; None
        where the quantizer needs none. The rotated Gram is released once the plan is made."""
        if not self._gptq(entry, estimating):
            return None
        gram = stats.gram
        if rot is not None:  # rotated in the plan's precision (float32 above PLAN_FLOAT64_UP_TO inputs)
            gram = rotate_gram(gram.float() if gram.shape[0] > PLAN_FLOAT64_UP_TO else gram.double(), *rot)
        o = entry.options
        return gptq_plan(gram.to(device), o["gptq_damping"], o["act_order"])

    def _quantize(self, w, bits, entry, plan, group_size=None, estimating=False, rot=None):
        """The quantizer's codes of `w` (of `w` R with a rotation `rot`; `plan` from `_plan`)."""
        return self._quantize_widths(w, [bits], entry, plan, group_size, estimating, rot)[0]

    def _quantize_widths(self, w, widths, entry, plan, group_size=None, estimating=False, rot=None, errors=None):
        """`_quantize` at each width of `widths` (GPTQ sweeps them together: `quantize_gptq_widths`); with `errors` (a
        dtype; GPTQ only) [(codes, GPTQ's whitened error)]."""
        o, g = entry.options, group_size or entry.group_size
        if rot is not None:
            w = rotate(w, *rot)
        if self._gptq(entry, estimating):
            done = quantize_gptq_widths(w, widths, g, o["grid"], plan, errors)
            return done if errors is not None else [q for q, _ in done]
        return [quantize_rtn(w, b, g, o["grid"]) for b in widths]

    @staticmethod
    def _approx(q, rot) -> torch.Tensor:
        """Q's de-quantized value in the input's own space."""
        return q.dequantize() if rot is None else unrotate(q.dequantize(), *rot)

    def _derived(self, made: list | None, stats, entry, rot, device, estimating=False, whiten=True):
        """(whitening factor, GPTQ plan) of a matrix, taken from the matrix before it when that one reads the same input
        (q / k / v, gate / up, named in that order: an equal Gram and the same rotation), else made and kept in `made`
        in its place (one matrix's at a time: a 7B down_proj's are 2 GB). `whiten=False`: no whitening factor (None)."""
        gram = None if stats is None else stats.gram
        made = [] if made is None else made
        for k, (g, r, s, plan) in enumerate(made):
            if (gram is not None and g.shape == gram.shape and (r is None) == (rot is None)
                    and (r is None or (r[1] == rot[1] and torch.equal(r[0], rot[0]))) and torch.equal(g, gram)):
                if s is None and whiten:  # the matrix before needed none
                    s = self._whitening(stats, entry)
                    made[k] = (g, r, s, plan)
                return s, plan
        made.clear()  # the previous matrix's, freed before this one's are made
        s, plan = self._whitening(stats, entry) if whiten else None, self._plan(stats, entry, rot, device, estimating)
        if gram is not None:
            made.append((gram, rot, s, plan))
        return s, plan

    def fit(self, w: torch.Tensor, bits: int, rank: int, entry, stats, s, rot=None, plan=None) -> tuple:
        """(QTensor, A, B, fitted) for one matrix: quantize, fit the correction, alternate (`plan`: GPTQ's, if made).
        `fitted`: the last fit's (‖E S‖², ‖(E - B A) S‖²), E = W - Q; with no correction, from GPTQ's whitened error
        (‖Err‖², (δ - λ)): ‖E S‖² = ‖Err‖² - (δ - λ) ‖E‖², `_errors` having E; None: not known without a product."""
        w = w.detach().float()
        plan = self._plan(stats, entry, rot, w.device) if plan is None else plan
        if not rank and s is not None and self._gptq(entry) and bool((stats.gram.diagonal() > 0).all()):
            # no correction: the report's ‖E S‖² from GPTQ's own whitened error (on G + δI, δ = gptq_damping x mean
            # diag G; S Sᵀ = G + λI): ‖E S‖² = ‖Err‖² - (δ - λ) ‖E‖², no product (no dead input, where the plan's
            # diagonal would differ)
            o = entry.options
            q, err = self._quantize_widths(w, [bits], entry, plan, rot=rot, errors=torch.float32)[0]
            shift = (o["gptq_damping"] - o["damping"]) * float(stats.gram.diagonal().double().mean())
            return q, None, None, (float(err.double().pow(2).sum()), shift)  # `_errors` takes the shift with ‖E‖²
        q = self._quantize(w, bits, entry, plan, rot=rot)
        a = b = fitted = None
        for k in range(1 + entry.options["rounds"] if rank else 0):
            if k:
                q = self._quantize(w - b @ a, bits, entry, plan, rot=rot)
            b, a, sv, total = whitened_svd(w - self._approx(q, rot), rank, s, energy=True)
            fitted = total, total - float(sv[:rank].pow(2).sum())
        return q, a, b, fitted

    def _rung_bytes(self, lin, bits, rank, entry, group_size=None, rotated=False) -> float:
        i, o = lin.in_features, lin.out_features
        corr_bits = entry.factor_bits or 16
        return (stored_bytes((o, i), bits, group_size or entry.group_size) + rank * (i + o) * corr_bits / 8
                + (i if rotated else 0))  # the rotation's signs, one byte each

    @staticmethod
    def _default_bits(entry, share: float | None = None) -> tuple[int, ...]:
        """The widths a byte budget chooses from by default: the widest width whose codes everywhere fit
        ``target_bytes`` (their scale and zero per group counted, 2 % to spare; with the embedding table in the
        budget, what the table leaves the linears: `share`, `Allocation.share`) and every wider one; every width when not
        even 3 bits fit. Narrower codes beside wider ones cost the model more than the Fisher-weighted
        score prices them where one width fits everywhere (Gemma-3 at 0.27: 1.110x / 1.117x dense perplexity with
        3-bit rungs, 1.068x / 1.095x without; at 0.21 2-bit rungs likewise)."""
        t, g = entry.options["target_bytes"] if share is None else share, entry.group_size
        fits = [b for b in DEFAULT_BITS if t >= 1.02 * stored_bytes((1, g), b, g) / (2 * g)]  # over bf16
        return tuple(b for b in DEFAULT_BITS if b >= fits[-1]) if fits else BITS

    def budget_hint(self, entry, alloc) -> str:
        left_out = [b for b in BITS if b not in self._default_bits(entry, alloc.share)]
        if entry.options["bit_choices"] is None and left_out:
            return (f", or bit_choices={list(BITS)} (the default leaves {', '.join(map(str, left_out))}-bit codes "
                    "out at this budget)")
        return ""

    def attach(self, model):
        share_input_rotations(model)  # q / k / v and gate / up rotate their common input once

    def ladder(self, name, module, stats, entry, ctx):
        return self._ladder(name, module, stats, entry, ctx.allocation, made=ctx.scratch)

    def table_ladder(self, name, head, stats, entry, ctx, bits, group_size, copies):
        return self._ladder(name, head, stats, entry, ctx.allocation, bits, (0,), group_size, copies, table=True)

    def _ladder(self, name, module, stats, entry, alloc, bits=None, ranks=RANK_RUNGS, group_size=None, copies=1,
                table=False, made=None) -> Ladder:
        """Rungs (bits, rank) on the Pareto front of (bytes, loss), costs in bf16 parameters (bytes / 2)
        so that the budget is `target_bytes` x the targeted parameters; the loss as ``allocation`` says.
        `bits`, `ranks`, `group_size` narrow the rungs (the embedding table: its own group size, no
        correction; default bits: the ``bit_choices`` option); `copies`: how many times the matrix is stored (an
        untied head beside its table); `table`: the embedding table (looked up, never rotated)."""
        bits = bits or entry.options["bit_choices"] or self._default_bits(entry, alloc.share)
        group_size = group_size or entry.group_size
        how = entry.options["allocation"]
        d = stats.fisher.clamp_min(0).sqrt().double() if how in ("fisher", "measured") else None
        w = module.weight.detach().float()
        rot = None if table else self._rotation(w.shape[1], entry, w.device)
        wide = min(w.shape) > EXACT_SPECTRUM  # float32 products where the spectrum is estimated anyway
        # GPTQ's own scaled error is the error whitened by its plan's Gram (`quantize_gptq_widths`): no E S product per
        # width, no whitening factor (the plan's damping, gptq_damping, stands in for the whitening's, damping)
        swept = entry.options["whiten"] and self._gptq(entry, estimating=True) and not table
        s, plan = self._derived(made, stats, entry, rot, w.device, estimating=True, whiten=not swept)  # q/k/v, gate/up
        s_ = None if s is None else s.float() if wide else s

        def weighted(m, rows=slice(None), whitened=False):
            m = m[rows].float() if wide else m[rows].double()
            m = m @ s_ if s_ is not None and not whitened else m
            return m * d[rows, None].to(m.dtype) if d is not None else m

        def energy(m, step=8192, whitened=False):  # ‖weighted(m)‖², a block of rows at a time (a vocabulary-sized table)
            return sum(float(weighted(m, slice(i, i + step), whitened).double().pow(2).sum()) for i in range(0, m.shape[0], step))

        if how in ("fisher", "measured"):
            ref = 2.0  # the loss itself: ½ Σ Fisher x squared output error
        else:
            ref = (self._plan_energy(w, stats.gram, entry) if swept else energy(w)) / (w.numel() if how == "size" else 1)
        ranks = [r for r in ranks if r < min(w.shape) // 2]
        points, probe = [], None
        errors = (torch.bfloat16 if wide else torch.float32) if swept else None  # bf16: a 7B matrix's widths in 0.9 GB
        done = self._quantize_widths(w, bits, entry, plan, group_size, estimating=True, rot=rot, errors=errors)
        for b in bits:
            q, err = done.pop(0) if swept else (done.pop(0), None)  # each width's released once priced
            if alloc.measured and b == bits[0]:  # the cheapest rung, for the measurement
                probe = partial(self._approx, q, rot)
            if err is None:
                err = w - self._approx(q, rot)
            # the squared (weighted) error each rank of correction leaves; rank 0 alone: the whole error, no SVD
            # whitened errors' spectra decay: two power passes lose 0.07 % of rank 256's gain (`spectrum_tails`)
            tails = (spectrum_tails(weighted(err, whitened=swept), ranks, power=2 if swept else 4) if any(ranks)
                     else [energy(err, whitened=swept)] * len(ranks))
            del err, q
            for r, tail in zip(ranks, tails):
                cost = copies * self._rung_bytes(module, b, r, entry, group_size, rot is not None) / 2
                points.append((cost, tail / ref, (b, r)))
        points.sort()
        front = []
        for cost, loss, setting in points:
            if not front or loss < front[-1][1]:
                front.append((cost, loss, setting))
        # each width with no correction, or the front's rung that costs no more and loses no more (the seed the
        # budget climbs from as well: it never ends below one width everywhere, where that fits)
        uniform = {s[0]: max(j for j, p in enumerate(front) if p[0] <= c) for c, _, s in points if s[1] == 0}
        return Ladder([p[0] for p in front], [p[1] for p in front], settings=[p[2] for p in front], uniform=uniform,
                      probe=probe)

    @staticmethod
    def _plan_energy(w, gram, entry) -> float:
        """‖W‖² on the GPTQ plan's damped Gram, tr(W (G + δ I) Wᵀ) with δ = ``gptq_damping`` x mean(diag G) (any
        rotation leaves it as it is; dead inputs aside): the output energy GPTQ's whitened errors are measured against.
        Float32 above `EXACT_SPECTRUM` inputs and outputs, as the ladder's products."""
        w = w.to(torch.float32 if min(w.shape) > EXACT_SPECTRUM else torch.float64)
        delta = entry.options["gptq_damping"] * float(gram.diagonal().double().mean())
        return gram_energy(w, gram) + delta * float(w.double().pow(2).sum())

    def compress(self, modules, entry, ctx):
        out, made = {}, []  # made: (Gram, rotation, whitening, plan) of this unit's matrices so far
        for name, lin in modules.items():
            stats = (ctx.stats or {}).get(name)
            if ctx.allocation is not None:
                bits, rank = ctx.allocation.settings[name][ctx.allocation.rungs[name]]
            else:
                bits, rank = entry.options["bits"], min(entry.rank, min(lin.weight.shape))
            rot = self._rotation(lin.in_features, entry, lin.weight.device)
            s, plan = self._derived(made, stats, entry, rot, lin.weight.device)
            q, a, b, fitted = self.fit(lin.weight, bits, rank, entry, stats, s, rot, plan)
            bias = None if lin.bias is None else lin.bias.detach()
            new = QuantizedLowRankLinear.build(q, a, b, bias, lin.weight.dtype, rotation=rot)
            errors = {k: None if v is None else round(v, 6) for k, v in _errors(lin.weight, new, s, fitted).items()}
            out[name] = (new, {"bits": bits, "rank": rank, "group_size": entry.group_size, **errors})
        return out
