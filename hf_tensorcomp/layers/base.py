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
    #: modules with a lower order are rebuilt first on reload (containers of shared factors: -1)
    build_order: int = 0

    def spec(self) -> dict:
        raise NotImplementedError

    @classmethod
    def from_spec(cls, spec: dict, dtype: torch.dtype | None = None, root: nn.Module | None = None) -> "FactorizedModule":
        """Empty module with the layout of `spec`; `root` (the model) resolves references to shared factors."""
        raise NotImplementedError

    def dense_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def to_dense(self) -> nn.Module | None:
        """An ordinary ``nn.Linear`` computing the same function (what `mode="dense"` writes).

        Containers of shared factors override this to return None: dense mode drops them.
        """
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        dtype=self.weight.dtype, device=self.weight.device)
        with torch.no_grad():
            lin.weight.copy_(self.dense_weight())
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin


def _layer_class(spec: dict) -> type[FactorizedModule]:
    kind = spec.get("layer")
    if kind not in LAYER_TYPES:
        raise ValueError(
            f"compressed_modules: unknown layer type {kind!r}; allowed: {sorted(LAYER_TYPES)} "
            "(was the checkpoint written by a newer hf_tensorcomp?)"
        )
    return LAYER_TYPES[kind]


def layer_build_order(spec: dict) -> int:
    return _layer_class(spec).build_order


def build_from_spec(spec: dict, dtype: torch.dtype | None = None, root: nn.Module | None = None) -> FactorizedModule:
    return _layer_class(spec).from_spec(spec, dtype=dtype, root=root)
