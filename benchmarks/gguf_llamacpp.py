"""A ``qlr`` checkpoint served by llama.cpp: the GGUF export's perplexity and decode speed against the library's own.

Exports the compressed folder given (a ``qlr`` checkpoint saved by the library, compressed with ``rotate=False``)
with ``hf_tensorcomp.export(model, out, format="gguf")``, loads ``model.gguf`` with ``llama_cpp.Llama`` and the
correction ``adapter.gguf`` as its LoRA adapter (scale 1), and measures on both bundled eval splits
(``hf_tensorcomp.assets.load_text("wikipedia" | "owt", "eval")``) the same perplexity the library computes: the
same token ids (the checkpoint's HF tokenizer, no special tokens), the first ``--max-tokens`` of them, disjoint
512-token windows whose first token is not scored (``hf_tensorcomp.eval.perplexity``); llama.cpp's logits come
from ``Llama.eval`` with ``logits_all=True``. Rows: the library (torch, CPU), llama.cpp with the adapter, llama.cpp
without it (the base alone: what the correction buys). Decode: greedy tokens per second, batch 1, a 32-token
prompt (held-out Wikipedia), ``--new-tokens`` new tokens, median of 3 after a warm-up, both on ``--threads``
threads. Writes ``results/gguf_llamacpp.json`` and ``.md`` (with the export's report); needs
``pip install llama-cpp-python`` (not a dependency of the library; not run in CI).

    python benchmarks/gguf_llamacpp.py out/smollm2-qlr            # a folder saved by save_pretrained
    python benchmarks/gguf_llamacpp.py out/smollm2-qlr --max-tokens 4096 --threads 4
    python benchmarks/gguf_llamacpp.py --report-only
    python benchmarks/gguf_llamacpp.py --bundled smollm2 --threads-list 1 2   # the peer row of decode_speed.py

``--bundled MODEL``: llama.cpp decoding the bundled GGUF file itself (SmolLM2: Q4_1, the file the dense model is
de-quantized from, so its quality is the dense model's) with `decode_speed.py`'s prompt and token counts (64 + 64,
median of 3 after a warm-up) at each thread count, its bytes (the file) and its speed; written to
``results/decode_speed_llamacpp.json`` / ``.md``, read by ``decode_speed.py``'s report as the CPU engine's row.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, cpu_kind, decode_tokens_per_s, markdown_table, set_threads, write_json  # noqa: E402

NAME = "gguf_llamacpp"
CORPORA = ("wikipedia", "owt")
CONTEXT = 512


def _ids(tok, corpus: str, max_tokens: int) -> list[int]:
    from hf_tensorcomp.assets import load_text

    return tok("\n\n".join(load_text(corpus, "eval")), add_special_tokens=False, verbose=False)["input_ids"][:max_tokens]


def llama_cpp_ppl(llm, ids: list[int], bos: list[int]) -> dict:
    """Perplexity as `hf_tensorcomp.eval.perplexity` computes it (disjoint windows of `CONTEXT` tokens, a window's
    first token unscored unless a BOS precedes it), llama.cpp's logits for every position."""
    nll, scored, t0 = 0.0, 0, time.perf_counter()
    for start in range(0, len(ids) - 1, CONTEXT):
        window = bos + ids[start:start + CONTEXT]
        if len(window) < 2:
            break
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        targets = np.asarray(window[1:])
        nll -= logp[np.arange(len(targets)), targets].sum()
        scored += len(targets)
    return {"ppl": math.exp(nll / scored), "n_tokens": scored, "seconds": time.perf_counter() - t0}


def llama_cpp_decode(llm, tok, new_tokens: int, prompt_tokens: int = 32, repeats: int = 3) -> float:
    """Greedy tokens per second (llama.cpp), the prompt `decode_tokens_per_s` uses."""
    from hf_tensorcomp.assets import load_text

    prompt = " ".join(load_text("wikipedia", "eval")[0].split()[: prompt_tokens * 3])
    ids = tok(prompt)["input_ids"][:prompt_tokens]

    def once() -> float:
        llm.reset()
        t0 = time.perf_counter()
        n = 0
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            n += 1
            if n == new_tokens:
                break
        return time.perf_counter() - t0

    once()  # warm-up
    return new_tokens / statistics.median(once() for _ in range(repeats))


def run(args) -> dict:
    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_tensorcomp
    from hf_tensorcomp.assets import load_text
    from hf_tensorcomp.eval import perplexity
    from hf_tensorcomp.eval.perplexity import bos_prefix

    set_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.folder)
    out = Path(tempfile.mkdtemp(prefix="gguf-bench-")) / "gguf"
    t0 = time.perf_counter()
    export = hf_tensorcomp.export(model, out, format="gguf", tokenizer=tok)
    export_s = time.perf_counter() - t0
    ids = {c: _ids(tok, c, args.max_tokens) for c in CORPORA}
    bos = bos_prefix(tok, None)
    rows = []
    row = {"row": "hf_tensorcomp (torch)", "cpu": cpu_kind(), "threads": args.threads}
    for c in CORPORA:
        r = perplexity(model, tok, load_text(c, "eval"), context_length=CONTEXT, stride=CONTEXT,
                       max_tokens=args.max_tokens, progress=False)  # the same ids as `_ids`
        row[f"ppl_{c}"], row[f"tokens_{c}"] = r["ppl"], r["n_tokens"]
    row["tok_s"] = decode_tokens_per_s(model, tok, new_tokens=args.new_tokens)
    rows.append(row)
    print(row, flush=True)
    adapters = [("llama.cpp (GGUF + LoRA adapter)", export["adapter"]), ("llama.cpp (GGUF base alone)", None)]
    for label, adapter in adapters if export["adapter"] else adapters[1:]:
        llm = Llama(model_path=export["base"], lora_path=adapter, lora_scale=1.0, n_ctx=CONTEXT + len(bos),
                    n_batch=CONTEXT + len(bos), logits_all=True, n_threads=args.threads, verbose=False)
        row = {"row": label, "cpu": cpu_kind(), "threads": args.threads}
        for c in CORPORA:
            r = llama_cpp_ppl(llm, ids[c], bos)
            row[f"ppl_{c}"], row[f"tokens_{c}"] = r["ppl"], r["n_tokens"]
        row["tok_s"] = llama_cpp_decode(llm, tok, args.new_tokens)
        rows.append(row)
        print(row, flush=True)
        del llm
    files = {k: Path(export[k]).stat().st_size for k in ("base", "adapter") if export[k]}
    return {"folder": str(args.folder), "max_tokens": args.max_tokens, "new_tokens": args.new_tokens,
            "export_s": round(export_s, 1), "bytes": files, "export_report": export["report"], "rows": rows}


def report(result: dict) -> str:
    rows = result["rows"]
    ours = rows[0]
    for r in rows:
        for c in CORPORA:
            r[f"x_{c}"] = r[f"ppl_{c}"] / ours[f"ppl_{c}"]
    table = markdown_table(rows, [
        ("row", "row", "{}"), ("ppl_wikipedia", "Wikipedia ppl", "{:.3f}"), ("x_wikipedia", "vs ours", "{:.4f}x"),
        ("ppl_owt", "OpenWebText ppl", "{:.3f}"), ("x_owt", "vs ours", "{:.4f}x"), ("tok_s", "decode tok/s", "{:.1f}")])
    sizes = ", ".join(f"{k} {v:,} bytes" for k, v in result["bytes"].items())
    return (f"# `{result['folder']}` in llama.cpp: the GGUF export against the library\n\n"
            f"Perplexity on the first {result['max_tokens']:,} tokens of each eval split (the checkpoint's tokenizer, "
            f"{CONTEXT}-token disjoint windows), greedy decode of {result['new_tokens']} tokens, batch 1, "
            f"{rows[0]['threads']} threads ({rows[0]['cpu']}). Files: {sizes}; export {result['export_s']} s. "
            "Written by benchmarks/gguf_llamacpp.py.\n\n" + table + "\n\nThe export's report:\n\n"
            + "\n".join(f"- {line}" for line in result["export_report"]) + "\n")


def bundled(model: str, threads: list[int], new_tokens: int, prompt_tokens: int) -> dict:
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    from hf_tensorcomp.assets import gguf_path, model_path

    path = gguf_path(model)
    tok = AutoTokenizer.from_pretrained(model_path(model))
    rows = []
    for n in threads:
        llm = Llama(model_path=str(path), n_ctx=prompt_tokens + new_tokens + 8, n_threads=n, n_threads_batch=n,
                    verbose=False)
        rows.append({"row": f"llama.cpp ({path.name})", "model": model, "threads": n, "cpu": cpu_kind(),
                     "file_bytes": path.stat().st_size,
                     "tok_s": llama_cpp_decode(llm, tok, new_tokens, prompt_tokens=prompt_tokens)})
        print(rows[-1], flush=True)
        del llm
    return {"model": model, "new_tokens": new_tokens, "prompt_tokens": prompt_tokens, "rows": rows}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?", help="a qlr checkpoint (rotate=False) saved by the library, with its tokenizer")
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--bundled", help="smollm2 | gemma3: decode the bundled GGUF file (decode_speed.py's peer row)")
    ap.add_argument("--threads-list", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompt-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.bundled:
        result = bundled(args.bundled, args.threads_list, args.new_tokens, args.prompt_tokens)
        write_json("decode_speed_llamacpp.json", result)
        (RESULTS / "decode_speed_llamacpp.md").write_text(
            f"# llama.cpp decoding the bundled {args.bundled} GGUF file\n\nGreedy, batch 1, {args.prompt_tokens}-token prompt "
            f"(held-out Wikipedia), {args.new_tokens} new tokens, median of 3 after a warm-up. Written by "
            "benchmarks/gguf_llamacpp.py --bundled.\n\n" + markdown_table(result["rows"], [
                ("row", "row", "{}"), ("threads", "threads", "{}"), ("file_bytes", "bytes", "{:,}"),
                ("tok_s", "decode tok/s", "{:.1f}")]) + "\n")
        sys.exit(0)
    if args.report_only:
        result = json.loads((RESULTS / f"{NAME}.json").read_text())
    else:
        if not args.folder:
            ap.error("folder: required unless --report-only")
        result = run(args)
        write_json(f"{NAME}.json", result)
    md = report(result)
    (RESULTS / f"{NAME}.md").write_text(md)
    print(md)
