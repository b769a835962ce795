"""hf_tensorcomp: tensor and structured compression for transformers models, loaded like a quantizer.

    import hf_tensorcomp
    cfg = hf_tensorcomp.TensorCompressionConfig(method="laser", rank=0.25, targets=["mlp.*"], layers=[-1])
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg)
"""

from . import assets, hybrid
from .config import TensorCompressionConfig
from .convert import convert_gguf
from .healing import heal
from .integration import AutoModelForCausalLM, TensorCompQuantizer, compress
from .integration.export import export
from .integration.hub import model_card, push_to_hub, write_model_card
from .layers import LowRankLinear
from .methods.einsort import EinSortCache
from .streaming import compress_checkpoint

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

__all__ = ["TensorCompressionConfig", "compress", "compress_checkpoint", "convert_gguf", "export", "heal", "EinSortCache", "AutoModelForCausalLM", "TensorCompQuantizer", "LowRankLinear", "model_card",
           "push_to_hub", "write_model_card", "__version__"]
