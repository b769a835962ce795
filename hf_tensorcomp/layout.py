"""Where a transformers model keeps its decoder layers (no dependency on the rest of the package)."""

from __future__ import annotations

from torch import nn


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.split(".")[-1] == "layers" and len(mod) > 0:
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise ValueError(
            f"{type(model).__name__}: no decoder-layer list (an nn.ModuleList named '...layers') found; "
            "hf_tensorcomp supports decoder-only transformers models such as Llama, Qwen3 and Gemma3"
        )
    return best
