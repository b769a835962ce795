"""The shape every method has: find targets in a layer → compress them → replacement modules.

Reload does not come through here: replaced modules describe themselves (`FactorizedModule.spec`)
and are rebuilt from the saved config by `hf_tensorcomp.model_surgery.build_skeleton`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

METHODS: dict[str, "Method"] = {}


def register_method(cls):
    METHODS[cls.name] = cls()
    return cls


def get_method(name: Any) -> "Method":
    if name not in METHODS:
        raise ValueError(f"TensorCompressionConfig.method: got {name!r}; allowed: {' | '.join(map(repr, sorted(METHODS)))}")
    return METHODS[name]


class Method:
    name: str = ""
    default_targets: tuple[str, ...] = ()
    default_rank: int | float | None = None
    uses_rank: bool = True
    #: method-specific options and their defaults; `validate_options` rejects anything else
    option_defaults: dict[str, Any] = {}
    #: module types this method can replace (leaf modules matched by `targets`)
    target_types: tuple[type, ...] = (nn.Linear,)

    def validate_options(self, options: dict) -> dict:
        unknown = sorted(set(options) - set(self.option_defaults))
        if unknown:
            allowed = sorted(self.option_defaults) or "none"
            raise ValueError(f"TensorCompressionConfig: unknown option(s) {unknown} for method {self.name!r}; allowed: {allowed}")
        out = dict(self.option_defaults)
        out.update(options)
        return out

    def check_target(self, name: str, module: nn.Module, entry) -> None:
        """Raise ValueError if `entry` cannot be applied to `module` (called on the meta model, before loading)."""

    def compress_layer(self, modules: dict[str, nn.Module], entry) -> dict[str, tuple[nn.Module, dict]]:
        """Compress the targeted modules of one decoder layer.

        `modules` maps names relative to the layer to modules with loaded weights. Returns, per name,
        the replacement module (factored) and a stats dict (at least ``rel_error``).
        """
        raise NotImplementedError
