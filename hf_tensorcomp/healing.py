"""Healing: every training step of the library, in one place.

- `fit`: one module trained to reproduce a dense one on real inputs (MSE, Adam): the rotor method and
  its LR / BH baselines, linearize's layer-wise attention transfer.
- `distill`: a model trained toward a teacher's next-token distributions (KL, plus an optional
  language-model loss), only the parameters given, with a held-out slice scored before, during and
  after and the best iterate kept: `heal`, linearize's end-to-end step
  (`hybrid.distill_logits`) and state reduction's LoRA recovery.
- `heal`: what a user calls on any compressed model (and what ``TensorCompressionConfig(heal=...)``
  runs after compression): the teacher is the dense model it was made from unless given; what is
  trained is chosen by ``train`` (default: every floating factor of the compressed modules plus the
  norms; quantized codes stay as they are, a ``qlr`` layer's correction trains). Healing that does
  not lower the held-out loss leaves the model bit-identical and says so.
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .calibration import LayerwiseRunner
from .calibration.data import (DEFAULT as DEFAULT_CALIBRATION, calibration_ids, calibration_tokenizer,
                               validate_calibration)
from .calibration.pipeline import drop_states
from .layers import FactorizedModule
from .layout import find_decoder_layers, first_output
from .validation import fail, is_int, is_number, is_path


def lr_schedule(step: int, total: int, warmup: float = 0.05, floor: float = 0.0) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based) of `total`:
    linear warm-up over the first ``warmup`` fraction of the steps, then one cosine half-period
    down to ``floor`` at the last step. (The paper's code steps a T_max = 1 cosine per batch, which
    makes the rate jump between its peak and 0 every step; this is the schedule it meant.)"""
    n_warm = int(round(warmup * total))
    if step < n_warm:
        return (step + 1) / n_warm
    span = max(1, total - n_warm - 1)
    progress = min(1.0, (step - n_warm) / span)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.enable_grad()  # from_pretrained may be called under torch.no_grad()
def fit(module: nn.Module, dense_linear, inputs: torch.Tensor, *, lr: float = 0.05, epochs: int = 1,
        batch_size: int = 64, seed: int = 0, warmup: float = 0.05, floor: float = 0.0, targets: torch.Tensor | None = None,
        windows: bool = False, progress: bool = False, desc: str = "fit") -> list[float]:
    """Train `module` in place so that ``module(x) ≈ dense_linear(x)`` on the rows of `inputs`.

    inputs: ``(tokens, d_in)`` real activations of the projection being replaced. The targets are
    ``dense_linear(inputs)`` (computed once, in float32; pass ``targets=`` to supply them). Loss: MSE
    per batch, Adam at ``lr`` with `lr_schedule` (stepped per batch), ``epochs`` passes over the
    tokens in a seeded shuffle: the same seed, module and data give the same result. The module keeps
    its best iterate (the start, or an epoch's end, by the MSE over all rows): training never leaves it
    worse than it began. The module is left in eval mode. Returns the loss of every step.

    ``windows=True``: `inputs` and `targets` keep their shape ``(windows, tokens, d)`` and the shuffle and
    batches run over windows (a module that mixes tokens, e.g. a whole attention block); a module
    returning a tuple is scored on its first element.
    """
    x = inputs.detach().float() if windows else inputs.detach().reshape(-1, inputs.shape[-1]).float()
    if targets is None:
        with torch.no_grad():
            if isinstance(dense_linear, nn.Linear):
                b = dense_linear.bias.float() if dense_linear.bias is not None else None
                y = F.linear(x.to(dense_linear.weight.device), dense_linear.weight.float(), b)
            else:
                y = dense_linear(x).float()
    else:
        y = targets.detach().float() if windows else targets.detach().reshape(x.shape[0], -1).float()
    params = [p for p in module.parameters() if p.requires_grad]

    def full_loss() -> float:  # MSE over every row, in eval mode
        module.eval()
        with torch.no_grad():
            total = sum(F.mse_loss(first_output(module(x[i: i + 4096])).float(), y[i: i + 4096], reduction="sum").item()
                        for i in range(0, x.shape[0], 4096))
        module.train()
        return total

    best_loss, best = full_loss(), [p.detach().clone() for p in params]  # the start: kept unless training beats it
    opt = torch.optim.Adam(params, lr=lr)
    steps_per_epoch = math.ceil(x.shape[0] / batch_size)
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_schedule(s, total, warmup, floor))
    g = torch.Generator().manual_seed(seed)
    history: list[float] = []
    module.train()
    bar = tqdm(total=total, desc=desc, disable=not progress, unit="step", leave=False)
    for _ in range(epochs):
        order = torch.randperm(x.shape[0], generator=g)
        for s in range(steps_per_epoch):
            idx = order[s * batch_size : (s + 1) * batch_size]
            out = module(x[idx])
            loss = F.mse_loss(first_output(out).float(), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            history.append(loss.item())
            bar.update(1)
            if progress and s % 20 == 0:
                bar.set_postfix(loss=f"{history[-1]:.4g}")
        now = full_loss()  # each epoch's end against the best so far: the best iterate is kept
        if now < best_loss:
            best_loss, best = now, [p.detach().clone() for p in params]
    bar.close()
    with torch.no_grad():
        for p, b in zip(params, best):
            p.copy_(b)
    module.eval()
    return history


@torch.no_grad()
def relative_mse(module: nn.Module, dense_linear, inputs: torch.Tensor, batch: int = 4096) -> float:
    """||module(x) - dense(x)||² / ||dense(x)||² over the rows of `inputs` (float32)."""
    num = den = 0.0
    x = inputs.detach().reshape(-1, inputs.shape[-1]).float()
    for i in range(0, x.shape[0], batch):
        xb = x[i : i + batch]
        if isinstance(dense_linear, nn.Linear):
            b = dense_linear.bias.float() if dense_linear.bias is not None else None
            y = F.linear(xb, dense_linear.weight.float(), b)
        else:
            y = dense_linear(xb).float()
        num += (module(xb).float() - y).pow(2).sum().item()
        den += y.pow(2).sum().item()
    return num / den


# ---------------------------------------------------------------------------------------- distillation
#: the float32 logits one chunk of the loss holds at a time (rows x vocabulary); 2**25 is 128 MB
CHUNK_ELEMENTS = 2 ** 25


class LogitLoss:
    """The distillation loss on the logits, a chunk of token rows at a time.

    A causal LM is run as its body (the final hidden states) and its output head, split where transformers
    splits it (the base model under ``base_model_prefix``, the output embeddings, Gemma's optional final
    soft-cap), and the head, the log-softmaxes, the KL and the language-model term run on ``CHUNK_ELEMENTS``
    of logits at a time; the student's gradient reaches its hidden states chunk by chunk and the body's
    backward runs once. Why: on a large vocabulary the whole logits, their float32 log-softmaxes, the KL and
    their gradients are (batch x length x vocabulary) tensors each (Gemma-3, 262k tokens, 4 x 256 tokens: 1 GB
    apiece); in chunks, a dense Gemma-3 student's step on two threads went from 16.3 to 12.2 s and its peak
    memory from 12.3 to 8.2 GB, the losses the same. The split is used only where it reproduces the model's
    own logits on a short window (checked once); anything else — a model laid out otherwise, a teacher given
    as a function — is read whole and only the loss is chunked."""

    def __init__(self, model, probe: torch.Tensor):
        self.model, self.split, self._cast, self._vocab = model, None, None, None
        if not isinstance(model, nn.Module):
            return  # a function batch -> log-probabilities
        prefix = getattr(model, "base_model_prefix", "") or ""
        body = getattr(model, prefix, None) if prefix else None
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not isinstance(body, nn.Module) or body is model or not isinstance(head, nn.Module):
            return
        cap = getattr(model.config, "final_logit_softcapping", None)
        self.split = (body, head, cap)
        probe, was = probe[:1, :8].to(model.device), model.training
        model.eval()
        with torch.no_grad():
            whole = model(input_ids=probe, use_cache=False).logits
            own = self.logits(self.hidden(probe))
        model.train(was)
        if whole.shape != own.shape or not torch.allclose(whole, own, rtol=1e-4, atol=1e-5):
            self.split = None
        self._vocab = whole.shape[-1]

    def hidden(self, batch: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """What the head runs on at positions `keep` (all by default): the final hidden states, or the
        model's logits (its log-probabilities for a function) where it is not split."""
        batch = batch.to(self.model.device) if isinstance(self.model, nn.Module) else batch
        if self.split is None:
            if not isinstance(self.model, nn.Module):
                out = self.model(batch)
                return out if keep is None else out[:, keep.to(out.device)]
            extra = {} if keep is None else {"logits_to_keep": keep.to(self.model.device)}
            return self.model(input_ids=batch, use_cache=False, **extra).logits
        h = self.split[0](input_ids=batch, use_cache=False)[0]  # the last hidden state
        return h if keep is None else h[:, keep.to(h.device)]

    def vocab(self, h: torch.Tensor) -> int:
        return h.shape[-1] if self.split is None else self._vocab

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.split is None:
            return h
        _, head, cap = self.split
        kind = h.device.type
        plain = type(head) is nn.Linear  # (a quantized head, tied to a quantized embedding, has no weight of its own)
        if plain and torch.is_autocast_enabled(kind) and not (head.weight.requires_grad and torch.is_grad_enabled()):
            # autocast casts a weight that does not train (or a teacher's, under no_grad) again at every call: the
            # tied 262k x 640 head cast per chunk took a sixth of a step; here once while the weight is unchanged
            w, dtype = head.weight, torch.get_autocast_dtype(kind)
            key = (w.data_ptr(), w._version, dtype)
            if self._cast is None or self._cast[0] != key:
                self._cast = (key, w.to(dtype), None if head.bias is None else head.bias.to(dtype))
            z = F.linear(h.to(dtype), self._cast[1], self._cast[2])
        else:
            z = head(h)
        return z if not cap else torch.tanh(z / cap) * cap

    def log_probs(self, h: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.model, nn.Module):
            return h.float()  # a function gives log-probabilities already
        return F.log_softmax(self.logits(h).float(), -1)


def chunked_losses(student: LogitLoss, teacher: LogitLoss, hs: torch.Tensor, ht: torch.Tensor, targets: torch.Tensor,
                   scale: tuple[float, float] = (1.0, 1.0), backward: bool = False, precision: str = "float32",
                   elements: int | None = None):
    """(KL(teacher ‖ student) summed over the rows x scale[0], the student's NLL of `targets` (rows; -100: none)
    summed x scale[1]) over the rows of the flattened hidden states `hs` / `ht`, ``elements`` (default
    ``CHUNK_ELEMENTS``) of logits at a time; with ``backward``, each chunk's KL + NLL is back-propagated into
    ``hs`` (a leaf that requires grad) and the head's parameters as it goes. Floats."""
    kl = nll = 0.0
    rows = max(1, (elements or CHUNK_ELEMENTS) // student.vocab(hs))
    for start in range(0, hs.shape[0], rows):
        with _autocast(hs.device, precision):
            s = student.log_probs(hs[start: start + rows])
            with torch.no_grad():
                t = teacher.log_probs(ht[start: start + rows]).to(s.device)
        k = F.kl_div(s, t, log_target=True, reduction="sum") * scale[0]
        n = F.nll_loss(s, targets[start: start + rows].to(s.device), ignore_index=-100, reduction="sum") * scale[1]
        if backward:
            (k + n).backward()
        kl, nll = kl + float(k.detach()), nll + float(n.detach())
    return kl, nll


def next_tokens(batch: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """The next token of each scored position, row by row as the hidden states flatten (-100 for the last
    position, which has none)."""
    nxt = torch.full((batch.shape[0], len(scored)), -100, dtype=torch.long, device=batch.device)
    have = scored < batch.shape[1] - 1
    nxt[:, have] = batch[:, scored[have].to(batch.device) + 1]
    return nxt.flatten()


@torch.no_grad()
def held_out_loss(student, teacher, ids: torch.Tensor, batch_size: int = 4,
                  split: tuple[LogitLoss, LogitLoss] | None = None, cache: list | None = None) -> tuple[float, float]:
    """(mean KL to the teacher per token, the student's perplexity) on the windows of `ids`; `split`: the two
    models' `LogitLoss` when the caller has them (`distill` scores many times: the split is checked once);
    `cache`: a list the teacher's final hidden states of `ids` are kept in (filled on the first call, read on
    the next with the same `ids` and `batch_size`: the teacher does not change, so each scoring after the first runs the teacher's head alone —
    where the teacher is split; a teacher read whole, whose cache would be logits, is run again)."""
    s_loss, t_loss = split or (LogitLoss(student, ids), LogitLoss(teacher, ids))
    kl = nll = 0.0
    every = torch.arange(ids.shape[1])
    keep = cache is not None and t_loss.split is not None
    for i, batch in enumerate(ids.split(batch_size)):
        if keep and len(cache) <= i:
            cache.append(t_loss.hidden(batch).flatten(0, 1))
        hs, ht = s_loss.hidden(batch).flatten(0, 1), cache[i] if keep else t_loss.hidden(batch).flatten(0, 1)
        k, n = chunked_losses(s_loss, t_loss, hs, ht, next_tokens(batch, every), elements=4 * CHUNK_ELEMENTS)
        kl, nll = kl + k, nll + n
    tokens = ids.shape[0] * ids.shape[1]
    return kl / tokens, math.exp(nll / (tokens - ids.shape[0]))


def held_out_objective(kl: float, ppl: float, lm_weight: float = 0.0) -> float:
    """The trained loss on the held-out windows: KL to the teacher + ``lm_weight`` x the language-model loss (log
    perplexity). It picks the kept iterate and says whether healing helped; with a language-model term, the KL
    alone would judge a loss that is not the one trained (it can rise while the trained loss still falls)."""
    return kl + lm_weight * math.log(ppl)


class RelativeSteps:
    """Train ``p = p₀ + δ ⊙ |p₀|`` through δ (from 0): Adam's steps then change each entry by a fraction of its own
    size (multiplicative updates; an entry at exactly zero stays there).

    Compressed layers need it. Their factors mix scales by orders of magnitude (whitened factors carry
    S⁻¹, large where an input channel is quiet) and some input channels are massive: Adam moves every
    entry by about the same step, so one step that suits most entries wrecks the rest (SmolLM2, LASER at
    0.8: one sign step of 10⁻⁷ x each tensor's RMS raised the KL to the dense model from 0.43 to 2.95,
    while a step of 10⁻³ of each entry's own size lowered it to 0.41; a floor of 10⁻³ x the RMS on the step
    of the smallest entries was enough to wreck it again). With δ = 0, p is p₀ bit for bit.
    """

    def __init__(self, params: list):
        self.params = params
        self.base = [p.detach().clone() for p in params]
        self.delta = [torch.zeros_like(p, requires_grad=True) for p in params]

    # both steps as a few multi-tensor (foreach) operations, not a handful of kernels per parameter: on a GPU a
    # small model's step is bound by kernel launches, and a compressed model has hundreds of small parameters

    def grads(self) -> None:
        """δ's gradient from p's (after the backward)."""
        have = [i for i, p in enumerate(self.params) if p.grad is not None]
        g = torch._foreach_mul([self.params[i].grad for i in have], torch._foreach_abs([self.base[i] for i in have]))
        for d in self.delta:
            d.grad = None
        for i, gi in zip(have, g):
            self.delta[i].grad = gi
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def apply(self) -> None:
        step = torch._foreach_mul(self.delta, torch._foreach_abs(self.base))  # δ ⊙ |p₀|
        torch._foreach_add_(step, self.base)
        torch._foreach_copy_(self.params, step)


def adam_step(opt: torch.optim.Optimizer, loss, relative: RelativeSteps | None = None) -> float:
    """One optimizer step on `loss` (through `relative`'s δ when given): a scalar tensor, or a function that runs
    the backward itself and returns the loss. Returns the loss."""
    opt.zero_grad(set_to_none=True)
    if isinstance(loss, torch.Tensor):
        loss.backward()
        loss = loss.item()
    else:
        loss = loss()
    if relative is not None:
        relative.grads()
    opt.step()
    if relative is not None:
        relative.apply()
    return loss


PRECISIONS = ("auto", "float32", "bfloat16")


def resolve_precision(precision: str, device: torch.device) -> str:
    """``"auto"``: ``"bfloat16"`` where the device multiplies bfloat16 natively (a CUDA device that supports
    it; a CPU with AVX512-BF16 or AMX), else ``"float32"``; the others as they are (``"bfloat16"`` on a CPU
    without native bfloat16 products warns: it is slower there than float32)."""
    if device.type == "cuda":
        return precision if precision != "auto" else "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    native = any(getattr(torch.cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    if precision == "bfloat16" and device.type == "cpu" and not native:
        # PyTorch's fallback GEMM then multiplies bfloat16 (an AVX2 AMD EPYC, torch 2.13, two threads: a 1024 x 576
        # by 576 x 1536 product 150 ms against 36 ms in float32; SmolLM2's layer-wise healing 230 s a layer)
        warnings.warn("heal: precision='bfloat16' on a CPU without native bfloat16 products (AVX512-BF16 or AMX): the "
                      "matrix products run PyTorch's fallback, several times slower than float32; precision='auto' "
                      "picks float32 here", stacklevel=3)
    if precision != "auto":
        return precision
    return "bfloat16" if device.type == "cpu" and native else "float32"


def _autocast(device: torch.device, precision: str):
    """The context the training forwards run in: bfloat16 autocast for ``precision="bfloat16"`` (matrix
    products in bfloat16, reductions and the loss in float32), nothing for ``"float32"``. On a CPU with
    native bfloat16 products (AVX512-BF16 / AMX) a SmolLM2 step (4 x 256 tokens, forward and backward)
    took 10-11 s against 18-21 s in float32, one thread."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16")


@torch.enable_grad()
def distill(student, teacher, ids: torch.Tensor, params: list, steps: int, *, lr: float = 1e-4, batch_size: int = 4,
            seed: int = 0, warmup: float = 0.1, schedule: bool = True, shuffle: bool = True, lm_weight: float = 0.0,
            held_out: torch.Tensor | None = None, eval_every: int = 25, train_mode: bool = False, relative: bool = False,
            precision: str = "float32", every: int = 1, progress: bool = True,
            desc: str = "hf_tensorcomp: distillation", start: tuple[float, float] | None = None,
            held_out_cache: list | None = None) -> dict:
    """Train `params` of `student` toward `teacher`'s next-token distributions on the windows of `ids`.

    teacher: a model, or a function ``batch -> log-probabilities`` (e.g. the student with its dense
    modules swapped back in). Loss: KL(teacher ‖ student) per token, plus ``lm_weight`` x the student's
    language-model loss. Adam at ``lr`` (warm-up and cosine decay with ``schedule``, else constant; with
    ``relative``, steps relative to each entry's size, `RelativeSteps`); ``precision="bfloat16"``: the
    training forwards and backwards (teacher and student) under bfloat16 autocast (`_autocast`; the
    parameters, the optimizer and the held-out scoring stay float32); windows in a seeded shuffle
    (``shuffle``) or in order, ``batch_size`` per step; ``every``: the loss on every `every`-th position of a
    window (from its first), the head run on those alone (on a vocabulary of 262k the head costs more than
    the layers; the held-out scoring keeps every position). Every other parameter keeps its
    ``requires_grad``. With `held_out` (windows never trained on): scored before,
    every ``eval_every`` steps and at the end, and the best iterate (by `held_out_objective`) is what the
    student keeps (the start, bit for bit, if no step improved on it); ``start``: the held-out (kl, ppl) of the student as
    given, when the caller has scored it already (one pass over the held-out windows fewer); ``held_out_cache``:
    the teacher's hidden states of the held-out windows, kept between scorings (`held_out_loss`'s ``cache``).

    Returns {"losses": per step, "held_out": [(step, kl, ppl), ...] or [], "best_step": int or None}.
    """
    if not params:
        raise ValueError("distill: nothing to train (no parameters given)")
    flags = {p: p.requires_grad for p in student.parameters()}
    for p in student.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    steps_of = RelativeSteps(params) if relative else None
    opt = torch.optim.Adam(steps_of.delta if relative else params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, (lambda s: lr_schedule(s, steps, warmup)) if schedule else (lambda s: 1.0))
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    in_order = ids.split(batch_size)
    losses, scores = [], []
    best = best_step = best_value = None
    was_training = student.training
    device = next(student.parameters()).device

    def score(step, known=None):
        nonlocal best, best_step, best_value
        student.eval()
        kl, ppl = known or held_out_loss(student, teacher, held_out, batch_size, (s_loss, t_loss), cache)
        student.train(train_mode)
        scores.append((step, kl, ppl))
        value = held_out_objective(kl, ppl, lm_weight)
        if best_value is None or value < best_value:
            best, best_step, best_value = [p.detach().clone() for p in params], step, value

    s_loss, t_loss = LogitLoss(student, ids), LogitLoss(teacher, ids)
    cache = [] if held_out_cache is None else held_out_cache
    student.train(train_mode)
    try:
        if held_out is not None:
            score(0, start)
        bar = tqdm(range(steps), desc=desc, disable=not progress, unit="step")
        for step in bar:
            if shuffle:
                if len(order) < batch_size:
                    order += torch.randperm(ids.shape[0], generator=g).tolist()
                batch, order = ids[order[:batch_size]], order[batch_size:]
            else:
                batch = in_order[step % len(in_order)]
            batch = batch.to(device)
            scored = torch.arange(0, batch.shape[1], every, device=device)
            keep = None if every == 1 else scored
            with _autocast(device, precision):
                with torch.no_grad():
                    ht = t_loss.hidden(batch, keep).flatten(0, 1)
                hs = s_loss.hidden(batch, keep)
            targets = next_tokens(batch, scored)
            scale = (1 / ht.shape[0], lm_weight / max(1, int((targets != -100).sum())))

            def backward():  # the loss chunk by chunk into the hidden states, then the body's backward once
                leaf = hs.detach().flatten(0, 1).requires_grad_()
                kl, nll = chunked_losses(s_loss, t_loss, leaf, ht, targets, scale, backward=True, precision=precision)
                if hs.requires_grad:
                    hs.backward(leaf.grad.view_as(hs))
                return kl + nll

            loss = adam_step(opt, backward, steps_of)
            sched.step()
            losses.append(loss)
            if held_out is not None and ((step + 1) % eval_every == 0 or step + 1 == steps):
                score(step + 1)
            # the last held-out score beside the loss, so that a run stopped early still shows where it stood
            bar.set_postfix(loss=f"{losses[-1]:.4g}", **({"held_out_kl": f"{scores[-1][1]:.4g}",
                                                          "held_out_ppl": f"{scores[-1][2]:.4g}"} if scores else {}))
        if held_out is not None:
            with torch.no_grad():
                for p, b in zip(params, best):
                    p.copy_(b)
    finally:
        student.train(was_training)
        for p, flag in flags.items():
            p.requires_grad_(flag)
    return {"losses": losses, "held_out": scores, "best_step": best_step}


# ---------------------------------------------------------------------------------------- heal
HEAL_DEFAULTS = {"mode": "e2e", "steps": 100, "layer_steps": 50, "lr": 1e-3, "relative": True, "batch_size": 4,
                 "train": "auto", "lm_weight": 0.0, "held_out": 0.125, "eval_every": 25, "seed": 0, "samples": 256,
                 "length": 256, "gradient_checkpointing": False, "precision": "auto", "generated": 0, "generated_prompt": None,
                 "every": 1}
#: what each ``train`` setting trains (`trainable`)
TRAIN_PARTS = {"auto": {"factors", "norms"}, "factors": {"factors"}, "norms": {"norms"}, "scales": {"scales"},
               "all": {"factors", "norms", "scales"}, "full": {"factors", "norms", "scales", "dense"}}
TRAIN = tuple(TRAIN_PARTS)
MODES = ("e2e", "layerwise", "both")


def validate_heal(value):
    """The config's ``heal``: False / None (no healing), True (the defaults) or a dict of `HEAL_DEFAULTS` keys."""

    if value is None or value is False:
        return None
    if value is True:
        return dict(HEAL_DEFAULTS)
    if not isinstance(value, dict):
        fail("heal", value, f"False | True | a dict with keys {sorted(HEAL_DEFAULTS)}")
    unknown = sorted(set(value) - set(HEAL_DEFAULTS))
    if unknown:
        fail("heal", value, f"a dict with keys among {sorted(HEAL_DEFAULTS)} (unknown: {unknown})")
    o = {**HEAL_DEFAULTS, **value}
    if o["mode"] not in MODES:
        fail("heal.mode", o["mode"], " | ".join(map(repr, MODES)) + " (end to end on the logits, layer by layer on "
             "each decoder layer's output, or layer-wise then end to end)")
    for key, lo in (("steps", 1), ("layer_steps", 1), ("batch_size", 1), ("eval_every", 1), ("samples", 2), ("length", 2),
                    ("generated", 0), ("every", 1)):
        if not is_int(o[key], lo):
            fail(f"heal.{key}", o[key], f"an int >= {lo}")
    if not is_int(o["seed"]):
        fail("heal.seed", o["seed"], "an int")
    for key, lo, hi in (("lr", 0, 1), ("lm_weight", 0, 100), ("held_out", 0, 0.5)):
        if not is_number(o[key]) or not lo <= o[key] <= hi or (key == "held_out" and o[key] == 0):
            fail(f"heal.{key}", o[key], f"a number in {'(' if key == 'held_out' else '['}{lo}, {hi}]")
    gp = o["generated_prompt"]
    if gp is not None and not (is_int(gp, 0) and gp < o["length"]):  # up front: teacher_windows checks it only late
        fail("heal.generated_prompt", gp, f"None (each sample continues the first length // 8 tokens of a calibration "
             f"window) | an int in [0, {o['length'] - 1}] (that many; 0: from the teacher's start-of-text token alone)")
    if o["generated"] and o["mode"] == "layerwise":
        fail("heal.generated", o["generated"], "0 with mode='layerwise' (windows sampled from the teacher feed the "
             "end-to-end step: mode='e2e' or 'both')")
    if o["train"] not in TRAIN:
        fail("heal.train", o["train"], " | ".join(map(repr, TRAIN)))
    if o["precision"] not in PRECISIONS:
        fail("heal.precision", o["precision"], "'auto' (bfloat16 where the device multiplies it natively) | 'float32' | "
             "'bfloat16' (the training forwards under bfloat16 autocast; parameters, optimizer and held-out scoring stay "
             "float32)")
    for key in ("gradient_checkpointing", "relative"):
        if not isinstance(o[key], bool):
            fail(f"heal.{key}", o[key], "True | False")
    return o


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


def _teacher(model, teacher):
    from transformers import AutoModelForCausalLM

    if teacher is not None and not is_path(teacher):
        return teacher.eval()
    src = teacher or _source(model)
    if src is None:
        raise ValueError("heal: teacher=None, and the model does not record the dense model it was made from; allowed: "
                         "teacher=<the dense model or its path>")
    first = next(model.parameters())
    dense = AutoModelForCausalLM.from_pretrained(src, dtype=first.dtype)
    if first.device.type not in ("cpu", "meta"):  # the teacher beside the student (on its accelerator)
        dense.to(first.device)
    if getattr(dense.config, "quantization_config", None) is not None:
        raise ValueError(f"heal: the teacher loaded from {src!r} is itself compressed or quantized; allowed: "
                         "teacher=<the dense model or its path>")
    return dense.eval()


def _source(model):
    cfg = getattr(model.config, "quantization_config", None)
    st = getattr(cfg, "stats", None) or {}
    return st.get("source") or getattr(model, "name_or_path", None) or None


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
            flags = {p: p.requires_grad for p in layer.parameters()}
            try:
                for p in layer.parameters():
                    p.requires_grad_(False)
                for p in own:
                    p.requires_grad_(True)

                def loss_on(i, precision="float32"):
                    with _autocast(hc[i].device, precision):
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
            finally:
                for p, flag in flags.items():
                    p.requires_grad_(flag)
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
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), _autocast(device, precision):
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
    ids = calibration_ids(calibration, tok, o["samples"], o["length"], o["seed"])
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
    `HEAL_DEFAULTS` (``lr``, ``relative`` — steps relative to each entry's size,
    `RelativeSteps`, the default —, ``batch_size``, ``train``, ``lm_weight``,
    ``eval_every``, ``seed``, ``samples``, ``length``, ``gradient_checkpointing``, ``generated`` — windows
    sampled from the teacher added to the end-to-end step's (`teacher_windows`) —, ``generated_prompt`` — the
    calibration tokens each continues (None: ``length // 8``; 0: the teacher's start-of-text token alone) —, ``precision`` —
    ``"auto"`` (default: `resolve_precision`), ``"float32"``, or ``"bfloat16"``: the training forwards under
    bfloat16 autocast, 1.65x faster on a CPU with native bfloat16 products and healing as far (SmolLM2,
    `benchmarks/heal.py`); the held-out scoring that decides what is kept stays float32 —, ``every`` — the
    end-to-end loss on every `every`-th position only, the head run on those: for a large vocabulary, see
    `distill`).
    """
    o = validate_heal({**settings, **({"steps": steps} if steps is not None else {})})  # bad input: before any change
    calibration = validate_calibration(calibration)
    forms, report = TrainingForms(model), {}
    try:
        report = _heal(model, teacher, calibration, o, tokenizer=tokenizer, progress=progress, _config=_config)
        return report
    finally:  # each module back in its stored form; train="scales" | "all": the trained scales back into float16
        forms.close(keep=report.get("improved", False))
        for m in model.modules():
            if isinstance(m, FactorizedModule):
                m.train_scales(False)


def _heal(model, teacher, calibration, o: dict, *, tokenizer, progress, _config) -> dict:
    t0 = time.perf_counter()
    params = trainable(model, o["train"])
    if not params:
        raise ValueError(f"heal: train={o['train']!r} finds nothing to train in this model; allowed: {' | '.join(map(repr, TRAIN))}")
    held, train_ids = heal_windows(model, calibration, tokenizer, o)
    dense = _teacher(model, teacher)
    start = [p.detach().clone() for p in params]
    model.eval()
    o["precision"] = resolve_precision(o["precision"], next(model.parameters()).device)
    cache: list = []  # the dense model's hidden states of the held-out windows, computed once
    kl0, ppl0 = held_out_loss(model, dense, held, o["batch_size"], cache=cache)
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
            run = distill(model, dense, train_ids, params, o["steps"], lr=o["lr"], batch_size=o["batch_size"],
                          seed=o["seed"], lm_weight=o["lm_weight"], held_out=held, eval_every=o["eval_every"],
                          relative=o["relative"], precision=o["precision"], every=o["every"], progress=progress,
                          desc="hf_tensorcomp: healing", start=(kl0, ppl0) if o["mode"] == "e2e" else None,
                          held_out_cache=cache)
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
        kl1, ppl1 = held_out_loss(model, dense, held, o["batch_size"], cache=cache)
    objective = functools.partial(held_out_objective, lm_weight=o["lm_weight"])
    report["improved"] = objective(kl1, ppl1) < objective(kl0, ppl0)
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
    if teacher is None or is_path(teacher):
        del dense
    return report
