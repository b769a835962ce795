"""LASER: per-matrix truncated SVD on chosen layers and matrix types (layer-selective rank reduction).

Sharma et al., "The Truth is in There" (LASER); the baseline TRAWL and TensorLLM compare with.
Each targeted ``nn.Linear`` W (out x in) becomes `LowRankLinear` with the best rank-r approximation
U_r S_r V_r^T; ``rank`` is an int, or a float fraction of min(out, in) resolved per matrix.
"""

from __future__ import annotations

from ..validation import resolve_rank
from ..decompositions import relative_error, truncated_svd
from ..layers import LowRankLinear
from .base import Method, register_method


@register_method
class Laser(Method):
    name = "laser"
    default_targets = ("self_attn.*_proj", "mlp.*_proj")
    default_rank = 0.5
    layer_types = ("lowrank",)
    remedy = "another rank (a truncated SVD of a finite weight is never worse than zeros: check the weight)"

    def check_unit(self, modules, entry, ctx):
        for name, module in modules.items():
            full = min(module.in_features, module.out_features)
            if isinstance(entry.rank, int) and entry.rank > full:
                raise ValueError(
                    f"TensorCompressionConfig.rank: got {entry.rank} but {ctx.prefix}.{name} ({module.out_features}x"
                    f"{module.in_features}) has full rank {full}; allowed: an int in [1, {full}] or a float in (0, 1]"
                )

    def compress(self, modules, entry, ctx):
        out = {}
        for name, lin in modules.items():
            w = lin.weight
            r = resolve_rank(entry.rank, min(w.shape))
            u, v = truncated_svd(w, r)
            out[name] = (LowRankLinear.from_factors(u, v, lin.bias, dtype=w.dtype),
                         {"rank": r, "rel_error": relative_error(w, u @ v)})
        return out
