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


def _is_int(x, lo: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


#: what a spec field may hold: (test, allowed text for the error)
FIELD_KINDS = {
    "int>=1": (lambda x: _is_int(x, 1), "an int >= 1"),
    "int>=0": (lambda x: _is_int(x, 0), "an int >= 0"),
    "bool": (lambda x: isinstance(x, bool), "true | false"),
    "str": (lambda x: isinstance(x, str) and bool(x), "a module name"),
    "ints>=1": (lambda x: isinstance(x, list) and bool(x) and all(_is_int(i, 1) for i in x), "a list of ints >= 1"),
    "dict": (lambda x: isinstance(x, dict), "a dict"),
    "number>0": (lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0, "a number > 0"),
}


class FactorizedModule(nn.Module):
    layer_type: str = ""
    #: modules with a lower order are rebuilt first on reload (containers of shared factors: -1)
    build_order: int = 0
    #: the fields `spec()` writes and their kinds (`FIELD_KINDS`), or a tuple of allowed values
    spec_fields: dict = {}
    #: True when the module keeps its tensors in child modules (checked recursively on reload)
    nested: bool = False

    @classmethod
    def check_spec(cls, name: str, spec: dict) -> None:
        """Raise ValueError naming the module and field if `spec` is not one this class writes."""
        if not isinstance(spec, dict):
            raise ValueError(f"compressed_modules[{name!r}]: got {spec!r}; allowed: a dict written by hf_tensorcomp")
        unknown = sorted(set(spec) - set(cls.spec_fields) - {"layer", "new"})
        if unknown:
            raise ValueError(f"compressed_modules[{name!r}]: unknown field(s) {unknown} for layer {cls.layer_type!r}; "
                             f"allowed: {sorted(cls.spec_fields)}")
        for field, kind in cls.spec_fields.items():
            if field not in spec:
                raise ValueError(f"compressed_modules[{name!r}].{field}: missing; the checkpoint's config.json is "
                                 f"incomplete or edited (layer {cls.layer_type!r} needs {sorted(cls.spec_fields)})")
            value = spec[field]
            ok, allowed = (value in kind, " | ".join(map(repr, kind))) if isinstance(kind, tuple) else \
                (FIELD_KINDS[kind][0](value), FIELD_KINDS[kind][1])
            if not ok:
                raise ValueError(f"compressed_modules[{name!r}].{field}: got {value!r}; allowed: {allowed}")
        if spec.get("new", False) is not (cls.build_order < 0):
            raise ValueError(f"compressed_modules[{name!r}].new: got {spec.get('new')!r}; allowed: "
                             f"{cls.build_order < 0} for layer {cls.layer_type!r}")

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
    kind = spec.get("layer") if isinstance(spec, dict) else None
    if kind not in LAYER_TYPES:
        raise ValueError(
            f"compressed_modules: unknown layer type {kind!r}; allowed: {sorted(LAYER_TYPES)} "
            "(was the checkpoint written by a newer hf_tensorcomp?)"
        )
    return LAYER_TYPES[kind]


def layer_build_order(spec: dict) -> int:
    return _layer_class(spec).build_order


def build_from_spec(spec: dict, dtype: torch.dtype | None = None, root: nn.Module | None = None,
                    name: str = "?") -> FactorizedModule:
    """The one way a saved spec becomes a module: checked (`check_spec`), then built empty."""
    cls = _layer_class(spec)
    cls.check_spec(name, spec)
    return cls.from_spec(spec, dtype=dtype, root=root)
