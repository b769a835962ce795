"""TensorLLM on the attention of single layers: ratio sweep, LASER at equal parameters, Q/K/V/O ablation, speed.

The paper's protocol (one layer at a time — decompose its attention, evaluate, revert), on each model:

(c) sweep: for each chosen layer and compression rate CR (original attention weights / compressed),
    TensorLLM with ranks picked for that CR;
(a) LASER on the same layer's q,k,v,o with one rank r storing as many parameters as TensorLLM at CR;
(b) ablation (the paper's Table IV): TensorLLM's ranks (R1, R2) at one CR applied to Q, K, V or O
    alone (tensor d_model x d_head x 1 x h, R3 = 1) vs all four together;
speed: TensorLLM at one CR on *every* layer, factorized and dense mode, and LASER at equal parameters,
    greedy decode tokens/s against the dense model (one run).

Metrics: held-out perplexity (Wikipedia eval split) and BIG-bench goal_step_wikihow accuracy.

    python benchmarks/tensorllm.py [--recipe benchmarks/recipes/tensorllm/tensorllm_benchmark.json] [--models smollm2 gemma3] ...

Writes benchmarks/results/tensorllm.json, tensorllm.md and tensorllm.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, decode_tokens_per_s, interleaved, load_recipe, markdown_table, prefill_tokens_per_s, write_json  # noqa: E402

from hf_tensorcomp import TensorCompressionConfig  # noqa: E402
from hf_tensorcomp.assets import load_bigbench_task, load_text, model_path  # noqa: E402
from hf_tensorcomp.eval import multiple_choice_accuracy, perplexity  # noqa: E402
from hf_tensorcomp.sweep import apply_approximation  # noqa: E402

ATTN = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
DEFAULTS = {"models": ["smollm2", "gemma3"], "layers": {"smollm2": [15, 27], "gemma3": [16]},
            "ratios": [1.5, 3, 8, 50], "laser_ratios": [3, 8], "ablation_ratio": 8, "speed_ratio": 16,
            "max_tokens": 1024, "mc_examples": 50}


def laser_cost_per_rank(layer) -> int:
    """Parameters LASER stores per unit of rank on a layer's q,k,v,o: sum of (out + in)."""
    return sum(sum(layer.get_submodule(t).weight.shape) for t in ATTN)


def tensorllm(layers, **kw) -> TensorCompressionConfig:
    # measured with K and V repeated per query head and the unweighted fit (before "group" and "balanced" became the
    # defaults)
    return TensorCompressionConfig(method="tensorllm", layers=layers, progress=False, gqa="repeat", slice_weight=None,
                                   **kw)


def run_model(name: str, p: dict) -> list[dict]:
    path = model_path(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    texts = load_text("wikipedia", "eval")
    mc = load_bigbench_task("goal_step_wikihow")[: p["mc_examples"]]

    def evaluate(m):
        return {"ppl": perplexity(m, tok, texts, max_tokens=p["max_tokens"], progress=False)["ppl"],
                "mc_acc": multiple_choice_accuracy(m, tok, mc, progress=False)["accuracy"]}

    base = {"model": name, "part": "dense", "layer": None, "method": "dense", **evaluate(model)}
    print(base, flush=True)
    rows = [base]
    n_layers = model.config.num_hidden_layers
    per_rank = laser_cost_per_rank(model.model.layers[0])  # same shapes in every layer

    def point(part, layer, method, cfg, **extra):
        restore, info = apply_approximation(model, cfg)
        try:
            metrics = evaluate(model)
        finally:
            restore()
        group = next((st for st in info["stats"].values() if "compression_ratio" in st), {})
        row = {"model": name, "part": part, "layer": layer % n_layers, "method": method, **extra,
               "ranks": group.get("ranks"), "params": info["factored_params"], "dense_params": info["dense_params"],
               "cr": round(info["dense_params"] / info["factored_params"], 2),
               "rel_error": group.get("rel_error", max(info["rel_errors"].values())),
               "compress_s": info["seconds"], **metrics}
        row["ppl_ratio"] = row["ppl"] / base["ppl"]
        row["mc_delta"] = row["mc_acc"] - base["mc_acc"]
        rows.append(row)
        print(row, flush=True)
        return row

    sweep = {}
    for layer in p["layers"][name]:
        for ratio in p["ratios"]:
            sweep[layer, ratio] = point("sweep", layer, "tensorllm", tensorllm([layer], ratio=ratio), target_cr=ratio)
        for ratio in p["laser_ratios"]:
            r = max(1, sweep[layer, ratio]["params"] // per_rank)
            laser = TensorCompressionConfig(method="laser", rank=r, targets=ATTN, layers=[layer], pivoted=False,
                                            progress=False)
            point("vs_laser", layer, "laser", laser, target_cr=ratio, laser_rank=r)
    mid = p["layers"][name][len(p["layers"][name]) // 2]
    r1, r2, _ = sweep[mid, p["ablation_ratio"]]["ranks"]
    for t in ATTN:
        point("ablation", mid, f"tensorllm {t.split('.')[1][0].upper()} only", tensorllm([mid], ranks=(r1, r2, 1), targets=[t]),
              target_cr=p["ablation_ratio"])

    # speed: every layer's attention at one CR; factorized and dense mode, LASER at equal parameters; all
    # variants measured round-robin in one process (median of 3), as ratios to the dense model
    def load(cfg=None):
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg).eval() if cfg else model

    variants = {"dense": model}
    for mode in ("factorized", "dense"):
        variants[f"tensorllm {mode}"] = load(tensorllm(None, ratio=p["speed_ratio"], mode=mode))
    stats = variants["tensorllm factorized"].config.quantization_config.stats["modules"]
    r = max(1, sum(st["params_compressed"] for st in stats.values() if "params_compressed" in st) // n_layers // per_rank)
    for mode in ("factorized", "dense"):
        variants[f"laser {mode}"] = load(TensorCompressionConfig(method="laser", rank=r, targets=ATTN, mode=mode,
                                                                  pivoted=False, progress=False))
    timed = interleaved(variants, {"decode": lambda m: decode_tokens_per_s(m, tok, repeats=1),
                                   "prefill": lambda m: prefill_tokens_per_s(m, tok)})
    speed = {"model": name, "part": "speed", "method": "tok/s", "cr": p["speed_ratio"], "laser_rank": r, **timed}
    print(speed, flush=True)
    rows.append(speed)
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 7), squeeze=False)
    for j, m in enumerate(models):
        base = next(r for r in rows if r["model"] == m and r["method"] == "dense")
        for i, metric in enumerate(("ppl", "mc_acc")):
            ax = axes[i][j]
            for layer in sorted({r["layer"] for r in rows if r["model"] == m and r.get("part") == "sweep"}):
                sel = sorted((r for r in rows if r["model"] == m and r.get("part") == "sweep" and r["layer"] == layer),
                             key=lambda r: r["cr"])
                ax.plot([r["cr"] for r in sel], [r[metric] for r in sel], marker="o", label=f"TensorLLM L{layer}")
                las = [r for r in rows if r["model"] == m and r.get("part") == "vs_laser" and r["layer"] == layer]
                ax.scatter([r["cr"] for r in las], [r[metric] for r in las], marker="x", s=60, label=f"LASER L{layer}")
            ax.axhline(base[metric], color="red", ls="--", label="dense")
            ax.set_xscale("log")
            if metric == "ppl":
                ax.set_yscale("log")
            ax.set_xlabel("compression rate of the layer's attention weights")
            ax.set_title(f"{m}: {metric}, one layer's attention")
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default=None, help="JSON with any of: " + ", ".join(DEFAULTS))
    ap.add_argument("--models", nargs="+", default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--mc-examples", type=int, default=None)
    args = ap.parse_args()
    p = load_recipe(args.recipe, DEFAULTS)
    for k in ("models", "max_tokens", "mc_examples"):
        if getattr(args, k) is not None:
            p[k] = getattr(args, k)
    rows = []
    for m in p["models"]:
        rows += run_model(m, p)
        write_json("tensorllm.json", rows)
    cols = [("model", "model", "{}"), ("layer", "layer", "{}"), ("method", "method", "{}"), ("target_cr", "target CR", "{}"),
            ("ranks", "ranks", "{}"), ("laser_rank", "LASER rank", "{}"), ("params", "params", "{:,}"), ("cr", "CR", "{:.1f}"),
            ("rel_error", "rel. error", "{:.3f}"), ("ppl", "ppl", "{:.2f}"), ("ppl_ratio", "ppl / dense", "{:.3f}"),
            ("mc_acc", "wikihow acc", "{:.2f}"), ("compress_s", "compress s", "{:.2f}")]
    md = [f"TensorLLM on one layer's attention ({p['max_tokens']} Wikipedia eval tokens, ctx 512; first {p['mc_examples']} "
          "goal_step_wikihow examples, length-normalised log-likelihood). CR = the layer's q,k,v,o weights / compressed. "
          f"fp32, {torch.get_num_threads()} CPU thread(s).\n"]
    titles = {"sweep": "(c) Layer x compression-rate sweep", "vs_laser": "(a) LASER on the same q,k,v,o at equal parameters",
              "ablation": "(b) Ablation: one projection alone vs all four (same R1, R2)"}
    for part, title in titles.items():
        sel = [r for r in rows if r.get("part") in (part, "dense")]
        md.append(f"## {title}\n\n{markdown_table(sel, cols)}\n")
    speed = [r for r in rows if r.get("part") == "speed"]
    names = ("tensorllm factorized", "tensorllm dense", "laser factorized", "laser dense")
    md.append("## Speed (every layer's attention compressed; ratio to the dense model; median of 3 round-robin runs in one "
              "process; decode: greedy, batch 1, 32 new tokens; prefill: one forward of 4 x 256 tokens)\n\n" + "\n".join(
        f"- {r['model']} (TensorLLM CR {r['cr']}, LASER rank {r['laser_rank']}): dense decode {r['dense decode']:.1f} tok/s, "
        f"prefill {r['dense prefill']:.0f} tok/s. Decode: " + "; ".join(f"{k} ×{r[k + ' decode'] / r['dense decode']:.2f}" for k in names)
        + ". Prefill: " + "; ".join(f"{k} ×{r[k + ' prefill'] / r['dense prefill']:.2f}" for k in names)
        for r in speed) + "\n")
    (RESULTS / "tensorllm.md").write_text("\n".join(md))
    plot(rows, RESULTS / "tensorllm.png")
    print((RESULTS / "tensorllm.md").read_text())


if __name__ == "__main__":
    main()
