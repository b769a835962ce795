"""What a model (and its caches) holds in memory: every tensor reachable from it, each storage once.

``model.get_memory_footprint()`` and the state dict count parameters and buffers only; a layer may keep
more (a kernel layout, a cast copy, a cache in a plain attribute). `held_bytes` walks parameters, buffers
and whatever modules' ``__dict__``, lists, tuples, dicts and dataclasses hold, counts tensor subclasses
(optimum-quanto's) by their ``__tensor_flatten__`` parts, and counts each storage once — so that bytes
measured after a `generate` show whatever the forward built and kept.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


def held_bytes(*objects) -> int:
    """Bytes of every tensor storage reachable from `objects` (modules, caches, containers), each once."""
    seen_objects, storages = set(), {}

    def visit(obj, depth=0):
        if obj is None or isinstance(obj, (str, bytes, int, float, bool)) or depth > 64 or id(obj) in seen_objects:
            return
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if hasattr(obj, "__tensor_flatten__") and type(obj) not in (torch.Tensor, nn.Parameter):  # a subclass
                for name in obj.__tensor_flatten__()[0]:
                    visit(getattr(obj, name), depth + 1)
                return
            if obj.device.type == "meta":
                return
            storage = obj.untyped_storage()
            storages[(obj.device, storage.data_ptr())] = storage.nbytes()
            return
        if isinstance(obj, nn.Module):
            for child in (obj._parameters, obj._buffers, obj._modules):
                visit(child, depth + 1)
            visit({k: v for k, v in obj.__dict__.items() if k not in ("_parameters", "_buffers", "_modules")}, depth + 1)
            return
        if isinstance(obj, dict):
            for v in obj.values():
                visit(v, depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                visit(v, depth + 1)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                visit(getattr(obj, f.name, None), depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__.split(".")[0] in (
                "hf_tensorcomp", "transformers", "optimum"):  # caches, kernels, hooks: their attributes
            visit(vars(obj), depth + 1)

    for o in objects:
        visit(o)
    return sum(storages.values())


__all__ = ["held_bytes"]
