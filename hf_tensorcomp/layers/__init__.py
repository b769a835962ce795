"""Factored layers shared by several methods, and the registry of every layer type (`LAYER_TYPES`: a saved
spec's ``layer`` name -> its class). A layer of one method alone lives in that method's package
(`methods.einsort.layer`, `methods.qlr.layer`, `methods.rotor.layer`) and registers itself when
`hf_tensorcomp.methods` is imported, which ``import hf_tensorcomp`` does."""

from .base import LAYER_TYPES, FactorizedModule, build_from_spec, layer_build_order, register_layer
from .block_hadamard import BlockHadamardLinear
from .embedding import QuantizedEmbedding, QuantizedHead
from .gated_deltanet import GatedDeltaNetAttention
from .head_tucker import HeadTuckerFactors, HeadTuckerProjection
from .lowrank import LowRankLinear
from .tensor_slice import SharedFactors, TensorSlice

__all__ = ["LAYER_TYPES", "BlockHadamardLinear", "FactorizedModule", "GatedDeltaNetAttention", "HeadTuckerFactors", "HeadTuckerProjection", "LowRankLinear", "QuantizedEmbedding", "QuantizedHead", "SharedFactors", "TensorSlice", "build_from_spec", "layer_build_order", "register_layer"]
