"""LASER on SmolLM2-135M and Gemma-3-270M: quality, size and speed against the dense model and int8.

For each model: LASER at several rank fractions on the attention (q,k,v,o) and on the FFN
(gate,up,down) of the last quarter of the layers, and on q,k of all layers. (On every layer, v/o and
FFN truncation wrecks these small models: SmolLM2 goes from ppl ~27 to thousands even at rank 0.7.) Each row: parameters, bytes
on disk, held-out perplexity (Wikipedia eval split), compression time, greedy decode tokens/s in
factorized and in dense mode — all as ratios to the dense model measured in the same run. The peers:
weight-only int8 and int4 quantization of every decoder-layer nn.Linear (optimum-quanto; what LASER's
bytes should be compared with), and PyTorch's dynamic int8 of every nn.Linear (which quantizes the
activations too).

    python benchmarks/laser.py [--models smollm2 gemma3] [--max-tokens 4096]
    python benchmarks/laser.py --peers-only     # remeasure dense + the weight-only peers, keep the other rows

Writes benchmarks/results/laser.json, laser.md and laser.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from common import (RESULTS, WEIGHT_ONLY, decode_tokens_per_s, disk_bytes, markdown_table, ppl, torch_save_bytes,  # noqa: E402
                    weight_only_peers, write_json)

from hf_tensorcomp import TensorCompressionConfig  # noqa: E402
from hf_tensorcomp.assets import model_path  # noqa: E402

RANKS = (0.75, 0.5, 0.25)
INT8_DYNAMIC = "int8 dynamic (torch), all Linear"


def groups(n_layers: int):
    q = max(1, n_layers // 4)
    return [(f"attn q,k,v,o, last {q} layers", ["self_attn.*_proj"], list(range(-q, 0))),
            (f"ffn, last {q} layers", ["mlp.*_proj"], list(range(-q, 0))),
            ("attn q,k, all layers", ["self_attn.q_proj", "self_attn.k_proj"], None)]


def dense_and_peers(name: str, max_tokens: int) -> list[dict]:
    """The dense row, then the weight-only peers (ratios against this dense row: add_ratios)."""
    torch.manual_seed(0)
    path = model_path(name)
    tok = AutoTokenizer.from_pretrained(path)
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    base = {"model": name, "variant": "dense", "params": dense.num_parameters(), "bytes": disk_bytes(dense),
            "ppl": ppl(dense, tok, max_tokens), "tok_s": decode_tokens_per_s(dense, tok)}
    print(base, flush=True)
    del dense
    peers = weight_only_peers(lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tok, max_tokens)
    return [base] + [{"model": name, **r} for r in peers]


def add_ratios(rows: list[dict], base: dict) -> list[dict]:
    for r in rows:
        r["params_ratio"] = r["params"] / base["params"]
        r["bytes_ratio"] = r["bytes"] / base["bytes"]
        r["ppl_ratio"] = r["ppl"] / base["ppl"]
        r["speed_ratio"] = r["tok_s"] / base["tok_s"]
        if "tok_s_dense_mode" in r:
            r["speed_ratio_dense_mode"] = r["tok_s_dense_mode"] / base["tok_s"]
    return rows


def run_model(name: str, max_tokens: int) -> list[dict]:
    rows = dense_and_peers(name, max_tokens)
    base = rows[0]
    path = model_path(name)
    tok = AutoTokenizer.from_pretrained(path)
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    int8 = torch.ao.quantization.quantize_dynamic(dense, {torch.nn.Linear}, dtype=torch.qint8)
    rows.append({"model": name, "variant": INT8_DYNAMIC, "params": base["params"],
                 "bytes": torch_save_bytes(int8), "ppl": ppl(int8, tok, max_tokens), "tok_s": decode_tokens_per_s(int8, tok)})
    print(rows[-1], flush=True)
    del int8, dense
    n_layers = AutoModelForCausalLM.from_pretrained(path).config.num_hidden_layers
    for label, targets, layers in groups(n_layers):
        for r in RANKS:
            cfg = dict(method="laser", rank=r, targets=targets, layers=layers, pivoted=False, progress=False)
            t0 = time.perf_counter()
            fac = AutoModelForCausalLM.from_pretrained(path, quantization_config=TensorCompressionConfig(**cfg)).eval()
            load_s = time.perf_counter() - t0
            st = fac.config.quantization_config.stats
            row = {"model": name, "variant": f"laser r={r} {label}", "params": fac.num_parameters(),
                   "bytes": disk_bytes(fac), "ppl": ppl(fac, tok, max_tokens), "tok_s": decode_tokens_per_s(fac, tok),
                   "compress_s": st["compress_seconds"], "load_compress_s": round(load_s, 2)}
            del fac
            den = AutoModelForCausalLM.from_pretrained(path, quantization_config=TensorCompressionConfig(**cfg, mode="dense")).eval()
            row["tok_s_dense_mode"] = decode_tokens_per_s(den, tok)
            del den
            rows.append(row)
            print(row, flush=True)
    return add_ratios(rows, base)


def peers_only(models: list[str], max_tokens: int) -> list[dict]:
    """Remeasure dense and the weight-only peers; the other rows of laser.json stay as they were.

    Peer rows carry ratios against the dense model measured with them (``"dense_rerun"``)."""
    rows = json.loads((RESULTS / "laser.json").read_text())
    for name in models:
        base, *peers = dense_and_peers(name, max_tokens)
        for r in peers:
            r["dense_rerun"] = {k: base[k] for k in ("ppl", "tok_s", "bytes")}
        add_ratios(peers, base)
        kept = [r for r in rows if not (r["model"] == name and r["variant"] in WEIGHT_ONLY)]
        at = max(i for i, r in enumerate(kept) if r["model"] == name and r["variant"] in ("dense", INT8_DYNAMIC)) + 1
        rows = kept[:at] + peers + kept[at:]
        write_json("laser.json", rows)
    return rows


COLS = [("model", "model", "{}"), ("variant", "variant", "{}"), ("params_ratio", "params ×", "{:.3f}"),
        ("bytes_ratio", "disk ×", "{:.3f}"), ("ppl", "ppl", "{:.2f}"), ("ppl_ratio", "ppl ×", "{:.2f}"),
        ("compress_s", "compress s", "{:.1f}"), ("speed_ratio", "decode × (factorized)", "{:.2f}"),
        ("speed_ratio_dense_mode", "decode × (dense mode)", "{:.2f}")]


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, m in zip(axes[0], models):
        rs = [r for r in rows if r["model"] == m]
        for r in rs:
            if r["variant"] == "dense" or r["variant"].startswith("int"):
                ax.scatter(r["params_ratio"] if r["variant"] == "dense" else r["bytes_ratio"], r["ppl"],
                           marker="*" if r["variant"] == "dense" else "s", s=120, label=r["variant"] + (" (x: bytes)" if r["variant"].startswith("int") else ""))
        for label in dict.fromkeys(r["variant"].split(" ", 2)[2] for r in rs if r["variant"].startswith("laser")):
            pts = sorted((r["params_ratio"], r["ppl"]) for r in rs if r["variant"].endswith(label) and r["variant"].startswith("laser"))
            ax.plot(*zip(*pts), marker="o", label=f"LASER {label}")
        ax.set_yscale("log")
        ax.set_xlabel("parameters (fraction of dense)")
        ax.set_ylabel("perplexity (Wikipedia eval split, ctx 512)")
        ax.set_title(m)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--peers-only", action="store_true", help="remeasure dense + the weight-only peers only")
    args = ap.parse_args()
    if args.peers_only:
        rows = peers_only(args.models, args.max_tokens)
    else:
        rows = []
        for m in args.models:
            rows += run_model(m, args.max_tokens)
            write_json("laser.json", rows)
    table = markdown_table(rows, COLS)
    rerun = [r for r in rows if "dense_rerun" in r]
    note = (f" The weight-only rows were measured in a later run ({torch.get_num_threads()} thread(s)) with their own "
            "dense baseline: their ratios are against it (dense ppl / decode tok/s of that run: "
            + "; ".join(f"{m} {d['ppl']:.2f} / {d['tok_s']:.1f}" for m, d in {r["model"]: r["dense_rerun"] for r in rerun}.items())
            + "). Bytes: every stored tensor (int8 / packed int4 weights, scales, shifts; embeddings fp32)."
            if rerun else "")
    header = (f"LASER benchmark ({args.max_tokens} Wikipedia eval tokens, ctx 512; decode: greedy, batch 1, 32 new tokens, "
              f"CPU, {torch.get_num_threads()} threads; ratios against the dense fp32 model of the same run)")
    if args.peers_only:  # the other rows keep the setting they were measured in
        header = (RESULTS / "laser.md").read_text().split("\n\n")[0].split(" The weight-only rows")[0]
    (RESULTS / "laser.md").write_text(f"{header}{note}\n\n{table}\n")
    plot(rows, RESULTS / "laser.png")
    print(table)


if __name__ == "__main__":
    main()
