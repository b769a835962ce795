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

The ``7b-`` paths (issue 85; the second half of this file): a LlamaForCausalLM checkpoint with Llama-2-7B's shapes (hidden
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
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (LLAMA_70B, MODEL, PATHS, RESULTS, SHAPES, layer_matrices,  # noqa: E402
                    markdown_table, set_threads, write_checkpoint, write_json)

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

    big = tuple(PATHS)
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", help=f"comma-separated paths among {', '.join(RUNS + big)} (unlimited), merged into the "
                                       "results already written")
    parser.add_argument("--shape", default="7b", choices=list(SHAPES), help="the 7b- paths' shapes (tiny: "
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
        rows = run([p for p in only if p in big], args.shape, args.layers_7b, args.limit_mb,
                            timeout=args.timeout_7b, done=None if tiny else lambda done: _write(done, merge=True))
        if tiny:
            print(report(rows))
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
    old_rows = json.loads((RESULTS / f"{NAME}.json").read_text()) if (RESULTS / f"{NAME}.json").exists() else []
    fresh = {_key(r) for r in rows}
    rows = [r for r in old_rows if _key(r) not in fresh and (merge or r["how"] in PATHS)] + rows
    order = {m: i for i, m in enumerate(("smollm2", "gemma3", *MODEL.values()))}
    paths = RUNS + tuple(PATHS)
    rows.sort(key=lambda r: (order.get(r["model"], 9), r["limit_mb"] is not None and r["how"] in RUNS,
                             paths.index(r["how"]), r.get("processes") or 0))
    write_json(f"{NAME}.json", rows)
    small = [r for r in rows if r["how"] in RUNS]
    big = [r for r in rows if r["how"] in PATHS]
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
                 "(`--only 7b-qlr,7b-laser`).\n\n" + report(big) + "\n"
                 + "".join(f"\n- {r['how']}, {r['processes']} process(es): {r.get('error') or r.get('peak_note')}"
                           for r in big if r.get("error") or r.get("peak_note")) + "\n")
    (RESULTS / f"{NAME}.md").write_text(text)
    print(text)

# ================================================================================================== the 7B-shaped paths
# A random-weight checkpoint with Llama-2-7B's shapes, streamed through `hf_tensorcomp.compress_checkpoint` (the CLI's
# ``compress --stream``) under a memory limit below its size, on one process and on two (``torchrun --nproc-per-node 2``,
# gloo), then a Llama-2-70B estimate from the per-layer time and peak. This file is also the program each process runs
# (``scale.py child ...``, plain or under torchrun): it joins its own memory cgroup after its imports, measures its peak
# resident memory and the stream's per-layer events, runs ``hf_tensorcomp.cli.main`` and writes what it saw to
# ``rank<N>.json``.

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent

# ----------------------------------------------------------------------------------------------- one process's run
def child(argv: list[str]) -> int:
    """``child RESULT_DIR LIMIT_MB THREADS -- CLI ARGS``: one process (a torchrun rank or alone)."""
    result, limit_mb, threads = Path(argv[0]), int(argv[1]), int(argv[2])
    cli_args = argv[argv.index("--") + 1:]
    import torch

    torch.set_num_threads(threads)
    import hf_tensorcomp
    from hf_tensorcomp import cli
    from hf_tensorcomp.layer_stream import LayerStream
    from hf_tensorcomp.memory import PeakRSS, rss

    rank = int(os.environ.get("RANK", 0))
    out = result / f"rank{rank}.json"
    row = {"rank": rank, "pid": os.getpid(), "threads": threads, "limit_mb": limit_mb, "cgroup": _limit_memory(limit_mb)}
    out.write_text(json.dumps(row))  # the cgroup named before any work (the parent removes it, even after a kill)
    if row["cgroup"] is None:
        row["error"] = "no writable memory cgroup on this machine: the limit was not applied"
        out.write_text(json.dumps(row))
        return 1
    events, reports = [], []
    t0 = time.perf_counter()
    load, release, compress = LayerStream._load, LayerStream._release, hf_tensorcomp.compress_checkpoint

    overall = [0]  # the peak over the whole run, bytes above the start (`peak` is reset at each event)
    with PeakRSS() as peak:
        def note(what, stream, li):  # the peak since the previous event, then reset to now
            overall[0] = max(overall[0], peak.peak - peak.start)
            events.append({"pass": "allocation" if type(stream).__name__ == "_ReadOnly" else "layers", "what": what,
                           "layer": li, "t": round(time.perf_counter() - t0, 3),
                           "peak_mb": round((peak.peak - peak.start) / 2**20, 1)})
            peak.peak = rss()

        def loading(self, li):
            note("load", self, li)
            return load(self, li)

        def releasing(self, li, write):
            out_ = release(self, li, write)
            note("release", self, li)
            return out_

        def compressing(*a, **kw):
            reports.append(compress(*a, **kw))
            return reports[-1]

        LayerStream._load, LayerStream._release, hf_tensorcomp.compress_checkpoint = loading, releasing, compressing
        rc = cli.main(cli_args)
    row.update(rc=rc, seconds=round(time.perf_counter() - t0, 1), peak_mb=round(max(overall[0], peak.above_start) / 2**20),
               start_mb=round(peak.start / 2**20), max_rss_mb=round(_rusage_mb()), events=events)
    if reports:
        r = reports[0]
        row["report"] = {k: r[k] for k in ("seconds", "seconds_per_layer", "peak_above_start_mb",
                                           "setup_peak_above_start_mb", "bound_mb", "within_bound")}
        row["report"]["modules"] = {k: {kk: v[kk] for kk in ("bits", "rank", "relative_error") if kk in v}
                                    for k, v in r["stats"].get("modules", {}).items()}
    out.write_text(json.dumps(row))
    return rc


def _rusage_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------------------------- the parent's side
def _layer_times(events: list[dict], compressed: int) -> dict:
    """Per layer: the allocation pass's and the compression pass's seconds and peaks (load to release), and the
    copied-through layers'."""
    def spans(pass_):
        out, start, peak = {}, {}, {}
        for e in events:
            if e["pass"] != pass_:
                continue
            if e["what"] == "load":
                start[e["layer"]], peak[e["layer"]] = e["t"], 0.0
            else:
                peak[e["layer"]] = max(peak.get(e["layer"], 0.0), e["peak_mb"])
                out[e["layer"]] = (round(e["t"] - start[e["layer"]], 1), peak[e["layer"]])
            for li in peak:  # every open span sees the peak of the interval just closed
                if li in start and li not in out:
                    peak[li] = max(peak[li], e["peak_mb"])
        return out

    alloc, layers = spans("allocation"), spans("layers")
    first = min((e["t"] for e in events if e["what"] == "load"), default=None)
    per = [{"layer": li, "allocation_s": alloc.get(li, (0.0, None))[0], "compress_s": layers[li][0],
            "seconds": round(alloc.get(li, (0.0, None))[0] + layers[li][0], 1),
            "peak_mb": max(v for v in (alloc.get(li, (0, 0))[1], layers[li][1]) if v is not None)}
           for li in sorted(layers) if li < compressed]
    through = [layers[li][0] for li in sorted(layers) if li >= compressed]
    return {"setup_s": first, "compressed": per,
            "copied_through_s_per_layer": round(sum(through) / len(through), 2) if through else None}


def _cost(shape: dict, rule: str) -> float:
    """A decoder layer's compression cost by `rule`: "gptq" sum of rows x cols^2 (GPTQ's column sweep, the input
    Gram's factorizations cols^3 <= that), "svd" sum of min^2 x max (a dense SVD)."""
    mats = layer_matrices(shape).values()
    if rule == "gptq":
        return sum(o * i * i for o, i in mats)
    return sum(min(o, i) ** 2 * max(o, i) for o, i in mats)


def _bound_at(shape: dict, cfg_args: dict, tokens: int, compressed_bytes: int) -> float:
    """`hf_tensorcomp.streaming._memory_bound` (the library's formula) for one decoder layer of `shape`, MB."""
    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig

    from hf_tensorcomp import TensorCompressionConfig
    from hf_tensorcomp.streaming import _memory_bound

    mats = {f"model.layers.0.{n}.weight": (o, i) for n, (o, i) in layer_matrices(shape).items()}

    class Reader:
        where = mats

        @staticmethod
        def info(name):
            o, i = mats[name]
            return torch.float32, [o, i], 0, o * i * 4

    cfg = TensorCompressionConfig(progress=False, **cfg_args)
    cfg.stats = {"calibration": {"tokens": tokens, "samples": 8}}
    model = SimpleNamespace(config=LlamaConfig(**{**shape, "vocab_size": 32000}))
    return _memory_bound(Reader, "model.layers", 1, model, cfg, compressed_bytes)["bound"] / 2**20


BOUND_CFG = {"7b-qlr": dict(method="qlr", target_bytes=0.27, calibration="wikipedia"),
             "7b-laser": dict(method="laser", target=0.8, whiten=True, allocation="relative", calibration="wikipedia")}


def _estimate_70b(path: str, shape: dict, per_layer_s: float, peak_mb: float, bound: dict, tokens: int) -> dict:
    """Llama-2-70B from a 7B-shaped run: seconds per layer x the cost ratio of `_cost`'s rule (GPTQ's for qlr, the
    SVD's for LASER), 80 layers; the peak x the ratio of a layer's parameters; and the library's bound at 70B's
    shapes (the compressed layer's bytes scaled by that ratio too)."""
    rule = "gptq" if path == "7b-qlr" else "svd"
    time_ratio = _cost(LLAMA_70B, rule) / _cost(shape, rule)
    params = lambda s: sum(o * i for o, i in layer_matrices(s).values())  # noqa: E731
    mem_ratio = params(LLAMA_70B) / params(shape)
    b70 = _bound_at(LLAMA_70B, BOUND_CFG[path], tokens, int(bound.get("compressed_layer", 0) * 2**20 * mem_ratio))
    return {"rule": rule, "time_ratio": round(time_ratio, 2), "mem_ratio": round(mem_ratio, 2),
            "s_per_layer_70b": round(per_layer_s * time_ratio), "hours_70b": round(per_layer_s * time_ratio * 80 / 3600, 1),
            "peak_mb_70b": round(peak_mb * mem_ratio), "bound_mb_70b": round(b70)}


def _tensors(folder: Path, layers: int) -> dict:
    from safetensors.torch import load_file

    return {k: v for li in range(layers) for k, v in load_file(str(folder / f"layer-{li:05d}.safetensors")).items()}


def run(paths: list[str], shape_name: str = "7b", layers: int = 1, limit_mb: int | None = None,
        procs: tuple[int, ...] = (1, 2), timeout: float = 3600, done=None) -> list[dict]:
    """The rows of `paths` at `shape_name`: the checkpoint written once into a temporary folder under /tmp (removed
    at the end), each path compressed on each count of processes under the memory limit (each run stopped after
    `timeout` seconds), then compared; ``done(rows)`` after each path (its rows written while the next runs)."""
    import torch

    shape = SHAPES[shape_name]
    fp32_mb = round(sum(o * i for o, i in layer_matrices(shape).values()) * shape["num_hidden_layers"] * 4 / 2**20
                    + 2 * shape["vocab_size"] * shape["hidden_size"] * 4 / 2**20)
    if limit_mb is None:
        limit_mb = 8192 if shape_name == "7b" else 1024
    work = Path(tempfile.mkdtemp(prefix="hf-tensorcomp-7b-", dir="/tmp"))
    rows = []
    try:
        src = work / "src"
        t = time.perf_counter()
        ckpt_bytes = write_checkpoint(src, shape)
        print(f"checkpoint: {ckpt_bytes / 2**30:.2f} GiB bf16 in {time.perf_counter() - t:.0f} s", flush=True)
        for path in paths:
            kept = {}
            for n in procs:
                result = work / f"{path}-{n}"
                result.mkdir()
                out = work / "out"
                cli_args = ["compress", str(src), "--stream", "--out", str(out), "--quiet", "--no-eval",
                            "--layers", *map(str, range(layers)), *PATHS[path]]
                me = [str(HERE / "scale.py"), "child", str(result), str(limit_mb), str(2 // n), "--", *cli_args]
                cmd = [sys.executable, *me] if n == 1 else \
                    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *me]
                env = {**os.environ, "OMP_NUM_THREADS": str(2 // n)}
                t = time.perf_counter()
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True)  # its own process group: a timeout stops every rank
                try:
                    _, err = proc.communicate(timeout=timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)
                    _, err = proc.communicate()
                    err += f"\nstopped after {timeout} s (the run's time limit)"
                wall = round(time.perf_counter() - t, 1)
                ranks = [json.loads(f.read_text()) for f in sorted(result.glob("rank*.json"))]
                for r in ranks:  # the cgroups the ranks made
                    if r.get("cgroup") and Path(r["cgroup"]).exists():
                        try:
                            Path(r["cgroup"]).rmdir()
                        except OSError:
                            pass
                ok = proc.returncode == 0 and len(ranks) == n and all(r.get("rc") == 0 for r in ranks)
                row = {"model": MODEL[shape_name], "how": path, "processes": n, "limit_mb": limit_mb, "fp32_mb": fp32_mb,
                       "checkpoint_mb": round(ckpt_bytes / 2**20), "layers_compressed": layers,
                       "layers": shape["num_hidden_layers"], "ok": ok, "seconds": wall}
                if not ok:
                    row["error"] = (f"exit code {proc.returncode}" + (" (a process was killed: at the memory limit, or at the time limit)" if any(
                        r.get("rc") is None for r in ranks) else "") + ": " + err.strip()[-300:])
                    if err:
                        print(err[-3000:], file=sys.stderr)
                if ranks and all("events" in r for r in ranks):
                    row["peak_mb"] = [r["peak_mb"] for r in ranks]
                    row["start_mb"] = [r["start_mb"] for r in ranks]
                    main = ranks[0]
                    times = _layer_times(main["events"], layers)
                    row.update(setup_s=times["setup_s"], per_layer=times["compressed"],
                               copied_through_s_per_layer=times["copied_through_s_per_layer"],
                               s_per_layer=round(sum(p["seconds"] for p in times["compressed"]) / layers, 1))
                    rep = main.get("report", {})
                    row.update(layers_peak_mb=rep.get("peak_above_start_mb"), bound=rep.get("bound_mb", {}).get("bound"),
                               bound_mb=rep.get("bound_mb"),
                               within_bound=rep.get("within_bound"), modules=rep.get("modules"))
                if ok:
                    keep = work / f"keep-{path}-{n}"
                    keep.mkdir()
                    for li in range(layers):
                        shutil.copy2(out / f"layer-{li:05d}.safetensors", keep)
                    row["out_mb"] = round(sum(f.stat().st_size for f in out.iterdir()) / 2**20)
                    kept[n] = keep
                shutil.rmtree(out, ignore_errors=True)
                for stale in work.glob(".out*"):  # a killed run's temporary sibling
                    shutil.rmtree(stale, ignore_errors=True)
                rows.append(row)
                print({k: v for k, v in row.items() if k not in ("modules",)}, flush=True)
            if 1 in kept and len(kept) > 1:
                a = _tensors(kept[1], layers)
                for n in kept:
                    if n == 1:
                        continue
                    b = _tensors(kept[n], layers)
                    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                    diff = {k: int((a[k] != b[k]).sum()) for k in a if k in b and not torch.equal(a[k], b[k])}
                    for r in rows:
                        if r["how"] == path and r["processes"] in (1, n):
                            r["identical"] = same
                            if n == r["processes"] and diff:
                                r["differing"] = {k: f"{v}/{a[k].numel()}" for k, v in diff.items()}
            for r in rows:
                if r["how"] == path and r.get("s_per_layer") is not None and r["processes"] == 1:
                    r["estimate_70b"] = _estimate_70b(path, shape, r["s_per_layer"],
                                                      r.get("layers_peak_mb") or max(r["peak_mb"]), r.get("bound_mb") or {},
                                                      tokens=8 * 256)
            if done is not None:
                done(rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def report(rows: list[dict]) -> str:
    """The 7B-shaped rows' table (a section of scale.md)."""
    table = []
    for r in rows:
        e = r.get("estimate_70b") or {}
        table.append({**r, "peaks": " / ".join("?" if p is None else str(p) for p in r.get("peak_mb", [])) or None,
                      "compressed": f"{r['layers_compressed']} of {r['layers']}",
                      "per_layer_s": " / ".join(f"{p['seconds']:.0f}" for p in r.get("per_layer", [])) or None,
                      "split": " / ".join(f"{p['allocation_s']:.0f}+{p['compress_s']:.0f}" for p in r.get("per_layer", []))
                      or None,
                      "e_time": f"{e['s_per_layer_70b']:,} s/layer, {e['hours_70b']} h (x{e['time_ratio']}, {e['rule']})"
                      if e else None,
                      "e_mem": f"{e['peak_mb_70b']:,} (x{e['mem_ratio']}); bound {e['bound_mb_70b']:,}" if e else None})
    return markdown_table(table, [
        ("model", "model", "{}"), ("how", "path", "{}"), ("processes", "processes", "{}"),
        ("checkpoint_mb", "checkpoint MB (bf16)", "{:,}"), ("fp32_mb", "float32 model MB", "{:,}"),
        ("limit_mb", "memory limit MB (per process)", "{}"), ("ok", "finished", "{}"),
        ("compressed", "layers compressed", "{}"), ("peaks", "peak RSS above start MB (per process)", "{}"),
        ("layers_peak_mb", "peak over the layers MB (rank 0)", "{}"), ("bound", "bound MB", "{}"),
        ("per_layer_s", "s per compressed layer", "{}"), ("split", "allocation + compression s", "{}"),
        ("copied_through_s_per_layer", "s per copied layer", "{}"), ("seconds", "seconds in all", "{:.0f}"),
        ("identical", "compressed layers identical (1 vs 2 processes)", "{}"),
        ("e_time", "70B estimate: time (scaling)", "{}"), ("e_mem", "70B estimate: peak MB (scaling); bound MB", "{}")])


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        sys.exit(child(sys.argv[2:]))
    main()
