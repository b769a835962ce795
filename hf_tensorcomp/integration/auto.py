"""`hf_tensorcomp.AutoModelForCausalLM`: the design card's spelling, ``compression_config=``.

It renames the argument to transformers' own ``quantization_config=`` and calls the stock
``transformers.AutoModelForCausalLM``; the returned model is an ordinary transformers model. One
difference: a checkpoint that is itself a hf_tensorcomp model (transformers would keep its saved
config and ignore the new one) is loaded as it is and then compressed further (`compress`).
"""

from __future__ import annotations

import transformers

from ..config import QUANT_METHOD

_CONFIG_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "trust_remote_code", "subfolder")


class AutoModelForCausalLM:
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, compression_config=None, **kwargs):
        if compression_config is None:
            return transformers.AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        if kwargs.get("quantization_config") is not None:
            raise ValueError("pass either compression_config= or quantization_config=, not both")
        saved = transformers.AutoConfig.from_pretrained(
            pretrained_model_name_or_path, **{k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs})
        held = getattr(saved, "quantization_config", None)
        method = held.get("quant_method") if isinstance(held, dict) else getattr(held, "quant_method", None)
        if method == QUANT_METHOD:
            from .quantizer import compress

            model = transformers.AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
            return compress(model, compression_config)
        kwargs["quantization_config"] = compression_config
        return transformers.AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
