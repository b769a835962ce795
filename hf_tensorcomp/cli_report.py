"""The ``compress`` command's output and report (`hf_tensorcomp.cli`): the folder written atomically, what was done
in words (`report_header`) and the before / after table (`print_report`). Imported by the command when it runs,
like the rest of the package (``cli.py`` itself imports only the standard library)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

TEXT_NAMES = {"wikipedia": "Wikipedia", "owt": "OpenWebText"}


def write_out(out: Path, overwrite: bool, model, tok, results, base_model, repo_id) -> bool:
    """Write the folder atomically (a temporary sibling swapped in whole; see `atomic.atomic_dir`).

    Without ``--overwrite``, of several runs racing into one ``--out`` only the first to finish succeeds.
    """
    from . import write_model_card
    from .atomic import atomic_dir

    try:
        with atomic_dir(out, overwrite=overwrite) as tmp:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            write_model_card(model, tmp, results, base_model=base_model, repo_id=repo_id)
    except FileExistsError as e:
        print(f"hf-tensorcomp: error: --out: {e}; nothing was written", file=sys.stderr)
        return False
    return True


def report_header(model_name: str, out: Path, model, st: dict) -> list[str]:
    """What was done, in words: per entry the method, where (targets, layers), the budget or rank it ran at and
    what it chose (bits, ranks), its settings; the embedding table; the calibration text."""
    from .config import DEFAULT_GROUP_SIZE
    from .integration.hub import _layers, chosen_ranks, compression_config
    from .methods import get_method

    cfg = compression_config(model)
    n_layers = model.config.get_text_config().num_hidden_layers
    lines = [f"hf_tensorcomp report: {model_name} -> {out}"]
    allocation = st.get("allocation", {})
    for k, e in enumerate(cfg.entries):
        m = get_method(e.method)
        doc = (sys.modules[type(m).__module__].__doc__ or "").strip().splitlines()
        where = _layers(e, st, n_layers)
        mods = [s for s in st.get("modules", {}).values() if s.get("method") == e.method]
        summary = doc[0].removeprefix(f"``{e.method}``:").strip().rstrip(".") if doc else ""
        lines.append(f"  method       {e.method}" + (f" ({summary})" if summary else ""))
        lines.append(f"  targets      {', '.join(e.targets)} in {'every layer' if where == 'all' else 'layers ' + where}"
                     f" ({len(mods)} matrices)")
        a = allocation.get(str(k))
        if a is not None and m.byte_budget:
            table = f" and the embedding table ({a['embedding_bits']}-bit codes)" if "embedding_bits" in a else ""
            lines.append(f"  budget       {a['target']} of the bfloat16 bytes of those matrices{table}; spent "
                         f"{a['kept_fraction']}")
        elif a is not None:
            lines.append(f"  budget       keep {a['target']} of their parameters; kept {a['kept_fraction']}")
        elif e.rank is not None:
            lines.append(f"  rank         {e.rank}")
        bits: dict[int, int] = {}
        for s in mods:
            if "bits" in s:
                bits[s["bits"]] = bits.get(s["bits"], 0) + 1
        if bits:
            lines.append("  bits         " + ", ".join(f"{b}-bit x{n}" for b, n in sorted(bits.items())) + " matrices")
        ranks = chosen_ranks(st, e.method)
        if ranks != "-":
            lines.append(f"  ranks        {ranks}" + (" (of the low-rank correction)" if e.method == "qlr" else ""))
        own = {key: v for key, v in e.options.items() if key != "target_bytes" and m.option_defaults.get(key) != v}
        if e.factor_bits:
            own.update(factor_bits=e.factor_bits)
        if (m.uses_group_size or e.factor_bits) and e.group_size != DEFAULT_GROUP_SIZE:
            own.update(group_size=e.group_size)
        listed = ", ".join(f"{key}={json.dumps(v)}" for key, v in own.items())
        lines.append(f"  settings     {listed + ' (the rest' if own else 'the defaults ('} listed by: "
                     f"hf-tensorcomp methods {e.method})")
    if cfg.embedding_bits:
        emb = [s for s in st.get("modules", {}).values() if s.get("method") == "embedding"]
        b = emb[0].get("bits", cfg.embedding_bits) if emb else cfg.embedding_bits
        lines.append(f"  embedding    input embedding and output head as {b}-bit codes, groups of {cfg.embedding_group_size}"
                     + (" (chosen by the byte budget)" if cfg.embedding_bits == "auto" else ""))
    c = st.get("calibration")
    if c is None:
        lines.append("  calibration  none (data-free)")
    else:
        data = c.get("data")
        data = ({"wikipedia": "Wikipedia calib split", "owt": "OpenWebText calib split",
                 "wikipedia+owt": "Wikipedia + OpenWebText calib splits"}.get(data, data) if isinstance(data, str)
                else (data or {}).get("described", "given data"))
        lines.append(f"  calibration  {data}: {c['samples']} windows, {c['tokens']:,} tokens"
                     + (", layer outputs propagated" if c.get("propagate") else ", dense activations"))
    return lines


def print_report(r: dict) -> None:
    def fmt(v, spec="{:,}"):
        return "-" if v is None else spec.format(v)

    def ratio(a, b):
        return f"{a / b:.3f}" if a is not None and b else "-"

    print()
    print("\n".join(r["header"]))
    if "eval" in r:
        e = r["eval"]
        names = ", ".join(f"{TEXT_NAMES[t]} eval split" if t in TEXT_NAMES else t for t in e["texts"])
        print(f"  evaluated on {names}: {e['context_length']}-token windows, stride {e['stride']}, "
              f"at most {e['max_tokens']:,} tokens each")
    dtype = r.get("dtype", "float32")
    print(f"\n{'size':<26}{'dense ' + dtype:>16}{'compressed':>16}{'vs ' + dtype:>12}{'vs bfloat16':>13}")
    rows = [("bytes on disk", r.get("dense_bytes"), r["bytes"]),
            ("in memory after generate", r.get("dense_memory_bytes"), r["memory_bytes"])]
    rows += [(f"  {p['name']}: in memory", None, p["memory_bytes"]) for p in r.get("peers", [])]
    for name, before, after in rows:
        bf16 = r.get("dense_bf16_bytes")
        print(f"{name:<26}{fmt(before):>16}{fmt(after):>16}{ratio(after, before or r.get('dense_memory_bytes')):>12}"
              f"{ratio(after, bf16):>13}")
    print(f"{'values stored':<26}{fmt(r.get('dense_values')):>16}{fmt(r['values']):>16}{ratio(r['values'], r.get('dense_values')):>12}"
          f"{'':>13}  (each weight, code, scale, zero point once)")
    if "ppl" in r:
        texts = r["eval"]["texts"]
        print(f"\n{'perplexity':<26}" + "".join(f"{TEXT_NAMES.get(t, t)[:20]:>22}" for t in texts))
        models = [("dense " + dtype, r["dense_ppl"]), ("compressed", r["ppl"])]
        models += [(p["name"], p["ppl"]) for p in r.get("peers", [])]
        for i, (name, ppl) in enumerate(models):
            cells = (f"{ppl[t]:.3f}" + (f" ({ppl[t] / r['dense_ppl'][t]:.3f}x)" if i else " " * 9) for t in texts)
            print(f"{name:<26}" + "".join(c.rjust(22) for c in cells))
    print(f"\n{'compression time (s)':<26}{r['compress_s']:>16}")
    print(f"{'load + compress (s)':<26}{r['load_and_compress_s']:>16}")
    if "heal" in r:
        h = r["heal"]
        print(f"{'healing: held-out KL':<26}{h['held_out_kl_before']:>16.4f}{h['held_out_kl_after']:>16.4f}"
              f"{'' if h['improved'] else '  (no gain: left as it was)':>10}  {h['seconds']} s")
