"""Compression methods. Each one is a `Method` subclass in its own file, registered by name."""

from .base import METHODS, Method, get_method, register_method
from . import laser, trawl  # noqa: F401  (register "laser", "trawl")

__all__ = ["METHODS", "Method", "get_method", "register_method"]
