"""KV-cache compression: EinSortCache against plain SVD, full sorting and transformers' QuantizedCache.

The EinSort paper's protocol (Section 3) on held-out Wikipedia paragraphs: each window is the first
129 tokens of a paragraph; prefill its first 64 tokens (attention sees them dense), compress the
cache, then decode tokens 64..127 teacher-forced — attention sees the reconstruction — and score
each step's prediction of the next token (64 predictions per window). Perplexity over all windows.

The teacher-forced decode is run as one 64-token forward after the prefill: with the compressed
prefix and causal attention this is the same computation as 64 single-token steps (the cache returns
reconstruction + the new tokens dense in both cases); the decode *time* is measured separately with
real single-token steps.

Contenders, at several byte ratios (bytes the cache holds after prefill + compression, over what
DynamicCache holds for the same 64 tokens; for the SVD family the ratio is each segment's byte
budget, permutation and sign bits included, and the realized ratio is reported):
- ``einsort``: SVD of the sorted, mapped magnitudes; one permutation per head_dim channel shared
  over the KV heads; sign bits; block-identity gauge.
- ``svd``: plain truncated SVD of the (heads*tokens, head_dim) segment, no sorting, no sign bits.
- ``fullsort``: as einsort, but one permutation per head (the reference; its indices cost more).
- ``einsort-fp16`` / ``svd-fp16``: the same with float16 factors (the budget still counts fp32 dense bytes).
- ``svd+q4`` / ``svd+q3`` / ``svd+q2`` / ``einsort+q2``: the segment's fit (float16 factors) plus what it
  misses quantized at 4 / 3 / 2 bits (``error_bits``: keys grouped along tokens, values along channels;
  the budget pays the quantized error first, the factors get the rest; at the lowest ratio of each, rank 0:
  quantization alone).
- ``quanto-2bit`` / ``quanto-4bit`` (and HQQ if installed): transformers' QuantizedCache.
Plus decode time per token (batch 1, single-token steps, interleaved round-robin, median) relative
to DynamicCache, and bytes per token.

    python benchmarks/kv_cache.py --recipe benchmarks/recipes/kv_cache/kv_cache_benchmark.json
    python benchmarks/kv_cache.py --scaling     # bytes and decode time against the context length

Writes benchmarks/results/kv_cache.json, kv_cache.md and kv_cache.png.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, QuantizedCache

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, cache_bytes, markdown_table, set_threads, write_json  # noqa: E402

from hf_tensorcomp import EinSortCache  # noqa: E402
from hf_tensorcomp.assets import load_text, model_path  # noqa: E402

PREFILL, DECODE = 64, 64

DEFAULT_RECIPE = {
    "model": "smollm2",
    "windows": 48,
    "batch": 8,
    "threads": 1,
    "ratios": [0.1, 0.15, 0.25, 0.4, 0.6],
    "timing_windows": 3,
    "timing_ratio": 0.25,
    "contenders": {
        "einsort": {"network": "svd", "sort": "shared", "nonnegative": True},
        "svd": {"network": "svd", "sort": None, "nonnegative": False},
        "fullsort": {"network": "svd", "sort": "full", "nonnegative": True},
    },
    "quantized": [["quanto", 2], ["quanto", 4]],
}


# --------------------------------------------------------------------------------------------
# bytes held by transformers' QuantizedCache (quanto: packed data + scale + shift; hqq: W_q + meta)
# --------------------------------------------------------------------------------------------

def dense_bytes(model, batch: int, tokens: int) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * tokens * head_dim * model.dtype.itemsize


# --------------------------------------------------------------------------------------------
# contenders
# --------------------------------------------------------------------------------------------

def factories(model, recipe) -> list[dict]:
    """[{name, family, ratio (target or None), make: () -> cache}]."""
    out = [{"name": "dynamic", "family": "dynamic", "ratio": 1.0, "make": lambda: DynamicCache(config=model.config)}]
    for family, kw in recipe["contenders"].items():
        kw = dict(kw)  # a contender may carry its own "ratios" and a factor "dtype" ("float16")
        ratios = kw.pop("ratios", recipe["ratios"])
        if "dtype" in kw:
            kw["dtype"] = getattr(torch, kw["dtype"])
        for r in ratios:
            out.append({"name": f"{family}@{r:g}", "family": family, "ratio": r,
                        "make": (lambda kw=kw, r=r: EinSortCache(model.config, rank=float(r), segment=PREFILL, residual=0, low_memory=True, **kw))})
    for family, kw in recipe.get("fp16_contenders", {}).items():
        for r in recipe.get("fp16_ratios", recipe["ratios"]):
            out.append({"name": f"{family}@{r:g}", "family": family, "ratio": r,
                        "make": (lambda kw=kw, r=r: EinSortCache(model.config, rank=float(r), segment=PREFILL, residual=0, low_memory=True,
                                                                 dtype=torch.float16, **kw))})
    for backend, nbits in recipe.get("quantized", []):
        out.append({"name": f"{backend}-{nbits}bit", "family": f"{backend}", "ratio": None, "nbits": nbits,
                    "make": (lambda b=backend, n=nbits: QuantizedCache(b, model.config, nbits=n, q_group_size=64,
                                                                      residual_length=PREFILL))})
    return out


def available(entry) -> str | None:
    """None if the contender can be built here, else why not."""
    try:
        entry["make"]()
    except (ImportError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


# --------------------------------------------------------------------------------------------
# measurements
# --------------------------------------------------------------------------------------------

def windows(tok, n: int) -> torch.Tensor:
    out = []
    for text in load_text("wikipedia", "eval"):
        ids = tok(text, return_tensors="pt").input_ids[0]
        if ids.numel() >= PREFILL + DECODE + 1:
            out.append(ids[: PREFILL + DECODE + 1])
        if len(out) == n:
            break
    return torch.stack(out)


@torch.inference_mode()
def evaluate(model, data: torch.Tensor, entry: dict, batch: int) -> dict:
    nll, count, held, dense, secs = 0.0, 0, 0, 0, 0.0
    for i in range(0, len(data), batch):
        ids = data[i: i + batch]
        cache = entry["make"]()
        t0 = time.perf_counter()
        model(ids[:, :PREFILL], past_key_values=cache, use_cache=True)  # prefill (dense), then segments compressed
        secs += time.perf_counter() - t0
        held += cache_bytes(cache)
        dense += dense_bytes(model, ids.shape[0], PREFILL)
        logits = model(ids[:, PREFILL: PREFILL + DECODE], past_key_values=cache, use_cache=True).logits
        nll += torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 ids[:, PREFILL + 1:].reshape(-1), reduction="sum").item()
        count += ids[:, PREFILL + 1:].numel()
    return {"ppl": math.exp(nll / count), "bytes_ratio": held / dense, "bytes_per_token": held / (len(data) * PREFILL),
            "prefill_compress_s": secs}


@torch.inference_mode()
def decode_ms_per_token(model, ids: torch.Tensor, entry: dict) -> float:
    """Prefill 64 tokens (untimed), then 64 single-token teacher-forced steps; ms per step."""
    cache = entry["make"]()
    model(ids[None, :PREFILL], past_key_values=cache, use_cache=True)
    t0 = time.perf_counter()
    for t in range(PREFILL, PREFILL + DECODE):
        model(ids[None, t: t + 1], past_key_values=cache, use_cache=True)
    return (time.perf_counter() - t0) / DECODE * 1e3


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------

def at_ratio(rows: list[dict], family: str, target: float) -> dict:
    """A family's perplexity at `target` bytes: measured if a point lies within 1.5 points of it, else
    log-linear interpolation between the measured points around it, else (not bracketed) its best point
    below `target` — a cache holding fewer bytes than the budget (None if it has none)."""
    pts = sorted((r["bytes_ratio"], r["ppl"]) for r in rows if r["family"] == family and r.get("ppl") is not None)
    near = [p for p in pts if abs(p[0] - target) <= 0.015]
    if near:
        return {"ppl": near[0][1], "bytes_ratio": near[0][0], "how": "measured"}
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= target <= x1:
            y = math.exp(math.log(y0) + (math.log(y1) - math.log(y0)) * (target - x0) / (x1 - x0))
            return {"ppl": y, "bytes_ratio": target, "how": f"interpolated between {x0:.3f} and {x1:.3f}"}
    below = [p for p in pts if p[0] <= target]
    if below:
        x, y = min(below, key=lambda p: p[1])
        return {"ppl": y, "bytes_ratio": x, "how": "best point below the budget (no measured point above it)"}
    return {"ppl": None, "bytes_ratio": None,
            "how": f"not reachable (measured ratios: {', '.join(f'{x:.3f}' for x, _ in pts) or 'none'})"}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    base = next(r["ppl"] for r in rows if r["family"] == "dynamic")
    ax.axhline(base, color="k", ls="--", lw=1, label=f"DynamicCache ({base:.2f})")
    families = [f for f in dict.fromkeys(r["family"] for r in rows) if f != "dynamic"]
    for fam in families:
        pts = sorted((r["bytes_ratio"], r["ppl"]) for r in rows if r["family"] == fam and r.get("ppl") is not None)
        if pts:
            ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], "o-", label=fam)
    ax.axvline(25, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("cache bytes after prefill, % of DynamicCache (fp32)")
    ax.set_ylabel("perplexity (64 decoded tokens)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SCALING_LENGTHS = (128, 256, 512, 1024, 2048)


@torch.inference_mode()
def scaling(lengths=SCALING_LENGTHS, steps: int = 16, rank: float = 0.25, threads: int = 2, stem: str = "kv_cache_scaling") -> list[dict]:
    """Bytes held and decode time per token against the context length, batch 1: DynamicCache, the
    EinSortCache default (packed segments only, rebuilt every step), EinSortCache keeping the rebuilt
    segments, and QuantizedCache (quanto, 4 and 2 bits, groups of 64). At each length every cache is
    filled by one prefill of `length` tokens of Wikipedia text, then all take `steps` single-token steps
    in turn (round robin, so a slow spell of the machine falls on all of them); the median step is
    reported, and each cache's slope (least squares of ms/token on the length) in ms per 1,000 tokens."""
    set_threads(threads)
    path = model_path("smollm2")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tok("\n\n".join(load_text("wikipedia", "eval")), return_tensors="pt").input_ids[:, : max(lengths) + steps]
    makers = {
        "dynamic": lambda: DynamicCache(config=model.config),
        "einsort default": lambda: EinSortCache(model.config, rank=rank),
        "einsort keep rebuilt": lambda: EinSortCache(model.config, rank=rank, low_memory=False),
        "quanto 4-bit": lambda: QuantizedCache("quanto", model.config, nbits=4, q_group_size=64, residual_length=64),
        "quanto 2-bit": lambda: QuantizedCache("quanto", model.config, nbits=2, q_group_size=64, residual_length=64),
    }
    rows = []
    for length in lengths:
        dense = dense_bytes(model, 1, length + steps)
        caches = {name: make() for name, make in makers.items()}
        for cache in caches.values():
            model(ids[:, :length], past_key_values=cache, use_cache=True)
        times = {name: [] for name in caches}
        for t in range(length, length + steps):
            for name, cache in caches.items():
                t0 = time.perf_counter()
                model(ids[:, t: t + 1], past_key_values=cache, use_cache=True)
                times[name].append((time.perf_counter() - t0) * 1e3)
        for name, cache in caches.items():
            rows.append({"cache": name, "length": length, "ms_per_token": statistics.median(times[name]),
                         "bytes": cache_bytes(cache), "bytes_vs_dynamic": cache_bytes(cache) / dense})
            print(rows[-1], flush=True)
    base = {r["length"]: r["ms_per_token"] for r in rows if r["cache"] == "dynamic"}
    for r in rows:
        r["time_vs_dynamic"] = r["ms_per_token"] / base[r["length"]]
    slopes = {}
    for name in makers:
        pts = [(r["length"], r["ms_per_token"]) for r in rows if r["cache"] == name]
        mx, my = statistics.fmean(p[0] for p in pts), statistics.fmean(p[1] for p in pts)
        slopes[name] = 1e3 * sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    write_json(f"{stem}.json", {"rows": rows, "ms_per_1000_tokens": slopes})
    (RESULTS / f"{stem}.md").write_text(
        "# KV cache: bytes held and decode time per token against the context length\n\n"
        f"SmolLM2-135M (float32), batch 1, {threads} threads; at each length one prefill, then {steps} single-token "
        f"steps per cache, taken in turn; median ms. EinSortCache at rank {rank} (byte fraction per segment), segment 64, "
        "residual 64. Written by `benchmarks/kv_cache.py --scaling`.\n\n"
        + markdown_table(rows, [("cache", "cache", "{}"), ("length", "length", "{}"), ("bytes", "bytes held", "{:,}"),
                                ("bytes_vs_dynamic", "bytes vs DynamicCache", "{:.3f}"),
                                ("ms_per_token", "ms / token", "{:.1f}"), ("time_vs_dynamic", "time vs DynamicCache", "{:.2f}x")])
        + "\n\nGrowth of the per-token time with the length (least squares over the lengths above):\n\n"
        + markdown_table([{"cache": k, "slope": v, "vs": v / slopes["dynamic"]} for k, v in slopes.items()],
                         [("cache", "cache", "{}"), ("slope", "ms / token per 1,000 tokens of context", "{:.2f}"),
                          ("vs", "vs DynamicCache", "{:.1f}x")])
        + "\n")
    plot_scaling(rows, RESULTS / f"{stem}.png")
    return rows


def plot_scaling(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.8))
    for name in dict.fromkeys(r["cache"] for r in rows):
        pts = [r for r in rows if r["cache"] == name]
        axes[0].plot([r["length"] for r in pts], [r["ms_per_token"] for r in pts], "o-", label=name)
        axes[1].plot([r["length"] for r in pts], [r["bytes_vs_dynamic"] for r in pts], "o-", label=name)
    for ax, label in zip(axes, ("ms per decoded token", "bytes held vs DynamicCache")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M KV cache, batch 1, CPU", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scaling", action="store_true", help="bytes and ms/token against the context length only")
    ap.add_argument("--recipe", type=Path, help="JSON overriding DEFAULT_RECIPE's keys")
    ap.add_argument("--windows", type=int)
    ap.add_argument("--out", default="kv_cache", help="result file stem under benchmarks/results")
    ap.add_argument("--report-only", action="store_true", help="rewrite the .md/.png (and summary) from the .json")
    args = ap.parse_args(argv)
    if args.scaling:
        return scaling(stem=args.out if args.out != "kv_cache" else "kv_cache_scaling")
    if args.report_only:
        return report(args.out)
    recipe = dict(DEFAULT_RECIPE)
    if args.recipe:
        recipe.update({k: v for k, v in json.loads(args.recipe.read_text()).items() if k != "description"})
    if args.windows:
        recipe["windows"] = args.windows
    set_threads(recipe["threads"])
    torch.manual_seed(0)

    path = model_path(recipe["model"])
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    data = windows(tok, recipe["windows"])
    t_start = time.perf_counter()

    rows, skipped = [], []
    for entry in factories(model, recipe):
        why = available(entry)
        if why is not None and "rank" not in why:
            skipped.append({"name": entry["name"], "why": why})
            print("skip", entry["name"], why, flush=True)
            continue
        row = {k: entry[k] for k in ("name", "family", "ratio") if k in entry}
        try:
            row.update(evaluate(model, data, entry, recipe["batch"]))
        except ValueError as e:  # e.g. a byte budget below what the permutation and sign bits alone take
            row.update({"ppl": None, "note": str(e).split(": ", 1)[-1][:160]})
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    eval_s = time.perf_counter() - t_start

    # decode time: the families at the timing ratio (the quantized ones at their own), interleaved
    timed = {"dynamic": next(e for e in factories(model, recipe) if e["name"] == "dynamic")}
    for e in factories(model, recipe):
        ok = any(r["name"] == e["name"] and r.get("ppl") is not None for r in rows)
        if ok and (e["ratio"] == recipe["timing_ratio"] or e["ratio"] is None or e["name"] in recipe.get("timed", ())):
            timed[e["name"]] = e
    times: dict[str, list[float]] = {k: [] for k in timed}
    for ids in data[: recipe["timing_windows"]]:
        for name, e in timed.items():
            times[name].append(decode_ms_per_token(model, ids, e))
    base_ms = statistics.median(times["dynamic"])
    timing = [{"name": k, "decode_ms_per_token": statistics.median(v), "vs_dynamic": statistics.median(v) / base_ms}
              for k, v in times.items()]
    for t in timing:
        print(t, flush=True)

    setup = {"model": recipe["model"], "windows": len(data), "tokens_scored": len(data) * DECODE,
             "prefill": PREFILL, "decode": DECODE, "threads": recipe["threads"], "dtype": str(model.dtype),
             "torch": torch.__version__, "eval_seconds": eval_s, "recipe": recipe}
    write_json(f"{args.out}.json", {"setup": setup, "rows": rows, "timing": timing, "skipped": skipped})
    report(args.out)


def report(out: str) -> None:
    """Summaries, markdown table and plot from benchmarks/results/<out>.json (rewrites its summary)."""
    res = json.loads((RESULTS / f"{out}.json").read_text())
    setup, rows, timing, skipped = res["setup"], res["rows"], res["timing"], res.get("skipped", [])
    recipe = setup["recipe"]
    dyn_bpt = next(r["bytes_per_token"] for r in rows if r["family"] == "dynamic")
    for r in rows:
        if r.get("bytes_per_token") is not None:
            r["bytes_per_token_vs_dynamic"] = r["bytes_per_token"] / dyn_bpt
    families = [f for f in dict.fromkeys(r["family"] for r in rows) if f != "dynamic"]
    summary = {f: at_ratio(rows, f, 0.25) for f in families}
    summary20 = {f: at_ratio(rows, f, 0.20) for f in families}
    dyn_ppl = next(r["ppl"] for r in rows if r["family"] == "dynamic")
    for v in (*summary.values(), *summary20.values()):
        v["vs_dynamic"] = None if v["ppl"] is None else v["ppl"] / dyn_ppl
    write_json(f"{out}.json", {**res, "rows": rows, "at_25_percent": summary, "at_20_percent": summary20})

    title = (f"{setup['model']}: prefill {PREFILL}, compress, decode {DECODE} teacher-forced; "
             f"{setup['windows']} Wikipedia windows")
    md = [f"# KV-cache compression ({title})", "",
          f"{setup['windows']} windows x {DECODE} scored tokens = {setup['tokens_scored']} tokens per contender; "
          f"model {setup['dtype']}, torch {setup['torch']}, {setup['threads']} thread(s) on a shared 2-core CPU; "
          f"evaluation took {setup['eval_seconds'] / 60:.1f} min.", "",
          "Bytes: what each cache holds after prefill + compression, over DynamicCache's bytes for the same "
          "64 tokens (fp32). EinSort-family ratios are per-segment byte budgets (factors + permutation + sign bits); "
          "the realized ratio is shown. `bytes / token` is for the whole cache (30 layers, keys and values).", "",
          markdown_table(rows, [("name", "cache", "{}"), ("bytes_ratio", "bytes / dynamic", "{:.3f}"),
                                ("bytes_per_token", "bytes / token", "{:.0f}"), ("ppl", "ppl", "{:.3f}"),
                                ("prefill_compress_s", "prefill+compress s", "{:.2f}"), ("note", "note", "{}")]),
          *[line for pct, summ in ((20, summary20), (25, summary)) for line in (
              "", f"## Perplexity at {pct} % of DynamicCache bytes", "",
              markdown_table([{"family": f, **v} for f, v in summ.items()],
                             [("family", "contender", "{}"), ("ppl", "ppl", "{:.3f}"), ("vs_dynamic", "vs dynamic", "{:.4f}"),
                              ("bytes_ratio", "bytes / dynamic", "{:.3f}"), ("how", "how", "{}")]))],
          "", f"DynamicCache perplexity: {next(r['ppl'] for r in rows if r['family'] == 'dynamic'):.3f}", "",
          f"## Decode time per token (batch 1, single-token steps after a 64-token prefill, median of "
          f"{recipe['timing_windows']} windows, interleaved, {setup['threads']} thread(s))", "",
          markdown_table(timing, [("name", "cache", "{}"), ("decode_ms_per_token", "ms / token", "{:.1f}"),
                                  ("vs_dynamic", "vs DynamicCache", "{:.2f}x")])]
    if skipped:
        md += ["", "Skipped: " + "; ".join(f"{s['name']} ({s['why'][:120]})" for s in skipped)]
    (RESULTS / f"{out}.md").write_text("\n".join(md) + "\n")
    plot(rows, RESULTS / f"{out}.png", title)
    print("\n".join(md))

if __name__ == "__main__":
    main()
