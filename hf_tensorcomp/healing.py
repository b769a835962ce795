"""Healing: `heal`, what a user calls on any compressed model (and what ``TensorCompressionConfig(heal=...)``
runs after compression): the teacher is the dense model it was made from unless given; what is trained is
chosen by ``train`` (default: every floating factor of the compressed modules plus the norms; quantized codes
stay as they are, a ``qlr`` layer's correction trains). Healing that does not lower the held-out loss leaves
the model bit-identical and says so. End to end it runs `hf_tensorcomp.training.distill`; layer by layer,
`LayerHealer` (also while streaming: `StreamHealer`). Its settings and their validation:
`hf_tensorcomp.heal_settings`.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from . import distributed
from .calibration import LayerwiseRunner
from .calibration.data import (DEFAULT as DEFAULT_CALIBRATION, calibration_ids, calibration_tokenizer, check_vocabulary,
                               validate_calibration)
from .calibration.pipeline import drop_states
from .heal_settings import TRAIN, TRAIN_PARTS, validate_heal
from .layers import FactorizedModule
from .layout import find_decoder_layers, first_output
from .training import (DistillSettings, RelativeSteps, adam_step, distill, held_out_loss, held_out_objective,
                       only_training, precision_autocast, resolve_precision)
from .validation import is_path, missing_folder


def trainable(model, train: str = "auto") -> list:
    """What healing trains: ``"factors"``: every floating parameter of the compressed (factored) modules
    (LASER's U and V, TRAWL / TensorLLM factors and cores, EinSort cores, a ``qlr`` layer's correction;
    quantized codes are buffers and stay); ``"norms"``: the normalisation weights and every bias;
    ``"auto"``: both; ``"scales"``: the per-group scales of every quantized tensor (codes and zero
    points stay; turned into parameters here, `FactorizedModule.train_scales`, and folded back into
    their float16 buffers by `heal`); ``"all"``: factors, norms and scales; ``"full"``: those and every
    weight of the decoder layers the compression left dense (a method that keeps some matrices whole,
    LASER's global allocation at 0.8 keeps about half, then heals those too); embeddings and the head stay."""
    parts, out = TRAIN_PARTS[train], {}
    for m in model.modules():
        if isinstance(m, FactorizedModule):
            if "scales" in parts:
                out.update({id(p): p for p in m.train_scales(True)})
            if "factors" in parts:
                out.update({id(p): p for p in m.parameters() if p.is_floating_point()})
    if "dense" in parts:  # a whole model or one decoder layer (streaming): every plain linear but the head
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        kept = {id(p) for p in head.parameters()} if head is not None else set()
        for m in model.modules():
            if isinstance(m, nn.Linear):
                out.update({id(p): p for p in m.parameters() if id(p) not in kept})
    if "norms" in parts:
        for name, m in model.named_modules():
            if "norm" in type(m).__name__.lower():
                out.update({id(p): p for p in m.parameters(recurse=False)})
        out.update({id(p): p for n, p in model.named_parameters() if n.endswith(".bias")})
    return list(out.values())


def _teacher_source(model, teacher, o: dict, compressed: bool):
    """Where the teacher comes from — a model as given, else a folder or Hub id (teacher=None: the dense model this
    one was made from) — checked before any work, from its config alone: refused when the model would be its own
    teacher, when the folder does not exist, when it is itself compressed, when its vocabulary differs from the
    model's (the KL compares next-token distributions), and layer by layer when its decoder layers differ."""
    from transformers import AutoConfig

    if teacher is None and not compressed:
        raise ValueError("heal: this model is not compressed (it holds no hf_tensorcomp layer and no compression record), "
                         "so with teacher=None it would be its own teacher; allowed: teacher=<a model or its folder> (the "
                         "model to distil toward), or a model compressed by hf_tensorcomp")
    src = teacher if teacher is not None else _source(model)
    if src is None:
        raise ValueError("heal: teacher=None, and the model does not record the dense model it was made from; allowed: "
                         "teacher=<the dense model or its path>")
    if not is_path(src):
        config = getattr(src, "config", None)
    else:
        if missing_folder(src):
            raise ValueError(f"heal: teacher: {os.fspath(src)}: no such folder; allowed: the dense model's folder, a Hub "
                             "repo id, or the model itself")
        config = AutoConfig.from_pretrained(src)
        if getattr(config, "quantization_config", None) is not None:
            raise ValueError(f"heal: the teacher loaded from {os.fspath(src)!r} is itself compressed or quantized; "
                             "allowed: teacher=<the dense model or its path>")
    if config is not None:
        mine, theirs = model.config.get_text_config(), config.get_text_config()
        if theirs.vocab_size != mine.vocab_size:
            raise ValueError(f"heal: teacher: a vocabulary of {theirs.vocab_size} tokens, the model's {mine.vocab_size}; "
                             "allowed: a teacher with the model's vocabulary (the dense model it was made from)")
        shape = lambda c: (c.num_hidden_layers, c.hidden_size)  # noqa: E731
        if o["mode"] != "e2e" and shape(theirs) != shape(mine):
            raise ValueError(f"heal: teacher: {theirs.num_hidden_layers} decoder layers of width {theirs.hidden_size}, the "
                             f"model's {mine.num_hidden_layers} of width {mine.hidden_size}; allowed: layer by layer, a "
                             "teacher of the model's layers (the dense model it was made from), or mode='e2e'")
    return src


def _teacher(model, src):
    """The teacher model (`_teacher_source`'s), loaded when it is a folder or Hub id, beside the model."""
    from transformers import AutoModelForCausalLM

    if not is_path(src):
        return src.eval()
    first = next(model.parameters())
    dense = AutoModelForCausalLM.from_pretrained(src, dtype=first.dtype)
    if first.device.type not in ("cpu", "meta"):  # the teacher beside the student (on its accelerator)
        dense.to(first.device)
    return dense.eval()


def _source(model):
    cfg = getattr(model.config, "quantization_config", None)
    st = getattr(cfg, "stats", None) or {}
    return st.get("source") or getattr(model, "name_or_path", None) or None


def _compressed(model, config) -> bool:
    """Whether `model` was compressed by hf_tensorcomp (`config`: the record of a compression under way)."""
    from .config import TensorCompressionConfig

    record = getattr(model.config, "quantization_config", None) or getattr(model, "tensorcomp_config", None)
    return (config is not None or isinstance(record, TensorCompressionConfig)
            or any(isinstance(m, FactorizedModule) for m in model.modules()))


class TrainingForms:
    """Every factored module of `root` in the parametrization healing trains (`FactorizedModule.training_form`:
    LASER's pivoted factors as balanced plain ones) until `close` puts each back in its stored form — the trained
    values (``keep``), or exactly the tensors it had."""

    def __init__(self, root: nn.Module):
        self.changed = [m for m in root.modules() if isinstance(m, FactorizedModule) and m.training_form()]

    def close(self, keep: bool) -> None:
        for m in self.changed:
            m.storage_form(keep)
        self.changed = []


class LayerHealer:
    """Layer-wise healing, one decoder layer at a time: `targets` runs the dense layer ``li`` over the
    dense stream (its outputs: the layer's targets and the dense stream's next states), `heal` trains
    the compressed layer ``li`` so that its outputs on the compressed stream (each layer also corrects
    the errors of the ones before it) match them, then moves the compressed stream on. MSE, Adam at
    ``lr``, ``layer_steps`` steps a layer over the batches; the last batch is held out (when there are
    several) and the layer keeps its best iterate by it, the start included. Used by `heal_layerwise`
    (a whole compressed model and its dense teacher) and by streaming compression (each layer healed
    while it is in memory, its dense weights read before it is compressed)."""

    def __init__(self, comp_hidden, dense_hidden, kwargs: list[list[dict]], o: dict, forward):
        self.hc, self.hd, self.kwargs, self.o, self._forward = comp_hidden, dense_hidden, kwargs, o, forward
        self.held = [len(comp_hidden) - 1] if len(comp_hidden) > 1 else [0]
        self.train = [i for i in range(len(comp_hidden)) if i not in self.held] or self.held
        self.target = None
        self.layers: list[dict] = []

    def targets(self, li: int) -> None:
        """The dense layer ``li``'s outputs on the dense stream (call while layer ``li`` is still dense)."""
        self.target = self._forward(li, self.hd, dense=True)

    @torch.enable_grad()
    def heal(self, li: int, layer: nn.Module, own: list) -> None:
        """Train `own` (parameters of the compressed `layer`) toward the targets, then move both streams on."""
        o, hc, target = self.o, self.hc, self.target
        if own:
            with only_training(layer, own):
                def loss_on(i, precision="float32"):
                    with precision_autocast(hc[i].device, precision):
                        y = layer(hc[i], **self.kwargs[i][li])
                    return F.mse_loss(first_output(y).float(), target[i].float())

                def score():
                    with torch.no_grad():
                        return sum(float(loss_on(i)) for i in self.held) / len(self.held)

                best_loss, best = score(), [p.detach().clone() for p in own]
                first = best_loss
                rel = RelativeSteps(own) if o["relative"] else None
                opt = torch.optim.Adam(rel.delta if rel else own, lr=o["lr"])
                for step in range(o["layer_steps"]):
                    loss = loss_on(self.train[step % len(self.train)], o["precision"])
                    adam_step(opt, loss, rel)
                    if (step + 1) % max(1, o["layer_steps"] // 4) == 0 or step + 1 == o["layer_steps"]:
                        now = score()
                        if now < best_loss:
                            best_loss, best = now, [p.detach().clone() for p in own]
                with torch.no_grad():
                    for p, b in zip(own, best):
                        p.copy_(b)
            self.layers.append({"layer": li, "mse_before": round(first, 8), "mse_after": round(best_loss, 8)})
        new = self._forward(li, hc, dense=False)
        drop_states(hc, new, target)  # states on disk (streaming's states_dir): the stale ones removed
        drop_states(self.hd, new, target)
        self.hc, self.hd, self.target = new, target, None


def heal_layerwise(model, dense, ids: torch.Tensor, trainable_ids: set, o: dict, progress: bool) -> dict:
    """`LayerHealer` over every decoder layer of the compressed `model`, the `dense` model giving the
    targets: inputs are the compressed model's own hidden states (propagated), targets the dense
    model's outputs of the same layer on the dense stream."""
    prefix, layers = find_decoder_layers(model)
    dprefix, dense_layers = find_decoder_layers(dense)
    comp = LayerwiseRunner(model, prefix, layers, ids, o["batch_size"])
    ref = LayerwiseRunner(dense, dprefix, dense_layers, ids, o["batch_size"])
    healer = LayerHealer(list(comp.hidden), list(ref.hidden), comp.kwargs, o,
                         lambda li, h, dense: (ref if dense else comp)._forward(li, h))
    for li in tqdm(range(len(layers)), desc="hf_tensorcomp: layer-wise healing", disable=not progress, unit="layer"):
        with torch.no_grad():
            healer.targets(li)
        healer.heal(li, layers[li], [p for p in layers[li].parameters() if id(p) in trainable_ids])
    return {"layers": healer.layers}


class StreamHealer:
    """``heal={"mode": "layerwise"}`` while streaming (`hf_tensorcomp.compress_checkpoint`): each decoder
    layer is healed while it is in memory — `before` (the layer still dense) runs it over the dense
    stream for its targets, `after` (the layer compressed, the calibration stream moved on) trains it and
    moves the compressed stream on — the same steps, in the same order, as `heal_layerwise` after
    in-memory compression, on the same windows (`heal_windows`). What needs the whole model (the
    held-out KL of the logits before and after, and putting everything back when it did not improve) is
    not done: each layer keeps its best iterate by its own held-out batch, the start included."""

    def __init__(self, model, config, states_dir=None):
        self.t0 = time.perf_counter()
        o = dict(config.heal)
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
        o["precision"] = resolve_precision(o["precision"], device)
        self.o = o
        _, train_ids = heal_windows(model, validate_calibration(config.calibration), config.calibration_tokenizer, o)
        prefix, self.layer_list = find_decoder_layers(model)
        self.runner = LayerwiseRunner(model, prefix, self.layer_list, train_ids, o["batch_size"],
                                      states_dir=None if states_dir is None else Path(states_dir) / "heal")
        self.healer = LayerHealer(self.runner.hidden, self.runner.hidden, self.runner.kwargs, o,
                                  lambda li, h, dense: self.runner._forward(li, h))
        self.windows, self.tokens = int(train_ids.shape[0]), int(train_ids.shape[1])
        self.params = 0

    def before(self, li: int) -> None:
        with torch.no_grad():
            self.healer.targets(li)

    def after(self, li: int) -> None:
        layer = self.layer_list[li]
        forms, done = TrainingForms(layer), len(self.healer.layers)
        ids = {id(p) for p in trainable(layer, self.o["train"])}
        own = [p for p in layer.parameters() if id(p) in ids]
        self.params += sum(p.numel() for p in own)
        try:
            self.healer.heal(li, layer, own)
        finally:  # stored forms and trained scales (float16 buffers) back before the layer is written
            healed = self.healer.layers[done:]
            forms.close(keep=bool(healed) and healed[0]["mse_after"] < healed[0]["mse_before"])
            for m in layer.modules():
                if isinstance(m, FactorizedModule):
                    m.train_scales(False)

    def report(self) -> dict:
        drop_states(self.healer.hc)
        drop_states(self.healer.hd)
        o = self.o
        layers = self.healer.layers
        return {"mode": "layerwise", "streamed": True, "layer_steps": o["layer_steps"], "train": o["train"],
                "params_trained": self.params, "lr": o["lr"], "relative": o["relative"], "precision": o["precision"],
                "tokens": len(layers) * o["layer_steps"] * o["batch_size"] * self.tokens, "windows": self.windows,
                "length": self.tokens,
                "layerwise": {"layers": layers}, "seconds": round(time.perf_counter() - self.t0, 1)}


class InverseCDFSampler:
    """A logits processor that draws each row's next token from ``softmax(scores)`` by its inverse CDF (one
    uniform a row, the CDF in float64) and returns scores that leave it the only choice (0 there, -inf
    elsewhere), for greedy decoding to take: sampling from the full distribution without `torch.multinomial`,
    which draws one exponential per vocabulary entry (Gemma-3's 262k-token vocabulary, 64 rows: 0.33 s of the
    ~0.6 s a decoding step took on two CPU cores).
    ``never``: token ids it does not draw (the end of text: windows of a fixed length)."""

    def __init__(self, never=()):
        self.never = [int(t) for t in ([never] if isinstance(never, int) else never or ())]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.float(), dim=-1)
        if self.never:
            probs[:, self.never] = 0.0
        cdf = probs.cumsum(-1, dtype=torch.float64)
        u = torch.rand(cdf.shape[0], 1, device=cdf.device, dtype=cdf.dtype) * cdf[:, -1:]
        token = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)
        return torch.full_like(scores, float("-inf")).scatter_(1, token, 0.0)


@torch.no_grad()
def teacher_windows(teacher, prompts: torch.Tensor, n: int, length: int, seed: int = 0, batch_size: int = 64,
                    precision: str = "float32", progress: bool = False, prompt: int | None = None) -> torch.Tensor:
    """``n`` windows of ``length`` tokens sampled from `teacher` (its full next-token distribution:
    temperature 1, no top-k / top-p, no end of text; `InverseCDFSampler`), each continuing the first
    ``prompt`` tokens (default ``length // 8``) of a window of `prompts` (cycled); ``prompt=0``: from the
    teacher's start-of-text token alone, text of whatever kind the teacher writes unprompted (its pretraining
    text's, not the calibration's). Healing text with no end: the KL to the teacher is then trained on the
    states the teacher itself visits, as in data-free distillation (LLM-QAT), beside the calibration text.
    ``precision="bfloat16"``: the teacher's forwards under bfloat16 autocast, as healing's. Deterministic for
    a seed (the global generator is forked, not consumed)."""
    from transformers import LogitsProcessorList

    k = max(1, length // 8) if prompt is None else prompt
    if not 0 <= k < length:
        raise ValueError(f"teacher_windows: prompt={prompt} tokens; allowed: an int in [0, {length - 1}] (length {length})")
    if k == 0:
        bos = teacher.generation_config.bos_token_id
        bos = teacher.config.bos_token_id if bos is None else bos
        if bos is None:
            raise ValueError("heal.generated_prompt: got 0, but the teacher has no start-of-text token "
                             "(generation_config.bos_token_id); allowed: an int >= 1 (tokens of a calibration window)")
        heads, new = torch.full((n, 1), int(bos), dtype=torch.long), length - 1
    else:
        heads, new = prompts[:, :k], length - k
        heads = heads.repeat((n + heads.shape[0] - 1) // heads.shape[0], 1)[:n]
    device = next(teacher.parameters()).device
    out, sampler = [], LogitsProcessorList([InverseCDFSampler(never=teacher.generation_config.eos_token_id)])
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), precision_autocast(device, precision):
        torch.manual_seed(seed)
        for chunk in tqdm(heads.split(batch_size), desc="hf_tensorcomp: sampling from the teacher", disable=not progress,
                          unit="batch"):
            out.append(teacher.generate(chunk.to(device), attention_mask=torch.ones_like(chunk, device=device),
                                        do_sample=False, top_k=None, top_p=None, temperature=None, min_p=None,
                                        repetition_penalty=1.0, max_new_tokens=new, logits_processor=sampler,
                                        pad_token_id=0).cpu())
    return torch.cat(out)


def heal_windows(model, calibration, tokenizer, o: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(held-out windows, training windows) of the calibration text for healing settings `o`."""
    tok = calibration_tokenizer(model, calibration, tokenizer)
    ids = check_vocabulary(calibration_ids(calibration, tok, o["samples"], o["length"], o["seed"]), model)
    if ids.shape[1] < 2:
        raise ValueError(f"heal: calibration windows of {ids.shape[1]} token; allowed: windows of at least 2 tokens (each "
                         "position is scored on the next token)")
    n_held = max(1, round(o["held_out"] * ids.shape[0]))
    if ids.shape[0] - n_held < 1:
        raise ValueError(f"heal: calibration gives {ids.shape[0]} windows; allowed: at least 2 (one is held out)")
    return ids[:n_held], ids[n_held:]


def heal(model, teacher=None, calibration=DEFAULT_CALIBRATION, steps: int | None = None, *, tokenizer=None,
         progress: bool = True, _config=None, **settings) -> dict:
    """Distil a compressed model toward the dense one, in place; returns what it did (also in
    ``config.quantization_config.stats["heal"]``, so the model card records it).

    teacher: the dense model (or its path); None: the model the compressed one was made from (its
    recorded source, reloaded). calibration: as in `TensorCompressionConfig` (a bundled text name —
    by default ``"wikipedia+owt"``, both bundled corpora —, texts, a Dataset, token ids); a held-out
    slice of its windows (``held_out``) is never trained on and decides which iterate is kept, by the trained
    loss (`held_out_objective`: the KL, plus ``lm_weight`` x the log perplexity); if the kept iterate's is not
    below the start's, the model is put back bit for bit. ``mode``:
    ``"e2e"`` (default: `distill` on the logits, ``steps``), ``"layerwise"`` (`heal_layerwise`,
    ``layer_steps`` per layer) or ``"both"`` (layer-wise, then end to end). Other settings:
    `hf_tensorcomp.heal_settings.HEAL_DEFAULTS` (``lr``, ``relative`` — steps relative to each entry's size,
    `RelativeSteps`, the default —, ``batch_size``, ``train``, ``lm_weight``,
    ``eval_every``, ``seed``, ``samples``, ``length``, ``gradient_checkpointing``, ``generated`` — windows
    sampled from the teacher added to the end-to-end step's (`teacher_windows`) —, ``generated_prompt`` — the
    calibration tokens each continues (None: ``length // 8``; 0: the teacher's start-of-text token alone) —, ``precision`` —
    ``"auto"`` (default: `resolve_precision`), ``"float32"``, or ``"bfloat16"``: the training forwards under
    bfloat16 autocast, 1.65x faster on a CPU with native bfloat16 products and healing as far (SmolLM2,
    `benchmarks/heal.py`); the held-out scoring that decides what is kept stays float32 —, ``every`` — the
    end-to-end loss on every `every`-th position only, the head run on those: for a large vocabulary, see
    `distill`). Under ``torchrun`` / ``accelerate launch`` (`hf_tensorcomp.distributed`), end to end is
    data-parallel: each step's batch split over the processes and the gradients summed (the same steps as one
    process, within float rounding), the held-out windows shared out; layer-wise healing runs whole on each process.
    """
    o = validate_heal({**settings, **({"steps": steps} if steps is not None else {})})  # bad input: before any change
    calibration = validate_calibration(calibration)
    teacher = _teacher_source(model, teacher, o, _compressed(model, _config))  # checked before any work
    forms, report = TrainingForms(model), {}
    try:
        report = _heal(model, teacher, calibration, o, tokenizer=tokenizer, progress=progress, _config=_config)
        return report
    finally:  # each module back in its stored form (after an error or interrupt too: `_heal` put the start back);
        # train="scales" | "all": the trained scales back into float16
        forms.close(keep=report.get("improved", False))
        for m in model.modules():
            if isinstance(m, FactorizedModule):
                m.train_scales(False)


def _heal(model, teacher, calibration, o: dict, *, tokenizer, progress, _config) -> dict:
    t0 = time.perf_counter()
    params = trainable(model, o["train"])
    if not params:
        raise ValueError(f"heal: train={o['train']!r} finds nothing to train in this model; allowed: {' | '.join(map(repr, TRAIN))}")
    start, was_training = [p.detach().clone() for p in params], model.training
    try:
        return _train(model, teacher, calibration, o, params, start, t0, tokenizer=tokenizer, progress=progress,
                      _config=_config)
    except BaseException as e:  # an error or an interrupt (Ctrl-C) mid-way: the model exactly as it came
        with torch.no_grad():
            for p, b in zip(params, start):
                p.copy_(b)
        model.train(was_training)
        if not isinstance(e, Exception):
            warnings.warn(f"hf_tensorcomp: healing stopped ({type(e).__name__}); the model is left exactly as it came",
                          stacklevel=3)
        raise


def _train(model, teacher, calibration, o: dict, params: list, start: list, t0: float, *, tokenizer, progress,
           _config) -> dict:
    held, train_ids = heal_windows(model, calibration, tokenizer, o)
    group = distributed.group()  # under torchrun / accelerate launch: end to end, data-parallel
    distributed.agree(group, "heal", **distributed.fields("settings", o), windows=distributed.fingerprint(train_ids))
    dense = _teacher(model, teacher)
    model.eval()
    o["precision"] = resolve_precision(o["precision"], next(model.parameters()).device)
    cache: list = []  # the dense model's hidden states of the held-out windows, computed once
    kl0, ppl0 = held_out_loss(model, dense, held, o["batch_size"], cache=cache, group=group)
    report = {"mode": o["mode"], "steps": o["steps"], "train": o["train"], "params_trained": sum(p.numel() for p in params),
              "lr": o["lr"], "relative": o["relative"], "precision": o["precision"], "tokens": 0,
              **({"every": o["every"]} if o["every"] > 1 else {}), **({"lm_weight": o["lm_weight"]} if o["lm_weight"] else {})}
    torch.manual_seed(o["seed"])
    if o["mode"] in ("layerwise", "both"):
        report["layerwise"] = heal_layerwise(model, dense, train_ids, {id(p) for p in params}, o, progress)
        report["tokens"] += len(report["layerwise"]["layers"]) * o["layer_steps"] * o["batch_size"] * int(train_ids.shape[1])
    if o["mode"] in ("e2e", "both"):
        if o["generated"]:
            sampled = teacher_windows(dense, train_ids, o["generated"], int(train_ids.shape[1]), o["seed"],
                                      precision=o["precision"], progress=progress, prompt=o["generated_prompt"])
            train_ids = torch.cat([train_ids, sampled])
            report["generated"] = o["generated"]
            if o["generated_prompt"] is not None:
                report["generated_prompt"] = o["generated_prompt"]
        checkpointing = o["gradient_checkpointing"] and hasattr(model, "gradient_checkpointing_enable")
        if checkpointing:
            model.gradient_checkpointing_enable()
        try:
            settings = DistillSettings(o["steps"], lr=o["lr"], batch_size=o["batch_size"], seed=o["seed"],
                                       lm_weight=o["lm_weight"], eval_every=o["eval_every"], relative=o["relative"],
                                       precision=o["precision"], every=o["every"], progress=progress,
                                       desc="hf_tensorcomp: healing")
            run = distill(model, dense, train_ids, params, settings, held_out=held,
                          start=(kl0, ppl0) if o["mode"] == "e2e" else None, held_out_cache=cache, group=group)
        finally:
            if checkpointing:
                model.gradient_checkpointing_disable()
        report.update(loss_first=round(run["losses"][0], 6), loss_last=round(run["losses"][-1], 6),
                      best_step=run["best_step"],
                      held_out_steps=[[step, round(kl, 6), round(ppl, 4)] for step, kl, ppl in run["held_out"]])
        report["tokens"] += o["steps"] * o["batch_size"] * int(train_ids.shape[1])
    if o["mode"] in ("e2e", "both"):  # the kept iterate is the best scored one: its scores, not a pass more
        _, kl1, ppl1 = next(s for s in run["held_out"] if s[0] == run["best_step"])
    else:
        kl1, ppl1 = held_out_loss(model, dense, held, o["batch_size"], cache=cache, group=group)
    objective = functools.partial(held_out_objective, lm_weight=o["lm_weight"])
    report["improved"] = improved(objective(max(kl0, 0.0), ppl0), objective(max(kl1, 0.0), ppl1))  # KL < 0: rounding
    if not report["improved"]:  # no harm: the model exactly as it came
        with torch.no_grad():
            for p, b in zip(params, start):
                p.copy_(b)
        kl1, ppl1 = kl0, ppl0
    report.update(held_out_kl_before=round(kl0, 6), held_out_kl_after=round(kl1, 6), held_out_ppl_before=round(ppl0, 4),
                  held_out_ppl_after=round(ppl1, 4), seconds=round(time.perf_counter() - t0, 1))
    if not report["improved"]:
        scored = ", ".join(f"step {step}: {objective(kl, ppl):.4g}"
                           for step, kl, ppl in report.get("held_out_steps", [])[1:])
        what = "KL to the dense model" + (f" + {o['lm_weight']:g} x log perplexity" if o["lm_weight"] else "")
        warnings.warn(f"hf_tensorcomp: healing did not lower the held-out loss ({what} {objective(kl0, ppl0):.4g} at the "
                      f"start{'; ' + scored if scored else ''}); the model is left exactly as it was. A smaller "
                      f"lr (this run: {o['lr']:g}; a closed form already near dense may want about a third of it)"
                      + (" or lm_weight" if o["lm_weight"] else "") + " may help", stacklevel=2)
    cfg = _config if _config is not None else getattr(model.config, "quantization_config", None)
    if cfg is not None and hasattr(cfg, "stats"):
        cfg.stats = {**(cfg.stats or {}), "heal": report}
    if is_path(teacher):
        del dense
    return report


#: a held-out loss lower than the start's by less than ``NOISE`` of it plus ``NOISE_FLOOR`` is float rounding, not an
#: improvement (the losses are float32 sums; a model that was its own teacher scored KL 0.0, then -0.0 after training
#: its norms on rounding-level gradients). A tiny model's real gain can be small: 2.3e-7 on a KL of 1.5e-4.
NOISE, NOISE_FLOOR = 1e-6, 1e-7


def improved(before: float, after: float) -> bool:
    """Whether the held-out loss `after` is lower than `before` by more than numerical noise (`NOISE`)."""
    return after < before - NOISE * abs(before) - NOISE_FLOOR
