"""The math, free of transformers."""
from . import einsort, tensor_networks
from .cp_tucker import CP, Tucker, cp_als, tucker_hooi
from .einsort import EinSortTensor
from .svd import relative_error, truncated_svd
from .tensor_networks import TensorNetwork

__all__ = ["CP", "EinSortTensor", "TensorNetwork", "Tucker", "cp_als", "einsort", "relative_error", "truncated_svd", "tucker_hooi"]
