"""Compression methods. Each one is a `Method` subclass registered by name, in its own file — or, when its code
has parts besides the replacer, in its own package: `einsort/`, `qlr/`, `rotor/` (``method.py`` the replacer,
``layer.py`` its module, ``decomposition.py`` its own math, and for EinSort the KV cache)."""

from .base import METHODS, Method, attach, get_method, register_method
from . import einsort, laser, latent_kv, linearize, qlr, rotor, state_reduction, tensorllm, trawl  # noqa: F401  (register each by name)

__all__ = ["METHODS", "Method", "attach", "get_method", "register_method"]
