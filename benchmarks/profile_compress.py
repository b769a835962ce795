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
STAGES = [
    ("ladders: quantizer (GPTQ / RTN) per width", "_quantize", "ladder"),
    ("ladders: error spectra (SVD) per width", "svdvals", "ladder"),
    ("ladders: error energy, no correction", "energy", "ladder"),
    ("ladders: GPTQ plan (inverse Gram)", "_plan", "ladder"),
    ("ladders: whitening factor (Cholesky)", "_whitening", "ladder"),
    ("LASER spectra (whitened SVD values)", "whitened_spectrum", None),
    ("compress: GPTQ plan (inverse Gram)", "_plan", "fit"),
    ("compress: quantizer (GPTQ / RTN)", "_quantize", "fit"),
    ("compress: correction (whitened SVD)", "whitened_svd", "fit"),
    ("compress: de-quantize (approx)", "_approx", "fit"),
    ("compress: whitening factor (Cholesky)", "_whitening", "compress"),
    ("compress: errors for the report", "_error", "compress"),
    ("compress: layer build (pack, kernel layout)", "build", "compress"),
    ("statistics (Gram hooks)", "hook", None),
    ("embedding table (GPTQ of the head's inputs)", "quantize_embeddings", None),
    ("embedding table's ladder", "_table_ladder", None),
    ("Fisher (one backward pass)", "output_fisher", None),
    ("loading the model", "from_pretrained", "load_model"),
    ("streamed layer load", "_load", None),
    ("streamed layer write", "_release", None),
    ("saving", "save_pretrained", None),
]


def _find(stats: pstats.Stats, func: str, caller: str | None) -> float:
    total = 0.0
    for (path, _, name), (_, _, _, ct, callers) in stats.stats.items():
        if not (name == func or name.endswith(f".{func}") or name.endswith(f" {func}>") or f"linalg_{func}" in name):
            continue
        if "hf_tensorcomp" not in path and "~" != path and caller is None and func not in ("from_pretrained", "save_pretrained"):
            continue
        if caller is None:
            total += ct
        else:
            total += sum(v[3] for (_, _, cname), v in callers.items() if cname == caller)
    return total


def _stages(prof: Path, wall: float) -> dict:
    stats = pstats.Stats(str(prof))
    out = {label: round(_find(stats, f, c), 1) for label, f, c in STAGES}
    hooks = out["statistics (Gram hooks)"]
    out["calibration forward (decoder layers, with hooks)"] = round(_find(stats, "_forward", "run") - hooks, 1)
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
            write_checkpoint(work / "src", shape)
            args = ["compress", str(work / "src"), "--stream", "--out", str(work / "out"), "--quiet", "--no-eval",
                    "--layers", "0", *PATHS[path]]
        import torch

        torch.set_num_threads(threads)
        from hf_tensorcomp import cli

        prof = work / "run.prof"
        t = time.perf_counter()
        cProfile.runctx("rc = cli.main(args)", globals(), {"cli": cli, "args": args}, str(prof))
        wall = time.perf_counter() - t
        row = {"path": path, "label": label, "threads": threads, **_stages(prof, wall)}
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
        mine = [r for r in rows if r["path"] == path]
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
