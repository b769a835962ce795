"""Module replacement: put a compressed module in a model, list the factored ones, rebuild a saved skeleton.

Plain torch, and nothing else: finding what to compress is `hf_tensorcomp.plan`, running the
compression is `hf_tensorcomp.pipeline`. Works on any model whose decoder layers sit in one
``nn.ModuleList`` named ``...layers`` (Llama, Qwen, Gemma, Mistral, Phi, GPT-NeoX and most others).
"""

from __future__ import annotations

import torch
from torch import nn

from . import checks
from .config import TensorCompressionConfig
from .layers import FactorizedModule, build_from_spec, layer_build_order
from .plan import plan


def set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def factored_specs(model: nn.Module) -> dict[str, dict]:
    return {name: m.full_spec() for name, m in model.named_modules() if isinstance(m, FactorizedModule)}


def build_skeleton(model: nn.Module, config: TensorCompressionConfig, dtype: torch.dtype | None = None) -> None:
    """Replace modules by empty factored ones (on the meta device) as recorded in the saved config.

    Every spec is checked first against the model and the config's entries (`checks.check_specs`):
    only modules a method could have written, with the fields and rules of that method.
    """
    checks.check_specs(model, config, plan(model, config, check_units=False))
    specs = sorted(config.compressed_modules.items(), key=lambda kv: layer_build_order(kv[1]))
    for name, spec in specs:
        try:
            # a module the compression added (shared factors) needs only its parent to exist
            model.get_submodule(name.rpartition(".")[0] if spec.get("new") else name)
            old = None if spec.get("new") else model.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"compressed_modules: the checkpoint names module {name!r}, which this model does not have; "
                "the config.json and the model architecture do not match"
            ) from None
        for dim in ("in_features", "out_features"):
            if dim in spec and hasattr(old, dim) and getattr(old, dim) != spec[dim]:
                raise ValueError(
                    f"compressed_modules[{name!r}].{dim}: checkpoint says {spec[dim]}, model has {getattr(old, dim)}; "
                    "the config.json and the model architecture do not match"
                )
        old_w = getattr(old, "weight", None)
        dt = dtype or (old_w.dtype if old_w is not None else next(model.parameters()).dtype)
        with torch.device("meta"):
            new = build_from_spec(spec, dtype=dt, root=model, name=name)
            for factor, q in spec.get("quant", {}).items():
                if factor not in new.quantizable():
                    raise ValueError(f"compressed_modules[{name!r}].quant: names {factor!r}, not a factor of this "
                                     f"layer (allowed: {new.quantizable()}); the checkpoint's config.json is corrupt or edited")
                new.quantize_factors(q["bits"], q["group_size"], [factor])
        for dim in ("in_features", "out_features"):
            if old is not None and hasattr(old, dim) and getattr(new, dim) != getattr(old, dim):
                raise ValueError(f"compressed_modules[{name!r}]: builds a module with {dim}={getattr(new, dim)}, the model's "
                                 f"has {getattr(old, dim)}; the checkpoint's config.json is corrupt or edited")
        set_module(model, name, new)
    checks.check_references(model, config.compressed_modules)
