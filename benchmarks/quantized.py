"""Stacking with quantization: quantized weights plus a calibrated low-rank correction (``qlr``), quantized
LASER factors, and the peers a user would pick instead, on perplexity against bytes.

Every decoder-layer linear of each model; calibration on the Wikipedia *calib* split; perplexity on the
Wikipedia *eval* split (in-domain) and on OpenWebText's eval split (text of another kind: compression
tuned to one kind of text must hold on another). Bytes: the decoder linears' stored bytes (codes,
float16 scales and zero points, corrections at bf16) relative to their bf16 bytes, and the whole model
at bf16 (embeddings included). Both bundled models are de-quantized 4-bit GGUF files (SmolLM2-135M
Q4_1, Gemma-3-270M Q4_K_M, blocks of 32): every quantizer here uses groups of >= 64 and integer zero
points, which do not ride on those blocks. Each row runs in a child process (its own peak memory).

Peers: optimum-quanto int8 / int4 weight-only (round to nearest; int4 in groups of 128), torchao int8
weight-only (one scale per row; the row ``torchao_int8``, needs ``pip install torchao``), GPTQ int4
g128 (this library's own implementation, the row ``gptq4``) and GPTQModel's own GPTQ int4 g128 with
its EoRA correction (rows ``gptqmodel4``, ``gptqmodel4_eora16``, ``gptqmodel4_eora32``: the calibrated
peer a user would pick). GPTQModel pins numpy 2.2 and so lives in a virtual environment of its own;
those rows run their child under the interpreter named by ``GPTQMODEL_PYTHON``:

    python3 -m venv /tmp/gptq && /tmp/gptq/bin/pip install torch==2.13.0 gptqmodel==7.6.0 "transformers==5.23.*" \
        tensorly opt_einsum gguf peft && /tmp/gptq/bin/pip install --no-deps -e .
    GPTQMODEL_PYTHON=/tmp/gptq/bin/python python benchmarks/quantized.py --recipe R   # R's rows: gptqmodel4 ...

It quantizes with its defaults (symmetric, no activation order) on the same calibration windows as every
other row; the quantized model is cached per model and group size in the temporary folder for the
EoRA rows; its CPU forward is its ``GPTQ_TORCH`` backend.

    python benchmarks/quantized.py                 # the grid (rows already in the JSON are kept)
    python benchmarks/quantized.py --report-only   # table and plot from the JSON
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (bench_main, child_setup, decode_tokens_per_s, linear_bytes, markdown_table, per_model, ppl_both,  # noqa: E402
                    ratio_plot, row_calibration, row_samples, run_rows, shipped_bytes, wikihow)
from hf_tensorcomp.decompositions.quantize import BITS  # noqa: E402  (every width)
from hf_tensorcomp.eval.peers import quanto_weight_only  # noqa: E402

NAME = "quantized"
DEFAULTS = {
    "models": ["smollm2", "gemma3"],
    "rows": ["dense", "quanto_int8", "quanto_int4", "rtn4", "gptq4", "qlr4_r32", "qlr_bytes_0.27", "rtn4_r32",
             "qlr_bytes_0.33", "qlr_bytes_0.21", "laser0.6_f8", "qlr4_r16", "laser0.6_f4", "qlr4_r32_emb8",
             "qlr4_r32_emb4", "qlr_bytes_0.27_size", "qlr_bytes_0.27_fisher", "torchao_int8", "gptq3_search",
             "qlr_bytes_0.27_b3", "qlr_bytes_0.21_b3", "qlr3_r16_search", "qlr_bytes_0.33_b3",
             "qlr_bytes_0.40_b3", "qlr_bytes_0.27_b348", "qlr_bytes_0.21_b348", "qlr_bytes_0.27_b48"],
    "eval_tokens": 8192,
    "calibration_samples": 32,
    "calibration_length": 256,
    "group_size": 128,
    "speed_rows": ["dense", "quanto_int4", "qlr4_r32"],
    "bigbench_examples": 0,
    "bigbench_rows": ["dense", "quanto_int4", "gptq4", "qlr4_r32"],
    "threads": 2,
}
ROWS = {  # label -> TensorCompressionConfig fields
    "rtn4": {"method": "qlr", "rank": 0, "quantizer": "rtn", "whiten": False, "grid": "minmax"},
    "gptq4": {"method": "qlr", "rank": 0, "grid": "minmax"},
    "rtn4_r32": {"method": "qlr", "rank": 32, "quantizer": "rtn", "rounds": 1, "grid": "minmax"},
    "qlr4_r16": {"method": "qlr", "rank": 16, "rounds": 1, "grid": "minmax"},
    "qlr4_r32": {"method": "qlr", "rank": 32, "rounds": 1, "grid": "minmax"},
    "qlr_bytes_0.21": {"method": "qlr", "target_bytes": 0.21, "bit_choices": [2, 4, 8], "rounds": 1, "grid": "minmax"},
    "qlr_bytes_0.27": {"method": "qlr", "target_bytes": 0.27, "bit_choices": [2, 4, 8], "rounds": 1, "grid": "minmax"},
    "qlr_bytes_0.33": {"method": "qlr", "target_bytes": 0.33, "bit_choices": [2, 4, 8], "rounds": 1, "grid": "minmax"},
    "laser0.6_f8": {"method": "laser", "target": 0.6, "whiten": True, "factor_bits": 8},
    "laser0.6_f4": {"method": "laser", "target": 0.6, "whiten": True, "factor_bits": 4},
    "laser0.6_bf16": {"method": "laser", "target": 0.6, "whiten": True},  # the factors unquantized, beside f8 / f4
    # calibrated LASER at 80 % (the earlier main job's settings) on Wikipedia, and on both bundled corpora (the
    # library's default calibration): what the mix does to the off-domain collapse (OpenWebText is then in-domain)
    "laser0.8_bf16": {"method": "laser", "target": 0.8, "whiten": True, "weighting": "fisher"},
    "laser0.8_bf16_mix": {"method": "laser", "target": 0.8, "whiten": True, "weighting": "fisher",
                          "calibration": "wikipedia+owt"},
    # what the byte allocation compares across matrices (qlr's allocation option; the rows above: "relative")
    "qlr_bytes_0.27_size": {"method": "qlr", "target_bytes": 0.27, "bit_choices": [2, 4, 8], "rounds": 1, "allocation": "size", "grid": "minmax"},
    "qlr_bytes_0.27_fisher": {"method": "qlr", "target_bytes": 0.27, "bit_choices": [2, 4, 8], "rounds": 1, "allocation": "fisher", "grid": "minmax"},
    # the main job with the input embedding (and the tied head with it) stored as codes too
    "qlr4_r32_emb8": {"method": "qlr", "rank": 32, "rounds": 1, "embedding_bits": 8, "grid": "minmax"},
    "qlr4_r32_emb4": {"method": "qlr", "rank": 32, "rounds": 1, "embedding_bits": 4, "grid": "minmax"},
    # each group's range searched (clipping) instead of min-max; rungs scored by GPTQ itself
    "gptq4_search": {"method": "qlr", "rank": 0, "grid": "search"},
    "qlr4_r32_search": {"method": "qlr", "rank": 32, "rounds": 1, "grid": "search"},
    "qlr_bytes_0.27_fisher_search": {"method": "qlr", "target_bytes": 0.27, "bit_choices": [2, 4, 8], "rounds": 1, "allocation": "fisher",
                                     "grid": "search"},
    "qlr_bytes_0.27_fisher_search_est": {"method": "qlr", "target_bytes": 0.27, "bit_choices": [2, 4, 8], "rounds": 1, "allocation": "fisher",
                                         "grid": "search", "estimate": "quantizer"},
    "qlr_bytes_0.21_fisher_search_est": {"method": "qlr", "target_bytes": 0.21, "bit_choices": [2, 4, 8], "rounds": 1, "allocation": "fisher",
                                         "grid": "search", "estimate": "quantizer"},
    "qlr_bytes_0.30_embauto_fisher_search_est": {"method": "qlr", "target_bytes": 0.30, "bit_choices": [2, 4, 8], "rounds": 1, "allocation": "fisher",
                                                 "grid": "search", "estimate": "quantizer", "embedding_bits": "auto"},
    # one byte budget over the linears *and* the embedding table, whose bits (4 or 8) it chooses
    "qlr_bytes_0.30_embauto_fisher": {"method": "qlr", "target_bytes": 0.30, "bit_choices": [2, 4, 8], "rounds": 1, "allocation": "fisher", "grid": "minmax",
                                      "embedding_bits": "auto"},
    "qlr_bytes_0.30_embauto_size": {"method": "qlr", "target_bytes": 0.30, "bit_choices": [2, 4, 8], "rounds": 1, "allocation": "size", "grid": "minmax",
                                    "embedding_bits": "auto"},
    # 3-bit codes (eight to three bytes), alone, corrected, and as a rung of the byte allocation
    "gptq3_search": {"method": "qlr", "rank": 0, "bits": 3, "grid": "search"},
    "qlr3_r16_search": {"method": "qlr", "rank": 16, "bits": 3, "rounds": 1, "grid": "search"},
    "qlr_bytes_0.21_b3": {"method": "qlr", "target_bytes": 0.21, "rounds": 1, "allocation": "fisher", "grid": "search",
                          "estimate": "quantizer"},
    "qlr_bytes_0.27_b3": {"method": "qlr", "target_bytes": 0.27, "rounds": 1, "allocation": "fisher", "grid": "search",
                          "estimate": "quantizer"},
    "qlr_bytes_0.33_b3": {"method": "qlr", "target_bytes": 0.33, "rounds": 1, "allocation": "fisher", "grid": "search",
                          "estimate": "quantizer"},
    "qlr_bytes_0.40_b3": {"method": "qlr", "target_bytes": 0.40, "rounds": 1, "allocation": "fisher", "grid": "search",
                          "estimate": "quantizer"},
    "qlr_bytes_0.27_b348": {"method": "qlr", "target_bytes": 0.27, "bit_choices": [3, 4, 8], "rounds": 1,
                            "allocation": "fisher", "grid": "search", "estimate": "quantizer"},
    "qlr_bytes_0.21_b348": {"method": "qlr", "target_bytes": 0.21, "bit_choices": [3, 4, 8], "rounds": 1,
                            "allocation": "fisher", "grid": "search", "estimate": "quantizer"},
    "qlr_bytes_0.27_b48": {"method": "qlr", "target_bytes": 0.27, "bit_choices": [4, 8], "rounds": 1,
                           "allocation": "fisher", "grid": "search", "estimate": "quantizer"},
}
# the rows above were measured with GPTQ in column order (before act_order became qlr's default), with
# the 2-, 3-, 4- and 8-bit rungs (before 5 and 6 bits joined the default ladder), and every qlr row in
# this file unrotated unless it says rotate=True (before the rotation became qlr's default)
for _f in ROWS.values():
    if _f["method"] == "qlr":
        _f.setdefault("act_order", False)
        _f.setdefault("rotate", False)
        if "target_bytes" in _f:
            _f.setdefault("bit_choices", [2, 3, 4, 8])
# the same allocation on 4x the calibration text (128 windows of 256 tokens instead of 32)
ROWS["qlr_bytes_0.27_b3_c128"] = {**ROWS["qlr_bytes_0.27_b3"], "calibration_samples": 128}
ROWS["qlr_bytes_0.33_b3_c128"] = {**ROWS["qlr_bytes_0.33_b3"], "calibration_samples": 128}
# GPTQ in activation order (static groups): the inputs with the most energy quantized first
ROWS["gptq4_search_act"] = {**ROWS["gptq4_search"], "act_order": True}
ROWS["gptq3_search_act"] = {**ROWS["gptq3_search"], "act_order": True}
for _b in ("0.21", "0.27", "0.33"):
    ROWS[f"qlr_bytes_{_b}_b3_c128_act"] = {**ROWS[f"qlr_bytes_{_b}_b3"], "calibration_samples": 128, "act_order": True}
for _r in ("qlr_bytes_0.21_b348", "qlr_bytes_0.27_b48", "qlr_bytes_0.33_b3", "qlr_bytes_0.40_b3", "qlr4_r32_search"):
    ROWS[f"{_r}_act"] = {**ROWS[_r], "act_order": True}
# 5- and 6-bit codes: alone (GPTQ, activation order) and as rungs of the byte allocation (every width)
for _b in (5, 6):
    ROWS[f"gptq{_b}_search_act"] = {**ROWS["gptq4_search"], "bits": _b, "act_order": True}
for _b in ("0.27", "0.33", "0.40"):
    ROWS[f"qlr_bytes_{_b}_b56_act"] = {**ROWS[f"qlr_bytes_{_b}_b3"], "act_order": True, "bit_choices": list(BITS)}
ROWS["qlr_bytes_0.21_b56_act"] = {**ROWS["qlr_bytes_0.21_b3"], "act_order": True, "bit_choices": list(BITS)}
# the same with each matrix quantized in a random block-Hadamard basis of its inputs (rotate=True)
for _r in ("gptq3_search_act", "gptq4_search_act", "gptq5_search_act", "qlr_bytes_0.21_b56_act", "qlr_bytes_0.27_b56_act",
           "qlr_bytes_0.33_b56_act", "qlr_bytes_0.27_b48_act"):
    ROWS[f"{_r}_rot"] = {**ROWS[_r], "rotate": True}
# rotated allocations without the narrow rungs (Gemma: 2/3-bit rungs cost more than the score predicts)
ROWS["qlr_bytes_0.27_b4568_act_rot"] = {**ROWS["qlr_bytes_0.27_b56_act_rot"], "bit_choices": [4, 5, 6, 8]}
ROWS["qlr_bytes_0.21_b348_act_rot"] = {**ROWS["qlr_bytes_0.21_b348_act"], "rotate": True}
ROWS["qlr_bytes_0.21_b3568_act_rot"] = {**ROWS["qlr_bytes_0.21_b56_act_rot"], "bit_choices": [3, 4, 5, 6, 8]}
ROWS["qlr_bytes_0.27_b3568_act_rot"] = {**ROWS["qlr_bytes_0.27_b56_act_rot"], "bit_choices": [3, 4, 5, 6, 8]}
# the default widths since: none narrower than the widest whose codes fit everywhere (0.33: from 4 bits, 0.40: from
# 6), against the old default (3 bits and up) at the same budgets
for _b in ("0.33", "0.40"):
    ROWS[f"qlr_bytes_{_b}_b3568_act_rot"] = {**ROWS["qlr_bytes_0.27_b3568_act_rot"], "target_bytes": float(_b)}
ROWS["qlr_bytes_0.33_b4568_act_rot"] = {**ROWS["qlr_bytes_0.27_b4568_act_rot"], "target_bytes": 0.33}
ROWS["qlr_bytes_0.40_b68_act_rot"] = {**ROWS["qlr_bytes_0.27_b4568_act_rot"], "target_bytes": 0.40, "bit_choices": [6, 8]}
# the README's main job (recipes/qlr_smollm2.json): 0.35 of the linears' and the table's bytes together, the table
# and the tied head as 8-bit codes, the default widths (bit_choices=None)
ROWS["qlr_bytes_0.35_emb8_act_rot"] = {**ROWS["qlr_bytes_0.40_b68_act_rot"], "target_bytes": 0.35, "bit_choices": None,
                                       "embedding_bits": 8}
ROWS["qlr_bytes_0.33_emb8_act_rot"] = {**ROWS["qlr_bytes_0.35_emb8_act_rot"], "target_bytes": 0.33}
# Gemma-3's table is 63 % of its bytes: 0.42 of the linears' and the table's bf16 bytes, the table as 8-bit codes,
# leaves the linears about quanto int4's 0.27
ROWS["qlr_bytes_0.42_emb8_act_rot"] = {**ROWS["qlr_bytes_0.35_emb8_act_rot"], "target_bytes": 0.42}
# 0.43: the linears' share (0.293) clears 4-bit codes with the default widths' 2 % to spare (0.42 leaves 0.266,
# so the default widths start at 3 bits)
ROWS["qlr_bytes_0.43_emb8_act_rot"] = {**ROWS["qlr_bytes_0.35_emb8_act_rot"], "target_bytes": 0.43}
# the same ladders, each decoder layer's level set to the KL its matrices measurably cause on their cheapest rung
for _b in ("0.21", "0.27"):
    ROWS[f"qlr_bytes_{_b}_measured"] = {**ROWS[f"qlr_bytes_{_b}_b3568_act_rot"], "allocation": "measured"}
    # and on 4x the calibration text: does GPTQ fitted on more windows keep its 3-bit codes closer off-domain?
    ROWS[f"qlr_bytes_{_b}_b3568_act_rot_c128"] = {**ROWS[f"qlr_bytes_{_b}_b3568_act_rot"], "calibration_samples": 128}
# the 3-bit class on the library's default calibration text (both bundled corpora, paragraphs alternating): what the
# measured allocation keeps on each eval split when neither is the other kind of text
ROWS["qlr_bytes_0.21_measured_mix"] = {**ROWS["qlr_bytes_0.21_measured"], "calibration": "wikipedia+owt"}
# GPTQ's damping (lambda x mean(diag XᵀX) added to the Gram; default 0.01): does a Gram leaning further towards
# round-to-nearest's identity keep 3-bit codes closer on the text it was not fitted on?
for _d in ("0.1", "0.3"):
    ROWS[f"gptq3_search_act_rot_d{_d}"] = {**ROWS["gptq3_search_act_rot"], "gptq_damping": float(_d)}
# 3-bit codes in groups of 64 (a float16 scale and a uint8 zero per 64 weights: 0.211 of the bf16 bytes)
ROWS["gptq3_search_act_rot_g64"] = {**ROWS["gptq3_search_act_rot"], "group_size": 64}
# and round to nearest in the same rotated basis (no calibration at all): how much of the 3-bit codes' loss on the
# other corpus is GPTQ fitting the calibration text?
ROWS["rtn3_search_rot"] = {**ROWS["gptq3_search_act_rot"], "quantizer": "rtn", "whiten": False, "act_order": False}
# the 3-bit class on the default calibration text with 4x its windows (128 x 256 tokens, half from each corpus):
# GPTQ's Gram and the measured allocation's KL both seen on more of each kind of text
ROWS["qlr_bytes_0.21_measured_mix_c128"] = {**ROWS["qlr_bytes_0.21_measured_mix"], "calibration_samples": 128}
# what a user who writes only `TensorCompressionConfig(method="qlr", target_bytes=0.27)` gets: every option at the
# library's default (calibration None: the library's own, both bundled corpora), beside the uniform setting that
# budget holds (4-bit codes everywhere, no correction) on the same calibration; past the loop above, so none of the
# older rows' settings apply
# (calibration_samples None: the library's own count too, 128 windows for qlr; the `_c32` rows are the same at the
# 32 windows that were the default before)
ROWS["qlr_bytes_0.27_defaults"] = {"method": "qlr", "target_bytes": 0.27, "calibration": None, "calibration_samples": None}
ROWS["qlr4_r0_defaults"] = {"method": "qlr", "bits": 4, "rank": 0, "calibration": None, "calibration_samples": None}
# the serving profile: the widths vLLM's kernels serve (4 and 8 bits) and the rotation compressed-tensors writes
ROWS["qlr_bytes_0.27_vllm_defaults"] = {**ROWS["qlr_bytes_0.27_defaults"], "bit_choices": [4, 8]}
ROWS["qlr_bytes_0.27_defaults_c32"] = {**ROWS["qlr_bytes_0.27_defaults"], "calibration_samples": 32}
ROWS["qlr4_r0_defaults_c32"] = {**ROWS["qlr4_r0_defaults"], "calibration_samples": 32}


def _model_bytes(model, linear_stored: int, linear_dense: int) -> int:
    """The whole model with the decoder linears as stored (`linear_bytes`) and every other tensor as
    `_as_shipped` counts it (tied embeddings once; a quantized embedding by its codes and scales)."""
    from hf_tensorcomp.plan import find_decoder_layers

    _, layers = find_decoder_layers(model)
    linears = [m for m in layers.modules() if _is_linear(m)]
    return _as_shipped(model.modules()) - _as_shipped(linears) + linear_stored


def _is_linear(m) -> bool:
    import torch

    from hf_tensorcomp.layers import FactorizedModule

    return (isinstance(m, (torch.nn.Linear, FactorizedModule)) or "qweight" in m._buffers) and hasattr(m, "in_features")


def _as_shipped(modules) -> int:
    """Bytes of the modules' own parameters and saved buffers, float32 counted at bf16 (the models as
    shipped), integer codes and float16 scales as stored; each tensor once."""
    seen, total = set(), 0
    for m in modules:
        for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if name in m._non_persistent_buffers_set or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += shipped_bytes(t)
    return total


def _torchao_int8(model) -> None:
    """torchao's int8 weight-only quantization (one scale per output row) of every decoder-layer linear."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from hf_tensorcomp.plan import find_decoder_layers

    _, layers = find_decoder_layers(model)
    quantize_(layers, Int8WeightOnlyConfig())


def _gptqmodel_external(job: dict) -> dict:
    """A ``gptqmodel*`` row: its child runs under ``GPTQMODEL_PYTHON`` (`_gptqmodel_row`), its row read back."""
    import json
    import os
    import subprocess
    import tempfile

    python = os.environ.get("GPTQMODEL_PYTHON")
    row = {"model": job["model"], "row": job["row"]}
    if not python:
        return {**row, "error": "GPTQMODEL_PYTHON is not set (the interpreter of a virtual environment with "
                                "gptqmodel==7.6.0; see this script's docstring)"}
    run = subprocess.run([python, os.path.abspath(__file__), "--gptqmodel-row", json.dumps(job)], capture_output=True,
                         text=True, cwd=tempfile.gettempdir())  # (GPTQModel writes a logs/ folder where it runs)
    lines = run.stdout.strip().splitlines()
    if run.returncode or not lines:
        return {**row, "error": f"exit {run.returncode}: {run.stderr.strip()[-400:]}"}
    return json.loads(lines[-1])


def _gptqmodel_row(job: dict) -> dict:
    """GPTQModel's GPTQ (4 bits, ``group_size``, its defaults) of the model on this benchmark's calibration
    windows, then with ``..._eora<rank>`` its EoRA correction of that rank; scored like every row."""
    import json
    import os
    import tempfile

    cores = os.cpu_count() or 1
    os.cpu_count = lambda: max(cores, 4)  # GPTQModel 7.6's loader asks for 2 workers of a pool of (cores + 1) // 2
    import torch
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    from gptqmodel.adapter.adapter import Lora

    from hf_tensorcomp.calibration import calibration_ids

    path, tok, row = child_setup(job)
    path = str(path)  # GPTQModel reads a Path as a Hub repo id
    ids = calibration_ids("wikipedia", tok, job["calibration_samples"], job["calibration_length"], 0)
    data = [{"input_ids": r.tolist(), "attention_mask": [1] * len(r)} for r in ids]
    cache = os.path.join(tempfile.gettempdir(), "hf_tensorcomp_gptqmodel",
                         f"{job['model']}-g{job['group_size']}-{job['calibration_samples']}x{job['calibration_length']}")

    def timed(folder, make):  # a step's seconds, kept beside its cached output (a cached rerun reports them too)
        seconds = os.path.join(cache, folder + ".seconds")
        if not os.path.exists(seconds):
            t0 = time.perf_counter()
            make()
            with open(seconds, "w") as f:
                f.write(str(round(time.perf_counter() - t0, 1)))
        with open(seconds) as f:
            return float(f.read())

    def quantize():
        m = GPTQModel.load(path, QuantizeConfig(bits=4, group_size=job["group_size"]), device="cpu")
        m.quantize(data, batch_size=1)
        m.save(os.path.join(cache, "q"))

    os.makedirs(cache, exist_ok=True)
    row["gptq_s"] = row["compress_s"] = timed("q", quantize)
    adapter = None
    if "_eora" in job["row"]:
        rank = int(job["row"].rsplit("_eora", 1)[1])
        adapter = Lora(path=os.path.join(cache, f"eora{rank}"), rank=rank)
        row["eora_s"] = timed(f"eora{rank}", lambda: GPTQModel.adapter.generate(
            adapter=adapter, model_id_or_path=path, quantized_model_id_or_path=os.path.join(cache, "q"),
            calibration_dataset=data, calibration_dataset_concat_size=0, device="cpu"))
        row["compress_s"] += row["eora_s"]
        row["mean_rank"] = rank
    # its torch kernel takes float16 / bfloat16 only: scored in bfloat16, against the dense model in bfloat16
    model = GPTQModel.load(os.path.join(cache, "q"), adapter=adapter, backend=BACKEND.GPTQ_TORCH, device="cpu",
                           dtype=torch.bfloat16).model.eval()
    row["bits"] = [4]
    stored, dense = linear_bytes(model)
    row["linear_bytes"] = stored / dense
    row["model_bytes"] = _model_bytes(model, stored, dense)
    row.update({f"ppl_{c}": v for c, v in ppl_both(model, tok, job["eval_tokens"]).items()})
    row["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    del model
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    row["dense_ref"] = {"dtype": "bfloat16", **{f"ppl_{c}": v for c, v in ppl_both(ref, tok, job["eval_tokens"]).items()}}
    print(json.dumps(row))
    return row


def _one(job: dict, q) -> None:
    if job["row"].startswith("gptqmodel"):
        row = _gptqmodel_external(job)
        if "error" in row:  # no row: reported, and tried again on the next run
            print(f"{job['model']} {job['row']}: {row['error']}", flush=True)
        else:
            q.put(row)
        return
    import torch
    from transformers import AutoModelForCausalLM

    from hf_tensorcomp import TensorCompressionConfig

    path, tok, row = child_setup(job)
    t0 = time.perf_counter()
    if job["row"] in ("dense", "quanto_int8", "quanto_int4", "torchao_int8"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if job["row"] == "torchao_int8":
            _torchao_int8(model)
        elif job["row"] != "dense":
            quanto_weight_only(model, int(job["row"][-1]))  # its forward outside inference mode (int4 fails in it)
    else:
        fields = dict(ROWS[job["row"]])
        if fields["method"] == "qlr" or "factor_bits" in fields:
            fields.setdefault("group_size", job["group_size"])  # a row may set its own
        if "embedding_bits" in fields:
            fields["embedding_group_size"] = job["group_size"]
        if fields["method"] == "laser":
            fields["targets"] = ["*_proj"]
            fields.setdefault("pivoted", False)  # the plain storage these rows were measured in
        samples = row_samples(fields, row, job)  # a row may set its own
        calibration = row_calibration(fields, row)  # and its own calibration text
        cfg = TensorCompressionConfig(progress=False, calibration=calibration, calibration_samples=samples,
                                      calibration_length=job["calibration_length"], **fields)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=cfg)
        row["calibration_samples"] = model.config.quantization_config.calibration_samples  # None: the library's count
        st = model.config.quantization_config.stats
        mods = st["modules"].values()
        row["bits"] = sorted({m["bits"] for m in mods if "bits" in m})
        row["mean_rank"] = round(sum(m.get("rank", 0) for m in mods) / max(len(mods), 1), 1)
        row["embedding_bits"] = next((m["bits"] for m in mods if m.get("method") == "embedding"), None)
        # per projection kind (q_proj, ..., down_proj): how many matrices at each width, and the mean rank
        kinds: dict[str, dict] = {}
        for name, m in st["modules"].items():
            if "bits" in m and m.get("method") != "embedding":
                k = kinds.setdefault(name.rsplit(".", 1)[-1], {"bits": {}, "ranks": []})
                k["bits"][str(m["bits"])] = k["bits"].get(str(m["bits"]), 0) + 1
                k["ranks"].append(m.get("rank", 0))
        row["by_kind"] = {k: {"bits": v["bits"], "mean_rank": round(sum(v["ranks"]) / len(v["ranks"]), 1)}
                          for k, v in sorted(kinds.items())}
    row["compress_s"] = round(time.perf_counter() - t0, 1)
    model.eval()
    stored, dense = linear_bytes(model)
    row["linear_bytes"] = stored / dense
    row["model_bytes"] = _model_bytes(model, stored, dense)
    row.update({f"ppl_{c}": v for c, v in ppl_both(model, tok, job["eval_tokens"]).items()})
    if job["row"] in job["speed_rows"]:
        with torch.inference_mode(False), torch.no_grad():
            row["tok_s"] = decode_tokens_per_s(model, tok)
    if job["bigbench_examples"] and job["row"] in job["bigbench_rows"]:
        row.update(wikihow(model, tok, job["bigbench_examples"]))
    row["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    q.put(row)


def run(cfg: dict) -> list[dict]:
    return run_rows(NAME, cfg["rows"], cfg["models"], cfg, _one)


def report(rows: list[dict]) -> str:
    out = []
    for model, rs, dense in per_model(rows):
        for r in rs:
            r["model_ratio"] = r["model_bytes"] / dense["model_bytes"]
            for c in ("wikipedia", "owt"):  # a row scored in another dtype: against the dense model in it
                r[f"x_{c}"] = r[f"ppl_{c}"] / r.get("dense_ref", dense)[f"ppl_{c}"]
            if "tok_s" in r and "tok_s" in dense:
                r["speed"] = r["tok_s"] / dense["tok_s"]
        out.append(f"### {model} (dense perplexity: Wikipedia {dense['ppl_wikipedia']:.2f}, OpenWebText {dense['ppl_owt']:.2f})\n")
        out.append(markdown_table(sorted(rs, key=lambda r: r["linear_bytes"]), [
            ("row", "row", "{}"), ("bits", "bits", "{}"), ("mean_rank", "mean rank", "{}"),
            ("embedding_bits", "table bits", "{}"), ("linear_bytes", "linear bytes vs bf16", "{:.3f}"), ("model_ratio", "model bytes vs bf16", "{:.3f}"),
            ("x_wikipedia", "ppl vs dense, Wikipedia", "{:.3f}x"), ("x_owt", "ppl vs dense, OpenWebText", "{:.3f}x"),
            ("wikihow", "wikihow acc", "{:.3f}"), ("wikihow_se", "± se", "{:.3f}"),
            ("speed", "decode vs dense", "{:.2f}x"), ("compress_s", "compress s", "{:.0f}"),
            ("peak_rss_mb", "peak RSS MB", "{:,}")]))
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    def draw(ax, rs):
        rs = [r for r in rs if "x_owt" in r]
        rotated = [r for r in rs if r["row"].endswith("_rot")]
        rs = [r for r in rs if r not in rotated]
        groups = {"quanto": [r for r in rs if r["row"].startswith("quanto")],
                  "torchao int8": [r for r in rs if r["row"].startswith("torchao")],
                  "round to nearest / GPTQ alone": [r for r in rs if r["row"] == "rtn4" or
                                                    (r["row"].startswith("gptq") and not r["row"].startswith("gptqmodel"))],
                  "GPTQModel: GPTQ, + EoRA": [r for r in rs if r["row"].startswith("gptqmodel")],
                  "qlr (quantized + correction)": [r for r in rs if r["row"].startswith(("qlr", "rtn4_r"))],
                  "LASER (quantized factors)": [r for r in rs if r["row"].startswith("laser")],
                  "GPTQ / qlr, rotate=True": rotated}
        for label, g in groups.items():
            for corpus, marker in (("wikipedia", "o"), ("owt", "x")):
                pts = sorted((r["linear_bytes"], r[f"x_{corpus}"]) for r in g)
                if pts:
                    ax.plot(*zip(*pts), marker=marker, linestyle="-" if corpus == "wikipedia" else ":",
                            label=f"{label} ({'Wikipedia' if corpus == 'wikipedia' else 'OpenWebText'})")

    ratio_plot(rows, path, draw)
    plot_bits(rows, path.with_name(f"{path.stem}_bits.png"))


# the byte budgets whose chosen widths are plotted: the 3-bit class and the default widths at 0.27 / 0.33 / 0.40
BITS_ROWS = ("qlr_bytes_0.21_measured_mix_c128", "qlr_bytes_0.27_b4568_act_rot", "qlr_bytes_0.33_b4568_act_rot",
             "qlr_bytes_0.40_b68_act_rot")


def plot_bits(rows: list[dict], path: Path) -> None:
    """What the byte budgets chose: per model, per budget and projection kind, the share of the matrices at each
    width (stacked) and the mean correction rank (above the bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    picked = [r for r in rows if r["row"] in BITS_ROWS and r.get("by_kind")]
    models = list(dict.fromkeys(r["model"] for r in picked))
    if not models:
        return
    colours = dict(zip(BITS, plt.get_cmap("viridis")([i / (len(BITS) - 1) for i in range(len(BITS))])))
    fig, axes = plt.subplots(len(models), 1, figsize=(12, 3.6 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        rs = sorted((r for r in picked if r["model"] == model), key=lambda r: r["linear_bytes"])
        ticks, labels, x = [], [], 0.0
        for r in rs:
            for kind, k in r["by_kind"].items():
                n, bottom = sum(k["bits"].values()), 0.0
                for b in BITS:
                    share = k["bits"].get(str(b), 0) / n
                    if share:
                        ax.bar(x, share, bottom=bottom, color=colours[b], width=0.8)
                        bottom += share
                ax.text(x, 1.02, f"{k['mean_rank']:g}", ha="center", fontsize=7)
                ticks.append(x)
                labels.append(kind.removesuffix("_proj"))
                x += 1
            ax.text(x - len(r["by_kind"]) / 2 - 0.5, 1.12, f"target_bytes={r['linear_bytes']:.2f}", ha="center")
            x += 1
        ax.set_xticks(ticks, labels, fontsize=8)
        ax.set_ylim(0, 1.22)
        ax.set_ylabel("share of matrices")
        ax.set_title(f"{model}: widths chosen per projection kind (numbers: mean correction rank)", pad=18)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[b]) for b in BITS]
    fig.legend(handles, [f"{b} bits" for b in BITS], loc="upper right", ncol=len(BITS))
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def header(cfg: dict) -> str:
    return (
        "# Quantized weights plus a calibrated low-rank correction, against weight quantization\n\n"
        "Every decoder linear; calibration: Wikipedia calib split (32 x 256 tokens); perplexity: "
        f"{cfg['eval_tokens']} tokens of the Wikipedia eval split and of OpenWebText's, 512-token windows. Groups of "
        f"{cfg['group_size']} with integer zero points (the bundled models are de-quantized GGUF 4-bit files with blocks "
        "of 32, which a 32-group float-minimum quantizer would reproduce for free). Decode speed of hf_tensorcomp's own "
        "rows: benchmarks/results/decode_speed.md (its 4-bit rows run the CPU int4 kernel in float32 since it was "
        "measured here). GPTQModel rows (its GPTQ int4 with its defaults: symmetric, no activation order; + its EoRA "
        "correction) run in bfloat16, as its CPU kernel requires, and their ratios are to the dense model in bfloat16. "
        "Rows ending in `_rot`: `rotate=True` (each matrix quantized in a random block-Hadamard basis of its inputs, "
        "the layer rotating its input). Rows ending in `_mix` calibrate on both corpora; rows ending in `_defaults` "
        "(`qlr_bytes_0.27_defaults`: `TensorCompressionConfig(method=\"qlr\", target_bytes=0.27)` and nothing else; "
        "`qlr4_r0_defaults`: `bits=4, rank=0`) on the library's default calibration text, both corpora, and its "
        "default window count (128 for qlr); rows ending in `_defaults_c32`: the same at 32 windows, the default when "
        "they were measured (other_prose.md holds the defaults at 128 windows on these corpora as well). "
        "Written by benchmarks/quantized.py.\n\n"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--gptqmodel-row"]:  # a gptqmodel row's child, under GPTQMODEL_PYTHON
        import json

        _gptqmodel_row(json.loads(sys.argv[2]))
    else:
        bench_main(__doc__, NAME, DEFAULTS, run, report, plot, header)
