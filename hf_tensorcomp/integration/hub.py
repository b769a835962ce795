"""Model cards and Hub pushes for compressed models.

``model.push_to_hub(repo)`` alone works (factors + config.json; the card gets the ``hf_tensorcomp``
tags set at compression). `push_to_hub` here also writes a card saying how the model was compressed:
transformers keeps a card already on the repo, so the card is uploaded first.
"""

from __future__ import annotations

import os

from huggingface_hub import HfApi

from ..config import TensorCompressionConfig
from ..layers.base import FactorizedModule
from ..methods import get_method

INSTALL_NOTE = (
    "This checkpoint stores compressed factors, not dense weights. Loading it needs the `hf_tensorcomp` "
    "package installed **and imported** before `from_pretrained`; without it transformers stops with a "
    "size-mismatch error."
)
DENSE_NOTE = (
    "The approximation was written back into ordinary dense weights (`mode=\"dense\"`), so plain transformers "
    "loads it; with `hf_tensorcomp` installed and imported the compression record below is kept on reload."
)


STRUCTURAL_NOTE = (
    "An ordinary transformers checkpoint: the compression changed the architecture itself (e.g. a smaller "
    "`linear_key_head_dim` from state reduction), so plain transformers loads it, without `hf_tensorcomp`; "
    "the record below is kept in this card only."
)


def compression_config(model) -> TensorCompressionConfig:
    """The model's compression record: its quantization config, or (after a structural method, whose
    quantizer removed itself) the one kept on the model object for this session."""
    cfg = getattr(model.config, "quantization_config", None)
    if cfg is None:
        cfg = getattr(model, "tensorcomp_config", None)
    if not isinstance(cfg, TensorCompressionConfig):
        raise ValueError("model: not compressed by hf_tensorcomp (model.config.quantization_config is not a TensorCompressionConfig)")
    return cfg


def _layers(entry, stats: dict | None, n_layers: int) -> str:
    """The entry's layers (negative indices counted from the end, as given to the config), or (layers=None) the
    decoder layers its method actually changed."""
    if entry.layers is not None:
        from ..layout import resolve_layers

        given = resolve_layers(entry.layers, n_layers)
        return "all" if len(given) == n_layers else ", ".join(map(str, given))
    seen = sorted({int(n.split(".layers.", 1)[1].split(".", 1)[0]) for n, m in (stats or {}).get("modules", {}).items()
                   if m.get("method") == entry.method and ".layers." in n})
    return "all" if not seen or len(seen) == n_layers else ", ".join(map(str, seen))


def _options(entry) -> dict:
    """An entry's method options, with the quantization of its factors when there is one."""
    extra = {"factor_bits": entry.factor_bits, "group_size": entry.group_size} if entry.factor_bits else {}
    return {**entry.options, **extra}


def chosen_ranks(stats: dict, method: str) -> str:
    """The ranks compression chose for a method's modules, e.g. ``"288 ×40, 96 ×20"`` ("-" if none recorded)."""
    counts: dict[str, int] = {}
    for m in stats.get("modules", {}).values():
        rank = m.get("ranks", m.get("rank"))
        if m.get("method") == method and rank is not None:
            counts[str(rank)] = counts.get(str(rank), 0) + 1
    if len(counts) > 8 and all(r.isdigit() for r in counts):  # a global budget: summarise the spread
        ranks = sorted(int(r) for r, n in counts.items() for _ in range(n))
        return f"{ranks[0]}–{ranks[-1]} (median {ranks[len(ranks) // 2]}) over {len(ranks)} modules; see config.json stats"
    return ", ".join(f"{r} ×{n}" for r, n in counts.items()) or "-"


def model_card(model, results: dict | None = None, base_model: str | None = None, repo_id: str | None = None) -> str:
    """Markdown model card (with YAML metadata) describing the compression and how to load it.

    ``base_model``: the Hub id of the model it was compressed from (the card's metadata); ``repo_id``:
    where this model is loaded from (the card's snippet), a Hub repo id or a local folder.
    """
    cfg = compression_config(model)
    st = cfg.stats
    structural = getattr(model.config, "quantization_config", None) is None
    lines = ["---", "library_name: transformers", "tags:", "- hf_tensorcomp"]
    lines += [f"- tensorcomp-{e.method}" for e in cfg.entries]
    if base_model:
        lines += [f"base_model: {base_model}"]
    lines += ["---", "", f"# {type(model).__name__} compressed with hf_tensorcomp", "",
              INSTALL_NOTE if cfg.compressed_modules else STRUCTURAL_NOTE if structural else DENSE_NOTE, "",
              "```python", *([] if structural else ["import hf_tensorcomp  # registers the `tensorcomp` quantizer"]),
              "from transformers import AutoModelForCausalLM",
              f'model = AutoModelForCausalLM.from_pretrained("{repo_id or "<repo id or folder>"}")', "```", "",
              "## Compression", "",
              "| entry | method | rank | chosen ranks | targets | layers | mode | options |", "|---|---|---|---|---|---|---|---|"]
    for i, e in enumerate(cfg.entries):
        lines.append(f"| {i} | {e.method} | {'-' if e.rank is None else e.rank} | {chosen_ranks(st, e.method)} "
                     f"| {', '.join(e.targets)} | {_layers(e, st, model.config.get_text_config().num_hidden_layers)} | {e.mode} | {_options(e) or ''} |")
    if st:
        for k, a in st.get("allocation", {}).items():
            if get_method(cfg.entries[int(k)].method).byte_budget:
                lines.append(f"\nEntry {k}: target_bytes {a['target']} of the bf16 bytes of {a['params_targeted']:,} "
                             f"parameters, spent {a['kept_fraction']}"
                             + (f", the embedding table inside it at {a['embedding_bits']} bits." if "embedding_bits" in a
                                else "."))
            else:
                lines.append(f"\nEntry {k}: target {a['target']} of {a['params_targeted']:,} parameters, kept "
                             f"{a['params_kept']:,} ({a['kept_fraction']}); {len(a['kept_dense'])} matrices left dense.")
        bits: dict[str, int] = {}
        for m in st.get("modules", {}).values():
            if "bits" in m:
                key = f"{m['bits']} (embedding)" if m.get("method") == "embedding" else str(m["bits"])
                bits[key] = bits.get(key, 0) + 1
        if bits:
            lines.append("\nBits per stored matrix: " + ", ".join(f"{b} ×{n}" for b, n in sorted(bits.items())) + ".")
        before, after = st.get("params_before"), st.get("params_after")
        if any(isinstance(m, FactorizedModule) and m.quantized_names() for m in model.modules()):  # codes are buffers
            from ..eval.peers import stored_values

            values = stored_values(model)
            counted = (f"- values stored (each weight, integer code, scale and zero point once): {before:,} → {values:,} "
                       f"({values / before:.3f} of the original); {after:,} of them float parameters, the quantized "
                       "codes being buffers")
        else:
            counted = f"- parameters: {before:,} → {after:,} ({after / before:.3f} of the original)"
        lines += ["", counted,
                  *([f"- bytes stored: {st['bytes_before']:,} → {st['bytes_after']:,} "
                     f"({st['bytes_after'] / st['bytes_before']:.3f} of the original)"] if st.get("bytes_before") else []),
                  *([f"- compression passes: {st['passes']}"] if st.get("passes") else []),
                  f"- compressed modules: {len(st.get('modules', {}))}",
                  f"- compression time: {st.get('compress_seconds')} s"]
        h = st.get("heal")
        if h and h.get("streamed"):  # layer-wise while streaming: no whole-model held-out score
            layers = h["layerwise"]["layers"]
            mean = lambda key: sum(r[key] for r in layers) / max(len(layers), 1)  # noqa: E731
            lines.append(f"- healed: layer by layer while streaming ({h['tokens']:,} tokens, training {h['train']}: "
                         f"{h['params_trained']:,} parameters); each layer's output MSE to the dense layer's, mean over "
                         f"{len(layers)} layers: {mean('mse_before'):.6g} → {mean('mse_after'):.6g}")
        elif h:
            how = {"e2e": f"{h['steps']} end-to-end distillation steps", "layerwise": "layer by layer",
                   "both": f"layer by layer, then {h['steps']} end-to-end steps"}[h.get("mode", "e2e")]
            lines.append(f"- healed: {how} ({h['tokens']:,} tokens, training {h['train']}: "
                         f"{h['params_trained']:,} parameters"
                         + (f"; loss: KL to the dense model + {h['lm_weight']} x the language-model loss" if h.get("lm_weight") else "")
                         + f"); held-out KL to the dense model {h['held_out_kl_before']} → "
                         f"{h['held_out_kl_after']}, held-out perplexity {h['held_out_ppl_before']} → {h['held_out_ppl_after']}"
                         + ("" if h["improved"] else " (no improvement: the model was left as compressed)"))
        errs = [m["rel_error"] for m in st.get("modules", {}).values() if "rel_error" in m]
        if errs:
            lines.append(f"- relative reconstruction error per matrix: mean {sum(errs) / len(errs):.4f}, max {max(errs):.4f}")
    if results:
        lines += ["", "## Evaluation", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in results.items()]
    return "\n".join(lines) + "\n"


def write_model_card(model, directory, results: dict | None = None, base_model: str | None = None,
                     repo_id: str | None = None) -> str:
    """Write the model card (`model_card`) as ``README.md`` in `directory`, replacing one there (a temporary sibling
    renamed into place: a reader sees the old card or the new one)."""
    from ..atomic import atomic_file

    path = os.path.join(directory, "README.md")
    text = model_card(model, results, base_model, repo_id)
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path


def push_to_hub(model, repo_id: str, tokenizer=None, results: dict | None = None, base_model: str | None = None,
                token=None, private: bool | None = None, commit_message: str | None = None) -> str:
    """Push a compressed model (and tokenizer) with a model card saying how it was compressed."""
    model_card(model, results, base_model)  # fails before anything is created if not compressed
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    card = model_card(model, results, base_model, repo_id)
    api.upload_file(path_or_fileobj=card.encode(), path_in_repo="README.md", repo_id=repo_id,
                    commit_message="hf_tensorcomp model card")
    url = model.push_to_hub(repo_id, token=token, commit_message=commit_message)
    if tokenizer is not None:
        tokenizer.push_to_hub(repo_id, token=token)
    return url
