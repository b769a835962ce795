"""Decode speed of 4-bit weights: the dense model, optimum-quanto int4 and hf_tensorcomp's 4-bit codes
(`qlr` without and with a rank-32 correction), in float32 and in bfloat16.

hf_tensorcomp's 4-bit weights run PyTorch's CPU int4 kernel in both dtypes (float32 activations are
rounded to bfloat16 for the product, the kernel's only input type); the correction's two thin products
run in float32 in both. Speed depends on the shapes only, not on the codes, so the rows use the
round-to-nearest quantizer (GPTQ gives the same speed after a longer compression). Greedy decode,
batch 1, 32-token prompt, 32 new tokens, median of 3; each model in its own child process.

    python benchmarks/decode_speed.py
    python benchmarks/decode_speed.py --report-only
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import _without_inference_mode, bench_main, child_setup, decode_tokens_per_s, markdown_table, per_model, run_rows  # noqa: E402
from hf_tensorcomp.decompositions.quantize import BITS  # noqa: E402  (every width)

NAME = "decode_speed"
DEFAULTS = {
    "models": ["smollm2", "gemma3"],
    # the budget rows (bytes*) run on request (--recipe): each needs a one-thread Fisher calibration pass per model
    "rows": ["dense", "quanto_int4", "rtn4", "rtn4_rot", "rtn4_r32", "rtn4_r32_emb8"],
    "group_size": 128,
    "calibration_samples": 32,
    "calibration_length": 256,
    "threads": 1,  # the other core was busy with another one-thread benchmark in the published run
}
ROWS = {
    "rtn4": {"method": "qlr", "rank": 0, "quantizer": "rtn", "whiten": False},
    "rtn4_r32": {"method": "qlr", "rank": 32, "quantizer": "rtn", "rounds": 1},
    # a byte budget's mix of widths and ranks (2, 3, 4 bits run the int4 kernel, 8 bits two calls of it)
    "bytes0.27": {"method": "qlr", "target_bytes": 0.27, "quantizer": "rtn", "rounds": 1, "allocation": "fisher",
                  "bit_choices": list(BITS)},
    "bytes0.33": {"method": "qlr", "target_bytes": 0.33, "quantizer": "rtn", "rounds": 1, "allocation": "fisher",
                  "bit_choices": list(BITS)},
    # the main job's shapes: 4-bit + rank 32 with the embedding and the tied head as 8-bit codes
    "rtn4_r32_emb8": {"method": "qlr", "rank": 32, "quantizer": "rtn", "rounds": 1, "embedding_bits": 8},
    "bytes0.27_b34": {"method": "qlr", "target_bytes": 0.27, "quantizer": "rtn", "rounds": 1, "allocation": "fisher",
                      "bit_choices": [3, 4]},
}
for _f in ROWS.values():  # without the input rotation (qlr's default); `_rot` rows with it: one block-Hadamard
    _f["rotate"] = False  # product on each layer's input before the int4 kernel (the rotation's cost: the ratio)
ROWS["rtn4_rot"], ROWS["bytes0.27_rot"] = ({**ROWS[r], "rotate": True} for r in ("rtn4", "bytes0.27"))


def _one(job: dict, q) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from hf_tensorcomp import TensorCompressionConfig
    from quantized import _quanto

    path, tok, row = child_setup(job)
    if job["row"] in ROWS:
        cfg = TensorCompressionConfig(progress=False, calibration="wikipedia", calibration_samples=job["calibration_samples"],
                                      calibration_length=job["calibration_length"], group_size=job["group_size"],
                                      **ROWS[job["row"]])
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=cfg).eval()
    for dtype, key in ((torch.float32, "tok_s_fp32"), (torch.bfloat16, "tok_s_bf16")):
        if job["row"] in ROWS:
            model.to(dtype)  # the codes and their float16 scales stay as stored
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
            if job["row"] == "quanto_int4":
                _quanto(model, 4)
                _without_inference_mode(model)  # quanto's int4 weights fail under inference mode
        with torch.no_grad():
            row[key] = decode_tokens_per_s(model, tok)
        print(job["model"], job["row"], key, round(row[key], 2), flush=True)
    q.put(row)


def run(cfg: dict) -> list[dict]:
    return run_rows(NAME, cfg["rows"], cfg["models"], cfg, _one)


def report(rows: list[dict]) -> str:
    out = []
    for model, rs, dense in per_model(rows):
        for r in rs:
            for k in ("fp32", "bf16"):
                r[f"x_{k}"] = r[f"tok_s_{k}"] / dense[f"tok_s_{k}"]
            r["x_bf16_vs_fp32_dense"] = r["tok_s_bf16"] / dense["tok_s_fp32"]
        out.append(f"### {model}\n")
        out.append(markdown_table(rs, [
            ("row", "row", "{}"), ("tok_s_fp32", "tok/s float32", "{:.1f}"), ("x_fp32", "vs dense float32", "{:.2f}x"),
            ("tok_s_bf16", "tok/s bfloat16", "{:.1f}"), ("x_bf16", "vs dense bfloat16", "{:.2f}x"),
            ("x_bf16_vs_fp32_dense", "bfloat16 vs dense float32", "{:.2f}x")]))
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    """No plot: a table of six numbers per model says it."""


def header(cfg: dict) -> str:
    return ("# Decode speed of 4-bit weights, float32 and bfloat16\n\n"
            f"Batch 1, greedy, 32 new tokens after a 32-token prompt, {cfg['threads']} thread(s), groups of "
            f"{cfg['group_size']}; one child process per model and row. `rtn4`: hf_tensorcomp's 4-bit codes "
            "(`qlr`, rank 0, `rotate=False`); `rtn4_rot`: the same with the input rotation (`qlr`'s default: one "
            "block-Hadamard product on each layer's input); `rtn4_r32`: plus a rank-32 whitened correction; `bytes0.27`: "
            "`target_bytes=0.27` (Fisher allocation over every width, 2, 3, 4, 5, 6 and 8 bits, and ranks; round to "
            "nearest), `bytes0.27_rot` rotated, `bytes0.27_b34`: over 3 and 4 bits; `bytes0.33`: `target_bytes=0.33`; "
            "`rtn4_r32_emb8`: `rtn4_r32` with the embedding and the tied head as 8-bit codes (the budget rows run on request). "
            "2-, 3- and 4-bit codes run PyTorch's CPU int4 kernel, 5-, 6- and 8-bit codes two calls of it. Every row "
            "from one run, nothing else running. Written by benchmarks/decode_speed.py.\n\n")


if __name__ == "__main__":
    bench_main(__doc__, NAME, DEFAULTS, run, report, plot, header)
