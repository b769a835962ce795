"""Build a hybrid linear-attention model from a softmax one: layer-wise distillation, then optional end-to-end.

    model, report = build_hybrid("smollm2", "out/smollm2-gdn", every=3, distill_steps=30)

1. ``from_pretrained(model, quantization_config=TensorCompressionConfig(method="linearize", ...))``: every
   ``every``-th layer's self-attention becomes a Gated DeltaNet layer trained to reproduce the block's
   output on the calibration windows (`hf_tensorcomp.methods.linearize`);
2. optionally `distill_logits`: a short end-to-end distillation, KL(dense ‖ hybrid) on the next-token
   distributions over the same calibration windows, only the Gated DeltaNet layers trainable;
3. perplexity of the dense and the hybrid model on the held-out Wikipedia split (the evaluation the
   calibrated benchmark uses: 512-token windows, stride 512, ``eval_tokens`` tokens);
4. saved atomically with a model card saying how it was made and what it scores.

The bundled hybrid (`linearized_path`) is this with `DEFAULTS`, cached under
``<cache>/models/<model>-gdn-every<k>-seed<s>/`` and never committed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from .assets._common import _note, cache_dir
from .assets.models import _spec
from .layers import GatedDeltaNetAttention
from .training import DistillSettings, distill
from .validation import fail, is_int

#: the recipe of the bundled hybrid (also recipes/linearize_smollm2.json)
DEFAULTS = {"every": 3, "layers": None, "calibration": "wikipedia", "samples": 128, "length": 256, "epochs": 4,
            "lr": 1e-2, "batch_size": 4, "distill_steps": 30, "distill_lr": 1e-4, "distill_batch_size": 4, "seed": 0,
            "eval_tokens": 8192}


def distill_logits(student, teacher, ids: torch.Tensor, steps: int, lr: float = 1e-4, batch_size: int = 4,
                   seed: int = 0, warmup: float = 0.1, progress: bool = True) -> list[float]:
    """Train the student's Gated DeltaNet layers (only those) to match the teacher's next-token distributions
    (`training.distill`: KL, Adam with warm-up and cosine decay, seeded shuffle of the windows of ``ids``).
    Returns the loss of every step."""
    if not is_int(steps, 1):
        fail("distill_steps", steps, "an int >= 1")
    params = [p for m in student.modules() if isinstance(m, GatedDeltaNetAttention) for p in m.parameters()]
    if not params:
        raise ValueError("distill_logits: the student has no Gated DeltaNet layers; allowed: a model linearized by "
                         "hf_tensorcomp (method 'linearize')")
    run = distill(student, teacher, ids, params,
                  DistillSettings(steps, lr=lr, batch_size=batch_size, seed=seed, warmup=warmup, train_mode=True,
                                  progress=progress, desc="hf_tensorcomp: end-to-end distillation"))
    student.eval()
    return run["losses"]


def _ppl(model, tok, tokens: int) -> float:
    from .assets import load_text
    from .eval import perplexity

    return perplexity(model, tok, load_text("wikipedia", "eval"), max_tokens=tokens, progress=False)["ppl"]


def build_hybrid(model: str = "smollm2", out=None, progress: bool = True, overwrite: bool = False, **options) -> dict:
    """Linearize `model` (a bundled name or a folder), optionally distil end to end, evaluate, save to `out` (a new or
    empty folder, or with ``overwrite=True`` an existing one: only the files written are replaced; never the model's
    own folder, one inside it or one holding it).

    ``options``: the keys of `DEFAULTS`. Returns ``(hybrid model, report)``; the report is also written to
    ``out/linearize_report.json`` and summarised in the model card there.
    """
    import transformers

    from .config import TensorCompressionConfig
    from .integration.hub import write_model_card
    from .calibration import calibration_ids
    from .atomic import atomic_dir

    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"build_hybrid: unknown option(s) {unknown}; allowed: {sorted(DEFAULTS)}")
    o = {**DEFAULTS, **options}
    if not is_int(o["distill_steps"], 0):
        fail("distill_steps", o["distill_steps"], "an int >= 0 (0: no end-to-end distillation)")
    src = model
    base_model = None
    if model in ("smollm2", "gemma3"):
        from .assets import hub_id, model_path

        src, base_model = str(model_path(model)), hub_id(model)
    if out is not None:  # checked before any work
        from .atomic import refuse_overlap

        refuse_overlap(out, [src] if os.path.isdir(src) else [], "build_hybrid: out")
        if Path(out).exists() and (not Path(out).is_dir() or any(Path(out).iterdir())) and not overwrite:
            raise ValueError(f"build_hybrid: out: {out} exists and is not empty; allowed: a new or empty folder, or "
                             "overwrite=True")
    torch.manual_seed(o["seed"])
    cfg = TensorCompressionConfig(method="linearize", layers=o["layers"], every=o["every"], epochs=o["epochs"], lr=o["lr"],
                                  batch_size=o["batch_size"], seed=o["seed"], calibration=o["calibration"],
                                  calibration_samples=o["samples"], calibration_length=o["length"],
                                  calibration_seed=o["seed"], progress=progress)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    t0 = time.perf_counter()
    hybrid = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, quantization_config=cfg)
    layerwise_s = time.perf_counter() - t0
    st = hybrid.config.quantization_config.stats
    linear = sorted(int(n.split(".")[-2]) for n in st["modules"])
    report = {"model": model, "options": o, "linear_layers": linear, "n_layers": hybrid.config.num_hidden_layers,
              "layerwise_seconds": round(layerwise_s, 1),
              "layer_rel_mse": {str(i): m["rel_mse"] for i, m in zip(linear, st["modules"].values())},
              "layer_rel_mse_init": {str(i): m["rel_mse_init"] for i, m in zip(linear, st["modules"].values())}}
    teacher = None
    if o["distill_steps"] or o["eval_tokens"]:
        teacher = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    if o["eval_tokens"]:
        report["dense_ppl"] = round(_ppl(teacher, tok, o["eval_tokens"]), 3)
        if o["distill_steps"]:
            report["layerwise_ppl"] = round(_ppl(hybrid, tok, o["eval_tokens"]), 3)
    if o["distill_steps"]:
        ids = calibration_ids(o["calibration"], tok, o["samples"], o["length"], o["seed"])
        t1 = time.perf_counter()
        losses = distill_logits(hybrid, teacher, ids, o["distill_steps"], lr=o["distill_lr"],
                                batch_size=o["distill_batch_size"], seed=o["seed"], progress=progress)
        report["distill_seconds"] = round(time.perf_counter() - t1, 1)
        report["distill_kl"] = {"first": round(losses[0], 4), "last": round(losses[-1], 4)}
        st["distill"] = {"steps": o["distill_steps"], "lr": o["distill_lr"], "batch_size": o["distill_batch_size"],
                         "kl_first": round(losses[0], 4), "kl_last": round(losses[-1], 4),
                         "seconds": report["distill_seconds"]}
    del teacher
    if o["eval_tokens"]:
        report["ppl"] = round(_ppl(hybrid, tok, o["eval_tokens"]), 3)
    report["build_seconds"] = round(time.perf_counter() - t0, 1)
    results = {}
    if o["eval_tokens"]:
        what = f"perplexity (wikipedia eval split, ctx 512, stride 512, {o['eval_tokens']} tokens)"
        results = {what: report["ppl"], "dense perplexity, same setting": report["dense_ppl"]}
        if "layerwise_ppl" in report:
            results["perplexity after layer-wise distillation only"] = report["layerwise_ppl"]
    if out is not None:
        with atomic_dir(Path(out), overwrite=overwrite) as tmp:
            hybrid.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            write_model_card(hybrid, tmp, results, base_model=base_model, repo_id=str(out))
            with open(Path(tmp) / "README.md", "a", encoding="utf-8") as f:
                f.write(_how_made(report))
            (Path(tmp) / "linearize_report.json").write_text(json.dumps(report, indent=2) + "\n")
        report["out"] = str(out)
    return hybrid, report


def _how_made(r: dict) -> str:
    o = r["options"]
    lines = ["", "## How it was made", "",
             f"A hybrid linear-attention model: of {r['n_layers']} decoder layers, {len(r['linear_layers'])} "
             f"({', '.join(map(str, r['linear_layers']))}) had their softmax self-attention replaced by a Gated DeltaNet "
             "layer (transformers' `Qwen3_5GatedDeltaNet`, wrapped by hf_tensorcomp), initialised from the layer's q/k/v/o "
             "(KV heads repeated for grouped-query attention, identity short convolution) and trained to reproduce the "
             f"attention block's output on {o['samples']} x {o['length']} tokens of the {o['calibration']} calibration "
             f"split ({o['epochs']} epochs, Adam lr {o['lr']}, {o['batch_size']} windows per step, seed {o['seed']}; each "
             "layer on the outputs of the already linearized layers before it).",
             "", f"Layer-wise distillation: {r['layerwise_seconds']} s. Relative MSE of each new layer's output on "
             "its calibration data (at initialisation → after training):", ""]
    lines += [f"- layer {i}: {r['layer_rel_mse_init'][i]:.3f} → {r['layer_rel_mse'][i]:.3f}" for i in r["layer_rel_mse"]]
    if o["distill_steps"]:
        lines += ["", f"End-to-end distillation: {o['distill_steps']} steps of KL(dense ‖ hybrid) on the next-token "
                  f"distributions, {o['distill_batch_size']} windows per step, Adam lr {o['distill_lr']}, only the Gated "
                  f"DeltaNet layers trainable; KL {r['distill_kl']['first']} → {r['distill_kl']['last']}, "
                  f"{r['distill_seconds']} s."]
    lines += ["", f"Total build time (including evaluation): {r['build_seconds']} s on CPU.", ""]
    return "\n".join(lines)


def linearized_path(name: str = "smollm2", every: int = 3, seed: int = 0, **options) -> Path:
    """Folder of a hybrid linear-attention model made from a bundled model, building it on first use.

    Every ``every``-th decoder layer's self-attention replaced by a Gated DeltaNet layer distilled on the
    Wikipedia calibration split (`build_hybrid` with its ``DEFAULTS``; other
    ``options`` of it are passed on and named in the folder). Cached as ``<cache>/models/<name>-gdn-every<k>-seed<s>``
    (plus the non-default options), written atomically; about 15-25 min on 2 CPU cores the first time.
    Loading it needs ``import hf_tensorcomp`` (the Gated DeltaNet layers are rebuilt by its quantizer).
    """
    spec = _spec(name)
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"linearized_path: unknown option(s) {unknown}; allowed: {sorted(set(DEFAULTS) - {'every', 'seed'})}")
    extra = "".join(f"-{k.replace('_', '')}{v}" for k, v in sorted(options.items()) if v != DEFAULTS[k])
    out = cache_dir() / "models" / f"{spec.aliases[0]}-gdn-every{every}-seed{seed}{extra}"
    if not (out / "config.json").is_file():
        _note(f"building the hybrid linear-attention model {out.name} (one time; see hf_tensorcomp.hybrid) ...")
        build_hybrid(spec.aliases[0], out, every=every, seed=seed, **options)
    return out
