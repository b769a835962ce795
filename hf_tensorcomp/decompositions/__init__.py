"""The math, free of transformers."""
from . import hadamard, tensor_networks
from .cp_tucker import CP, Tucker, cp_als, tucker_hooi
from .svd import relative_error, truncated_svd
from .tensor_networks import TensorNetwork

__all__ = ["CP", "hadamard", "TensorNetwork", "Tucker", "cp_als", "relative_error", "truncated_svd", "tucker_hooi"]
