"""The math, free of transformers."""
from .cp_tucker import CP, Tucker, cp_als, tucker_hooi
from .svd import relative_error, truncated_svd

__all__ = ["CP", "Tucker", "cp_als", "relative_error", "truncated_svd", "tucker_hooi"]
