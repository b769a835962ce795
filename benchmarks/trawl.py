"""TRAWL (CP, Tucker) against LASER at equal parameter count, on the FFN of single layers.

The paper's protocol: one layer at a time — decompose its FFN (gate/up/down stacked, down transposed),
evaluate, revert. Per model and layer, three budgets; at each, LASER rank r on each of the three
matrices, TRAWL-CP rank R and TRAWL-Tucker ranks (3, R1, R1) chosen to store the same number of
parameters. Metrics: held-out perplexity (Wikipedia eval split) and BIG-bench goal_step_wikihow
accuracy; compression time. Then, for the middle budget on the last layer, decode speed of the
factorized and the dense-mode model against the dense model.

    python benchmarks/trawl.py [--models smollm2 gemma3] [--max-tokens 2048] [--mc-examples 100]

Writes benchmarks/results/trawl.json, trawl.md and trawl.png.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, decode_tokens_per_s, markdown_table, write_json  # noqa: E402

from hf_tensorcomp import TensorCompressionConfig  # noqa: E402
from hf_tensorcomp.assets import load_bigbench_task, load_text, model_path  # noqa: E402
from hf_tensorcomp.eval import multiple_choice_accuracy, perplexity  # noqa: E402
from hf_tensorcomp.sweep import apply_approximation  # noqa: E402

LASER_RANKS = (32, 128)


def equal_budget(r: int, o: int, n: int) -> dict:
    """LASER rank r on three O x N matrices, and the CP / Tucker ranks storing as many parameters."""
    budget = 3 * r * (o + n)
    cp = max(1, round(budget / (o + n + 3)))
    # Tucker (3, t, t): O t + N t + 3 t^2 + 3 (the slices' rows) = budget
    t = int((-(o + n) + math.sqrt((o + n) ** 2 + 12 * (budget - 3))) / 6)
    return {"laser": r, "cp": cp, "tucker": [3, t, t]}


def configs(layer: int, ranks: dict) -> dict[str, TensorCompressionConfig]:
    return {
        "laser": TensorCompressionConfig(method="laser", rank=ranks["laser"], targets=["mlp.*_proj"], layers=[layer],
                                         pivoted=False, progress=False),
        "trawl-cp": TensorCompressionConfig(method="trawl", decomposition="cp", group="fc", rank=ranks["cp"], layers=[layer],
                                            n_iter_max=50, slice_weight=None, progress=False),  # the paper's fit
        "trawl-tucker": TensorCompressionConfig(method="trawl", decomposition="tucker", group="fc", rank=ranks["tucker"],
                                                layers=[layer], slice_weight=None, progress=False),
    }


def run_model(name: str, layers: list[int], max_tokens: int, mc_examples: int) -> list[dict]:
    path = model_path(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    texts = load_text("wikipedia", "eval")
    mc = load_bigbench_task("goal_step_wikihow")[:mc_examples]

    def evaluate(m):
        return {"ppl": perplexity(m, tok, texts, max_tokens=max_tokens, progress=False)["ppl"],
                "mc_acc": multiple_choice_accuracy(m, tok, mc, progress=False)["accuracy"]}

    base = {"model": name, "layer": None, "method": "dense", **evaluate(model)}
    print(base, flush=True)
    rows = [base]
    o, n = model.model.layers[0].mlp.gate_proj.weight.shape
    n_layers = model.config.num_hidden_layers
    for layer in layers:
        for r in LASER_RANKS:
            ranks = equal_budget(r, o, n)
            for method, cfg in configs(layer, ranks).items():
                restore, info = apply_approximation(model, cfg)
                try:
                    row = {"model": name, "layer": layer % n_layers, "method": method, "budget_laser_rank": r,
                           "rank": str(cfg.rank), "params": info["factored_params"], "dense_params": info["dense_params"],
                           "mean_rel_error": sum(info["rel_errors"].values()) / len(info["rel_errors"]),
                           "compress_s": info["seconds"], **evaluate(model)}
                finally:
                    restore()
                row["ppl_ratio"] = row["ppl"] / base["ppl"]
                row["mc_delta"] = row["mc_acc"] - base["mc_acc"]
                rows.append(row)
                print(row, flush=True)
    # decode speed: last layer, first budget, factorized and dense mode vs dense (one run, same prompt)
    speed = {"model": name, "method": "decode tok/s", "dense": decode_tokens_per_s(model, tok)}
    del model
    for method, cfg in configs(layers[-1], equal_budget(LASER_RANKS[0], o, n)).items():
        for mode in ("factorized", "dense"):
            d = cfg.to_dict()["entries"][0]
            d["mode"] = mode
            m = AutoModelForCausalLM.from_pretrained(path, quantization_config=TensorCompressionConfig(entries=[d], progress=False)).eval()
            speed[f"{method} {mode}"] = decode_tokens_per_s(m, tok)
            del m
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
        pts = [r for r in rows if r["model"] == m and r.get("layer") is not None]
        base = next(r for r in rows if r["model"] == m and r["method"] == "dense")
        for i, metric in enumerate(("ppl", "mc_acc")):
            ax = axes[i][j]
            for method, marker in (("laser", "o"), ("trawl-cp", "s"), ("trawl-tucker", "^")):
                sel = [r for r in pts if r["method"] == method]
                ax.scatter([f"L{r['layer']} r{r['budget_laser_rank']}" for r in sel], [r[metric] for r in sel], marker=marker, label=method)
            ax.axhline(base[metric], color="red", ls="--", label="dense")
            ax.set_title(f"{m}: {metric} (FFN of one layer, equal parameters)")
            ax.tick_params(axis="x", rotation=45, labelsize=7)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    ap.add_argument("--layers", nargs="+", type=int, default=[-2, -1])
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--mc-examples", type=int, default=100)
    args = ap.parse_args()
    rows = []
    for m in args.models:
        rows += run_model(m, args.layers, args.max_tokens, args.mc_examples)
        write_json("trawl.json", rows)
    pts = [r for r in rows if r.get("layer") is not None or r["method"] == "dense"]
    cols = [("model", "model", "{}"), ("layer", "layer", "{}"), ("method", "method", "{}"), ("rank", "rank", "{}"),
            ("params", "params", "{:,}"), ("dense_params", "dense params", "{:,}"), ("mean_rel_error", "rel. error", "{:.3f}"),
            ("ppl", "ppl", "{:.2f}"), ("mc_acc", "wikihow acc", "{:.3f}"), ("compress_s", "compress s", "{:.2f}")]
    speed = [r for r in rows if r["method"] == "decode tok/s"]
    speed_md = "\n".join(
        f"- {r['model']}: dense {r['dense']:.1f} tok/s; " + "; ".join(f"{k} ×{v / r['dense']:.2f}" for k, v in r.items()
                                                                 if k not in ("model", "method", "dense"))
        for r in speed)
    (RESULTS / "trawl.md").write_text(
        f"TRAWL vs LASER at equal parameters, FFN of one layer at a time ({args.max_tokens} Wikipedia eval tokens, ctx 512; "
        f"first {args.mc_examples} goal_step_wikihow examples, length-normalised log-likelihood)\n\n"
        f"{markdown_table(pts, cols)}\n\nDecode speed (greedy, batch 1, 32 new tokens; last layer, smallest budget; "
        f"ratio to the dense model, same run):\n\n{speed_md}\n")
    plot(rows, RESULTS / "trawl.png")
    print((RESULTS / "trawl.md").read_text())


if __name__ == "__main__":
    main()
