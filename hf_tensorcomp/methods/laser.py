"""LASER: per-matrix truncated SVD on chosen layers and matrix types (layer-selective rank reduction).

Sharma et al., "The Truth is in There" (LASER); the baseline TRAWL and TensorLLM compare with.
Each targeted ``nn.Linear`` W (out x in) becomes `LowRankLinear` with the best rank-r approximation
U_r S_r V_r^T; ``rank`` is an int, or a float fraction of min(out, in) resolved per matrix.
"""

from __future__ import annotations

import torch

from ..config import resolve_rank
from ..decompositions import truncated_svd
from ..layers import LowRankLinear
from .base import Method, register_method


@register_method
class Laser(Method):
    name = "laser"
    default_targets = ("self_attn.*_proj", "mlp.*_proj")
    default_rank = 0.5

    def check_target(self, name, module, entry):
        full = min(module.in_features, module.out_features)
        if isinstance(entry.rank, int) and entry.rank > full:
            raise ValueError(
                f"TensorCompressionConfig.rank: got {entry.rank} but {name} ({module.out_features}x{module.in_features}) "
                f"has full rank {full}; allowed: an int in [1, {full}] or a float in (0, 1]"
            )

    def compress_layer(self, modules, entry):
        out = {}
        for name, lin in modules.items():
            w = lin.weight
            r = resolve_rank(entry.rank, min(w.shape))
            u, v = truncated_svd(w, r)
            new = LowRankLinear.from_factors(u, v, lin.bias, dtype=w.dtype)
            with torch.no_grad():
                err = (torch.linalg.matrix_norm(w.float() - u @ v) / torch.linalg.matrix_norm(w.float())).item()
            out[name] = (new, {"rank": r, "rel_error": round(err, 6)})
        return out
