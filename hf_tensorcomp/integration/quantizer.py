"""`TensorCompQuantizer`: runs compression at load time, the way transformers runs a quantizer.

Hook order in ``from_pretrained`` (transformers 5.23): validate_environment → model built on meta →
`_process_model_before_weight_loading` → weights load → dispatch → `_process_model_after_weight_loading`.

- Compressing a dense checkpoint (``pre_quantized=False``): the plan is validated on the meta model
  (bad layers / targets / ranks fail before any weight loads); the dense weights load; then each
  chosen decoder layer is compressed in turn.
- Reloading a compressed checkpoint (``pre_quantized=True``, the config came from config.json):
  the factored modules are built empty on meta from ``compressed_modules``; the factors then load
  straight into them. No dense weight of a compressed module is ever created.
"""

from __future__ import annotations

from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer

from .. import checks, pipeline, surgery
from ..plan import plan
from .saving import make_save_atomic
from ..config import QUANT_METHOD, TensorCompressionConfig
from ..layers import FactorizedModule
from ..methods import attach
from ..layers.base import hold_kernels
from ..methods import get_method

register_quantization_config(QUANT_METHOD)(TensorCompressionConfig)

_OFFLOAD = ("cpu", "disk", "meta")
_BUFFERED = ("einsort_linear",)  # layers whose forward reads integer buffers (permutations, pivots, signs)


def _is_offloaded(device_map) -> bool:
    """True when a device map puts some modules on an accelerator and others on cpu/disk (offload)."""
    if not isinstance(device_map, dict):
        return False
    values = {str(v) for v in device_map.values()}
    return "disk" in values or (bool(values & {"cpu", "meta"}) and bool(values - set(_OFFLOAD)))


@register_quantizer(QUANT_METHOD)
class TensorCompQuantizer(HfQuantizer):
    requires_calibration = False

    def validate_environment(self, device_map=None, **kwargs):
        if self.pre_quantized and _is_offloaded(device_map):
            specs = self.quantization_config.compressed_modules.values()
            kinds = sorted({sp.get("layer") for sp in specs if isinstance(sp, dict)
                            and (sp.get("new") or sp.get("quant") or sp.get("layer") in _BUFFERED)})
            if kinds:
                raise ValueError(
                    f"hf_tensorcomp: device_map offloads part of the model, and this checkpoint holds {kinds} layers "
                    "(factors shared across modules, or codes and indices kept as buffers), which accelerate's offload "
                    "hooks would not bring back before they are read: the outputs would be wrong. Allowed: a device "
                    "map without offload (device_map=None, 'auto' that fits, or one kind of device)")
        if not self.pre_quantized and _is_offloaded(device_map):
            raise ValueError(
                "hf_tensorcomp: device_map offloads part of the model to cpu/disk; compressing at load time with "
                "offload gives wrong results (accelerate dispatches before compression). Allowed: device_map=None, "
                "'auto' without offload, or a map onto one kind of device. Compress first, save, then reload with offload."
            )

    def _process_model_before_weight_loading(self, model, **kwargs):
        if self.pre_quantized:
            surgery.build_skeleton(model, self.quantization_config)
            files = kwargs.get("checkpoint_files")
            self._files = checks.checkpoint_identity(self.quantization_config, files)  # before the headers are read
            checks.check_checkpoint_tensors(model, self.quantization_config.compressed_modules, files)
        else:
            self._work = plan(model, self.quantization_config)
            checks.read_headers(kwargs.get("checkpoint_files"))  # a truncated shard: one line naming it, before loading
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        make_save_atomic(model)  # save_pretrained writes a temporary folder and swaps it in
        if self.pre_quantized:
            checks.check_unchanged(getattr(self, "_files", {}))  # no other save's files read meanwhile
            checks.check_loaded(model)  # factors finite, EinSort indices and LASER pivots valid
            _own_aligned_memory(model)
            hold_kernels(model)  # quantized factors in the layout their product reads, in place of the packed codes
            attach(model)  # each method's run-time wiring: shared input rotations, the latent attention and cache
        else:
            if _is_offloaded(getattr(model, "hf_device_map", None)):
                self.validate_environment(device_map=model.hf_device_map)
            _compressed(model, self.quantization_config, getattr(self, "_work", None))
            self.pre_quantized = True  # the model now holds factors: save as such
            if _only_structural(model, self.quantization_config):
                # only structural methods ran (e.g. state reduction): the model is an ordinary, smaller
                # transformers model of its own class and config; drop the quantizer so it saves and
                # reloads with plain transformers
                self.remove_quantization_config(model)
        return model

    def get_state_dict_and_metadata(self, model):
        # called by save_pretrained before config.json is written: record the factors as they are now
        # (a LoRA merge may have grown a rank since compression)
        self.quantization_config.compressed_modules = surgery.factored_specs(model)
        return None, {}

    def is_serializable(self):
        return True

    @property
    def is_trainable(self):
        return True

    @property
    def is_qat_trainable(self):
        return True

    @property
    def is_compileable(self):
        return True


def _own_aligned_memory(model, align: int = 64) -> None:
    """Move the compressed modules' floating parameters that a checkpoint left off a 64-byte boundary
    (safetensors maps each tensor at its offset in the file) into fresh memory.

    CPU kernels take another vectorised path for unaligned operands and round differently: a reloaded
    TensorLLM model's logits moved by 3e-7 from the saved model's until its factors were copied. With
    the copy, a reloaded model computes bitwise what was saved. Each parameter keeps its object (only
    ``.data`` changes), so tied or shared parameters stay tied."""
    for mod in model.modules():
        if isinstance(mod, FactorizedModule):
            for p in mod.parameters(recurse=False):  # a shared one, once moved, is aligned when met again
                if p.device.type == "cpu" and p.is_floating_point() and p.data_ptr() % align:
                    p.data = p.data.clone()


def _compressed(model, cfg: TensorCompressionConfig, work=None) -> None:
    pipeline.compress_model(model, cfg, work)
    model.add_model_tags(["hf_tensorcomp"] + [f"tensorcomp-{e.method}" for e in cfg.entries])
    # the record of this compression, for the session's model card / report (a structural result saves none)
    model.tensorcomp_config, model.tensorcomp_stats = cfg, cfg.stats


def _only_structural(model, cfg: TensorCompressionConfig) -> bool:
    return all(get_method(e.method).structural for e in cfg.entries) and not cfg.compressed_modules


def merged_stats(before: dict, now: dict) -> dict:
    """The stats of a model compressed in several passes: the model as it is after the last one.

    ``params_before`` is the dense model's, ``params_after`` and the other totals the latest pass's;
    ``modules`` holds every compressed module (a later pass's entry wins); ``passes`` counts them.
    """
    if not before:
        return dict(now)
    merged = {**before, **now, "params_before": before.get("params_before", now.get("params_before")),
              "bytes_before": before.get("bytes_before", now.get("bytes_before")),
              "modules": {**before.get("modules", {}), **now.get("modules", {})},
              "compress_seconds": round(before.get("compress_seconds", 0) + now.get("compress_seconds", 0), 3),
              "passes": before.get("passes", 1) + 1}
    return merged


def compress(model, config: TensorCompressionConfig):
    """Compress an already loaded model in place and return it: what ``from_pretrained(...,
    quantization_config=config)`` does at load time, for a model in hand.

    This is the way to compress a checkpoint that is itself a hf_tensorcomp model (transformers keeps
    the checkpoint's own ``quantization_config`` and ignores one passed to ``from_pretrained``), e.g.
    state reduction on a linearized hybrid::

        model = AutoModelForCausalLM.from_pretrained(hybrid_dir)          # Gated DeltaNet layers rebuilt
        hf_tensorcomp.compress(model, TensorCompressionConfig(method="state_reduction", keep=0.5,
                                                              calibration="wikipedia"))
        model.save_pretrained("out")

    On a model that already carries a hf_tensorcomp config, structural methods (state reduction) only
    reshape its modules, and the saved config records the new shapes; a factoring method adds its entries
    to that config. On a plain model it attaches the quantizer unless only structural methods ran.
    """
    if not isinstance(config, TensorCompressionConfig):
        raise ValueError(f"hf_tensorcomp.compress: config: got {type(config).__name__}; allowed: a TensorCompressionConfig "
                         "(hf_tensorcomp.TensorCompressionConfig(method=..., ...))")
    held = getattr(model, "hf_quantizer", None)
    if held is not None and not isinstance(held, TensorCompQuantizer):
        raise ValueError(f"hf_tensorcomp.compress: the model is quantized with {type(held).__name__}; allowed: a dense "
                         "model or one compressed by hf_tensorcomp")
    _compressed(model, config, plan(model, config))
    if held is not None:
        prior = held.quantization_config
        if not all(get_method(e.method).structural for e in config.entries):
            prior.entries = list(prior.entries) + list(config.entries)
        prior.compressed_modules = surgery.factored_specs(model)
        prior.stats = merged_stats(prior.stats, config.stats)
    elif not _only_structural(model, config):
        quantizer = TensorCompQuantizer(config, pre_quantized=True)
        make_save_atomic(model)
        model.hf_quantizer, model.config.quantization_config = quantizer, config
        model.is_quantized = True
    return model
