"""The weight-only quantization peers a user would pick instead of compressing, for side-by-side reports.

optimum-quanto (``pip install "hf_tensorcomp[quanto]"``): int8 per output channel or int4 in groups of
128, every linear of the decoder layers (the embeddings and the head stay as they are, as a tied head
must); activations stay in float.
"""

from __future__ import annotations

import os

import torch
from torch import nn

QUANTO_BITS = (8, 4)


def quanto_weight_only(model: nn.Module, bits: int) -> nn.Module:
    """Quantize `model`'s decoder-layer linears in place with optimum-quanto at `bits` (8 | 4) and return it.

    Its forward then runs under ``no_grad`` outside inference mode: quanto's int4 weights fail inside it
    ("Cannot set version_counter for inference tensor"), and perplexity and generate use it."""
    if bits not in QUANTO_BITS:
        raise ValueError(f"quanto_weight_only: bits: got {bits!r}; allowed: 8 | 4")
    quanto = import_quanto()
    from ..plan import find_decoder_layers

    _, layers = find_decoder_layers(model)
    quanto.quantize(layers, weights={8: quanto.qint8, 4: quanto.qint4}[bits])
    quanto.freeze(layers)
    without_inference_mode(model)
    return model


def import_quanto():
    """``optimum.quanto``, or an ImportError saying how to install it.

    quanto imports torch's cpp_extension, which imports setuptools; in a process where the standard library's
    distutils was imported first, setuptools' distutils override then fails an assertion (seen in full test runs,
    from the CLI's ``--peers`` as from here): keep the standard library's, which quanto's CPU path never uses."""
    os.environ.setdefault("SETUPTOOLS_USE_DISTUTILS", "stdlib")
    try:
        from optimum import quanto
    except ImportError:
        raise ImportError("the quanto peer needs optimum-quanto: pip install \"hf_tensorcomp[quanto]\"") from None
    return quanto


def without_inference_mode(model: nn.Module) -> None:
    """Run `model`'s forward under ``no_grad`` outside inference mode (quanto's int4 weights fail inside it)."""
    forward = model.forward

    def run(*args, **kwargs):
        with torch.inference_mode(False), torch.no_grad():
            return forward(*args, **kwargs)

    model.forward = run


def stored_bytes(model: nn.Module) -> int:
    """Bytes of every tensor in the state dict as held: quantized tensor subclasses (optimum-quanto) by their
    stored parts (data, scales, shifts), tied tensors once."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if hasattr(t, "__tensor_flatten__"):
            for name in t.__tensor_flatten__()[0]:
                add(getattr(t, name))
        elif t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.numel() * t.element_size()

    for t in model.state_dict().values():
        add(t)
    return total


__all__ = ["QUANTO_BITS", "quanto_weight_only", "stored_bytes", "without_inference_mode"]
