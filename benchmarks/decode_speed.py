"""Decode speed of 4-bit weights: the dense model, optimum-quanto int4 and hf_tensorcomp's 4-bit codes
(`qlr` without and with a rank-32 correction, without and with the input rotation), in float32 and bfloat16.

hf_tensorcomp's 4-bit weights run PyTorch's CPU int4 kernel in both dtypes (float32 activations are
rounded to bfloat16 for the product, the kernel's only input type); the correction's two thin products
run in float32 in both. Speed depends on the shapes only, not on the codes, so the rows use the
round-to-nearest quantizer (GPTQ gives the same speed after a longer compression). Greedy decode,
batch 1, 32-token prompt, 32 new tokens. Timings on a shared machine drift by tens of percent within
minutes, so every row of a model is built in one child process and timed in turns: `rounds` rounds,
each decoding once with every row (after a 4-token warm-up), the median and the best round reported.

    python benchmarks/decode_speed.py
    python benchmarks/decode_speed.py --report-only
    python benchmarks/decode_speed.py --recipe R   # R: {"models": [...], "rows": [...], "retime": true}
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (bench_main, child_setup, decode_tokens_per_s, interleaved,  # noqa: E402
                    markdown_table, per_model, set_threads, thread_count)
from hf_tensorcomp.decompositions.quantize import BITS  # noqa: E402  (every width)

NAME = "decode_speed"
DEFAULTS = {
    "models": ["smollm2", "gemma3"],
    # the budget rows (bytes*) run on request (--recipe): each needs a one-thread Fisher calibration pass per model
    "rows": ["dense", "quanto_int4", "rtn4", "rtn4_rot_each", "rtn4_rot", "rtn4_r32", "rtn4_r32_rot", "rtn4_r32_rot_emb8"],
    "group_size": 128,
    "calibration_samples": 32,
    "calibration_length": 256,
    "threads": 1,
    "build_threads": os.cpu_count() or 1,  # compression only: speed depends on the shapes, not on the codes
    "rounds": 5,
    "retime": False,  # True: time the models again although all their rows are in the JSON (after a speed fix)
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
for _f in ROWS.values():  # without the input rotation (qlr's default); `_rot` rows with it: a block-Hadamard product
    _f["rotate"] = False  # on each input before the int4 kernel, q / k / v and gate / up sharing theirs
ROWS["rtn4_rot"], ROWS["rtn4_r32_rot"], ROWS["rtn4_r32_rot_emb8"], ROWS["bytes0.27_rot"] = (
    {**ROWS[r], "rotate": True} for r in ("rtn4", "rtn4_r32", "rtn4_r32_emb8", "bytes0.27"))
ROWS["rtn4_rot_each"] = {**ROWS["rtn4_rot"], "share": False}  # every linear rotating its own input
# the default widths of a byte budget (0.27: 4, 5, 6 and 8 bits; 0.33 likewise; 0.40: 6 and 8), rotated
for _b in ("0.27", "0.33", "0.40"):
    ROWS[f"bytes{_b}_default_rot"] = {"method": "qlr", "target_bytes": float(_b), "quantizer": "rtn", "rounds": 1,
                                      "allocation": "fisher"}
# the main job's shapes: 0.35 of the bytes of the linears and the table together, the table as 8-bit codes
ROWS["bytes0.35_emb8_default_rot"] = {**ROWS["bytes0.40_default_rot"], "target_bytes": 0.35, "embedding_bits": 8}
# Gemma-3's: 0.42 of the linears' and the table's bytes, the table as 8-bit codes (the linears at about 0.27)
ROWS["bytes0.42_emb8_default_rot"] = {**ROWS["bytes0.35_emb8_default_rot"], "target_bytes": 0.42}


def _build(job: dict, path, label: str, dtype, compressed: dict):
    """The row's model in `dtype`: compressed rows once (in float32, then cast: codes and float16 scales stay)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_tensorcomp import TensorCompressionConfig
    from hf_tensorcomp.methods.qlr import share_input_rotations
    from hf_tensorcomp.eval.peers import quanto_weight_only

    if label in ROWS:
        if label not in compressed:
            opts = dict(ROWS[label])
            share = opts.pop("share", True)
            cfg = TensorCompressionConfig(progress=False, calibration="wikipedia", group_size=job["group_size"],
                                          calibration_samples=job["calibration_samples"],
                                          calibration_length=job["calibration_length"], **opts)
            set_threads(job["build_threads"], "build_threads")  # compression on every core; timing on `threads`
            try:
                compressed[label] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                         quantization_config=cfg).eval()
            finally:
                set_threads(job["threads"])
            share_input_rotations(compressed[label], share)  # False: each rotated linear rotates its own input
        return compressed[label].to(dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if label == "quanto_int4":
        quanto_weight_only(model, 4)  # its forward outside inference mode (quanto's int4 weights fail in it)
    return model


def _model(job: dict, q) -> None:
    """Every row of one model, timed in turns (see the module docstring)."""
    import statistics

    import torch

    path, tok, base = child_setup({**job, "row": None})
    out = {label: {**base, "row": label, "rounds": job["rounds"]} for label in job["rows"]}
    compressed: dict = {}
    for dtype, key in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        models = {label: _build(job, path, label, dtype, compressed) for label in job["rows"]}
        with torch.no_grad():
            speeds = interleaved(models, {"": lambda m: decode_tokens_per_s(m, tok, repeats=1)}, job["rounds"], list)
        for label in job["rows"]:
            v = speeds[f"{label} "]
            out[label].update({f"tok_s_{key}": statistics.median(v), f"tok_s_{key}_best": max(v), f"tok_s_{key}_all": v})
        del models
    q.put(list(out.values()))


def run(cfg: dict) -> list[dict]:
    """One child per model whose rows are not all in ``results/decode_speed.json`` (every model with
    ``retime``); its rows replace that model's old ones (ratios only within one run)."""
    import json

    from common import RESULTS, in_child, write_json

    thread_count(cfg["threads"]), thread_count(cfg["build_threads"], "build_threads")  # before any child starts
    if not isinstance(cfg["retime"], bool):
        raise SystemExit(f"retime: got {cfg['retime']!r}; allowed: true or false")
    path = RESULTS / f"{NAME}.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    labels = list(dict.fromkeys(["dense", *cfg["rows"]]))
    for model in cfg["models"]:
        if not cfg["retime"] and {(model, lb) for lb in labels} <= {(r["model"], r["row"]) for r in rows}:
            continue
        new = in_child(_model, {**cfg, "model": model, "rows": labels}, model)
        if new is None:
            continue
        rows = [r for r in rows if r["model"] != model] + new
        write_json(f"{NAME}.json", rows)
    return rows


def report(rows: list[dict]) -> str:
    out = []
    for model, rs, dense in per_model(rows):
        for r in rs:
            for k in ("fp32", "bf16"):
                r[f"x_{k}"] = r[f"tok_s_{k}"] / dense[f"tok_s_{k}"]
                r[f"x_{k}_best"] = r.get(f"tok_s_{k}_best", r[f"tok_s_{k}"]) / dense.get(f"tok_s_{k}_best", dense[f"tok_s_{k}"])
            r["x_bf16_vs_fp32_dense"] = r["tok_s_bf16"] / dense["tok_s_fp32"]
        out.append(f"### {model}\n\nCPU (torch's dispatch): {dense.get('cpu', 'not recorded')}\n")
        out.append(markdown_table(rs, [
            ("row", "row", "{}"), ("tok_s_fp32", "tok/s float32 (median)", "{:.1f}"), ("x_fp32", "vs dense float32", "{:.2f}x"),
            ("x_fp32_best", "best rounds' ratio", "{:.2f}x"), ("tok_s_bf16", "tok/s bfloat16 (median)", "{:.1f}"),
            ("x_bf16", "vs dense bfloat16", "{:.2f}x"), ("x_bf16_best", "best rounds' ratio", "{:.2f}x"),
            ("x_bf16_vs_fp32_dense", "bfloat16 vs dense float32", "{:.2f}x")]))
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    """No plot: a table of a few numbers per model says it."""


def header(cfg: dict) -> str:
    return ("# Decode speed of 4-bit weights, float32 and bfloat16\n\n"
            f"Batch 1, greedy, 32 new tokens after a 32-token prompt, {cfg['threads']} thread(s), groups of "
            f"{cfg['group_size']}; every row of a model in one child process, timed in turns: {cfg['rounds']} rounds, "
            "each decoding once with every row; the median of the rounds and the ratio of the best rounds. `rtn4`: "
            "hf_tensorcomp's 4-bit codes (`qlr`, rank 0, `rotate=False`); `rtn4_rot`: the same with the input rotation "
            "(`qlr`'s default: a block-Hadamard product on each input, q / k / v and gate / up sharing theirs: four a "
            "layer); `rtn4_rot_each`: every linear rotating its own input (seven a layer); `rtn4_r32`: plus a rank-32 "
            "whitened correction, `rtn4_r32_rot` rotated; `rtn4_r32_rot_emb8`: with the embedding and the tied head "
            "as 8-bit codes too (the main job's shapes before 0.35). On request (`--recipe`): `bytes0.27`: "
            "`target_bytes=0.27` (Fisher allocation over every width, 2, 3, 4, 5, 6 and 8 bits, and ranks; round to nearest), "
            "`bytes0.27_rot` rotated, `bytes0.27_b34`: over 3 and 4 bits; `bytes0.33`: `target_bytes=0.33`; "
            "`bytes{0.27,0.33,0.40}_default_rot`: the default widths at that budget (from the widest that fits "
            "everywhere up), rotated; `bytes0.35_emb8_default_rot`: the main job's shapes (0.35 of the linears' and "
            "the table's bytes together, the table as 8-bit codes; round to nearest here), `bytes0.42_emb8_default_rot` the same "
            "at 0.42 (Gemma-3: the linears at about 0.27). "
            "2-, 3- and 4-bit codes run PyTorch's CPU int4 kernel, 5-, 6- and 8-bit codes two calls of it. The "
            "compression (untimed) on every core, the timing on the thread count above. Nothing else running. "
            "Written by benchmarks/decode_speed.py.\n\n")


if __name__ == "__main__":
    bench_main(__doc__, NAME, DEFAULTS, run, report, plot, header)
