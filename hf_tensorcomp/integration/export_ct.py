"""``export(model, out, format="compressed-tensors")``: a ``qlr`` model as vLLM and transformers read it.

What is written (``out/base``, ``out/adapter``):

- **the codes**, ``pack-quantized`` (``weight_packed`` int32, ``weight_scale``, ``weight_zero_point``,
  ``weight_shape``), one config group per (width, group size), each naming its modules: a byte budget's mix
  stays a mix. ``widths="vllm"`` (default) writes every width at the nearest of 4 and 8 bits at or above it
  (what vLLM's WNA16 kernels take: 2/3-bit codes as 4, 5/6-bit as 8; a b-bit code is the same code at more
  bits, exact), said with the bytes it costs; ``widths="any"`` writes each width as the budget chose it (1-8
  bits: compressed-tensors and transformers read them, vLLM does not). Codes ``c`` in [0, 2^b) become signed
  ``c - 2^(b-1)``, so do the integer zero points. Scales in the model's 16-bit dtype (float16 for a float32
  model: ours, exactly).
- **the rotation** (``rotate=True``: the codes are those of W R, R = D blockdiag(H_b), see
  `decompositions.hadamard`) as a compressed-tensors transform: one ``random-hadamard`` scheme per distinct R
  (one per input width: the signs are seeded per width), applied at the ``input`` of its linears, its inverse
  recorded at ``weight_input`` (already folded: the codes). R's signs differ per block, which a block-diagonal
  scheme (``head_dim``) cannot say, so the scheme is full width and its matrix is stored, ``sqrt(n) R`` in
  float32 (the loaders divide by sqrt(n)), once per scheme under its first module
  (``<module>.<scheme>_input.weight``): n^2 4 bytes a width. vLLM applies it online (a dense n x n product per
  token: no Hadamard kernel for it); transformers (5.23) does not apply ``transform_config`` at all: there it is
  applied with compressed-tensors' own `apply_transform_config` (see `docs/serving.md`).
- **the correction**: a PEFT LoRA adapter (`peft.save_adapter`), which vLLM serves beside a quantized base.
- input embeddings and a head quantized with ``embedding_bits``: de-quantized, in the model's dtype.

Refused, one line naming the field: groups that do not divide a matrix's input width (the format needs whole
groups), a width `widths` cannot hold.
"""

from __future__ import annotations

import math
import warnings

import torch

from .compressed_tensors import FORMAT, quantization_config

WIDTHS = {"vllm": (4, 8), "any": (1, 2, 3, 4, 5, 6, 7, 8)}


def written_widths(spec: dict, widths: str) -> dict[int, int]:
    """``{bits chosen: bits written}`` for the modules' ``{name: qspec}`` under `widths`."""
    if widths not in WIDTHS:
        raise ValueError(f"export: widths: got {widths!r}; allowed: {' | '.join(map(repr, WIDTHS))}")
    out = {}
    for bits in sorted({s[0] for s in spec.values()}):
        fits = [w for w in WIDTHS[widths] if w >= bits]
        if not fits:
            raise ValueError(f"export: widths: {bits}-bit codes have no width at or above them in {widths!r} "
                             f"{WIDTHS[widths]}; allowed: widths='any', or a model compressed at those widths")
        out[bits] = fits[0]
    return out


def rotation_matrix(signs: torch.Tensor, block: int) -> torch.Tensor:
    """R (n x n, float64) with ``rotate(x) = x R``."""
    from ..decompositions.hadamard import rotate

    n = signs.numel()
    return rotate(torch.eye(n, dtype=torch.float64), signs.to(torch.float64), block)


def transform_config(qlr: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """(``transform_config`` dict, stored transform matrices) for the rotated modules of `qlr` ({} where none)."""
    groups: dict[tuple, list[str]] = {}
    for name, m in qlr.items():
        if m.rotation_block:
            key = (m.in_features, m.rotation_block, tuple(m.input_signs.tolist()))
            groups.setdefault(key, []).append(name)
    schemes, tensors = {}, {}
    for i, ((n, block, signs), names) in enumerate(sorted(groups.items(), key=lambda kv: kv[1][0])):
        scheme = f"rotation_{i}"
        schemes[scheme] = {
            "type": "random-hadamard", "randomize": False, "requires_grad": False, "head_dim": None,
            "precision": "float32",
            "apply": [{"targets": sorted(names), "location": "input", "inverse": False, "ignore": []},
                      {"targets": sorted(names), "location": "weight_input", "inverse": True, "ignore": []}]}
        r = rotation_matrix(torch.tensor(signs), block)
        tensors[f"{sorted(names)[0]}.{scheme}_input.weight"] = (r * math.sqrt(n)).float().contiguous()
    return ({"config_groups": schemes} if schemes else {}), tensors


def quantized_tensors(qlr: dict, widths: str, scale_dtype: torch.dtype) -> tuple[dict, dict, list[str]]:
    """(packed tensors, ``quantization_config``, report lines) for the modules `qlr` ({name: module})."""
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    except ImportError:
        raise ValueError("export: format='compressed-tensors' needs the compressed-tensors package; allowed: "
                         "pip install \"hf_tensorcomp[export]\"") from None
    spec = {name: m.qspec("weight") for name, m in qlr.items()}  # (bits, group, shape, dtype)
    for name, (bits, group, (out_f, in_f), _) in spec.items():
        if in_f % group:
            raise ValueError(f"export: group_size: {name} has {in_f} inputs, not a multiple of its groups of {group}; "
                             "allowed with format='compressed-tensors': a group_size dividing every matrix's input "
                             "width (compress again, e.g. group_size=64)")
    to = written_widths(spec, widths)
    state, groups = {}, {}
    for name, m in qlr.items():
        bits, group, (out_f, in_f), _ = spec[name]
        width = to[bits]
        q = m.quantized("weight")
        offset = 1 << (width - 1)
        codes = (q.codes[: out_f * in_f].view(out_f, in_f).to(torch.int16) - offset).to(torch.int8)
        zero = (q.zero.view(out_f, in_f // group).to(torch.int16) - offset).to(torch.int8)
        state[f"{name}.weight_packed"] = pack_to_int32(codes, width)
        state[f"{name}.weight_scale"] = q.scale.view(out_f, in_f // group).to(scale_dtype).contiguous()
        state[f"{name}.weight_zero_point"] = pack_to_int32(zero, width, packed_dim=0)
        state[f"{name}.weight_shape"] = torch.tensor([out_f, in_f])
        groups.setdefault((width, group), []).append(name)
    report = []
    for bits, width in sorted(to.items()):
        numel = sum(s[2][0] * s[2][1] for s in spec.values() if s[0] == bits)
        n = sum(1 for s in spec.values() if s[0] == bits)
        if width == bits:
            report.append(f"{bits}-bit: {n} matrices written as {bits}-bit codes")
        else:
            report.append(f"{bits}-bit: {n} matrices written as {width}-bit codes ({widths!r} holds no {bits}-bit "
                          f"scheme): codes {numel * width / 8:,.0f} bytes instead of {numel * bits / 8:,.0f}")
            warnings.warn(f"export: {report[-1]}", stacklevel=4)
    config = quantization_config(groups)
    return state, config, report


def write(model, out, tmp, widths: str = "vllm") -> dict:
    """Write the export of `model` into the temporary folder `tmp` (``base/``, ``adapter/``); returns the report."""
    import json

    from .peft import plain_base, qlr_modules, save_adapter, save_base_tensors

    qlr = qlr_modules(model, "export: format='compressed-tensors'")
    dtype = next(model.parameters()).dtype
    scale_dtype = dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16
    packed, qconfig, lines = quantized_tensors(qlr, widths, scale_dtype)
    tconfig, matrices = transform_config(qlr)
    if tconfig:
        qconfig["transform_config"] = tconfig
        n = {t.shape[0] for t in matrices.values()}
        lines.append(f"rotation: {len(matrices)} random-hadamard input transforms (widths {sorted(n)}), matrices "
                     f"stored in float32: {sum(t.numel() * 4 for t in matrices.values()):,} bytes")
    base, ranks, factors = plain_base(model, qlr, with_qlr_weights=False)
    (tmp / "base").mkdir()
    save_base_tensors(base, qlr, {**packed, **matrices}, tmp / "base")
    path = tmp / "base" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization_config"] = qconfig
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    if ranks:
        save_adapter(base, ranks, factors, tmp / "adapter")
        lines.append(f"correction: a PEFT LoRA adapter on {len(ranks)} linears (ranks {min(ranks.values())}-"
                     f"{max(ranks.values())})")
    else:
        lines.append("correction: none (every qlr layer has rank 0): no adapter")
    return {"base": str(out / "base"), "adapter": str(out / "adapter") if ranks else None, "report": lines}
