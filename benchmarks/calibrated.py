"""Calibrated compression of every decoder linear: data-free vs activation-aware vs global budget, and the peer.

For each model and each budget (`target`: the fraction of the decoder linears' weight parameters kept):
plain SVD (uniform ranks, data-free), ASVD scaling, SVD-LLM whitening with uniform ranks, whitening with
a global allocation (relative loss; Fisher-weighted loss), Fisher-weighted whitening in the SVD itself
(`weighting="fisher"`, the main job's setting) with and without propagation and with error correction; beside them optimum-quanto weight-only int8 / int4 on the same linears (the peer a user
would pick instead) and the dense model. Calibration: the Wikipedia *calib* split; perplexity: the
Wikipedia *eval* split (disjoint paragraphs). Each variant runs in a child process, so its peak memory
(max RSS) is its own. Bytes are counted at bf16 for every float tensor (the model as shipped in bf16),
quanto at its bit width plus bf16 scales.

    python benchmarks/calibrated.py --recipe benchmarks/recipes/calibrated/calibrated_benchmark.json
    python benchmarks/calibrated.py --report-only        # re-render table and plot from the JSON
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, in_child, load_recipe, markdown_table, per_model, set_threads, write_json  # noqa: E402

DEFAULTS = {
    "models": ["smollm2", "gemma3"],
    "targets": [0.8, 0.6],
    "variants": ["plain", "asvd", "whiten_uniform", "whiten_relative", "whiten_global", "whiten_global_noprop"],
    "peers": ["int8", "int4"],
    "eval_tokens": 8192,
    "calibration_samples": 32,
    "calibration_length": 256,
    "wikihow_examples": 0,
    "wikihow_variants": ["dense", "int8", "int4", "fisher"],
    "threads": 2,
    "jobs": None,  # or an explicit list of [model, variant, target] run in that order (instead of the grid)
}

VARIANTS = {  # label -> TensorCompressionConfig fields (besides method/target/targets)
    "plain": {"allocation": "uniform"},
    "asvd": {"whiten": "asvd", "allocation": "uniform"},
    "whiten_uniform": {"whiten": True, "allocation": "uniform"},
    "whiten_relative": {"whiten": True, "allocation": "relative"},
    "whiten_global": {"whiten": True, "allocation": "global"},
    "whiten_global_noprop": {"whiten": True, "allocation": "global", "propagate": False},
    "fisher": {"whiten": True, "allocation": "global", "weighting": "fisher"},
    "fisher_noprop": {"whiten": True, "allocation": "global", "weighting": "fisher", "propagate": False},
    "fisher_correct": {"whiten": True, "allocation": "global", "weighting": "fisher", "correct": True},
    # attention only (q, k, v, o of every layer), same kept fraction per layer: TensorLLM and TRAWL (Tucker)
    # data-free vs whitened, beside whitened LASER with uniform ranks (calibrate=False: no calibration at all)
    "attn_laser_whiten": {"targets": ["self_attn.*_proj"], "whiten": True, "allocation": "uniform"},
    "attn_tensorllm": {"method": "tensorllm", "targets": ["self_attn.*_proj"], "calibrate": False, "gqa": "repeat"},
    "attn_tensorllm_whiten": {"method": "tensorllm", "targets": ["self_attn.*_proj"], "whiten": True, "gqa": "repeat"},
    # TensorLLM's default layout on grouped-query attention: one slab per KV group (K and V entered once)
    "attn_tensorllm_group": {"method": "tensorllm", "targets": ["self_attn.*_proj"], "calibrate": False,
                             "gqa": "group"},
    "attn_tensorllm_whiten_group": {"method": "tensorllm", "targets": ["self_attn.*_proj"], "whiten": True,
                                    "gqa": "group"},
    # TRAWL rows measured before slice_weight="balanced" became its default name the unweighted fit (None)
    "attn_trawl": {"method": "trawl", "decomposition": "tucker", "group": "qkvo", "calibrate": False, "gqa": "repeat",
                   "slice_weight": None},
    "attn_trawl_whiten": {"method": "trawl", "decomposition": "tucker", "group": "qkvo", "whiten": True, "gqa": "repeat",
                          "slice_weight": None},
    # TRAWL's default layout on grouped-query attention: slices as tall as K, Q and O in n_rep slots each
    "attn_trawl_group": {"method": "trawl", "decomposition": "tucker", "group": "qkvo", "calibrate": False,
                         "gqa": "group", "slice_weight": None},
    "attn_trawl_whiten_group": {"method": "trawl", "decomposition": "tucker", "group": "qkvo", "whiten": True,
                                "gqa": "group", "slice_weight": None},
}
# the grouped layout with K's and V's slices weighted down in the fit (slice_weight: the fit spends less on them)
for _w in (0.3, 0.5):
    for _v in ("attn_trawl_group", "attn_trawl_whiten_group"):
        VARIANTS[f"{_v}_kv{_w}"] = {**VARIANTS[_v], "slice_weight": {"k_proj": _w, "v_proj": _w}}
for _v in ("attn_tensorllm", "attn_tensorllm_whiten", "attn_tensorllm_group", "attn_tensorllm_whiten_group"):
    VARIANTS[_v]["slice_weight"] = None  # measured before slice_weight="balanced" became TensorLLM's default
# TRAWL on the MLP (gate, up and down_proj transposed: the paper's FC stack), Tucker, whitened
VARIANTS["fc_trawl_whiten"] = {"method": "trawl", "decomposition": "tucker", "group": "fc", "whiten": True,
                               "slice_weight": None}
for _v in ("attn_trawl_group", "attn_trawl_whiten_group", "fc_trawl_whiten",  # each matrix scaled to one norm
           "attn_tensorllm_whiten_group"):
    VARIANTS[f"{_v}_balanced"] = {**VARIANTS[_v], "slice_weight": "balanced"}
NAME = "calibrated"


def _bf16_bytes(model) -> int:
    return sum(p.numel() * 2 for p in model.parameters())


def _quanto(model, bits: int) -> int:
    """Weight-only quantize the decoder linears with optimum-quanto; returns the model's bytes."""
    from hf_tensorcomp.eval.peers import quanto_weight_only

    quanto_weight_only(model, bits)
    total = 0
    for p in model.parameters():  # each tensor once (tied embeddings are one tensor)
        if type(p).__name__.startswith(("QTensor", "WeightQBits", "QBits", "QBytes")) or hasattr(p, "_data"):
            total += p.numel() * bits // 8 + (p.shape[0] * 2 if bits == 8 else p.numel() // 128 * 4)
        else:
            total += p.numel() * 2
    return total


def _linear_params(model) -> int:
    import torch

    from hf_tensorcomp.plan import find_decoder_layers

    _, layers = find_decoder_layers(model)
    return sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))


def _targeted_kept(model, patterns, stats) -> float:
    """Fraction of the targeted modules' weight parameters kept (their dense in x out, then what compression removed)."""
    from fnmatch import fnmatchcase

    from hf_tensorcomp.plan import find_decoder_layers

    _, layers = find_decoder_layers(model)
    dense = sum(m.in_features * m.out_features for layer in layers for n, m in layer.named_modules()
                if any(fnmatchcase(n, p) for p in patterns) and hasattr(m, "in_features"))
    return (dense - (stats["params_before"] - stats["params_after"])) / dense


def _one(job: dict, q) -> None:
    import torch

    set_threads(job["threads"])
    from hf_tensorcomp import TensorCompressionConfig, assets
    from hf_tensorcomp.eval import perplexity
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assets.model_path(job["model"])
    tok = AutoTokenizer.from_pretrained(path)
    row = {k: job[k] for k in ("model", "variant", "target")}
    t0 = time.perf_counter()
    if job["variant"] in ("dense", "int8", "int4"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        row["linear_params"] = _linear_params(model)
        row["bytes"] = _bf16_bytes(model) if job["variant"] == "dense" else _quanto(model, int(job["variant"][3:]))
        row["compress_s"] = round(time.perf_counter() - t0, 1)
    else:
        fields = dict(VARIANTS[job["variant"]])
        calibrate = fields.pop("calibrate", job["variant"] != "plain")
        method = fields.pop("method", "laser")
        if method != "trawl":
            fields.setdefault("targets", ["*_proj"])
        if method == "laser":
            fields.setdefault("pivoted", False)  # the plain storage these rows were measured in
        cfg = TensorCompressionConfig(
            method=method, target=job["target"], progress=False,
            calibration="wikipedia" if calibrate else None,
            calibration_samples=job["calibration_samples"], calibration_length=job["calibration_length"],
            propagate=fields.pop("propagate", True), **fields)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=cfg)
        st = model.config.quantization_config.stats
        row["targeted_kept"] = _targeted_kept(model, cfg.entries[0].targets, st)
        row["compress_s"] = st["compress_seconds"]
        row["bytes"] = _bf16_bytes(model)
        alloc = st.get("allocation", {}).get("0")
        ranks = {n: m.get("rank", m.get("ranks")) for n, m in st["modules"].items() if "rank" in m or "ranks" in m}
        row["ranks"] = ranks
        if alloc:
            row["kept_dense"] = alloc["kept_dense"]
    row["params"] = sum(p.numel() for p in model.parameters())
    row["ppl"] = perplexity(model, tok, assets.load_text("wikipedia", "eval"), max_tokens=job["eval_tokens"],
                            progress=False)["ppl"]
    if job["wikihow_examples"] and job["variant"] in job["wikihow_variants"]:
        from hf_tensorcomp.eval.multiple_choice import multiple_choice_accuracy

        ex = assets.load_bigbench_task("goal_step_wikihow")
        row["wikihow"] = multiple_choice_accuracy(model, tok, ex, max_examples=job["wikihow_examples"], progress=False)["accuracy"]
    row["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    q.put(row)


def run(cfg: dict) -> list[dict]:
    path = RESULTS / f"{NAME}.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    done = {(r["model"], r["variant"], r["target"]) for r in rows}
    # in priority order (dense and peers, then each variant for both models), so a cut-short run has what matters
    if cfg["jobs"]:
        order = [tuple(j) for j in cfg["jobs"]]
    else:
        jobs = [("dense", None)] + [(p, None) for p in cfg["peers"]]
        jobs += [(v, t) for v in cfg["variants"] for t in cfg["targets"]]
        order = [(m, v, t) for v, t in jobs for m in cfg["models"]]
    for model, variant, target in order:
        if (model, variant, target) in done:
            continue
        row = in_child(_one, {**cfg, "model": model, "variant": variant, "target": target}, f"{model} {variant} {target}")
        if row is None:
            continue
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("ranks", "kept_dense")}), flush=True)
        write_json(f"{NAME}.json", rows)
    return rows


def report(rows: list[dict]) -> str:
    out = []
    for model, rs, dense in per_model(rows, "variant"):
        for r in rs:
            r["bytes_ratio"] = r["bytes"] / dense["bytes"]
            r["ppl_ratio"] = r["ppl"] / dense["ppl"]
            if "ranks" in r:
                r["linear_kept"] = 1 - (dense["params"] - r["params"]) / dense["linear_params"]
        out.append(f"### {model}\n")
        out.append(markdown_table(rs, [("variant", "variant", "{}"), ("target", "target", "{}"),
                                       ("linear_kept", "linear params kept", "{:.3f}"),
                                       ("targeted_kept", "targeted params kept", "{:.3f}"),
                                       ("bytes_ratio", "bytes vs dense (bf16)", "{:.3f}"), ("ppl", "perplexity", "{:.2f}"),
                                       ("ppl_ratio", "ppl vs dense", "{:.2f}x"), ("wikihow", "wikihow acc", "{:.3f}"),
                                       ("compress_s", "compress s", "{:.1f}"), ("peak_rss_mb", "peak RSS MB", "{:,}")]))
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = [r for r in rows if r["variant"] == "fisher" and r.get("ranks")]  # LASER's per-matrix ranks
    if not best:
        return
    fig, axes = plt.subplots(1, len(best), figsize=(5 * len(best), 4), squeeze=False)
    for ax, r in zip(axes[0], best):
        by_type: dict[str, dict[int, int]] = {}
        for name, rank in r["ranks"].items():
            parts = name.split(".")
            li = int(parts[parts.index("layers") + 1])
            by_type.setdefault(parts[-1], {})[li] = rank
        for kind, d in sorted(by_type.items()):
            ax.plot(sorted(d), [d[i] for i in sorted(d)], marker=".", label=kind)
        ax.set_title(f"{r['model']} target {r['target']}: rank per layer\n(missing point = kept dense)")
        ax.set_xlabel("layer")
        ax.set_ylabel("rank")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    cfg = load_recipe(args.recipe, DEFAULTS)
    path = RESULTS / f"{NAME}.json"
    rows = json.loads(path.read_text()) if args.report_only else run(cfg)
    md = report(rows)
    (RESULTS / f"{NAME}.md").write_text(
        "# Calibrated compression (every decoder linear)\n\n"
        "LASER on every decoder-layer linear; `target` = fraction of those weight parameters kept. Calibration: "
        f"{cfg['calibration_samples']} x {cfg['calibration_length']} tokens of the Wikipedia calib split; perplexity: "
        f"{cfg['eval_tokens']} tokens of the disjoint eval split, ctx 512; goal_step_wikihow: first "
        f"{cfg['wikihow_examples']} examples. Bytes: every tensor at bf16 (quanto: its bits plus bf16 scales), the "
        "embeddings included. One CPU thread per run, on a 2-core machine shared with other jobs (compression "
        "times are upper bounds). Variants: plain = truncated SVD, uniform ranks (data-free); asvd; whiten_uniform = "
        "SVD-LLM whitening, uniform ranks; whiten_global = whitening, ranks allocated by the Fisher-weighted loss; "
        "fisher = whitening + Fisher-weighted SVD + that allocation (the main job); _noprop = without propagation; "
        "_correct = with error correction; attn_* = q, k, v, o of every layer only (`targeted params kept`: of "
        "those), each layer keeping the same fraction: LASER whitened (uniform ranks), TensorLLM (K and V repeated "
        "per query head; `_group`: one slab per KV group, the library's default) and TRAWL Tucker (qkvo; K and V "
        "repeated per query head; `_group`: slices as tall as K, Q and O in n_rep slots each, the library's default), "
        "data-free or with `whiten=True`; fc_trawl_whiten = TRAWL Tucker of the MLP (gate, up, down transposed), "
        "whitened. TRAWL and TensorLLM rows fit the paper's unweighted tensor unless suffixed: `_kv0.3` / `_kv0.5`: "
        "K's and V's slices weighted by that factor in the fit; `_balanced`: each matrix's slices scaled to one "
        "norm (`slice_weight=\"balanced\"`, the library's default).\n\n"
        f"{md}\n")
    plot(rows, RESULTS / f"{NAME}.png")
    print(md)


if __name__ == "__main__":
    main()
