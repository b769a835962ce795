"""`hf_tensorcomp.AutoModelForCausalLM`: the design card's spelling, ``compression_config=``.

It only renames the argument to transformers' own ``quantization_config=`` and calls the stock
``transformers.AutoModelForCausalLM``; the returned model is an ordinary transformers model.
"""

from __future__ import annotations

import transformers


class AutoModelForCausalLM:
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, compression_config=None, **kwargs):
        if compression_config is not None:
            if kwargs.get("quantization_config") is not None:
                raise ValueError("pass either compression_config= or quantization_config=, not both")
            kwargs["quantization_config"] = compression_config
        return transformers.AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
