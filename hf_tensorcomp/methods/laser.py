"""LASER: per-matrix truncated SVD on chosen layers and matrix types (layer-selective rank reduction).

Sharma et al., "The Truth is in There" (LASER); the baseline TRAWL and TensorLLM compare with.
Each targeted ``nn.Linear`` W (out x in) becomes `LowRankLinear` with a rank-r approximation u @ v;
``rank`` is an int, or a float fraction of min(out, in) resolved per matrix.

Activation-aware (needs ``calibration=``): ``whiten=True`` is SVD-LLM's truncation-aware whitening —
S = chol(XᵀX + λI), SVD of W S, S⁻¹ folded into the right factor, so the dropped singular values are
exactly the output error ‖(W - W') Xᵀ‖ on the calibration inputs; ``whiten="asvd"`` scales the input
channels by mean|x|^alpha instead (ASVD). Both keep the factored forward exactly as cheap as plain SVD.

``correct=True`` (with ``whiten=True``, ``propagate=True``): each matrix is fitted to the *dense*
model's outputs from the inputs it really gets after the earlier layers were compressed —
W' = argmin ‖W X_denseᵀ - W' Xᵀ‖² + λ‖W - W'‖² at rank r, i.e. the whitened truncation of
W (C + λI)(G + λI)⁻¹ with C = X_denseᵀ X, G = XᵀX (λ: the whitening's damping; the ridge keeps the
fit near W where the calibration data say little) — so each layer corrects part of the error the
layers before it left.

``target=<fraction>`` instead of ``rank``: the targeted matrices keep that fraction of their weight
parameters in total. ``allocation="global"`` (default) ranks every matrix against every other by the
(whitened, if whitening) truncation loss each rank saves per parameter, relative to the matrix's
output energy (by the loss itself, ½ Fisher × squared output error, when the dense model's output Fisher is
known), and may keep a matrix dense when factoring would not shrink it; ``"relative"`` compares relative
(whitened, Fisher-weighted with ``weighting="fisher"``) errors instead; ``"uniform"`` gives every matrix the
same fraction.

``pivoted=True`` stores each factored matrix in `LowRankLinear`'s pivoted form (r of V's columns the identity,
r (in + out - r) numbers instead of r (in + out): the same product, fewer parameters), and every budget —
``target``, the allocation's costs, when a matrix is kept dense — counts those numbers, so one budget buys higher
ranks; ``pivoted=False`` keeps both factors whole (the earlier default: a saved entry without the option loads so).
The default ``"auto"`` is True unless ``factor_bits=4`` (4-bit codes of the pivoted factors collapse the model).
"""

from __future__ import annotations

import math

import torch

from ..decompositions import relative_error, truncated_svd
from ..decompositions.svd import whitened_spectrum, whitened_svd, whitening_factor
from ..layers import LowRankLinear
from ..validation import choices, fail, is_number, resolve_rank
from .base import Ladder, Method, register_method

WHITEN = (False, True, "cholesky", "asvd")
ALLOCATIONS = ("global", "relative", "uniform")


def _break_even(lin, pivoted: bool = False) -> int:
    """Smallest rank whose factors are not smaller than the dense matrix."""
    i, o = lin.in_features, lin.out_features
    return min(i, o) if pivoted else math.ceil(i * o / (i + o))


def _pivoted(entry) -> bool:
    """The ``pivoted`` option, ``"auto"`` resolved: pivoted unless the factors are stored in 4 bits (4-bit codes of
    the pivoted form's T and U V_J lose too much: SmolLM2 at 60 %, 1,633x dense perplexity against 11.7x plain)."""
    p = entry.options["pivoted"]
    return p if isinstance(p, bool) else entry.factor_bits != 4


def _cost(lin, r: int, pivoted: bool) -> int:
    """Numbers stored at rank r: r (in + out), or r (in + out - r) in the pivoted form."""
    return r * (lin.in_features + lin.out_features - (r if pivoted else 0))


def _uniform_rank(lin, target: float, pivoted: bool) -> int:
    """The largest rank (at least 1) whose `_cost` is at most `target` of the dense matrix's parameters."""
    i, o, budget = lin.in_features, lin.out_features, target * lin.in_features * lin.out_features
    if not pivoted:
        return max(1, math.floor(budget / (i + o)))
    return max(1, min(min(i, o), math.floor((i + o - math.sqrt(max((i + o) ** 2 - 4 * budget, 0.0))) / 2)))


@register_method
class Laser(Method):
    name = "laser"
    per_matrix = True
    default_targets = ("self_attn.*_proj", "mlp.*_proj")
    default_rank = 0.5
    supports_target = True
    layer_types = ("lowrank",)
    remedy = "another rank (a truncated SVD of a finite weight is never worse than zeros: check the weight)"
    option_defaults = {"whiten": False, "alpha": 0.5, "damping": 1e-4, "allocation": "global", "weighting": None,
                       "correct": False, "pivoted": "auto"}
    saved_defaults = {"pivoted": False}  # checkpoints from before the option kept every factor plain

    def validate_options(self, options):
        o = super().validate_options(options)
        if not isinstance(o["whiten"], (bool, str)) or o["whiten"] not in WHITEN:  # 1 == True, but is not meant
            fail("whiten", o["whiten"], "False | True (SVD-LLM: Cholesky of XᵀX) | 'cholesky' (the same) | 'asvd' (mean|x|^alpha)")
        if o["whiten"] is True:
            o["whiten"] = "cholesky"
        for key in ("alpha", "damping"):
            if not is_number(o[key]) or not 0 <= o[key] <= 10:
                fail(key, o[key], "a number in [0, 10]")
        if o["weighting"] not in (None, "fisher"):
            fail("weighting", o["weighting"], "None | 'fisher' (weight each output channel's error by its mean squared loss gradient)")
        if not isinstance(o["correct"], bool) or o["correct"] and o["whiten"] != "cholesky":
            fail("correct", o["correct"], "False, or True together with whiten=True (fit the dense outputs from the "
                 "compressed model's inputs: needs the input Gram)")
        if not isinstance(o["pivoted"], bool) and o["pivoted"] != "auto":
            fail("pivoted", o["pivoted"], "'auto' (True unless factor_bits=4) | False | True (store r of V's columns as "
                 "the identity: r (in + out - r) numbers a matrix instead of r (in + out))")
        if o["allocation"] not in ALLOCATIONS:
            fail("allocation", o["allocation"], choices(ALLOCATIONS))
        return o

    def needs(self, entry):
        kinds = {"cholesky": {"gram"}, "asvd": {"abs_mean"}}.get(entry.options["whiten"], set())
        kinds |= {"fisher"} if entry.options["weighting"] else set()
        return frozenset(kinds | ({"cross"} if entry.options["correct"] else set()))

    def allocates(self, entry):
        return entry.target is not None and entry.options["allocation"] != "uniform"

    def ladder_needs(self, entry):
        sensitive = entry.options["allocation"] == "global" and entry.options["whiten"] == "cholesky"
        return (self.needs(entry) - {"cross"}) | ({"fisher"} if sensitive else set())

    def check_unit(self, modules, entry, ctx):
        for name, module in modules.items():
            full = min(module.in_features, module.out_features)
            if isinstance(entry.rank, int) and entry.rank > full:
                raise ValueError(
                    f"TensorCompressionConfig.rank: got {entry.rank} but {ctx.prefix}.{name} ({module.out_features}x"
                    f"{module.in_features}) has full rank {full}; allowed: an int in [1, {full}] or a float in (0, 1]"
                )

    def _scaling(self, stats, entry):
        """S of the whitening (a triangular factor, a 1-D scale vector, or None when not whitening)."""
        how = entry.options["whiten"]
        if not how:
            return None
        if stats is None:
            raise ValueError(f"TensorCompressionConfig.whiten={how!r} needs calibration statistics; pass calibration=")
        if how == "cholesky":
            return whitening_factor(stats.gram, entry.options["damping"])
        return stats.abs_mean.clamp_min(1e-6).pow(entry.options["alpha"])

    def _output_weights(self, stats, entry):
        return stats.fisher.clamp_min(1e-30).sqrt() if entry.options["weighting"] else None

    def ladder(self, name, module, stats, entry, ctx):
        d = self._output_weights(stats, entry)
        sv2 = whitened_spectrum(module.weight, self._scaling(stats, entry), d).pow(2)
        # loss unit: the loss itself (½ Fisher x squared output error) when known and asked for (allocation="global"),
        # else the relative error — weighting="fisher" gathers the Fisher for the SVD, not for the allocation
        fisher = getattr(stats, "fisher", None) if entry.options["allocation"] == "global" else None
        if fisher is None:
            total = float(sv2.sum()) or 1.0
        else:
            total = 2.0 if d is not None else 2.0 / float(fisher.mean())
        tail = (sv2.flip(0).cumsum(0).flip(0) / total).tolist() + [0.0]  # tail[r] = loss at rank r
        pivoted = _pivoted(entry)
        ranks = range(1, _break_even(module, pivoted))
        return Ladder([_cost(module, r, pivoted) for r in ranks] + [module.weight.numel()], [tail[r] for r in ranks] + [0.0])

    def compress(self, modules, entry, ctx):
        out, pivoted = {}, _pivoted(entry)
        for name, lin in modules.items():
            w = lin.weight
            if entry.target is None:
                r = resolve_rank(entry.rank, min(w.shape))
            elif ctx.allocation is not None:
                r = ctx.allocation.rungs[name] + 1
                if r >= _break_even(lin, pivoted):
                    continue  # the budget keeps this matrix dense
            else:  # uniform: every matrix keeps `target` of its parameters
                r = _uniform_rank(lin, entry.target, pivoted)
            st = (ctx.stats or {}).get(name)
            s, d = self._scaling(st, entry), self._output_weights(st, entry) if st is not None else None
            if s is None and d is None:
                u, v = truncated_svd(w, r)
                extra = {}
            else:
                target = w
                if st is not None and st.cross is not None:  # error correction: fit W Xd from X (Xd: dense inputs)
                    g = s @ s.T  # G + λI: the ridge pulls the fit towards W where the data says little
                    lam_eye = g - st.gram
                    target = w.detach().double() @ (st.cross + lam_eye) @ torch.cholesky_inverse(s)
                u, v, sv = whitened_svd(target, r, s, d)
                sv2 = sv.pow(2)
                extra = {"rel_output_error": round(float((sv2[r:].sum() / sv2.sum()).sqrt()), 6)} if s is not None and s.ndim == 2 and d is None else {}
            build = LowRankLinear.pivoted_from_factors if pivoted and r < min(w.shape) else LowRankLinear.from_factors
            out[name] = (build(u, v, lin.bias, dtype=w.dtype),
                         {"rank": r, "rel_error": relative_error(w, u @ v), **extra})
        return out
