"""A model's ``save_pretrained`` made atomic (`make_save_atomic`, called by the quantizer for every model it
compresses or reloads): written to a temporary sibling folder by `hf_tensorcomp.atomic.atomic_dir` and swapped into
place, by rank 0 alone in a distributed run, refused over the checkpoint the model was compressed from or with
unmerged LoRA layers injected."""

from __future__ import annotations

import os
import sys
import types

from ..atomic import atomic_dir, refuse_overlap


def unmerged_lora_layers(model) -> list[str]:
    """Names of the PEFT LoRA layers injected in `model` and not merged (a state dict no loader expects)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [n for n, m in model.named_modules() if isinstance(m, BaseTunerLayer) and not m.merged]


def save_pretrained(self, save_directory, *args, **kwargs):
    """``save_pretrained`` written to a temporary sibling folder and swapped into place (see `atomic_dir`); in a
    distributed run (`hf_tensorcomp.distributed`), by rank 0 alone (the other ranks hold the same model)."""
    from ..distributed import is_main

    save = type(self).save_pretrained
    if not is_main():
        return None
    if "peft" in sys.modules:  # an injected, unmerged adapter would be saved as base weights no loader expects
        layers = unmerged_lora_layers(self)
        if layers:
            raise ValueError(
                f"save_pretrained: {len(layers)} unmerged LoRA layers are injected in this model (e.g. {layers[0]}); "
                "allowed: peft_model.merge_and_unload() first (LASER layers absorb the adapter), or "
                "peft_model.save_pretrained(dir) to save the adapter the PEFT way (reload it with "
                "hf_tensorcomp.integration.peft.load_lora); nothing was written")
    record = getattr(getattr(self, "config", None), "quantization_config", None)
    source = (getattr(record, "stats", None) or {}).get("source")
    if source and os.path.isdir(source):  # never over its own input (heal's default teacher)
        refuse_overlap(save_directory, [source], "save_pretrained", "the dense checkpoint this model was compressed from:")
    if os.path.isfile(save_directory):
        return save(self, save_directory, *args, **kwargs)  # transformers' own error
    with atomic_dir(save_directory, overwrite=True) as tmp:
        return save(self, tmp, *args, **kwargs)


def make_save_atomic(model) -> None:
    """Route ``model.save_pretrained`` through `atomic_dir` (a bound method: survives deepcopy and pickle)."""
    model.save_pretrained = types.MethodType(save_pretrained, model)
