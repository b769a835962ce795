"""LoRA on factored modules, through PEFT's custom-module mapping.

PEFT only knows its own layer types; a factored module named ``q_proj`` is adapted once the mapping
is registered on the `LoraConfig`. Every factored layer takes LoRA: `LowRankLinear` (LASER),
`TensorSlice` (TRAWL), `HeadTuckerProjection` (TensorLLM) and `EinSortLinear` (EinSort); the
adapter runs beside the layer's own forward. What a user calls::

    from hf_tensorcomp.integration.peft import lora_config, load_lora
    model = get_peft_model(model, lora_config(r=8, target_modules=["q_proj", "v_proj"]))
    ... train ...
    merged = model.merge_and_unload()      # LowRankLinear only: the LoRA factors are appended, the rank grows by r
    merged.save_pretrained("out")          # a compressed checkpoint again; reloads with from_pretrained
    # or keep the adapter separate (every layer type):
    model.save_pretrained("adapter"); model = load_lora(base, "adapter")

Merging never densifies: W = U V plus B A (scaled) is stored as [U | s B] [V ; A], rank r + r_lora.
The other layers cannot absorb B A without densifying (TRAWL and TensorLLM matrices share their
factors with the rest of their group; an EinSort weight is a sorted tensorization), so merging
into them stops with a ValueError; their adapters stay separate.
"""

from __future__ import annotations

import os

import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora.layer import Linear as _LoraLinear

from ..layout import set_tied_embeddings
from ..layers import HeadTuckerProjection, LowRankLinear, QuantizedEmbedding, QuantizedHead, TensorSlice
from ..methods.einsort import EinSortLinear
from ..methods.qlr import QuantizedLowRankLinear


class LoraFactored(_LoraLinear):
    """PEFT's LoRA `Linear` on a factored layer: the adapter's output is added to the layer's own."""

    def _get_in_out_features(self, module):
        return module.in_features, module.out_features  # PEFT warns "unsupported layer type" otherwise

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise ValueError(
            f"LoRA merge: a {type(self.get_base_layer()).__name__} cannot absorb the adapter without densifying; "
            "allowed: merging into LowRankLinear (method 'laser') layers, or keeping the adapter separate "
            "(peft_model.save_pretrained, then hf_tensorcomp.integration.peft.load_lora)"
        )

    def unmerge(self) -> None:
        pass  # nothing is ever merged


class LoraLowRankLinear(LoraFactored):
    """LoRA on a `LowRankLinear` or a `QuantizedLowRankLinear` (its correction), merged in factor space."""

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        from peft.tuners.tuners_utils import check_adapters_to_merge

        base = self.get_base_layer()
        names = [n for n in check_adapters_to_merge(self, adapter_names) if n in self.lora_A]
        for name in names:  # every check before anything changes: a failed merge leaves the layer as it was
            if name in self.lora_variant:
                raise NotImplementedError("hf_tensorcomp: merging LoRA variants (DoRA, ...) into factored layers")
            if self.lora_bias[name] and base.bias is None:
                raise RuntimeError("Impossible to merge LoRA with `lora_bias=True` because the base layer has no bias.")
            if safe_merge and not all(torch.isfinite(t).all() for t in (self.lora_A[name].weight, self.lora_B[name].weight)):
                raise ValueError(f"NaNs detected in the merged weights. The adapter {name} seems to be broken")
        for name in names:
            a = self.lora_A[name].weight
            b = self.lora_B[name].weight * self.scaling[name]
            base.append_factors(b.to(base.weight.dtype), a.to(base.weight.dtype))
            if self.lora_bias[name]:
                base.bias.data += self.lora_B[name].bias * self.scaling[name]
            self.merged_adapters.append(name)

    def unmerge(self) -> None:
        base = self.get_base_layer()
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            base.truncate(base.rank - self.lora_A[name].weight.shape[0])
            if self.lora_bias[name]:
                base.bias.data -= self.lora_B[name].bias * self.scaling[name]


CUSTOM_MODULES = {LowRankLinear: LoraLowRankLinear, QuantizedLowRankLinear: LoraLowRankLinear, TensorSlice: LoraFactored, HeadTuckerProjection: LoraFactored,
                  EinSortLinear: LoraFactored}


def register(config: LoraConfig) -> LoraConfig:
    """Register hf_tensorcomp's factored layers on a `LoraConfig` (returns it)."""
    config._register_custom_module(CUSTOM_MODULES)
    return config


def lora_config(**kwargs) -> LoraConfig:
    """`LoraConfig(**kwargs)` that can target factored modules by their usual names."""
    return register(LoraConfig(**kwargs))


def load_lora(model, adapter_dir, **kwargs) -> PeftModel:
    """`PeftModel.from_pretrained` for an adapter trained on a compressed model."""
    config = register(LoraConfig.from_pretrained(adapter_dir))
    return PeftModel.from_pretrained(model, adapter_dir, config=config, **kwargs)


def _check_export_folders(model, base_dir, adapter_dir, base_format: str, overwrite: bool) -> None:
    """`export_qlr`'s format and folders refused before anything is written: the two apart from each other and from
    the folder the model was loaded from, each new or empty unless ``overwrite``."""
    from ..atomic import refuse_overlap

    formats = ("dequantized", "compressed-tensors")
    if base_format not in formats:
        raise ValueError(f"export_qlr: base_format: got {base_format!r}; allowed: {' | '.join(map(repr, formats))}")
    loaded_from = getattr(model, "name_or_path", None)
    loaded_from = loaded_from if loaded_from and os.path.isdir(loaded_from) else None
    refuse_overlap(base_dir, [loaded_from], "export_qlr: base_dir")
    refuse_overlap(adapter_dir, [loaded_from, base_dir], "export_qlr: adapter_dir")
    for field, folder in (("base_dir", base_dir), ("adapter_dir", adapter_dir)):
        if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)) and not overwrite:
            raise ValueError(f"export_qlr: {field}: {folder} exists and is not empty; allowed: a new or empty folder, or "
                             "overwrite=True")


def export_qlr(model, base_dir, adapter_dir, dtype=None, base_format: str = "dequantized",
               overwrite: bool = False) -> tuple[str, str]:
    """Export a ``qlr`` model as the pair other tools run: a quantized base plus a LoRA adapter.

    (a) `base_dir`, loadable without hf_tensorcomp: with ``base_format="dequantized"`` (default) a
    plain transformers checkpoint whose replaced linears hold Q(W) de-quantized to `dtype` (default:
    the model's); with ``"compressed-tensors"`` the codes themselves, packed in that format
    (`integration.compressed_tensors`: loaded by ``AutoModelForCausalLM.from_pretrained(base_dir,
    quantization_config=CompressedTensorsConfig(dequantize=True))``; needs every group size to divide its
    matrix's input width). (b) `adapter_dir`: a PEFT LoRA adapter holding each layer's correction
    (``lora_A`` = A, ``lora_B`` = B, scaling 1, the rank of each layer in ``rank_pattern``).
    ``PeftModel.from_pretrained(<the base>, adapter_dir)`` computes what the hf_tensorcomp model
    computes. Returns the two folders. Each is a new or empty folder, or with ``overwrite=True`` an existing
    one (only the files written are replaced); the two apart from each other and from the folder the model
    was loaded from.
    """
    from ..atomic import atomic_dir

    _check_export_folders(model, base_dir, adapter_dir, base_format, overwrite)
    qlr = qlr_modules(model, "export_qlr")
    packed, quant_config = {}, None
    if base_format == "compressed-tensors":  # checked before anything is written
        from .compressed_tensors import quantized_base_tensors

        packed, quant_config = quantized_base_tensors(qlr)
    base, ranks, factors = plain_base(model, qlr, dtype, with_qlr_weights=quant_config is None)
    if not ranks:
        raise ValueError("export_qlr: every qlr layer has rank 0 (no correction): the base alone is the model")
    with atomic_dir(base_dir, overwrite=overwrite) as tmp:
        if quant_config is None:
            base.save_pretrained(tmp)
        else:  # the replaced linears' weights go as their packed codes instead
            from .compressed_tensors import write_config

            save_base_tensors(base, qlr, packed, tmp)
            write_config(tmp, quant_config)
    with atomic_dir(adapter_dir, overwrite=overwrite) as tmp:
        save_adapter(base, ranks, factors, tmp)
    return str(base_dir), str(adapter_dir)


def qlr_modules(model, who: str) -> dict:
    """``{name: QuantizedLowRankLinear}`` of `model`; refused by name where there is none."""
    qlr = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLowRankLinear)}
    if not qlr:
        raise ValueError(f"{who}: the model has no qlr layers; allowed: a model compressed with method='qlr'")
    return qlr


def plain_base(model, qlr: dict, dtype=None, with_qlr_weights: bool = True):
    """(the model as a plain transformers model of its own class, ``{name: rank}``, ``{name: (A, B)}``): the
    replaced linears hold Q(W) de-quantized (or are left at their initial values without `with_qlr_weights`,
    for a writer that stores their codes instead), quantized tables de-quantized and tied again, the rest as it
    is, in `dtype` (default: the model's)."""
    import copy

    plain_cfg = copy.deepcopy(model.config)
    if hasattr(plain_cfg, "quantization_config"):
        delattr(plain_cfg, "quantization_config")
    tables = {n: m for n, m in model.named_modules() if isinstance(m, (QuantizedEmbedding, QuantizedHead))}
    if any(getattr(m, "tied", False) for m in tables.values()):  # a tied quantized head: tied again in the plain base
        set_tied_embeddings(plain_cfg, True)
    base = type(model)(plain_cfg)
    dtype = dtype or next(model.parameters()).dtype
    state, ranks, factors = {}, {}, {}
    for name, m in qlr.items():
        if with_qlr_weights:
            state[f"{name}.weight"] = m.base_weight().detach()
        if m.bias is not None:
            state[f"{name}.bias"] = m.bias.detach()
        if m.rank:
            ranks[name], factors[name] = m.rank, (m.lora_A.detach(), m.lora_B.detach())
    for name, m in tables.items():  # embedding_bits: the de-quantized tables, the tie restored the transformers way
        if not getattr(m, "tied", False):
            state[f"{name}.weight"] = m.weight.detach()
        if getattr(m, "bias", None) is not None:
            state[f"{name}.bias"] = m.bias.detach()
    for name, t in model.state_dict().items():
        owner = name.rpartition(".")[0]
        if owner not in qlr and owner not in tables:
            state[name] = t
    base.load_state_dict(state, strict=False)
    base.tie_weights()
    return base.to(dtype), ranks, factors


def save_base_tensors(base, qlr: dict, extra: dict, folder) -> None:
    """Write `base`'s config, generation config and weights to `folder` with the weights of the `qlr` linears left
    out and the tensors `extra` (their codes, in some format) in their place; a tied copy is stored once."""
    from safetensors.torch import save_file

    base.config.save_pretrained(folder)
    rest, seen = {}, set()
    for k, v in base.state_dict().items():
        if (k.rpartition(".")[0] in qlr and k.endswith(".weight")) or v.data_ptr() in seen:
            continue  # a replaced weight (its codes go instead), or a tied copy (the head's: stored once)
        seen.add(v.data_ptr())
        rest[k] = v.detach().contiguous()
    save_file({**rest, **extra}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if base.generation_config is not None:
        base.generation_config.save_pretrained(folder)


def save_adapter(base, ranks: dict, factors: dict, folder) -> None:
    """Save the corrections ``{name: (A, B)}`` as a PEFT LoRA adapter on `base` (scaling 1, each layer's rank in
    ``rank_pattern``) to `folder`. The adapter is injected into `base` itself: call it last."""
    from peft import get_peft_model

    config = LoraConfig(r=max(ranks.values()), lora_alpha=max(ranks.values()), lora_dropout=0.0,
                        target_modules=sorted(ranks), rank_pattern=dict(ranks), alpha_pattern=dict(ranks))
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, (a, b) in factors.items():
            layer = peft_model.base_model.model.get_submodule(name)
            layer.lora_A["default"].weight.copy_(a)
            layer.lora_B["default"].weight.copy_(b)
    peft_model.save_pretrained(folder)
