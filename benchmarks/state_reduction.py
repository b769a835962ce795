"""State reduction of Gated DeltaNet layers: every scorer at several key-dim keeps, perplexity and mixer speed.

For each scorer (DRRQR, Grad, S-Wanda, L1, Rand, PCA) and keep fraction: the model's linear-attention
layers are pruned to ``keep * head_k_dim`` (rounded half up) key channels per head (calibration: the Wikipedia
*calib* split), then perplexity on the Wikipedia *eval* split (disjoint paragraphs), compression
time, and — once per keep — one mixer's prefill tokens/s against the unpruned mixer (same run, fixed
threads) and the recurrent + conv state bytes per sequence of all linear-attention layers (fp32, as
the PyTorch path keeps them). ``--recover-steps N`` adds rows after N steps of LoRA + distillation.

    python benchmarks/state_reduction.py --model PATH --recipe benchmarks/recipes/state_reduction/state_reduction_benchmark.json
    python benchmarks/state_reduction.py --model tiny          # a random tiny Qwen3.5 (pipeline check only)
    python benchmarks/state_reduction.py --report-only         # re-render the table from the JSON
    python benchmarks/state_reduction.py --mixer               # one random 576-wide mixer: speed and state vs key dim

The paper's claim to test (Gated DeltaNet 1.3B at 50 % key dim, before recovery: base 16.8, DRRQR
17.3, Grad 17.4, Rand 18.8, L1 26.5): DRRQR and Grad stay near the base, L1 is the worst.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, ppl, set_threads, write_json  # noqa: E402

NAME = "state_reduction"
SCORERS = ["drrqr", "grad", "wanda", "l1", "rand", "pca"]


def load(model: str):
    import hf_tensorcomp  # noqa: F401  (a linearized hybrid reloads through the library)
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    if model == "tiny":
        path = hf_tensorcomp.assets.model_path("smollm2")
        tok = AutoTokenizer.from_pretrained(path)
        cfg = Qwen3_5TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                                linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                layer_types=["linear_attention", "full_attention"])
        torch.manual_seed(0)
        m = Qwen3_5ForCausalLM(cfg).eval()
        m.name_or_path = str(path)  # the calibration tokenizer
        return m, tok
    return AutoModelForCausalLM.from_pretrained(model).eval(), AutoTokenizer.from_pretrained(model)


def state_bytes(model) -> int:
    from hf_tensorcomp.methods.state_reduction import find_mixers

    total = 0
    for m in find_mixers(model).values():
        total += m.num_v_heads * m.head_k_dim * m.head_v_dim * 4  # recurrent state (fp32)
        total += m.conv1d.out_channels * (m.conv1d.kernel_size[0] - 1) * m.conv1d.weight.element_size()
    return total


def prefill_tokens_per_s(mixer, hidden: int, length: int = 512, repeats: int = 3) -> float:
    x = torch.randn(1, length, hidden, dtype=next(mixer.parameters()).dtype)
    with torch.no_grad():
        mixer(hidden_states=x)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            mixer(hidden_states=x)
            best = min(best, time.perf_counter() - t)
    return length / best


def decode_tokens_per_s(model, new_tokens: int = 32, prompt: int = 32) -> float:
    """Whole-model greedy decoding speed (cache on), best of two runs."""
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        best = min(best, time.perf_counter() - t)
    return new_tokens / best


def run(args) -> dict:
    from hf_tensorcomp import TensorCompressionConfig
    from hf_tensorcomp.methods.state_reduction import find_mixers
    from hf_tensorcomp.pipeline import compress_model

    set_threads(args.threads)
    base, tok = load(args.model)
    mixers = find_mixers(base)
    first = next(iter(mixers.values()))
    rows = [{"scorer": "base", "keep": 1.0, "head_k_dim": first.head_k_dim,
             "ppl": round(ppl(base, tok, args.eval_tokens), 3), "state_bytes": state_bytes(base)}]
    print(rows[-1], flush=True)
    speed = {}
    for keep in args.keeps:
        for scorer in args.scorers:
            for steps in sorted({0, args.recover_steps}):
                model = copy.deepcopy(base)
                cfg = TensorCompressionConfig(method="state_reduction", scorer=scorer, keep=keep, calibration="wikipedia",
                                              calibration_samples=args.calibration_samples,
                                              calibration_length=args.calibration_length, recover_steps=steps,
                                              progress=False)
                t = time.perf_counter()
                compress_model(model, cfg)
                seconds = time.perf_counter() - t
                pruned = next(iter(find_mixers(model).values()))
                row = {"scorer": scorer + (f"+lora{steps}" if steps else ""), "keep": keep, "head_k_dim": pruned.head_k_dim,
                       "ppl": round(ppl(model, tok, args.eval_tokens), 3), "compress_s": round(seconds, 1),
                       "state_bytes": state_bytes(model)}
                if keep not in speed:
                    dense_tps = prefill_tokens_per_s(first, base.config.get_text_config().hidden_size)
                    tps = prefill_tokens_per_s(pruned, base.config.get_text_config().hidden_size)
                    dense_dec, dec = decode_tokens_per_s(base), decode_tokens_per_s(model)
                    speed[keep] = {"keep": keep, "head_k_dim": pruned.head_k_dim, "dense_prefill_tok_s": round(dense_tps),
                                   "pruned_prefill_tok_s": round(tps), "prefill_speedup": round(tps / dense_tps, 3),
                                   "dense_decode_tok_s": round(dense_dec, 1), "pruned_decode_tok_s": round(dec, 1),
                                   "decode_speedup": round(dec / dense_dec, 3),
                                   "state_ratio": round(row["state_bytes"] / rows[0]["state_bytes"], 3)}
                rows.append(row)
                print(row, flush=True)
                del model
    return {"model": args.model, "eval_tokens": args.eval_tokens, "calibration_samples": args.calibration_samples,
            "calibration_length": args.calibration_length, "threads": args.threads, "rows": rows,
            "mixer_speed": list(speed.values())}


def _cache_bytes(cache) -> int:
    """Bytes of every tensor the cache layer holds (its conv and recurrent states sit in dicts)."""
    items = []
    for v in vars(cache.layers[0]).values():
        items += list(v.values()) if isinstance(v, dict) else list(v) if isinstance(v, (list, tuple)) else [v]
    return sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))


def mixer_speed(hidden: int = 576, heads: int = 9, head_dim: int = 64, keeps=(1.0, 0.75, 0.5, 0.25), length: int = 512,
                steps: int = 32, rounds: int = 15) -> dict:
    """One random Qwen3.5 Gated DeltaNet mixer (SmolLM2's width, 9 heads of 64) and copies of it pruned to each
    keep (first channels of each head: speed does not depend on which): prefill tokens/s on `length` tokens,
    decode-step latency after that prefill (cache on), the cache's state bytes per sequence. Rounds alternate
    between the variants, so load on a shared machine hits all alike; best of `rounds`."""
    from transformers import DynamicCache, Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from hf_tensorcomp.methods.state_reduction import prune

    cfg = Qwen3_5TextConfig(hidden_size=hidden, linear_num_key_heads=heads, linear_num_value_heads=heads,
                            linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, num_hidden_layers=1,
                            layer_types=["linear_attention"], vocab_size=16, num_attention_heads=heads,
                            num_key_value_heads=heads, head_dim=head_dim)
    torch.manual_seed(0)
    dense = Qwen3_5GatedDeltaNet(cfg, 0).eval()
    variants = {}
    for keep in keeps:
        m = copy.deepcopy(dense)
        k = int(keep * head_dim + 0.5)
        if k < head_dim:
            prune(m, [torch.arange(k)] * heads)
        variants[keep] = m
    x = torch.randn(1, length, hidden)
    tok = torch.randn(1, 1, hidden)
    best = {keep: [float("inf"), float("inf"), 0] for keep in keeps}
    with torch.no_grad():
        for _ in range(rounds):
            for keep, m in variants.items():
                t = time.perf_counter()
                cache = DynamicCache(config=cfg)
                m(hidden_states=x, cache_params=cache)
                best[keep][0] = min(best[keep][0], time.perf_counter() - t)
                t = time.perf_counter()
                for _ in range(steps):
                    m(hidden_states=tok, cache_params=cache)
                best[keep][1] = min(best[keep][1], (time.perf_counter() - t) / steps)
                best[keep][2] = _cache_bytes(cache)
    d = best[keeps[0]]
    rows = [{"keep": keep, "head_k_dim": variants[keep].head_k_dim, "prefill_tok_s": round(length / b[0]),
             "prefill_speedup": round(d[0] / b[0], 3), "decode_step_ms": round(b[1] * 1e3, 3),
             "decode_speedup": round(d[1] / b[1], 3), "state_bytes": b[2], "state_ratio": round(b[2] / d[2], 3)}
            for keep, b in best.items()]
    return {"hidden": hidden, "heads": heads, "head_dim": head_dim, "length": length, "decode_steps": steps,
            "rounds": rounds, "threads": torch.get_num_threads(), "rows": rows}


def mixer_report(res: dict) -> str:
    cols = ["keep", "head_k_dim", "prefill_tok_s", "prefill_speedup", "decode_step_ms", "decode_speedup", "state_bytes",
            "state_ratio"]
    head = (f"# State reduction: one Gated DeltaNet mixer on CPU (`benchmarks/state_reduction.py --mixer`)\n\n"
            f"Random Qwen3.5 mixer, hidden {res['hidden']}, {res['heads']} key/value heads of {res['head_dim']}; prefill "
            f"of {res['length']} tokens, then {res['decode_steps']} single-token decode steps with the cache; best of "
            f"{res['rounds']} alternating rounds, {res['threads']} thread(s); transformers' PyTorch path "
            "(no flash-linear-attention). State bytes: the cache's conv + recurrent state per sequence.\n\n")
    return head + markdown_table([cols] + [[str(r[c]) for c in cols] for r in res["rows"]]) + "\n"


def markdown_table(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows[1:]])


def report(res: dict) -> str:
    keeps = sorted({r["keep"] for r in res["rows"] if r["scorer"] != "base"}, reverse=True)
    scorers = list(dict.fromkeys(r["scorer"] for r in res["rows"] if r["scorer"] != "base"))
    base = next(r for r in res["rows"] if r["scorer"] == "base")
    table = [["scorer"] + [f"keep {k} (dk {next(r['head_k_dim'] for r in res['rows'] if r['keep'] == k)})" for k in keeps]]
    table.append(["base"] + [str(base["ppl"])] * len(keeps))
    for s in scorers:
        cells = []
        for k in keeps:
            r = next((r for r in res["rows"] if r["scorer"] == s and r["keep"] == k), None)
            cells.append("" if r is None else str(r["ppl"]))
        table.append([s] + cells)
    speed = [["keep", "key head dim", "mixer prefill tok/s (dense)", "pruned", "speed-up", "model decode tok/s (dense)",
              "pruned", "speed-up", "state bytes ratio"]]
    speed += [[str(s[k]) for k in ("keep", "head_k_dim", "dense_prefill_tok_s", "pruned_prefill_tok_s", "prefill_speedup",
                                   "dense_decode_tok_s", "pruned_decode_tok_s", "decode_speedup", "state_ratio")]
              for s in res["mixer_speed"]]
    model = res.get("model_note", f"`{res['model']}`")
    head = (f"# State reduction (`benchmarks/state_reduction.py`)\n\nModel: {model}; perplexity on "
            f"{res['eval_tokens']} tokens of the Wikipedia eval split; calibration {res['calibration_samples']} x "
            f"{res['calibration_length']} tokens of the calib split; {res['threads']} thread(s).\n\n")
    return head + markdown_table(table) + "\n\n" + markdown_table(speed) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--scorers", nargs="+", default=SCORERS)
    p.add_argument("--keeps", nargs="+", type=float, default=[0.75, 0.5])
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--calibration-samples", type=int, default=32)
    p.add_argument("--calibration-length", type=int, default=256)
    p.add_argument("--recover-steps", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=NAME, help="results file stem under benchmarks/results")
    p.add_argument("--model-note", help="how the model was made (written into the results instead of its path)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--mixer", action="store_true", help="only the one-mixer speed / state measurement")
    p.add_argument("--recipe", help="a JSON file of these options (dashes as underscores); the command line names the model")
    args = p.parse_args()
    if args.recipe:
        import json

        recipe = json.loads(Path(args.recipe).read_text())
        recipe.pop("description", None)
        unknown = sorted(set(recipe) - set(vars(args)))
        if unknown:
            raise SystemExit(f"{args.recipe}: unknown keys {unknown}; allowed: {sorted(vars(args))}")
        for k, v in recipe.items():
            setattr(args, k, v)
    if args.mixer:
        set_threads(args.threads)
        res = mixer_speed()
        write_json(f"{NAME}_mixer.json", res)
        md = mixer_report(res)
        (RESULTS / f"{NAME}_mixer.md").write_text(md)
        print(md)
        return
    json_path = RESULTS / f"{args.out}.json"
    if args.report_only:
        import json

        res = json.loads(json_path.read_text())
    else:
        res = run(args)
        if args.model_note:
            res["model_note"] = args.model_note
        write_json(f"{args.out}.json", res)
    md = report(res)
    (RESULTS / f"{args.out}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
