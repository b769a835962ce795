"""Streaming vs in-memory compression: peak memory and time, as ratios to the float32 model's size.

For each bundled model, one child process compresses it in memory (``from_pretrained(...,
quantization_config=cfg)``) and another streams it (``hf_tensorcomp.compress_checkpoint``, one decoder
layer in memory at a time); both with the same calibrated config (whitened LASER at 80 % of the decoder
linears' parameters, relative allocation: streaming refuses Fisher weighting, which needs a backward
pass of the whole model). Peak resident memory is the child's max RSS above its own after-import
baseline; the two outputs are compared tensor by tensor. Then both again in a memory cgroup limited to 60 %
of the float32 model (where the machine lets a process make one; root, cgroup v1 or v2).

The ``-table8`` paths add ``embedding_bits=8`` (the input embedding and the head as 8-bit codes, GPTQ on
the head's inputs): streaming reads, quantizes and writes the table a block of rows at a time.

The ``7b-`` paths (issue 85; `scale_7b.py`): a LlamaForCausalLM checkpoint with Llama-2-7B's shapes (hidden
4096, 32 layers, intermediate 11008, 32 heads; the vocabulary is SmolLM2's 49152 ids, 1.5x Llama-2's 32000, so that
its tokenizer, saved beside, can give the calibration text), random N(0, 0.02) bfloat16 weights written shard by
shard (~2 GB shards) into a temporary folder under /tmp, removed at the end. Each path runs the CLI's ``compress
--stream`` with the first ``--layers-7b`` decoder layers compressed (default 1; the others copied through, written
as float32 like every streamed layer), on one process (two threads) and on two (``torchrun --nproc-per-node 2``,
gloo, a thread each), every process in its own memory cgroup (``--limit-mb``, default 8192, below the checkpoint's
13 GB; each run stopped after ``--timeout-7b`` seconds). ``7b-qlr``: ``qlr`` at ``target_bytes=0.27`` (its allocation settles to "relative" while streaming);
``7b-laser``: whitened LASER at ``target=0.8``, relative allocation; both calibrated on 8 x 256 tokens of
Wikipedia in two batches (one a rank). Reported: each process's peak RSS above its start, seconds per compressed
layer (its allocation pass + its compression pass, load to release), seconds per copied layer, whether the
compressed layers are identical on 1 and 2 processes, and a Llama-2-70B estimate (80 layers; time x the layer's
cost ratio, rows x cols^2 summed over its matrices for qlr's GPTQ, min^2 x max for LASER's SVDs; peak x the ratio
of the layer's parameters; and the library's memory bound at 70B's shapes). ``--shape tiny`` runs the same path at
hidden 512, 4 layers, printing its rows without writing them.

    python benchmarks/scale.py
    python benchmarks/scale.py --only memory-table8,stream-table8   # those paths, merged into the results
    python benchmarks/scale.py --only 7b-qlr,7b-laser                # the 7B-shaped paths (~1 h on 2 cores; qlr is killed at 8 GB)
    python benchmarks/scale.py --only 7b-qlr --shape tiny            # the same path at a small shape, not written
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, markdown_table, set_threads, write_json  # noqa: E402

NAME = "scale"
CFG = {"method": "laser", "target": 0.8, "whiten": True, "allocation": "relative", "targets": ["*_proj"],
       "pivoted": False,
       "calibration": "wikipedia", "calibration_samples": 32, "calibration_length": 256}


CGROUP = Path("/sys/fs/cgroup/memory")  # cgroup v1's memory controller (v2: memory.max under /sys/fs/cgroup)


def _limit_memory(limit_mb: int) -> str | None:
    """Put this process in a new memory cgroup whose limit is `limit_mb` (what it allocates from now on is
    charged there; the kernel kills it past the limit). None where no writable memory cgroup exists."""
    for root, limit_file in ((CGROUP, "memory.limit_in_bytes"), (Path("/sys/fs/cgroup"), "memory.max")):
        group = root / f"hf_tensorcomp_scale_{os.getpid()}"
        try:
            group.mkdir()
            (group / limit_file).write_text(str(limit_mb * 2**20))
            (group / "cgroup.procs").write_text(str(os.getpid()))
            return str(group)
        except OSError:
            continue
    return None


def _one(model: str, how: str, out: str, limit_mb: int | None, q) -> None:
    import torch

    set_threads(2)
    import hf_tensorcomp
    from hf_tensorcomp import TensorCompressionConfig, assets
    from hf_tensorcomp.memory import PeakRSS
    from transformers import AutoModelForCausalLM

    src = assets.model_path(model)
    cfg = TensorCompressionConfig(progress=False, **CFG, **({"embedding_bits": 8} if how.endswith("-table8") else {}))
    row = {"model": model, "how": how, "limit_mb": limit_mb}
    if limit_mb is not None:
        row["cgroup"] = _limit_memory(limit_mb)
        if row["cgroup"] is None:
            q.put({**row, "ok": False, "error": "no writable memory cgroup on this machine: the limit was not applied"})
            return
    t0 = time.perf_counter()
    try:
        with PeakRSS() as peak:
            if how == "gguf-memory":  # the bundled conversion: transformers' GGUF loading (the whole model), then saved
                from hf_tensorcomp.assets.models import _convert, _spec

                _convert(_spec(model), Path(out))
            elif how == "gguf-stream":  # tensor by tensor
                from hf_tensorcomp.assets.models import gguf_path

                hf_tensorcomp.convert_gguf(gguf_path(model), out, dtype="float32", max_shard_size="100MB")
            elif how.startswith("stream"):  # "stream-disk": the calibration states in files, one batch in memory
                report = hf_tensorcomp.compress_checkpoint(src, out, cfg, states_dir=tempfile.mkdtemp() if how == "stream-disk" else None)
                row.update(seconds_per_layer=report["seconds_per_layer"], bound_mb=report["bound_mb"],
                           layers_peak_mb=report["peak_above_start_mb"], setup_peak_mb=report["setup_peak_above_start_mb"])
            else:
                m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, quantization_config=cfg)
                m.save_pretrained(out)
        row.update(ok=True, peak_mb=round(peak.above_start / 2**20))
    except (MemoryError, RuntimeError, OSError) as e:  # the limit reached
        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:120]}")
    row["seconds"] = round(time.perf_counter() - t0, 1)
    q.put(row)


RUNS = ("memory", "stream", "stream-disk", "memory-table8", "stream-table8",  # and memory / stream under the limit
        "gguf-memory", "gguf-stream")  # the GGUF file to a float32 checkpoint: transformers' loading vs convert_gguf
GROUPS = {"memory": ("stream", "stream-disk"), "memory-table8": ("stream-table8",), "gguf-memory": ("gguf-stream",)}


def main() -> None:
    import argparse

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from hf_tensorcomp import assets

    import scale_7b

    big = tuple(scale_7b.PATHS)
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", help=f"comma-separated paths among {', '.join(RUNS + big)} (unlimited), merged into the "
                                       "results already written")
    parser.add_argument("--shape", default="7b", choices=list(scale_7b.SHAPES), help="the 7b- paths' shapes (tiny: "
                        "printed, not written)")
    parser.add_argument("--layers-7b", type=int, default=1, help="the 7b- paths: decoder layers compressed (the first)")
    parser.add_argument("--limit-mb", type=int, default=None, help="the 7b- paths: memory limit per process "
                        "(default 8192; 1024 with --shape tiny)")
    parser.add_argument("--timeout-7b", type=float, default=3600, help="the 7b- paths: seconds a run may take (then stopped, "
                        "its row marked unfinished)")
    args = parser.parse_args()
    only = None if args.only is None else args.only.split(",")
    if only is not None and not set(only) <= set(RUNS + big):
        parser.error(f"--only: got {args.only!r}; allowed: a comma-separated subset of {', '.join(RUNS + big)}")
    rows = []
    if only is not None and set(only) & set(big):
        tiny = args.shape == "tiny"  # printed, not written
        rows = scale_7b.run([p for p in only if p in big], args.shape, args.layers_7b, args.limit_mb,
                            timeout=args.timeout_7b, done=None if tiny else lambda done: _write(done, merge=True))
        if tiny:
            print(scale_7b.report(rows))
            return
        only = [p for p in only if p not in big]
        if not only:
            return
    ctx = mp.get_context("spawn")
    for model in ("smollm2", "gemma3"):
        src = Path(assets.model_path(model))
        fp32_mb = sum(math.prod(h.get_slice(k).get_shape()) * 4 for f in src.glob("*.safetensors")
                      for h in [safe_open(str(f), "pt")] for k in h.keys()) / 2**20  # from the headers
        limit = int(fp32_mb * 0.6)  # a memory limit below the float32 model
        outs = {}
        runs = [(how, None) for how in RUNS] + [("memory", limit), ("stream", limit)]
        if only is not None:
            runs = [(how, None) for how in only]
        for how, lim in runs:
            out = tempfile.mkdtemp() + "/out"
            q = ctx.Queue()
            p = ctx.Process(target=_one, args=(model, how, out, lim, q))
            p.start()
            p.join()
            row = q.get() if not q.empty() else {"model": model, "how": how, "limit_mb": lim, "ok": False,
                                                    "error": f"exit code {p.exitcode}" + (
                                                        " (killed at the memory limit)" if p.exitcode == -9 else "")}
            for root in (CGROUP, CGROUP.parent):
                for group in root.glob(f"hf_tensorcomp_scale_{p.pid}"):
                    group.rmdir()
            row.update(fp32_mb=round(fp32_mb))
            if row.get("peak_mb") is not None:
                row["peak_vs_fp32"] = row["peak_mb"] / fp32_mb
            if lim is None:
                outs[how] = out
            rows.append(row)
            print(row, flush=True)
        def tensors(how):
            return {k: v for f in Path(outs[how]).glob("*.safetensors") for k, v in load_file(str(f)).items()}

        same = {}  # each reference path -> its streamed outputs all identical to it, tensor for tensor
        for ref, streams in GROUPS.items():
            if ref not in outs:
                continue
            a = tensors(ref)
            same[ref] = all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                            for b in map(tensors, (h for h in streams if h in outs)))
        for r in rows[-len(runs):]:
            r["identical"] = same.get(next(ref for ref, streams in GROUPS.items() if r["how"] in (ref, *streams)))
            r["bound"] = r.get("bound_mb", {}).get("bound")
    _write(rows, merge=only is not None)


def _key(r: dict) -> tuple:
    return r["model"], r["how"], r["limit_mb"], r.get("processes")


def _write(rows: list[dict], merge: bool) -> None:
    """scale.json / scale.md: `rows`, and of the rows written before those not run now (`merge`: all of them; else
    the 7B-shaped ones, which a plain run does not redo)."""
    import scale_7b

    old_rows = json.loads((RESULTS / f"{NAME}.json").read_text()) if (RESULTS / f"{NAME}.json").exists() else []
    fresh = {_key(r) for r in rows}
    rows = [r for r in old_rows if _key(r) not in fresh and (merge or r["how"] in scale_7b.PATHS)] + rows
    order = {m: i for i, m in enumerate(("smollm2", "gemma3", *scale_7b.MODEL.values()))}
    paths = RUNS + tuple(scale_7b.PATHS)
    rows.sort(key=lambda r: (order.get(r["model"], 9), r["limit_mb"] is not None and r["how"] in RUNS,
                             paths.index(r["how"]), r.get("processes") or 0))
    write_json(f"{NAME}.json", rows)
    small = [r for r in rows if r["how"] in RUNS]
    big = [r for r in rows if r["how"] in scale_7b.PATHS]
    md = markdown_table(small, [("model", "model", "{}"), ("how", "path", "{}"), ("fp32_mb", "float32 model MB", "{:,}"),
                               ("limit_mb", "memory limit MB", "{}"), ("ok", "finished", "{}"),
                               ("peak_mb", "peak RSS above start MB", "{}"), ("peak_vs_fp32", "peak / float32 model", "{:.2f}"),
                               ("layers_peak_mb", "peak over the layers MB", "{}"), ("bound", "bound MB", "{}"),
                               ("setup_peak_mb", "peak before the first layer MB", "{}"), ("seconds", "seconds", "{:.0f}"),
                               ("identical", "outputs identical (memory vs its streams)", "{}")])
    text = ("# Streaming vs in-memory compression\n\n" + json.dumps(CFG) + "\n\nPeak: resident memory above the "
        "child's value at the start, sampled every 2 ms. The limited rows run in a memory cgroup whose limit is 60 % "
        "of the float32 model, joined after the child's imports (what it allocates from then on, page cache included, "
        "is charged; the kernel kills it past the limit). Bound: the streaming "
        "report's (1.5 x (layer + compressed layer + calibration states + statistics)), which holds the peak over the "
        "layers (from the first layer read on); before it, the calibration text is tokenized (Gemma-3's 262k-token "
        "tokenizer alone takes ~330 MB while loaded). stream-disk: `states_dir=` (the calibration hidden states in files, one batch of 8 "
        "samples in memory). -table8: with `embedding_bits=8` (the tied table as 8-bit codes, GPTQ on the head's "
        "inputs; streaming quantizes it a block of rows at a time), compared with its own in-memory run. "
        "gguf-memory / gguf-stream: the bundled GGUF file to a float32 checkpoint with its tokenizer, by transformers' "
        "GGUF loading (the whole model de-quantized in memory, then saved) and by `hf_tensorcomp.convert_gguf` (tensor by "
        "tensor, 100 MB shards). "
        "Written by benchmarks/scale.py.\n\n" + md + "\n")
    if big:
        text += ("\n## A Llama-2-7B-shaped checkpoint (issue 85)\n\n"
                 "Random N(0, 0.02) bfloat16 weights with Llama-2-7B's shapes (hidden 4096, 32 layers, intermediate "
                 "11008, 32 heads; vocabulary 49152, SmolLM2's tokenizer: 1.5x Llama-2's table), written shard by shard. "
                 "The CLI's `compress --stream` with the first layers compressed and the rest copied through (as "
                 "float32), on 1 process (2 threads) and 2 (`torchrun`, gloo, 1 thread each), each process in its own "
                 "memory cgroup. 7b-qlr: `method=\"qlr\", target_bytes=0.27` (allocation settled to \"relative\"); "
                 "7b-laser: `method=\"laser\", target=0.8, whiten=True, allocation=\"relative\"`; calibration: 8 x 256 "
                 "tokens of Wikipedia, batches of 4. Seconds per compressed layer: its allocation pass (qlr's ladders) "
                 "+ its compression pass (calibration forward, statistics, compression, propagation), from the layer's "
                 "read to its release (rank 0's). 70B estimate (Llama-2-70B: 80 layers, hidden 8192, intermediate 28672, "
                 "8 KV heads): time per layer x the layer's cost ratio (qlr: rows x cols^2 summed over the matrices, "
                 "GPTQ's sweep; LASER: min^2 x max, the SVDs), peak x the ratio of the layer's parameters, and the "
                 "library's bound (`streaming._memory_bound`) at 70B's shapes. Written by benchmarks/scale.py "
                 "(`--only 7b-qlr,7b-laser`).\n\n" + scale_7b.report(big) + "\n"
                 + "".join(f"\n- {r['how']}, {r['processes']} process(es): {r.get('error') or r.get('peak_note')}"
                           for r in big if r.get("error") or r.get("peak_note")) + "\n")
    (RESULTS / f"{NAME}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
