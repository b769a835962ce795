"""Calibration: real activations, layer by layer, for the methods that need data."""

from .data import BUNDLED, calibration_ids, describe, validate_calibration
from .pipeline import LayerwiseRunner
from .stats import KINDS, ModuleStats

__all__ = ["BUNDLED", "KINDS", "LayerwiseRunner", "ModuleStats", "calibration_ids", "describe", "validate_calibration"]
