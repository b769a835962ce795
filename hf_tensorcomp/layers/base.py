"""Base class and registry for the modules that run compressed weights in factored form.

Every factored module:
- describes its own layout with `spec()` (a JSON-able dict saved in the config), and can be rebuilt
  empty from that spec with `from_spec()` (under the meta device on reload: no dense weight made);
- can rebuild the dense weight it stands for with `dense_weight()` (only for `mode="dense"`, LoRA
  merging and tests: the forward never does);
- keeps at least one tensor under the replaced module's dense parameter name (`weight`) with a shape
  that cannot equal the dense one. Loading such a checkpoint without hf_tensorcomp therefore stops
  with transformers' size-mismatch error instead of silently random-initialising the dense weights.
"""

from __future__ import annotations

import torch
from torch import nn

LAYER_TYPES: dict[str, type["FactorizedModule"]] = {}


def register_layer(cls):
    LAYER_TYPES[cls.layer_type] = cls
    return cls


class FactorizedModule(nn.Module):
    layer_type: str = ""

    def spec(self) -> dict:
        raise NotImplementedError

    @classmethod
    def from_spec(cls, spec: dict, dtype: torch.dtype | None = None) -> "FactorizedModule":
        raise NotImplementedError

    def dense_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def to_dense(self) -> nn.Module:
        """An ordinary module computing the same function (what `mode="dense"` writes)."""
        raise NotImplementedError


def build_from_spec(spec: dict, dtype: torch.dtype | None = None) -> FactorizedModule:
    kind = spec.get("layer")
    if kind not in LAYER_TYPES:
        raise ValueError(
            f"compressed_modules: unknown layer type {kind!r}; allowed: {sorted(LAYER_TYPES)} "
            "(was the checkpoint written by a newer hf_tensorcomp?)"
        )
    return LAYER_TYPES[kind].from_spec(spec, dtype=dtype)
