"""Compression methods. Each one is a `Method` subclass in its own file, registered by name."""

from .base import METHODS, Method, get_method, register_method
from . import einsort, laser, linearize, qlr, rotor, state_reduction, tensorllm, trawl  # noqa: F401  (register each by name)

__all__ = ["METHODS", "Method", "get_method", "register_method"]
