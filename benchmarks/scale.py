"""Streaming vs in-memory compression: peak memory and time, as ratios to the float32 model's size.

For each bundled model, one child process compresses it in memory (``from_pretrained(...,
quantization_config=cfg)``) and another streams it (``hf_tensorcomp.compress_checkpoint``, one decoder
layer in memory at a time); both with the same calibrated config (whitened LASER at 80 % of the decoder
linears' parameters, relative allocation: streaming refuses Fisher weighting, which needs a backward
pass of the whole model). Peak resident memory is the child's max RSS above its own after-import
baseline; the two outputs are compared tensor by tensor.

    python benchmarks/scale.py
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, markdown_table, write_json  # noqa: E402

NAME = "scale"
CFG = {"method": "laser", "target": 0.8, "whiten": True, "allocation": "relative", "targets": ["*_proj"],
       "calibration": "wikipedia", "calibration_samples": 32, "calibration_length": 256}


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _one(model: str, how: str, out: str, limit_mb: int | None, q) -> None:
    import torch

    torch.set_num_threads(2)
    import hf_tensorcomp
    from hf_tensorcomp import TensorCompressionConfig, assets
    from hf_tensorcomp.streaming import PeakRSS
    from transformers import AutoModelForCausalLM

    src = assets.model_path(model)
    cfg = TensorCompressionConfig(progress=False, **CFG)
    row = {"model": model, "how": how, "limit_mb": limit_mb}
    if limit_mb is not None:  # address space: what is mapped now plus the limit (enforced by the kernel)
        resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + limit_mb * 2**20, resource.RLIM_INFINITY))
    t0 = time.perf_counter()
    try:
        with PeakRSS() as peak:
            if how == "stream":
                report = hf_tensorcomp.compress_checkpoint(src, out, cfg)
                row.update(seconds_per_layer=report["seconds_per_layer"], bound_mb=report["bound_mb"])
            else:
                m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, quantization_config=cfg)
                m.save_pretrained(out)
        row.update(ok=True, peak_mb=round(peak.above_start / 2**20))
    except (MemoryError, RuntimeError, OSError) as e:  # the limit reached
        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:120]}")
    row["seconds"] = round(time.perf_counter() - t0, 1)
    q.put(row)


def main() -> None:
    import torch
    from safetensors.torch import load_file

    from hf_tensorcomp import assets

    ctx = mp.get_context("spawn")
    rows = []
    for model in ("smollm2", "gemma3"):
        src = Path(assets.model_path(model))
        fp32_mb = sum(t.numel() * 4 for f in src.glob("*.safetensors") for t in load_file(str(f)).values()) / 2**20
        limit = int(fp32_mb * 0.6)  # an address-space limit below the float32 model
        outs = {}
        for how, lim in (("memory", None), ("stream", None), ("memory", limit), ("stream", limit)):
            out = tempfile.mkdtemp() + "/out"
            q = ctx.Queue()
            p = ctx.Process(target=_one, args=(model, how, out, lim, q))
            p.start()
            p.join()
            row = q.get() if not q.empty() else {"model": model, "how": how, "limit_mb": lim, "ok": False,
                                                    "error": f"exit code {p.exitcode}"}
            row.update(fp32_mb=round(fp32_mb))
            if row.get("peak_mb") is not None:
                row["peak_vs_fp32"] = row["peak_mb"] / fp32_mb
            if lim is None:
                outs[how] = out
            rows.append(row)
            print(row, flush=True)
        a = {k: v for f in Path(outs["memory"]).glob("*.safetensors") for k, v in load_file(str(f)).items()}
        b = {k: v for f in Path(outs["stream"]).glob("*.safetensors") for k, v in load_file(str(f)).items()}
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        for r in rows[-4:]:
            r["identical"] = same
            r["bound"] = r.get("bound_mb", {}).get("bound")
    write_json(f"{NAME}.json", rows)
    md = markdown_table(rows, [("model", "model", "{}"), ("how", "path", "{}"), ("fp32_mb", "float32 model MB", "{:,}"),
                               ("limit_mb", "address-space limit MB", "{}"), ("ok", "finished", "{}"),
                               ("peak_mb", "peak RSS above start MB", "{}"), ("peak_vs_fp32", "peak / float32 model", "{:.2f}"),
                               ("bound", "bound MB", "{}"), ("seconds", "seconds", "{:.0f}"),
                               ("identical", "outputs identical (memory vs stream)", "{}")])
    (RESULTS / f"{NAME}.md").write_text(
        "# Streaming vs in-memory compression\n\n" + json.dumps(CFG) + "\n\nPeak: resident memory above the "
        "child's value at the start, sampled every 2 ms. The limited rows run under an address-space limit (RLIMIT_AS) "
        "of 60 % of the float32 model above what the child had mapped after its imports. Bound: the streaming "
        "report's (1.5 x (layer + compressed layer + calibration states + statistics)). Written by benchmarks/scale.py.\n\n"
        + md + "\n")
    print(md)


if __name__ == "__main__":
    main()
