from .base import LAYER_TYPES, FactorizedModule, build_from_spec, layer_build_order, register_layer
from .block_hadamard import BlockHadamardLinear
from .einsort_linear import EinSortLinear
from .embedding import QuantizedEmbedding, QuantizedHead
from .gated_deltanet import GatedDeltaNetAttention
from .head_tucker import HeadTuckerFactors, HeadTuckerProjection
from .lowrank import LowRankLinear
from .qlr import QuantizedLowRankLinear
from .rotor import RotorLinear
from .tensor_slice import SharedFactors, TensorSlice

__all__ = ["LAYER_TYPES", "BlockHadamardLinear", "EinSortLinear", "FactorizedModule", "GatedDeltaNetAttention", "HeadTuckerFactors", "HeadTuckerProjection", "LowRankLinear", "QuantizedEmbedding", "QuantizedHead", "QuantizedLowRankLinear", "RotorLinear", "SharedFactors", "TensorSlice", "build_from_spec", "layer_build_order", "register_layer"]
