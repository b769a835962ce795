"""Where compression's seconds go: one run of the CLI under cProfile, its time split into stages.

Paths: ``7b-qlr`` / ``7b-laser`` — the settings of `scale.py`'s 7B-shaped rows (Llama-2-7B's layer shapes, random
N(0, 0.02) bfloat16 weights, SmolLM2's tokenizer and vocabulary; 8 x 256 Wikipedia calibration tokens in batches of
4; ``compress --stream``), on a checkpoint of ONE such decoder layer, so that the run is one layer's allocation and
compression passes; ``main-job`` — the README's main job (``recipes/qlr_smollm2.json``, without its evaluation and
peers) on the bundled SmolLM2. The stages are read off the profile by function (a function's time counted under the
stage of the caller named; the stages do not overlap) and printed as a table; ``--label`` names the column of the
results (``before`` / ``after`` a change), merged into ``benchmarks/results/profile_compress.{json,md}``.

    python benchmarks/profile_compress.py --path 7b-qlr --label after
    python benchmarks/profile_compress.py --path main-job --label after
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing as mp
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import PATHS, RESULTS, SHAPES, markdown_table, write_checkpoint, write_json  # noqa: E402

NAME = "profile_compress"
ROOT = Path(__file__).resolve().parent.parent

# (stage, function, caller or None): the function's cumulative time under that caller (or in all); disjoint
STAGES = [  # names before and after the change of issue 99 (`ladder` became `_ladder`; the widths swept together)
    ("ladders: quantizer (GPTQ / RTN) per width", ("_quantize", "_quantize_widths"), ("ladder", "_ladder")),
    ("ladders: error spectra (SVD) per width", ("svdvals", "spectrum_tails"), ("ladder", "_ladder")),
    ("ladders: energies (an error's, the weight's)", ("energy", "_plan_energy"), ("ladder", "_ladder")),
    ("ladders: GPTQ plan (inverse Gram)", ("_plan",), ("ladder",)),
    ("ladders: whitening factor (Cholesky)", ("_whitening",), ("ladder",)),
    ("ladders: GPTQ plan and whitening (one per input)", ("_derived",), ("_ladder",)),
    ("LASER spectra (whitened SVD values)", ("whitened_spectrum",), None),
    ("compress: GPTQ plan (inverse Gram)", ("_plan",), ("fit",)),
    ("compress: quantizer (GPTQ / RTN)", ("_quantize", "_quantize_widths"), ("fit",)),
    ("compress: correction (whitened SVD)", ("whitened_svd",), ("fit", "compress")),
    ("compress: de-quantize (approx)", ("_approx",), ("fit",)),
    ("compress: whitening factor (Cholesky)", ("_whitening",), ("compress",)),
    ("compress: GPTQ plan and whitening (one per input)", ("_derived",), ("compress",)),
    ("compress: errors for the report", ("_error", "_errors", "relative_error"), ("compress",)),
    ("compress: layer build (pack, kernel layout)", ("build", "from_factors", "pivoted_from_factors"), ("compress",)),
    ("statistics (Gram hooks)", ("hook",), None),
    ("embedding table (GPTQ of the head's inputs)", ("quantize_embeddings", "quantize_table"), None),
    ("embedding table's ladder", ("_table_ladder",), None),
    ("Fisher (one backward pass)", ("output_fisher",), None),
    ("loading the model", ("from_pretrained",), ("load_model",)),
    ("streamed layer load", ("_load",), None),
    ("streamed layer write", ("_release",), None),
    ("saving", ("save_pretrained",), None),
]


def _find(stats: pstats.Stats, funcs, callers) -> float:
    total = 0.0
    for (path, _, name), (_, _, _, ct, by) in stats.stats.items():
        if not any(name == f or name.endswith(f" {f}>") or f"linalg_{f}" in name for f in funcs):
            continue
        if callers is None:
            if "hf_tensorcomp" in path or "transformers" in path:
                total += ct
        else:
            total += sum(v[3] for (_, _, cname), v in by.items() if cname in callers)
    return total


def _stages(prof: Path, wall: float) -> dict:
    stats = pstats.Stats(str(prof))
    out = {label: round(_find(stats, f, c), 1) for label, f, c in STAGES}
    hooks = out["statistics (Gram hooks)"]
    out["calibration forward (decoder layers, with hooks)"] = round(_find(stats, ("_forward",), ("run",)) - hooks, 1)
    out["other (Python, checks, tokenizing, reports)"] = round(wall - sum(out.values()), 1)
    out["total (wall)"] = round(wall, 1)
    return out


def run(path: str, label: str, threads: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="hf-tensorcomp-profile-", dir="/tmp"))
    try:
        if path == "main-job":
            recipe = json.loads((ROOT / "recipes" / "qlr_smollm2.json").read_text())
            recipe.pop("peers", None)
            (work / "recipe.json").write_text(json.dumps(recipe))
            args = ["compress", "--recipe", str(work / "recipe.json"), "--out", str(work / "out"), "--no-eval", "--quiet"]
        else:
            shape = {**SHAPES["7b"], "num_hidden_layers": 1}
            writer = mp.get_context("spawn").Process(target=write_checkpoint, args=(work / "src", shape))
            writer.start()  # in a process of its own: this one's memory starts where the compression does
            writer.join()
            args = ["compress", str(work / "src"), "--stream", "--out", str(work / "out"), "--quiet", "--no-eval",
                    "--layers", "0", *PATHS[path]]
        import torch

        torch.set_num_threads(threads)
        from hf_tensorcomp import cli
        from hf_tensorcomp.memory import PeakRSS

        prof = work / "run.prof"
        with PeakRSS() as peak:
            t = time.perf_counter()
            cProfile.runctx("rc = cli.main(args)", globals(), {"cli": cli, "args": args}, str(prof))
            wall = time.perf_counter() - t
        row = {"path": path, "label": label, "threads": threads, **_stages(prof, wall),
               "peak RSS above start (MB)": round(peak.above_start / 2**20)}
        report = json.loads((work / "out" / "config.json").read_text()).get("quantization_config", {}).get("stats", {})
        row["compress_seconds (report)"] = report.get("compress_seconds")
        keep = RESULTS / f"{NAME}_{path}_{label}.prof.txt"  # the top of the profile, for the record
        with open(keep, "w") as f:
            pstats.Stats(str(prof), stream=f).sort_stats("cumulative").print_stats(60)
        return row
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write(row: dict) -> None:
    old = json.loads((RESULTS / f"{NAME}.json").read_text()) if (RESULTS / f"{NAME}.json").exists() else []
    rows = [r for r in old if (r["path"], r["label"]) != (row["path"], row["label"])] + [row]
    write_json(f"{NAME}.json", rows)
    stages = [k for k in row if k not in ("path", "label", "threads")]
    lines = ["# Where compression's seconds go", "", (__doc__ or "").split("\n\n")[1].replace("\n", " "), ""]
    for path in dict.fromkeys(r["path"] for r in rows):
        mine = sorted((r for r in rows if r["path"] == path), key=lambda r: (r["label"] != "before", r["label"]))
        table = [{"stage": s, **{r["label"]: r.get(s) for r in mine}} for s in stages]
        lines += [f"## {path} ({mine[0]['threads']} threads)", "",
                  markdown_table(table, [("stage", "stage", "{}")] + [(r["label"], f"{r['label']} s", "{}") for r in mine]), ""]
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", choices=["main-job", *PATHS], required=True)
    p.add_argument("--label", default="after")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    row = run(a.path, a.label, a.threads)
    print(json.dumps(row, indent=1))
    write(row)


if __name__ == "__main__":
    main()
