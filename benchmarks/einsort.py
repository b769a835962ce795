"""EinSort on real weights (SmolLM2-135M, Gemma-3-270M): does sorting lower the error at equal honest bytes?

Three parts, all with bfloat16 factors and honest bytes (factors at 2 bytes, permutation indices at
ceil(log2 n) bits, sign bits, block-identity pivots), compared with the dense matrix at bfloat16:

1. ``recon`` (the paper's Figure 2 shape): relative reconstruction error ||W - W_hat|| / ||W|| of
   single matrices of the middle layer against the rank, for every network (SVD / TT / TR / CP /
   Tucker) and four variants: ``plain`` (no sort, signed), ``signs`` (no sort; |W|^0.5 decomposed,
   sign bits kept), ``shared`` (EinSort: rows in groups of 8 share one permutation; pow(0.5), prod,
   non-negative, block-identity gauge) and ``full`` (one permutation per row, the reference). The
   same fits give error against honest bytes; for SVD also fits at fixed byte ratios (equal bytes).
2. ``ppl``: held-out perplexity (Wikipedia eval split) with the four variants at one byte ratio on
   chosen linear layers, and the time to compress them; where a run says ``"asvd": true``, also
   activation-aware variants (ASVD scaling, alpha 0.5, from the Wikipedia calibration split).
3. ``table`` (the paper's Table 4 shape): EinSort shared sort at the same ratio, perplexity for each
   mapping x reduction (SmolLM2).

4. ``speed``: inference with EinSort full sort on every linear layer of SmolLM2 (the recipe
   ``recipes/einsort_smollm2_full_sort.json``), the rebuilt weight kept (default) or rebuilt at
   every call, against the dense model: time to score held-out text, greedy decode speed, and the
   memory each option holds (stored tensors, weights kept for the forward).

    python benchmarks/einsort.py [--recipe benchmarks/recipes/einsort/einsort_weights.json] [--parts recon ppl table speed] [--threads 1]
    python benchmarks/einsort.py --report-only      # tables and plot again from einsort.json

Running some parts replaces only their rows in einsort.json; the other parts' rows are kept.

Writes benchmarks/results/einsort.json, einsort.md and einsort.png. One thread by default: on a
shared 2-core machine multi-threaded BLAS stalls far more than it gains.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, decode_tokens_per_s, load_recipe, markdown_table, ppl, set_threads, write_json  # noqa: E402

from hf_tensorcomp import TensorCompressionConfig  # noqa: E402
from hf_tensorcomp.assets import model_path  # noqa: E402
from hf_tensorcomp.methods.einsort import decomposition as es  # noqa: E402
from hf_tensorcomp.methods.einsort import EinSortLinear  # noqa: E402
from hf_tensorcomp.methods import get_method  # noqa: E402
from hf_tensorcomp.methods.einsort import activation_scales, save_activation_scales  # noqa: E402
from hf_tensorcomp.plan import find_decoder_layers, model_context, plan  # noqa: E402

VARIANTS = {  # method options per variant (on top of the shared ones below)
    "plain": {"sort": "none", "nonnegative": False},
    "signs": {"sort": "none", "nonnegative": True},
    "shared": {"sort": "shared", "nonnegative": True},
    "full": {"sort": "full", "nonnegative": True},
}
DEFAULTS = {
    "models": ["smollm2", "gemma3"],
    "matrices": ["self_attn.q_proj", "mlp.down_proj"],
    "networks": ["svd", "tt", "tr", "cp", "tucker"],
    "ranks": [1, 4, 16, 64, 256],
    "cp_ranks": [1, 4, 16, 64, 128],  # CP-ALS at rank 256 costs ~10 s a fit here
    "byte_ratios": [0.25, 0.5, 0.75, 0.9],
    "ratio_networks": ["svd", "tt", "tr", "tucker"],  # CP-ALS at large budget ranks is too slow here: rank sweep only
    "options": {"group": 8, "mapping": ["pow", 0.5], "reduction": "prod", "gauge": "auto",
                "factor_dtype": "bfloat16", "n_iter_max": 15},
    "ppl_ratio": 0.8,
    "ppl_runs": [
        {"model": "smollm2", "scope": "q,k all layers", "targets": ["self_attn.q_proj", "self_attn.k_proj"], "asvd": True},
        {"model": "smollm2", "scope": "all linear", "targets": ["self_attn.*_proj", "mlp.*_proj"]},
        {"model": "gemma3", "scope": "q,k all layers", "targets": ["self_attn.q_proj", "self_attn.k_proj"]},
    ],
    "table": {"model": "smollm2", "scope": "q,k all layers", "targets": ["self_attn.q_proj", "self_attn.k_proj"],
              "mappings": [["linear", 1.0], ["pow", 0.5], ["exp", 10.0], ["add_log", 0.01], ["mul_log", 1.0]],
              "reductions": ["mean", "max", "min", "median", "std", "prod"]},
    "max_tokens": 2048,
    "speed": {"model": "smollm2", "target": 0.8, "targets": ["self_attn.*_proj", "mlp.*_proj"],
              "options": {"sort": "full", "network": "svd", "factor_dtype": "bfloat16"}, "decode_tokens": 8},
}


def weights(model: str, layer_frac: float = 0.5) -> tuple[int, dict]:
    path = model_path(model)
    n_layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    layer = int(n_layers * layer_frac)
    f = safe_open(str(path / "model.safetensors"), "pt")
    return layer, lambda name: f.get_tensor(f"model.layers.{layer}.{name}.weight").float()


def fit_matrix(w: torch.Tensor, network: str, rank, opts: dict) -> tuple[es.EinSortTensor, float]:
    """The einsort method's own layout and fit for one matrix (same code path as compression)."""
    o = get_method("einsort").validate_options({**opts, "network": network})
    lay = get_method("einsort")._layout(w.shape[0], w.shape[1], o)
    t0 = time.perf_counter()
    a = es.fit(w.reshape(lay["shape"]), network, rank, sort_axis=lay["sort_axis"], reduce_over=lay["reduce_over"],
               mapping=tuple(o["mapping"]), reduction=o["reduction"], nonnegative=o["nonnegative"], gauge=lay["gauge"],
               fold=lay["fold"], dtype=getattr(torch, o["factor_dtype"]), n_iter_max=o["n_iter_max"])
    return a, time.perf_counter() - t0


def part_recon(cfg) -> list[dict]:
    rows = []
    for model in cfg["models"]:
        layer, get = weights(model)
        for mat in cfg["matrices"]:
            w = get(mat)
            dense = w.numel() * 2
            for network in cfg["networks"]:
                for variant, vopts in VARIANTS.items():
                    opts = {**cfg["options"], **vopts}
                    points = [("rank", r) for r in (cfg["cp_ranks"] if network == "cp" else cfg["ranks"])]
                    if network in cfg["ratio_networks"]:
                        points += [("ratio", b) for b in cfg["byte_ratios"]]
                    for kind, value in points:
                        try:
                            a, secs = fit_matrix(w, network, value, opts)
                        except ValueError as err:  # a byte ratio below the permutation/sign overhead
                            if kind == "ratio":
                                rows.append({"part": "recon", "model": model, "layer": layer, "matrix": mat, "shape": list(w.shape),
                                             "network": network, "variant": variant, "kind": kind, "target": value,
                                             "rel_error": None, "note": str(err).split("; allowed")[0]})
                                continue
                            raise
                        st = a.storage()
                        row = {"part": "recon", "model": model, "layer": layer, "matrix": mat, "shape": list(w.shape),
                               "network": network, "variant": variant, "kind": kind, "target": value,
                               "ranks": _bonds(a),
                               "rel_error": round(a.relative_error(w.reshape(a.shape)), 5), "bytes": st["total"],
                               "byte_ratio": round(st["total"] / dense, 4), "bytes_perm": st["perm"], "bytes_signs": st["signs"],
                               "fit_s": round(secs, 3)}
                        rows.append(row)
                    print(model, mat, network, variant, [(r.get("ranks"), r["rel_error"], r.get("byte_ratio")) for r in rows[-len(points):]],
                          flush=True)
    return rows


def _bonds(a: es.EinSortTensor) -> list[int]:
    """The ranks the fit used, read off the core shapes (svd/cp: [r]; tucker: the core; tt/tr: the bonds)."""
    s, kind = a.network.core_shapes, a.network.kind
    if kind in ("svd", "cp"):
        return [s[0][1]]
    if kind == "tucker":
        return list(s[0])
    return [c[0] for c in s] + [s[-1][2]]


def approximate(model, config: TensorCompressionConfig):
    """Write the compressed weights back densely (for evaluation); returns (restore, per-module stats, seconds)."""
    _, layer_list = find_decoder_layers(model)
    ctx = model_context(model)
    backups, stats = [], {}
    t0 = time.perf_counter()
    with torch.no_grad():
        for k, names in plan(model, config):
            entry = config.entries[k]
            mods = {n: layer_list.get_submodule(n) for n in names}
            for name, (new, st) in get_method(entry.method).compress(mods, entry, ctx).items():
                w = mods[name].weight
                backups.append((w, w.data.clone()))
                w.data.copy_(new.dense_weight().to(w.dtype))
                stats[name] = st
    secs = time.perf_counter() - t0

    def restore():
        with torch.no_grad():
            for w, orig in backups:
                w.data.copy_(orig)

    return restore, stats, secs


def _summary(stats: dict) -> dict:
    b = sum(s["bytes"] for s in stats.values())
    d = sum(s["dense_bytes"] for s in stats.values())
    return {"byte_ratio": round(b / d, 4), "mean_rel_error": round(sum(s["rel_error"] for s in stats.values()) / len(stats), 5),
            "perm_share": round(sum(s["bytes_perm"] for s in stats.values()) / d, 4),
            "sign_share": round(sum(s["bytes_signs"] for s in stats.values()) / d, 4), "matrices": len(stats)}


def evaluate(model, tok, cfg, targets, opts, label) -> dict:
    config = TensorCompressionConfig(method="einsort", target=cfg["ppl_ratio"], targets=targets, progress=False, **opts)
    restore, stats, secs = approximate(model, config)
    try:
        p = ppl(model, tok, cfg["max_tokens"])
    finally:
        restore()
    row = {**label, "ratio": cfg["ppl_ratio"], **_summary(stats), "ppl": round(p, 3), "compress_s": round(secs, 2)}
    print(row, flush=True)
    return row


def part_ppl(cfg) -> list[dict]:
    rows, loaded = [], {}
    for run in cfg["ppl_runs"]:
        name = run["model"]
        if name not in loaded:
            loaded.clear()
            path = model_path(name)
            loaded[name] = (AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path))
            m, tok = loaded[name]
            dense = {"part": "ppl", "model": name, "scope": "-", "variant": "dense", "ppl": round(ppl(m, tok, cfg["max_tokens"]), 3)}
            rows.append(dense)
            print(dense, flush=True)
        m, tok = loaded[name]
        variants = dict(VARIANTS)
        if run.get("asvd"):  # activation-aware (ASVD scaling from the calibration split), for plain and EinSort
            t0 = time.perf_counter()
            scales = activation_scales(m, tok, source="wikipedia", max_tokens=cfg["max_tokens"] * 2)
            path = save_activation_scales(scales, Path(tempfile.mkdtemp()) / "scales.safetensors")
            print(f"calibration: {time.perf_counter() - t0:.1f}s", flush=True)
            variants.update({f"{v}+asvd": {**VARIANTS[v], "activation_scales": path} for v in ("plain", "shared", "full")})
        for variant, vopts in variants.items():
            rows.append(evaluate(m, tok, cfg, run["targets"], {**cfg["options"], **vopts},
                                 {"part": "ppl", "model": name, "scope": run["scope"], "variant": variant}))
    return rows


def part_table(cfg) -> list[dict]:
    t = cfg["table"]
    path = model_path(t["model"])
    m, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    rows = []
    for mapping in t["mappings"]:
        for red in t["reductions"]:
            opts = {**cfg["options"], **VARIANTS["shared"], "mapping": mapping, "reduction": red}
            rows.append(evaluate(m, tok, cfg, t["targets"], opts, {"part": "table", "model": t["model"], "scope": t["scope"],
                                                                    "mapping": f"{mapping[0]}({mapping[1]:g})", "reduction": red}))
    return rows


def _held_bytes(model) -> dict:
    """Bytes the model holds: its parameters and buffers, and the weights EinSort layers keep for the forward."""
    stored = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    kept = sum(m.cached_nbytes() for m in model.modules() if isinstance(m, EinSortLinear))
    return {"stored_bytes": stored, "kept_bytes": kept}


def part_speed(cfg) -> list[dict]:
    sp = cfg["speed"]
    path = model_path(sp["model"])
    tok = AutoTokenizer.from_pretrained(path)
    config = TensorCompressionConfig(method="einsort", target=sp["target"], targets=sp["targets"], progress=False, **sp["options"])
    models = {"dense": AutoModelForCausalLM.from_pretrained(path).eval()}
    t0 = time.perf_counter()
    models["einsort, weight kept"] = AutoModelForCausalLM.from_pretrained(path, quantization_config=config).eval()
    compress_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:  # the rebuild-per-call option, as a user would load it
        models["einsort, weight kept"].save_pretrained(d)
        models["einsort, rebuilt per call"] = AutoModelForCausalLM.from_pretrained(d).eval()
    for m in models["einsort, rebuilt per call"].modules():
        if isinstance(m, EinSortLinear):
            m.cache_weight = False
    rows = []
    for name, m in models.items():
        t = time.perf_counter()
        with torch.inference_mode():  # the first call: the kept weights are rebuilt here, once
            m(tok("Warm-up.", return_tensors="pt").input_ids)
        first_s = time.perf_counter() - t
        t = time.perf_counter()
        p = ppl(m, tok, cfg["max_tokens"])
        ppl_s = time.perf_counter() - t
        row = {"part": "speed", "model": sp["model"], "variant": name, "ppl": round(p, 3), "first_call_s": round(first_s, 2),
               "ppl_s": round(ppl_s, 2),
               "decode_tok_s": round(decode_tokens_per_s(m, tok, new_tokens=sp["decode_tokens"], repeats=1), 2),
               **_held_bytes(m)}
        if name != "dense":
            row["compress_s"] = round(compress_s, 1)
        rows.append(row)
        print(row, flush=True)
    for r in rows:
        r["ppl_s_ratio"] = round(r["ppl_s"] / rows[0]["ppl_s"], 3)
        r["decode_ratio"] = round(r["decode_tok_s"] / rows[0]["decode_tok_s"], 3)
        r["held_ratio"] = round((r["stored_bytes"] + r["kept_bytes"]) / rows[0]["stored_bytes"], 3)
    return rows


# --------------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------------

def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fits = [r for r in rows if r["part"] == "recon" and r.get("rel_error") is not None]
    rec = [r for r in fits if r["kind"] == "rank"]
    models = sorted({r["model"] for r in rec}, key=lambda m: DEFAULTS["models"].index(m) if m in DEFAULTS["models"] else 9)
    nets = [n for n in DEFAULTS["networks"] if any(r["network"] == n for r in rec)]
    if not rec:
        return
    fig, axes = plt.subplots(2 * len(models), len(nets), figsize=(3.6 * len(nets), 5.6 * len(models)), squeeze=False)
    colors = {"plain": "tab:gray", "signs": "tab:blue", "shared": "tab:green", "full": "tab:red"}
    mats = sorted({r["matrix"] for r in rec})
    for i, model in enumerate(models):
        for j, net in enumerate(nets):
            for k, (x, label) in enumerate((("rank", "rank r"), ("byte_ratio", "honest bytes / dense bf16 bytes"))):
                ax = axes[2 * i + k][j]
                for variant, c in colors.items():
                    for mat, ls in zip(mats, ("-", "--", ":")):
                        pts = sorted((r[x] if x == "byte_ratio" else r["target"], r["rel_error"]) for r in (fits if k else rec)
                                     if r["model"] == model and r["network"] == net and r["variant"] == variant and r["matrix"] == mat)
                        if pts:
                            ax.plot(*zip(*pts), ls, color=c, marker="o", ms=3,
                                    label=f"{variant} {mat.split('.')[-1]}" if (i, j, k) == (0, 0, 0) else None)
                ax.set_xscale("log" if x == "rank" else "linear")
                ax.set_yscale("log")
                ax.set_title(f"{model} {net}: error vs {'rank' if x == 'rank' else 'bytes'}", fontsize=9)
                ax.set_xlabel(label, fontsize=8)
                ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("relative error")
    fig.legend(loc="lower center", ncol=8, fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=100)


def report(rows, cfg, args) -> str:
    out = [f"EinSort on real weights. bfloat16 factors; honest bytes = factors (2 B/entry, block-identity blocks not stored) "
           f"+ permutation indices at ceil(log2 n) bits + sign bits + pivots, against the dense matrix at bfloat16. "
           f"Relative error ||W - W_hat||_F / ||W||_F of the fp32 checkpoint weights. Variants: plain = no sort; signs = no sort, "
           f"|W|^0.5 decomposed + sign bits; shared = EinSort (rows in groups of {cfg['options']['group']} share a permutation of the "
           f"inputs; pow(0.5), prod, non-negative); full = one permutation per row (reference). Gauge: block identity (CP: "
           f"canonical). CPU, {args.threads} thread(s), {platform.processor() or platform.machine()}.\n"]
    rec_all = [r for r in rows if r["part"] == "recon" and r.get("rel_error") is not None]
    rec = [r for r in rec_all if r["kind"] == "rank"]
    if rec_all:
        out.append("## Equal honest bytes: lowest error at ≤ the byte ratio (fits at that budget, and the rank sweep; "
                   "'-': nothing fits, e.g. full sort's permutation alone is ~0.63-0.69 of the dense bytes)\n")
        table = []
        keys = sorted({(r["model"], r["matrix"], r["network"]) for r in rec_all},
                      key=lambda k: (k[0], k[1], DEFAULTS["networks"].index(k[2])))
        for ratio in cfg["byte_ratios"]:
            for (model, mat, net) in keys:
                row = {"model": model, "matrix": mat, "network": net, "ratio": ratio}
                for v in VARIANTS:
                    errs = [r["rel_error"] for r in rec_all if (r["model"], r["matrix"], r["network"], r["variant"]) == (model, mat, net, v)
                            and r["byte_ratio"] <= ratio]
                    row[v] = min(errs) if errs else None
                if row["plain"] and row["full"]:
                    row["gain"] = row["plain"] / row["full"]
                if row["plain"] and row["shared"]:
                    row["gain_shared"] = row["plain"] / row["shared"]
                table.append(row)
        out.append(markdown_table(table, [("model", "model", "{}"), ("matrix", "matrix", "{}"), ("network", "network", "{}"),
                                          ("ratio", "bytes ≤", "{:.2f}")] + [(v, v, "{:.3f}") for v in VARIANTS]
                                  + [("gain_shared", "plain / shared", "{:.2f}×"), ("gain", "plain / full", "{:.1f}×")]))
    if rec:
        out.append("\n## Rank sweep (the paper's Figure 2 shape): relative error at rank r (byte ratio in brackets), SVD\n")
        table = []
        for (model, mat, v) in sorted({(r["model"], r["matrix"], r["variant"]) for r in rec if r["network"] == "svd"}):
            row = {"model": model, "matrix": mat, "variant": v}
            for r in rec:
                if (r["model"], r["matrix"], r["variant"], r["network"]) == (model, mat, v, "svd"):
                    row[f"r{r['target']}"] = f"{r['rel_error']:.3f} ({r['byte_ratio']:.2f})"
            table.append(row)
        out.append(markdown_table(table, [("model", "model", "{}"), ("matrix", "matrix", "{}"), ("variant", "variant", "{}")]
                                  + [(f"r{k}", f"r={k}", "{}") for k in cfg["ranks"]]))
        fit = {}
        for r in rec:
            fit.setdefault((r["network"], r["variant"]), []).append(r["fit_s"])
        out.append("\nFit time per matrix (s, median over models/matrices/ranks): " + "; ".join(
            f"{n}/{v} {sorted(t)[len(t) // 2]:.2f}" for (n, v), t in sorted(fit.items())))
    pr = [r for r in rows if r["part"] == "ppl"]
    if pr:
        out.append(f"\n## Perplexity at {cfg['ppl_ratio']} honest bytes ({cfg['max_tokens']} Wikipedia eval tokens, ctx 512)\n")
        out.append(markdown_table(pr, [("model", "model", "{}"), ("scope", "layers", "{}"), ("variant", "variant", "{}"),
                                       ("byte_ratio", "bytes ×", "{:.3f}"), ("perm_share", "of which perm", "{:.3f}"),
                                       ("sign_share", "of which signs", "{:.3f}"), ("mean_rel_error", "mean rel. error", "{:.3f}"),
                                       ("ppl", "ppl", "{:.2f}"), ("compress_s", "compress s", "{:.1f}")]))
    tr = [r for r in rows if r["part"] == "table"]
    if tr:
        t = cfg["table"]
        out.append(f"\n## Mapping × reduction (the paper's Table 4 shape): perplexity, EinSort shared sort (non-negative), "
                   f"{t['model']} {t['scope']}, {cfg['ppl_ratio']} honest bytes\n")
        mappings = list(dict.fromkeys(r["mapping"] for r in tr))
        table = []
        for mp in mappings:
            row = {"mapping": mp}
            for r in tr:
                if r["mapping"] == mp:
                    row[r["reduction"]] = r["ppl"]
            table.append(row)
        out.append(markdown_table(table, [("mapping", "mapping", "{}")] + [(red, red, "{:.2f}") for red in t["reductions"]]))
        best = min(tr, key=lambda r: r["ppl"])
        out.append(f"\nBest: {best['mapping']} with {best['reduction']} (ppl {best['ppl']:.2f}, mean rel. error {best['mean_rel_error']:.3f}).")
    spr = [r for r in rows if r["part"] == "speed"]
    if spr:
        sp = cfg["speed"]
        out.append(f"\n## Inference speed and memory: EinSort {sp['options']} at {sp['target']} bytes on {', '.join(sp['targets'])} "
                   f"({spr[0]['model']}; scoring {cfg['max_tokens']} Wikipedia eval tokens at ctx 512; greedy decode of "
                   f"{sp['decode_tokens']} tokens, batch 1; first call: a one-token forward right after loading, where the kept "
                   f"weights are rebuilt; memory: parameters and buffers held, plus the dense weights EinSort layers keep "
                   f"for the forward, after the runs)\n")
        out.append(markdown_table(spr, [("variant", "variant", "{}"), ("ppl", "ppl", "{:.2f}"),
                                        ("first_call_s", "first call s", "{:.2f}"), ("ppl_s", "scoring s", "{:.1f}"),
                                        ("ppl_s_ratio", "× dense", "{:.2f}"), ("decode_tok_s", "decode tok/s", "{:.1f}"),
                                        ("decode_ratio", "× dense", "{:.2f}"), ("stored_bytes", "stored bytes", "{:,}"),
                                        ("kept_bytes", "kept weights, bytes", "{:,}"), ("held_ratio", "memory × dense", "{:.2f}")]))
    return "\n".join(out) + "\n"


PARTS = {"recon": part_recon, "ppl": part_ppl, "table": part_table, "speed": part_speed}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default=None, help="JSON overriding DEFAULTS (see benchmarks/recipes/einsort/einsort_weights.json)")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--report-only", action="store_true", help="rewrite einsort.md / einsort.png from einsort.json")
    args = ap.parse_args()
    if args.report_only:
        saved = json.loads((RESULTS / "einsort.json").read_text())
        args.threads = saved["threads"]
        (RESULTS / "einsort.md").write_text(report(saved["rows"], saved["config"], args)
                                             + f"\nTotal benchmark time: {saved['seconds']:.0f} s.\n")
        plot(saved["rows"], RESULTS / "einsort.png")
        return
    cfg = load_recipe(args.recipe, DEFAULTS)
    set_threads(args.threads)
    saved = json.loads((RESULTS / "einsort.json").read_text()) if (RESULTS / "einsort.json").is_file() else {}
    rows = [r for r in saved.get("rows", []) if r["part"] not in args.parts]  # other parts' rows are kept
    t0 = time.perf_counter()
    for part in args.parts:
        rows += PARTS[part](cfg)
        write_json("einsort.json", {"config": cfg, "threads": args.threads, "rows": rows})
    total = round(time.perf_counter() - t0 + (saved.get("seconds", 0) if set(args.parts) != set(PARTS) else 0), 1)
    write_json("einsort.json", {"config": cfg, "threads": args.threads, "seconds": total, "rows": rows})
    (RESULTS / "einsort.md").write_text(report(rows, cfg, args) + f"\nTotal benchmark time: {total:.0f} s.\n")
    plot(rows, RESULTS / "einsort.png")
    print((RESULTS / "einsort.md").read_text())


if __name__ == "__main__":
    main()
