"""A ``qlr`` model's quantized base as a compressed-tensors checkpoint (``pack-quantized``).

compressed-tensors (the format of llm-compressor and vLLM; transformers loads it through
`CompressedTensorsConfig`) stores a group-quantized linear as ``weight_packed`` (int32, the codes
packed densely), ``weight_scale``, ``weight_zero_point`` (packed along the output dim) and
``weight_shape``. Our codes map onto it one for one: an asymmetric grid with an integer zero point
per group along each row, widths 2, 3, 4 and 8; codes ``c`` in [0, 2^b) become signed ``c - 2^(b-1)``
and so do the zero points. The packing is the package's own (`compressed_tensors...pack_to_int32`),
so what is written is what its loader reads.

What it cannot express, refused by name: a group that does not divide a matrix's input width (the
format needs whole groups: SmolLM2's 576 at groups of 128 — compress with ``group_size=64``). What
the conversion costs: (1) one width for every matrix. The format could hold a byte budget's mix (a
config group per width), but transformers' loader (5.23) de-quantizes every dense layer with the
first group's scheme, so a mix is written at its widest width: a code of b bits is the same code at
more bits (exact; the stored base grows — `quantized_base_tensors` says by how much). (2) The scales
as float32 (ours are float16; the loader de-quantizes in the scale's dtype, and float16 there changed
logits by ~1e-4): 0.125 bits more per weight at groups of 128. The input embedding and head
(``embedding_bits``) are written de-quantized, tied again.
"""

from __future__ import annotations

import json
import warnings

import torch


FORMAT = "pack-quantized"


def quantized_base_tensors(modules: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict entries, ``quantization_config``) of the `QuantizedLowRankLinear` modules ``{name: module}``;
    warns with the bytes when a mix of widths is written at the widest."""
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    except ImportError:
        raise ValueError("export_qlr: base_format='compressed-tensors' needs the compressed-tensors package; allowed: "
                         "pip install \"hf_tensorcomp[export]\", or base_format='dequantized'") from None
    state, groups = {}, {}
    spec = {name: m.qspec("weight") for name, m in modules.items()}  # (bits, group, shape, dtype)
    widths = {bits for bits, *_ in spec.values()}
    width = max(widths)  # one scheme: the widest
    for name, m in modules.items():
        bits, group, shape, _ = spec[name]
        out_f, in_f = shape
        if m.rotation_block:
            raise ValueError(f"export_qlr: {name} quantizes its weight in a rotated basis (rotate=True), which "
                             "compressed-tensors cannot express; allowed with it: base_format='dequantized' (the "
                             "de-quantized base in the model's own basis), or a model compressed with rotate=False")
        if in_f % group:
            raise ValueError(f"export_qlr: group_size: {name} has {in_f} inputs, not a multiple of its groups of {group}; "
                             f"allowed with base_format='compressed-tensors': a group_size dividing every matrix's input "
                             f"width (compress again, e.g. group_size=64), or base_format='dequantized'")
        q = m.quantized("weight")
        offset = 1 << (width - 1)
        codes = (q.codes[: out_f * in_f].view(out_f, in_f).to(torch.int16) - offset).to(torch.int8)
        zero = (q.zero.view(out_f, in_f // group).to(torch.int16) - offset).to(torch.int8)
        state[f"{name}.weight_packed"] = pack_to_int32(codes, width)
        state[f"{name}.weight_scale"] = q.scale.view(out_f, in_f // group).float()
        state[f"{name}.weight_zero_point"] = pack_to_int32(zero, width, packed_dim=0)
        state[f"{name}.weight_shape"] = torch.tensor(shape)
        groups.setdefault((width, group), []).append(name)
    if len(widths) > 1:
        numel = {name: shape[0] * shape[1] for name, (_, _, shape, _) in spec.items()}
        written = sum(numel.values()) * width / 8
        own = sum(numel[name] * bits for name, (bits, *_) in spec.items()) / 8
        warnings.warn(f"export_qlr: widths {sorted(widths)} written as {width}-bit codes (transformers' compressed-tensors "
                      f"loader de-quantizes every dense layer with one scheme): codes {written:,.0f} bytes instead "
                      f"of {own:,.0f}", stacklevel=3)
    config = quantization_config(groups)
    return state, config


def quantization_config(groups: dict) -> dict:
    """compressed-tensors' ``quantization_config`` for ``{(bits, group_size): [module names]}``: one
    ``pack-quantized`` asymmetric group scheme per width and group size."""
    return {
        "quant_method": "compressed-tensors", "format": FORMAT, "quantization_status": "compressed",
        "config_groups": {f"group_{i}": {"targets": sorted(names), "format": FORMAT, "input_activations": None,
                                         "output_activations": None,
                                         "weights": {"num_bits": bits, "type": "int", "symmetric": False,
                                                     "strategy": "group", "group_size": group, "dynamic": False,
                                                     "observer": "minmax"}}
                          for i, ((bits, group), names) in enumerate(sorted(groups.items()))},
        "ignore": [],
    }


def write_config(folder, quantization_config: dict) -> None:
    """Add ``quantization_config`` to the ``config.json`` in `folder`."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization_config"] = quantization_config
    path.write_text(json.dumps(cfg, indent=2) + "\n")
