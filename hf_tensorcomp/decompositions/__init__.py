"""The math, free of transformers."""
from . import clifford, einsort, hadamard, tensor_networks
from .cp_tucker import CP, Tucker, cp_als, tucker_hooi
from .einsort import EinSortTensor
from .svd import relative_error, truncated_svd
from .tensor_networks import TensorNetwork

__all__ = ["CP", "clifford", "hadamard", "EinSortTensor", "TensorNetwork", "Tucker", "cp_als", "einsort", "relative_error", "truncated_svd", "tucker_hooi"]
