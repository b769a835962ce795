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

Every speed is measured at each thread count of ``threads`` (a list; "default": PyTorch's own default on this
machine, what a user gets), one table column per count, the count stated. ``saved`` rows time a model folder as
written (e.g. the main job's ``--out``), reloaded as a user reloads it: {"saved": {"main_job": "/tmp/out_main"}}.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (RESULTS, bench_main, bytes_read_per_token, child_setup, decode_tokens_per_s, interleaved,  # noqa: E402
                    markdown_table, per_model, read_bandwidth_gb_s, set_threads, thread_count)
from hf_tensorcomp.decompositions.quantize import BITS  # noqa: E402  (every width)
from hf_tensorcomp.eval.memory import held_bytes  # noqa: E402

NAME = "decode_speed"
DEFAULTS = {
    "models": ["smollm2", "gemma3"],
    # the budget rows (bytes*) run on request (--recipe): each needs a one-thread Fisher calibration pass per model
    "rows": ["dense", "quanto_int4", "rtn4", "rtn4_rot_each", "rtn4_rot", "rtn4_r32", "rtn4_r32_rot", "rtn4_r32_rot_emb8"],
    "group_size": 128,
    "calibration_samples": 32,
    "calibration_length": 256,
    "threads": [1, "default"],  # each timed; "default": torch.get_num_threads() as the child starts (a user's)
    "dtypes": ["fp32", "bf16"],
    "prompt_tokens": 32,
    "new_tokens": 32,
    "saved": {},  # row label -> a saved model folder, reloaded and timed as it is
    "compiled": [],  # rows also timed compiled: `torch.compile(model.forward)` with cache_implementation="static"
    "note": "",  # said under the header (e.g. what else ran on the machine)
    "build_threads": os.cpu_count() or 1,  # compression only: speed depends on the shapes, not on the codes
    "rounds": 5,
    "retime": False,  # True: time the models again although all their rows are in the JSON (after a speed fix)
    "results": NAME,  # the results files' name (results/<results>.json / .md / .png): a recipe timing other rows apart
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

    if label in job["saved"]:
        import hf_tensorcomp  # noqa: F401  (the quantizer registered)

        return AutoModelForCausalLM.from_pretrained(job["saved"][label], dtype=dtype).eval()
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
                set_threads(job["timing_threads"][0])
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

    default = torch.get_num_threads()  # PyTorch's default in a fresh process: what a user gets
    job["timing_threads"] = list(dict.fromkeys(default if t == "default" else t for t in job["threads"]))
    path, tok, base = child_setup({**job, "threads": job["timing_threads"][0], "row": None})
    out = {label: {**base, "row": label, "rounds": job["rounds"], "default_threads": default,
                   "prompt_tokens": job["prompt_tokens"], "new_tokens": job["new_tokens"]} for label in job["rows"]}
    compressed: dict = {}
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    bandwidth = {}
    for n in job["timing_threads"]:
        set_threads(n)
        bandwidth[n] = read_bandwidth_gb_s()
    for label in out:
        out[label]["bandwidth_gb_s"] = {str(n): round(b, 2) for n, b in bandwidth.items()}
    for label in job["compiled"]:
        out[f"{label} compiled"] = {**out[label], "row": f"{label} compiled"}
    for key in job["dtypes"]:
        models = {label: _build(job, path, label, dtypes[key], compressed) for label in job["rows"]}
        for label in job["compiled"]:  # the fast-generation path transformers documents
            models[f"{label} compiled"] = twin = _build(job, path, label, dtypes[key], {})
            twin.forward = torch.compile(twin.forward)
            twin.generation_config.cache_implementation = "static"
            decode_tokens_per_s(twin, tok, new_tokens=job["new_tokens"], repeats=0, prompt_tokens=job["prompt_tokens"])
        for n in job["timing_threads"]:
            set_threads(n)
            with torch.no_grad():
                speeds = interleaved(models, {"": lambda m: decode_tokens_per_s(
                    m, tok, new_tokens=job["new_tokens"], repeats=1, prompt_tokens=job["prompt_tokens"])}, job["rounds"], list)
            for label in models:
                v = speeds[f"{label} "]
                out[label].update({f"tok_s_{key}_t{n}": statistics.median(v), f"tok_s_{key}_t{n}_best": max(v),
                                   f"tok_s_{key}_t{n}_all": v})
        for label, m in models.items():  # after every generate: what the model holds and reads a token
            out[label].update({f"held_mb_{key}": held_bytes(m) / 1e6, f"read_mb_{key}": bytes_read_per_token(m) / 1e6})
        del models
    q.put(list(out.values()))


def run(cfg: dict) -> list[dict]:
    """One child per model whose rows are not all in ``results/<results>.json`` (every model with
    ``retime``); its rows replace that model's old ones (ratios only within one run)."""
    import json

    from common import RESULTS, in_child, write_json

    if not isinstance(cfg["threads"], list) or not cfg["threads"]:
        raise SystemExit(f"threads: got {cfg['threads']!r}; allowed: a non-empty list of ints >= 1 and \"default\"")
    for t in cfg["threads"]:
        if t != "default":
            thread_count(t)
    thread_count(cfg["build_threads"], "build_threads")  # before any child starts
    unknown = sorted(set(cfg["dtypes"]) - {"fp32", "bf16"})
    if unknown or not cfg["dtypes"]:
        raise SystemExit(f"dtypes: got {cfg['dtypes']!r}; allowed: a non-empty list of \"fp32\" and \"bf16\"")
    if not isinstance(cfg["retime"], bool):
        raise SystemExit(f"retime: got {cfg['retime']!r}; allowed: true or false")
    path = RESULTS / f"{cfg['results']}.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    labels = list(dict.fromkeys(["dense", *cfg["rows"], *cfg["saved"]]))
    for model in cfg["models"]:
        if not cfg["retime"] and {(model, lb) for lb in labels} <= {(r["model"], r["row"]) for r in rows}:
            continue
        new = in_child(_model, {**cfg, "model": model, "rows": labels}, model)
        if new is None:
            continue
        rows = [r for r in rows if r["model"] != model] + new
        write_json(path.name, rows)
    return rows


def report(rows: list[dict]) -> str:
    """Per model: every row in each dtype at each thread count — tok/s, the ratio to the dense model in float32
    AND in bfloat16 (same run), the bytes held after generate, the bytes read a token, and the fraction of the
    memory-bound limit (read bandwidth / bytes read a token) the row reaches. Rows written before bytes were
    recorded: their old per-dtype table."""
    out = []
    for r in rows:  # rows written before thread counts were recorded: one thread
        r.update({f"{k}_t1": r[k] for k in ("tok_s_fp32", "tok_s_bf16") if k in r})
    for model, rs, dense in per_model(rows):
        out.append(f"### {model}\n\nCPU (torch's dispatch): {dense.get('cpu', 'not recorded')}; PyTorch's default "
                   f"threads here: {dense.get('default_threads', 'not recorded')}; read bandwidth (a torch sum over 1 GiB): "
                   + ", ".join(f"{b} GB/s at {n} thread{'s' * (int(n) > 1)}" for n, b in dense.get("bandwidth_gb_s", {}).items())
                   + "\n")
        counts = sorted({int(m[2]) for k in dense if (m := re.fullmatch(r"tok_s_(fp32|bf16)_t(\d+)", k))})
        table = []
        for r in rs:
            for key, name in (("fp32", "float32"), ("bf16", "bfloat16")):
                if not counts or f"tok_s_{key}_t{counts[0]}" not in r:
                    continue
                row = {"row": f"{r['row']} ({name})", "held": r.get(f"held_mb_{key}"), "read": r.get(f"read_mb_{key}")}
                for n in counts:
                    v = r.get(f"tok_s_{key}_t{n}")
                    bw = dense.get("bandwidth_gb_s", {}).get(str(n))
                    ratio = lambda d: v / dense[f"tok_s_{d}_t{n}"] if v and f"tok_s_{d}_t{n}" in dense else None  # noqa: E731
                    row.update({f"t{n}": v, f"x32_{n}": ratio("fp32"), f"x16_{n}": ratio("bf16"),
                                f"lim_{n}": v * row["read"] / 1e3 / bw if v and bw and row["read"] else None})
                table.append(row)
        peer = RESULTS / "decode_speed_llamacpp.json"  # the CPU engine a user picks instead (gguf_llamacpp.py --bundled)
        if peer.exists() and json.loads(peer.read_text()).get("model") == model:
            rows_ = json.loads(peer.read_text())["rows"]
            mb = rows_[0]["file_bytes"] / 1e6
            row = {"row": rows_[0]["row"] + ", run after this table's", "held": mb, "read": mb}
            for n in counts:
                v = next((r["tok_s"] for r in rows_ if r["threads"] == n), None)
                bw = dense.get("bandwidth_gb_s", {}).get(str(n))
                row.update({f"t{n}": v, f"x32_{n}": v / dense[f"tok_s_fp32_t{n}"] if v and f"tok_s_fp32_t{n}" in dense else None,
                            f"x16_{n}": v / dense[f"tok_s_bf16_t{n}"] if v and f"tok_s_bf16_t{n}" in dense else None,
                            f"lim_{n}": v * mb / 1e3 / bw if v and bw else None})
            table.append(row)
        cols = [("row", "row", "{}"), ("held", "MB held after generate", "{:.1f}"), ("read", "MB read a token", "{:.1f}")]
        for n in counts:
            t = f"{n} thread{'s' * (n > 1)}"
            cols += [(f"t{n}", f"tok/s, {t}", "{:.1f}"), (f"x32_{n}", "x dense fp32", "{:.2f}x"),
                     (f"x16_{n}", "x dense bf16", "{:.2f}x"), (f"lim_{n}", "of the memory limit", "{:.0%}")]
        out += [markdown_table(table, cols), ""]
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    """No plot: a table of a few numbers per model says it."""


def header(cfg: dict) -> str:
    return ("# Decode speed of 4-bit weights, float32 and bfloat16\n\n"
            f"Batch 1, greedy, {cfg['new_tokens']} new tokens after a {cfg['prompt_tokens']}-token prompt, timed at each "
            f"thread count of {cfg['threads']} (\"default\": PyTorch's default, what a user gets; the count is in each "
            "column), groups of "
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
            "compression (untimed) on every core, the timing on the thread counts above. `saved` rows: a model folder "
            "as written (e.g. `main_job`: the main job's output, `hf-tensorcomp compress --recipe recipes/qlr_smollm2.json`), "
            "reloaded as a user reloads it. "
            "Written by benchmarks/decode_speed.py.\n\n" + (f"{cfg['note']}\n\n" if cfg.get("note") else ""))


if __name__ == "__main__":
    bench_main(__doc__, NAME, DEFAULTS, run, report, plot, header)
