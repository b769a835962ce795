"""Rotor layers on SmolLM2-135M (or Gemma-3-270M, `model`): q/k/v of one, two or three layers replaced by rotor / LR1 / LR4 / BH1.

The shape of the paper's Tables 1-3, on one thread. For each structure, one ``from_pretrained`` with
``TensorCompressionConfig(method="rotor", structure=..., layers=<all layers used>, retrain_o=True,
propagate=False, calibration="wikipedia")`` trains q/k/v of every layer used on the dense model's
activations (Wikipedia "calib" split) and a fresh dense o_proj per layer on the block's dense output
(``o_epochs``). With ``propagate=False`` each layer's stand-ins depend on that layer only, so every
layer subset of the grid is that model's modules swapped into the dense model — both ways: o_proj
untouched (dense) and o_proj retrained. Each row: log-perplexity on the held-out "eval" split (disjoint
from "calib"), BIG-bench goal_step_wikihow accuracy (zero-shot, length-normalized; on the subsets in
``bigbench_subsets``, o_proj retrained, and dense), the parameters of the replaced projections (with
and without the retrained o_proj). Also: training seconds per projection, the fits' relative MSE,
and the forward time of a trained rotor projection against the dense nn.Linear at batch 1 and 64.

    OMP_NUM_THREADS=1 python benchmarks/rotor.py [--recipe benchmarks/recipes/rotor/rotor_benchmark.json]

Writes benchmarks/results/<out>.json (after every row), <out>.md and <out>.png (``out``: "rotor" by
default; ``--resume`` keeps the rows already there and runs the missing ones. A structure whose
stand-in the library refuses (e.g. worse than zeros) is recorded with the message, and its subsets
without the refused layer are run. benchmarks/recipes/rotor/rotor_gemma.json writes rotor_gemma.*).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, best_time, load_recipe, markdown_table, set_threads, write_json  # noqa: E402

from hf_tensorcomp import TensorCompressionConfig  # noqa: E402
from hf_tensorcomp.assets import load_bigbench_task, load_text, model_path  # noqa: E402
from hf_tensorcomp.eval import multiple_choice_accuracy, perplexity  # noqa: E402

DEFAULTS = {
    "model": "smollm2",
    "structures": ["rotor", "lr1", "lr4", "bh1"],
    "subsets": [[15], [5], [25], [15, 25], [5, 15, 25]],
    "bigbench_subsets": [[15], [15, 25], [5, 15, 25]],
    "calibration_samples": 32,
    "calibration_length": 256,
    "eval_tokens": 4096,
    "bigbench_examples": 50,
    "o_epochs": 15,
    "seed": 0,
    "out": "rotor",
}
QKV = ("q_proj", "k_proj", "v_proj")


def log_ppl(model, tok, max_tokens: int) -> float:
    return perplexity(model, tok, load_text("wikipedia", "eval"), context_length=512, stride=512,
                      max_tokens=max_tokens, progress=False)["nll"]


def bigbench(model, tok, examples) -> float:
    return multiple_choice_accuracy(model, tok, examples, progress=False)["accuracy"]


def swapped(dense, source, layers, leaves):
    """Put `source`'s modules `leaves` of the attention blocks of `layers` into `dense`; returns an undo."""
    saved = []
    for li in layers:
        attn, new = dense.model.layers[li].self_attn, source.model.layers[li].self_attn
        for leaf in leaves:
            saved.append((attn, leaf, getattr(attn, leaf)))
            setattr(attn, leaf, getattr(new, leaf))

    def undo():
        for attn, leaf, mod in saved:
            setattr(attn, leaf, mod)
    return undo


def timing(dense, comp, layer: int, tokens: torch.Tensor) -> dict:
    """ms per call of the trained stand-ins of `layer`'s q/k projections against the dense Linears."""
    out = {}
    with torch.no_grad():
        for leaf in ("q_proj", "k_proj"):
            lin, new = getattr(dense.model.layers[layer].self_attn, leaf), getattr(comp.model.layers[layer].self_attn, leaf)
            for b in (1, 64):
                xb = tokens[:b].contiguous()
                t_lin = best_time(lambda: lin(xb), 200 if b == 1 else 50)
                t_new = best_time(lambda: new(xb), 20 if b == 1 else 5)
                out[f"{leaf} batch{b}"] = {"linear_ms": round(t_lin * 1e3, 4), "ms": round(t_new * 1e3, 3),
                                           "vs_linear": round(t_new / t_lin, 2)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", help="JSON file overriding DEFAULTS (e.g. benchmarks/recipes/rotor/rotor_benchmark.json)")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in <out>.json and run only the missing ones")
    args = ap.parse_args()
    cfg = load_recipe(args.recipe, DEFAULTS)
    set_threads(1)
    torch.manual_seed(cfg["seed"])
    path = model_path(cfg["model"])
    tok = AutoTokenizer.from_pretrained(path)
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    examples = load_bigbench_task("goal_step_wikihow")[: cfg["bigbench_examples"]]
    layers = sorted({li for s in cfg["subsets"] for li in s})
    n_dense = {leaf: getattr(dense.model.layers[layers[0]].self_attn, leaf).weight.numel() for leaf in (*QKV, "o_proj")}
    res = {"config": cfg, "rows": [], "fits": [], "timing": {}}
    done = set()
    if args.resume and (RESULTS / f"{cfg['out']}.json").is_file():  # keep earlier rows, run only the missing ones
        res = json.loads((RESULTS / f"{cfg['out']}.json").read_text())
        old = res["config"]
        res["config"] = {**cfg, "structures": list(dict.fromkeys(old["structures"] + cfg["structures"])),
                         "subsets": old["subsets"] + [x for x in cfg["subsets"] if x not in old["subsets"]]}
        done = {(r["structure"], r["layers"], r["o_proj"]) for r in res["rows"] if r.get("log_ppl") is not None}
    if ("dense", "-", "-") not in done:
        t0 = time.perf_counter()
        res["rows"].append({"structure": "dense", "layers": "-", "o_proj": "-", "log_ppl": log_ppl(dense, tok, cfg["eval_tokens"]),
                            "bigbench": bigbench(dense, tok, examples), "params_qkv": sum(n_dense[x] for x in QKV),
                            "params_qkvo": sum(n_dense.values()), "seconds": round(time.perf_counter() - t0, 1)})
        print(res["rows"][-1], flush=True)
    for structure in cfg["structures"]:
        subsets = [x for x in cfg["subsets"] if (structure, ",".join(map(str, x)), "retrained") not in done]
        if not subsets:
            continue
        comp = None
        while subsets and comp is None:
            layers = sorted({li for x in subsets for li in x})
            qc = TensorCompressionConfig(method="rotor", structure=structure, layers=layers, retrain_o=True,
                                         o_epochs=cfg["o_epochs"], seed=cfg["seed"], propagate=False, calibration="wikipedia",
                                         calibration_samples=cfg["calibration_samples"],
                                         calibration_length=cfg["calibration_length"], progress=False)
            t0 = time.perf_counter()
            try:
                comp = AutoModelForCausalLM.from_pretrained(path, quantization_config=qc, dtype=torch.float32).eval()
            except ValueError as e:  # a stand-in refused by the library's checks (e.g. worse than zeros): recorded,
                res["rows"].append({"structure": structure, "layers": ",".join(map(str, layers)), "o_proj": "-", "error": str(e)})
                print(res["rows"][-1], flush=True)
                write_json(f"{cfg['out']}.json", res)
                bad = re.search(r"model\.layers\.(\d+)\.", str(e))  # then the subsets without the refused layer are run
                subsets = [x for x in subsets if bad and int(bad.group(1)) not in x]
        if comp is None:
            continue
        load_s = time.perf_counter() - t0
        stats = comp.config.quantization_config.stats["modules"]
        per_layer = {}
        for name, st in stats.items():
            li, leaf = int(name.split(".")[2]), name.rpartition(".")[2]
            fit = {"structure": structure, "layer": li, "projection": leaf, "params": st["params"],
                   "train_seconds": st["train_seconds"], "rel_mse": st["rel_mse"], "steps": st["steps"]}
            if leaf == "o_proj":
                fit["attn_rel_mse_before"] = st["attn_rel_mse_before"]
            res["fits"].append(fit)
            per_layer.setdefault(li, {})[leaf] = st["params"]
            print(fit, flush=True)
        res["timing"][structure] = {"from_pretrained_seconds": round(load_s, 1),
                                    **timing(dense, comp, layers[len(layers) // 2], comp_inputs(dense, tok, layers[len(layers) // 2]))}
        print(res["timing"][structure], flush=True)
        for subset in subsets:
            for o_mode in ("untouched", "retrained"):
                t0 = time.perf_counter()
                undo = swapped(dense, comp, subset, QKV + (("o_proj",) if o_mode == "retrained" else ()))
                try:
                    row = {"structure": structure, "layers": ",".join(map(str, subset)), "o_proj": o_mode,
                           "log_ppl": log_ppl(dense, tok, cfg["eval_tokens"]),
                           "bigbench": bigbench(dense, tok, examples) if o_mode == "retrained" and subset in cfg["bigbench_subsets"] else None,
                           "params_qkv": sum(per_layer[li][x] for li in subset for x in QKV) // len(subset),
                           "params_qkvo": sum(per_layer[li][x] for li in subset for x in (*QKV, "o_proj")) // len(subset)}
                finally:
                    undo()
                row["seconds"] = round(time.perf_counter() - t0, 1)
                res["rows"].append(row)
                print(row, flush=True)
                write_json(f"{cfg['out']}.json", res)
        del comp
    write_json(f"{cfg['out']}.json", res)
    report(res)


@torch.no_grad()
def comp_inputs(dense, tok, layer: int) -> torch.Tensor:
    """64 rows of real input activations of `layer`'s attention projections (held-out text)."""
    rows = []
    hook = dense.model.layers[layer].self_attn.q_proj.register_forward_hook(lambda m, a, o: rows.append(a[0][0]))
    ids = tok(load_text("wikipedia", "eval")[0], return_tensors="pt").input_ids[:, :64]
    dense(ids)
    hook.remove()
    x = rows[0]
    return x.repeat(-(-64 // x.shape[0]), 1)[:64]


def report(res: dict) -> None:
    errors = [r for r in res["rows"] if r.get("error")]
    rows = [r for r in res["rows"] if not r.get("error")]
    cols = [("structure", "structure", "{}"), ("layers", "layers", "{}"), ("o_proj", "o_proj", "{}"),
            ("log_ppl", "log-ppl", "{:.3f}"), ("bigbench", "goal_step_wikihow acc", "{:.2f}"),
            ("params_qkv", "params q+k+v / layer", "{:,}"), ("params_qkvo", "params q+k+v+o / layer", "{:,}")]
    fit_rows = {}
    for f in res["fits"]:
        key = (f["structure"], f["projection"])
        fit_rows.setdefault(key, {"structure": f["structure"], "projection": f["projection"], "params": f["params"],
                                  "train_seconds": [], "rel_mse": []})
        fit_rows[key]["train_seconds"].append(f["train_seconds"])
        fit_rows[key]["rel_mse"].append(f["rel_mse"])
    fits = [{**v, "train_seconds": sum(v["train_seconds"]) / len(v["train_seconds"]), "rel_mse": sum(v["rel_mse"]) / len(v["rel_mse"])}
            for v in fit_rows.values()]
    fcols = [("structure", "structure", "{}"), ("projection", "projection", "{}"), ("params", "params", "{:,}"),
             ("train_seconds", "train s (mean over layers)", "{:.1f}"), ("rel_mse", "calib rel. MSE (mean)", "{:.3f}")]
    tim = [{"structure": s, "what": k, **v} for s, t in res["timing"].items() for k, v in t.items() if isinstance(v, dict)]
    tcols = [("structure", "structure", "{}"), ("what", "projection / batch", "{}"), ("linear_ms", "nn.Linear ms", "{:.4f}"),
             ("ms", "stand-in ms", "{:.3f}"), ("vs_linear", "x Linear", "{:.2f}")]
    c = res["config"]
    text = (f"# Rotor layers on {c['model']}: q/k/v replaced, trained on {c['calibration_samples']} x "
            f"{c['calibration_length']} calibration tokens\n\nlog-ppl: {c['eval_tokens']} held-out tokens (Wikipedia eval split, "
            f"512-token windows); goal_step_wikihow: first {c['bigbench_examples']} examples, zero-shot, length-normalized. "
            f"o_proj 'retrained': a fresh dense o_proj trained {c['o_epochs']} epochs on the block's dense output "
            "(its parameters counted in the last column).\n\n"
            + markdown_table(rows, cols) + "".join(f"\n\n**{r['structure']} on layers {r['layers']} refused**: {r['error']}"
                                                   for r in errors) + "\n\n## Fits (per projection)\n\n" + markdown_table(fits, fcols)
            + "\n\n## Forward time (one thread)\n\n" + markdown_table(tim, tcols) + "\n")
    (RESULTS / f"{c['out']}.md").write_text(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    dense_lp = next(r["log_ppl"] for r in rows if r["structure"] == "dense")
    subsets = [",".join(map(str, s)) for s in c["subsets"]]
    for ax, o_mode in zip(axes, ("untouched", "retrained")):
        width = 0.8 / len(c["structures"])
        for i, s in enumerate(c["structures"]):
            got = {r["layers"]: r["log_ppl"] for r in rows if r["structure"] == s and r["o_proj"] == o_mode}
            ax.bar([j + i * width for j in range(len(subsets))], [got.get(k, float("nan")) for k in subsets], width, label=s)
        ax.axhline(dense_lp, color="k", ls="--", lw=1, label="dense")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(subsets))], [f"layers {k}" for k in subsets], rotation=20)
        ax.set_title(f"o_proj {o_mode}")
        ax.set_ylabel("held-out log-ppl")
        ax.set_ylim(dense_lp - 0.1, None)
    axes[0].legend()
    fig.suptitle(f"{c['model']}: q/k/v replaced (rotor vs LR1/LR4/BH1)")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{c['out']}.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
