"""The math, free of transformers."""
from .svd import truncated_svd

__all__ = ["truncated_svd"]
