"""The weight-only quantization peers a user would pick instead of compressing, for side-by-side reports.

optimum-quanto (``pip install "hf_tensorcomp[quanto]"``): int8 per output channel or int4 in groups of
128, every linear of the decoder layers (the embeddings and the head stay as they are, as a tied head
must); activations stay in float.
"""

from __future__ import annotations

import math
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
    from ..layout import find_decoder_layers

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


def stored_bytes(model: nn.Module, float_bytes: int | None = None) -> int:
    """Bytes of every tensor in the state dict as held: quantized tensor subclasses (optimum-quanto) by their
    stored parts (data, scales, shifts), tied tensors once. `float_bytes` (e.g. 2): floating tensors counted
    at that many bytes a value instead (a dense model's size in bfloat16, without casting it)."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if hasattr(t, "__tensor_flatten__"):
            for name in t.__tensor_flatten__()[0]:
                add(getattr(t, name))
        elif t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.numel() * (float_bytes if float_bytes and t.is_floating_point() else t.element_size())

    for t in model.state_dict().values():
        add(t)
    return total


def stored_values(model: nn.Module) -> int:
    """Numbers the model stores, each once: every value of a float tensor, every integer code of a quantized
    weight (one per weight it stands for, however many share a byte), every scale, zero point and other
    buffer of the state dict; tied tensors once. ``num_parameters()`` misses quantized codes (they are
    buffers): a model quantized to 4 bits "has" a few scales and biases, while it stores as many values as
    before, in fewer bytes. optimum-quanto's tensors count their logical size plus their scales and shifts."""
    from ..layers.base import FactorizedModule

    codes = {}  # a packed code buffer's state-dict name -> the weights it stands for
    for mname, m in model.named_modules():
        if isinstance(m, FactorizedModule):
            for name in m.quantized_names():
                codes[f"{mname}.{name}" if mname else name] = math.prod(m.qspec(name)[2])
    seen, total = set(), 0
    for key, t in model.state_dict().items():
        ident = (t.data_ptr(), t.numel(), t.dtype)
        if ident in seen:
            continue
        seen.add(ident)
        if hasattr(t, "__tensor_flatten__"):  # quanto: the logical tensor, plus its scales / shifts
            total += t.numel() + sum(getattr(t, n).numel() for n in t.__tensor_flatten__()[0] if n != "_data")
        else:
            total += codes.get(key, t.numel())
    return total


__all__ = ["QUANTO_BITS", "quanto_weight_only", "stored_bytes", "stored_values", "without_inference_mode"]
