"""The transformers glue. Nothing else in hf_tensorcomp imports transformers internals."""
from .quantizer import TensorCompQuantizer
from .auto import AutoModelForCausalLM

__all__ = ["TensorCompQuantizer", "AutoModelForCausalLM"]
