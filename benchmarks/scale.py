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


def _one(model: str, how: str, out: str, q) -> None:
    import torch

    torch.set_num_threads(2)
    import hf_tensorcomp
    from hf_tensorcomp import TensorCompressionConfig, assets
    from transformers import AutoModelForCausalLM

    src = assets.model_path(model)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = TensorCompressionConfig(progress=False, **CFG)
    t0 = time.perf_counter()
    if how == "stream":
        report = hf_tensorcomp.compress_checkpoint(src, out, cfg)
        per_layer = report["seconds_per_layer"]
    else:
        m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, quantization_config=cfg)
        m.save_pretrained(out)
        per_layer = None
    q.put({"model": model, "how": how, "seconds": round(time.perf_counter() - t0, 1),
           "peak_mb": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024),
           "seconds_per_layer": per_layer})


def main() -> None:
    import torch
    from safetensors.torch import load_file

    from hf_tensorcomp import assets

    ctx = mp.get_context("spawn")
    rows = []
    for model in ("smollm2", "gemma3"):
        outs = {}
        for how in ("memory", "stream"):
            outs[how] = tempfile.mkdtemp() + "/out"
            q = ctx.Queue()
            p = ctx.Process(target=_one, args=(model, how, outs[how], q))
            p.start()
            p.join()
            rows.append(q.get())
            print(rows[-1], flush=True)
        src = Path(assets.model_path(model))
        fp32_mb = sum(t.numel() * 4 for f in src.glob("*.safetensors") for t in load_file(str(f)).values()) / 2**20
        a = {k: v for f in Path(outs["memory"]).glob("*.safetensors") for k, v in load_file(str(f)).items()}
        b = {k: v for f in Path(outs["stream"]).glob("*.safetensors") for k, v in load_file(str(f)).items()}
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        for r in rows[-2:]:
            r.update(fp32_mb=round(fp32_mb), peak_vs_fp32=r["peak_mb"] / fp32_mb, identical=same)
    write_json(f"{NAME}.json", rows)
    md = markdown_table(rows, [("model", "model", "{}"), ("how", "path", "{}"), ("fp32_mb", "float32 model MB", "{:,}"),
                               ("peak_mb", "peak RSS above baseline MB", "{:,}"), ("peak_vs_fp32", "peak / float32 model", "{:.2f}"),
                               ("seconds", "seconds", "{:.0f}"), ("identical", "identical outputs", "{}")])
    (RESULTS / f"{NAME}.md").write_text("# Streaming vs in-memory compression\n\n" + json.dumps(CFG) + "\n\n" + md + "\n")
    print(md)


if __name__ == "__main__":
    main()
