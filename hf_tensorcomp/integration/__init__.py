"""The transformers glue. Nothing else in hf_tensorcomp imports transformers internals."""
from .quantizer import TensorCompQuantizer, compress
from .auto import AutoModelForCausalLM

__all__ = ["TensorCompQuantizer", "AutoModelForCausalLM", "compress"]
