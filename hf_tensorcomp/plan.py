"""What a config will do to a model: its decoder-layer list, and the units of modules each entry compresses.

The bottom of the pipeline: reads the model's structure (it may be on the meta device) and the
config, touches no weight. `plan` validates every entry against the model before any work starts.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from .config import TensorCompressionConfig
from .layers import FactorizedModule
from .methods import get_method
from .layout import find_decoder_layers, resolve_layers  # noqa: F401 - the plan's callers use them from here too
from .methods.base import Context


def model_context(model: nn.Module) -> Context:
    prefix, layer_list = find_decoder_layers(model)
    cfg = model.config.get_text_config() if hasattr(model, "config") else None
    return Context(config=cfg, prefix=prefix, n_layers=len(layer_list))


def plan(model: nn.Module, config: TensorCompressionConfig, check_units: bool = True) -> list[tuple[int, list[str]]]:
    """Validate every entry against the (possibly meta) model and list the work.

    Returns ``[(entry index, [module names relative to the layer list, e.g. "3.mlp.up_proj"]), ...]``,
    one item per unit of layers. Raises ValueError, naming the field, before any weight is touched.
    """
    prefix, layer_list = find_decoder_layers(model)
    ctx = model_context(model)
    claimed: dict[str, int] = {}
    work = []
    for k, entry in enumerate(config.entries):
        method = get_method(entry.method)
        matched_any = {t: False for t in entry.targets}
        per_layer: dict[int, list[str]] = {}
        done: list[str] = []
        for li in resolve_layers(entry.layers, len(layer_list)):
            factored = [n for n, m in layer_list[li].named_modules() if isinstance(m, FactorizedModule)]
            for name, mod in layer_list[li].named_modules():
                hits = [t for t in entry.targets if name and fnmatch.fnmatchcase(name, t)]
                if hits and not method.structural and any(name == f or name.startswith(f + ".") for f in factored):
                    done.append(f"{prefix}.{li}.{name}")
                    continue
                if not hits or not method.is_target(mod):
                    continue
                for t in hits:
                    matched_any[t] = True
                full = f"{prefix}.{li}.{name}"
                if full in claimed:
                    raise ValueError(
                        f"TensorCompressionConfig.entries: entries {claimed[full]} and {k} both target {full}; "
                        "allowed: each module in at most one entry"
                    )
                claimed[full] = k
                per_layer.setdefault(li, []).append(f"{li}.{name}")
        if done:  # what a compression made is not compressed again: refused before anything changes
            raise ValueError(
                f"TensorCompressionConfig.targets: {entry.targets} reach {len(done)} module(s) already compressed by "
                f"hf_tensorcomp (e.g. {done[:3]}); allowed: modules that are still dense (narrow targets= or layers=); "
                "compressing a compressed module again is not supported")
        missing = [t for t, hit in matched_any.items() if not hit]
        if missing and method.no_target_error is not None and not any(matched_any.values()):
            raise ValueError(method.no_target_error)
        if missing:
            sample = sorted({n for n, m in layer_list[0].named_modules() if n and isinstance(m, method.target_types)})
            raise ValueError(
                f"TensorCompressionConfig.targets: pattern(s) {missing} match no {'/'.join(t.__name__ for t in method.target_types)} "
                f"module in the chosen layers; allowed: fnmatch patterns over names such as {sample}"
            )
        for unit in method.units(entry, sorted(per_layer), len(layer_list)):
            names = [n for li in unit for n in per_layer[li]]
            if check_units:
                method.check_unit({n: layer_list.get_submodule(n) for n in names}, entry, ctx)
            work.append((k, names))
    return work
