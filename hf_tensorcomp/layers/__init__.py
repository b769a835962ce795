from .base import LAYER_TYPES, FactorizedModule, build_from_spec, register_layer
from .lowrank import LowRankLinear

__all__ = ["LAYER_TYPES", "FactorizedModule", "LowRankLinear", "build_from_spec", "register_layer"]
