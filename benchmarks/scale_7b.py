"""The 7B-shaped paths of `scale.py` (issue 85): a random-weight checkpoint with Llama-2-7B's shapes, streamed
through `hf_tensorcomp.compress_checkpoint` (the CLI's ``compress --stream``) under a memory limit below its size,
on one process and on two (``torchrun --nproc-per-node 2``, gloo), then a Llama-2-70B estimate from the per-layer
time and peak.

Run from `scale.py` (``python benchmarks/scale.py --only 7b-qlr,7b-laser``); this file is also the program each
process runs (``scale_7b.py child ...``, plain or under torchrun): it joins its own memory cgroup after its
imports, measures its peak resident memory and the stream's per-layer events, runs ``hf_tensorcomp.cli.main``
and writes what it saw to ``rank<N>.json``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent

# Llama-2-7B's shapes but the vocabulary: SmolLM2's tokenizer (49152 ids, 1.5x Llama-2's 32000) is saved beside the
# weights, so that the calibration text's ids index the table.
SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=49152),
    "tiny": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=8, vocab_size=49152),  # the same path at a small shape, to check it end to end
}
LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8)
MODEL = {"7b": "llama2-7b-shape", "tiny": "tiny-llama-shape"}

CALIBRATION = ["--calibration", "wikipedia", "--calibration-samples", "8", "--calibration-length", "256",
               "--option", "calibration_batch_size=4"]  # two batches: one a rank on two processes
PATHS = {  # the CLI's arguments (besides the checkpoint, --out, --layers)
    "7b-qlr": ["--method", "qlr", "--option", "target_bytes=0.27", *CALIBRATION],  # allocation settles to "relative"
    "7b-laser": ["--method", "laser", "--target", "0.8", "--option", "whiten=true", "--option", "allocation=relative",
                 "--targets", "*_proj", *CALIBRATION],
}


def layer_matrices(shape: dict) -> dict[str, tuple[int, int]]:
    """A decoder layer's linears, (out, in)."""
    h, f = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}


def write_checkpoint(folder: Path, shape: dict, shard_bytes: int = 2 << 30) -> int:
    """A LlamaForCausalLM checkpoint of `shape`, random N(0, 0.02) bfloat16 weights (norms at 1), written shard by
    shard (a shard's tensors at most in memory) with its index, config and SmolLM2's tokenizer. Returns its bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    from hf_tensorcomp import assets

    tok = AutoTokenizer.from_pretrained(assets.model_path("smollm2"))
    config = LlamaConfig(**shape, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, dtype="bfloat16")
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    tok.save_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    h = shape["hidden_size"]

    def rand(*size):
        return (torch.randn(*size, generator=gen) * 0.02).to(torch.bfloat16)

    def tensors():  # (name, tensor) in file order, one tensor made at a time
        yield "model.embed_tokens.weight", rand(shape["vocab_size"], h)
        for li in range(shape["num_hidden_layers"]):
            for name, (o, i) in layer_matrices(shape).items():
                yield f"model.layers.{li}.{name}.weight", rand(o, i)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                yield f"model.layers.{li}.{norm}.weight", torch.ones(h, dtype=torch.bfloat16)
        yield "model.norm.weight", torch.ones(h, dtype=torch.bfloat16)
        yield "lm_head.weight", rand(shape["vocab_size"], h)

    weight_map, shard, size, n, total = {}, {}, 0, 0, 0

    def flush():
        nonlocal shard, size, n
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, size, n = {}, 0, n + 1

    for name, t in tensors():
        if shard and size + t.numel() * 2 > shard_bytes:
            flush()
        shard[name] = t
        size += t.numel() * 2
        total += t.numel() * 2
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


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

    sys.path.insert(0, str(HERE))
    from scale import _limit_memory

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
                me = [str(HERE / "scale_7b.py"), "child", str(result), str(limit_mb), str(2 // n), "--", *cli_args]
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
    sys.path.insert(0, str(HERE))
    from common import markdown_table

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
    sys.exit("usage: python benchmarks/scale.py --only 7b-qlr,7b-laser (this file's `child` is run by it)")
