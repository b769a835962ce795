"""Training primitives: every trainer of the library, apart from what uses them.

- `fit`: one module trained to reproduce a dense one on real inputs (MSE, Adam): the rotor method and
  its LR / BH baselines, linearize's layer-wise attention transfer.
- `distill` (its settings: `DistillSettings`): a model trained toward a teacher's next-token distributions
  (KL, plus an optional language-model loss), only the parameters given, with a held-out slice scored
  before, during and after and the best iterate kept: `hf_tensorcomp.heal`, linearize's end-to-end step
  (`hybrid.distill_logits`) and state reduction's LoRA recovery.
- what they share: the learning-rate schedule (`lr_schedule`), the chunked loss on the logits (`LogitLoss`,
  `chunked_losses`), the held-out scoring (`held_out_loss`, `held_out_objective`), steps relative to each
  entry's size (`RelativeSteps`, `adam_step`), and the training precision (`resolve_precision`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from . import distributed
from .layout import first_output


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
        with precision_autocast(hs.device, precision):
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
                  split: tuple[LogitLoss, LogitLoss] | None = None, cache: list | None = None,
                  group=None) -> tuple[float, float]:
    """(mean KL to the teacher per token, the student's perplexity) on the windows of `ids`; `split`: the two
    models' `LogitLoss` when the caller has them (`distill` scores many times: the split is checked once);
    `cache`: a list the teacher's final hidden states of `ids` are kept in (filled on the first call, read on
    the next with the same `ids` and `batch_size`: the teacher does not change, so each scoring after the first runs the teacher's head alone —
    where the teacher is split; a teacher read whole, whose cache would be logits, is run again); `group`
    (`hf_tensorcomp.distributed`): this rank scores batches ``rank, rank + world, ...``, the sums added over the ranks."""
    s_loss, t_loss = split or (LogitLoss(student, ids), LogitLoss(teacher, ids))
    kl = nll = 0.0
    every = torch.arange(ids.shape[1])
    keep = cache is not None and t_loss.split is not None
    batches = ids.split(batch_size)
    if group is not None:
        batches = group.deal(batches)
    for i, batch in enumerate(batches):
        if keep and len(cache) <= i:
            cache.append(t_loss.hidden(batch).flatten(0, 1))
        hs, ht = s_loss.hidden(batch).flatten(0, 1), cache[i] if keep else t_loss.hidden(batch).flatten(0, 1)
        k, n = chunked_losses(s_loss, t_loss, hs, ht, next_tokens(batch, every), elements=4 * CHUNK_ELEMENTS)
        kl, nll = kl + k, nll + n
    if group is not None:
        kl, nll = distributed.sum_floats(group, [kl, nll], "healing (the held-out loss)")
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


def adam_step(opt: torch.optim.Optimizer, loss, relative: RelativeSteps | None = None, sync=None) -> float:
    """One optimizer step on `loss` (through `relative`'s δ when given): a scalar tensor, or a function that runs
    the backward itself and returns the loss. `sync(loss)`: called after the backward (data-parallel: sums the
    gradients over the ranks), returns the loss to report. Returns the loss."""
    opt.zero_grad(set_to_none=True)
    if isinstance(loss, torch.Tensor):
        loss.backward()
        loss = loss.item()
    else:
        loss = loss()
    if sync is not None:
        loss = sync(loss)
    if relative is not None:
        relative.grads()
    opt.step()
    if relative is not None:
        relative.apply()
    return loss


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


def precision_autocast(device: torch.device, precision: str):
    """The context the training forwards run in: bfloat16 autocast for ``precision="bfloat16"`` (matrix
    products in bfloat16, reductions and the loss in float32), nothing for ``"float32"``. On a CPU with
    native bfloat16 products (AVX512-BF16 / AMX) a SmolLM2 step (4 x 256 tokens, forward and backward)
    took 10-11 s against 18-21 s in float32, one thread."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16")


@contextlib.contextmanager
def only_training(module: nn.Module, params: list):
    """Within: `params` require gradients and every other parameter of `module` does not; after, each
    parameter's ``requires_grad`` as it was."""
    flags = {p: p.requires_grad for p in module.parameters()}
    try:
        for p in module.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        yield
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)


@dataclass(frozen=True)
class DistillSettings:
    """How `distill` trains: ``steps`` optimizer steps of Adam at ``lr`` (warm-up over the first ``warmup``
    fraction and cosine decay with ``schedule``, else constant; with ``relative``, steps relative to each
    entry's size, `RelativeSteps`), ``batch_size`` windows a step, in a shuffle seeded by ``seed``
    (``shuffle``) or in order; loss: KL(teacher ‖ student) per token + ``lm_weight`` x the student's
    language-model loss, on every `every`-th position of a window (from its first; the head run on those
    alone — on a vocabulary of 262k the head costs more than the layers; the held-out scoring keeps every
    position); ``precision="bfloat16"``: the training forwards and backwards (teacher and student) under
    bfloat16 autocast (`precision_autocast`; the parameters, the optimizer and the held-out scoring stay
    float32); held-out windows scored every ``eval_every`` steps; the student in training mode
    (``train_mode``, e.g. for dropout) while it trains; a progress bar (``progress``) titled ``desc``."""

    steps: int
    lr: float = 1e-4
    batch_size: int = 4
    seed: int = 0
    warmup: float = 0.1
    schedule: bool = True
    shuffle: bool = True
    lm_weight: float = 0.0
    eval_every: int = 25
    train_mode: bool = False
    relative: bool = False
    precision: str = "float32"
    every: int = 1
    progress: bool = True
    desc: str = "hf_tensorcomp: distillation"


class _HeldOutScores:
    """`distill`'s held-out scoring: (step, kl, ppl) of each scoring and the best iterate so far, by
    `held_out_objective`; `restore` puts the best one back into the parameters."""

    def __init__(self, student, teacher, held_out: torch.Tensor | None, params: list, settings: DistillSettings,
                 losses: tuple[LogitLoss, LogitLoss], cache: list, group=None):
        self.student, self.teacher, self.held_out, self.params, self.settings = student, teacher, held_out, params, settings
        self.losses, self.cache, self.group = losses, cache, group
        self.scores: list[tuple[int, float, float]] = []
        self.best = self.best_step = self.best_value = None

    def score(self, step: int, known: tuple[float, float] | None = None) -> None:
        s = self.settings
        self.student.eval()
        kl, ppl = known or held_out_loss(self.student, self.teacher, self.held_out, s.batch_size, self.losses, self.cache,
                                         self.group)
        self.student.train(s.train_mode)
        self.scores.append((step, kl, ppl))
        value = held_out_objective(kl, ppl, s.lm_weight)
        if self.best_value is None or value < self.best_value:
            self.best, self.best_step, self.best_value = [p.detach().clone() for p in self.params], step, value

    @torch.no_grad()
    def restore(self) -> None:
        for p, b in zip(self.params, self.best):
            p.copy_(b)


def _batches(ids: torch.Tensor, settings: DistillSettings, device: torch.device):
    """`distill`'s batch of each step, on `device`: ``batch_size`` windows of `ids` in a seeded shuffle
    (reshuffled whenever fewer than a batch are left), or with ``shuffle=False`` in order, cycled."""
    s = settings
    g = torch.Generator().manual_seed(s.seed)
    order: list[int] = []
    in_order = ids.split(s.batch_size)
    for step in range(s.steps):
        if s.shuffle:
            if len(order) < s.batch_size:
                order += torch.randperm(ids.shape[0], generator=g).tolist()
            batch, order = ids[order[:s.batch_size]], order[s.batch_size:]
        else:
            batch = in_order[step % len(in_order)]
        yield batch.to(device)


def _step_loss(s_loss: LogitLoss, t_loss: LogitLoss, batch: torch.Tensor, settings: DistillSettings,
               rows: slice | None = None):
    """One `distill` step's loss on `batch`, as a function for `adam_step`: both models' forwards here (the
    teacher's without gradients), the loss chunk by chunk into the student's final hidden states and the
    body's backward once when called; it returns the loss. `rows`: this rank's windows of the (global) batch,
    the loss still scaled by the whole batch's counts (data-parallel: the ranks' gradients add up to the batch's)."""
    s, device = settings, batch.device
    scored = torch.arange(0, batch.shape[1], s.every, device=device)
    keep = None if s.every == 1 else scored
    targets = next_tokens(batch, scored)
    scale = (1 / (batch.shape[0] * len(scored)), s.lm_weight / max(1, int((targets != -100).sum())))
    if rows is not None:
        batch, targets = batch[rows], targets.view(batch.shape[0], len(scored))[rows].flatten()
    with precision_autocast(device, s.precision):
        with torch.no_grad():
            ht = t_loss.hidden(batch, keep).flatten(0, 1)
        hs = s_loss.hidden(batch, keep)

    def backward() -> float:
        leaf = hs.detach().flatten(0, 1).requires_grad_()
        kl, nll = chunked_losses(s_loss, t_loss, leaf, ht, targets, scale, backward=True, precision=s.precision)
        if hs.requires_grad:
            hs.backward(leaf.grad.view_as(hs))
        return kl + nll

    return backward


def _sync(group, params: list, loss: float) -> float:
    """Data-parallel: the gradients of `params` and the step's loss summed over the ranks."""
    distributed.all_reduce_grads(group, params)
    return distributed.sum_floats(group, [loss], "healing (the step's loss)")[0]


@torch.enable_grad()
def distill(student, teacher, ids: torch.Tensor, params: list, settings: DistillSettings, *,
            held_out: torch.Tensor | None = None, start: tuple[float, float] | None = None,
            held_out_cache: list | None = None, group=None) -> dict:
    """Train `params` of `student` toward `teacher`'s next-token distributions on the windows of `ids`, as
    `settings` (`DistillSettings`) say.

    teacher: a model, or a function ``batch -> log-probabilities`` (e.g. the student with its dense
    modules swapped back in). Every other parameter keeps its ``requires_grad``. With `held_out` (windows
    never trained on): scored before, every ``eval_every`` steps and at the end, and the best iterate (by
    `held_out_objective`) is what the student keeps (the start, bit for bit, if no step improved on it);
    ``start``: the held-out (kl, ppl) of the student as given, when the caller has scored it already (one
    pass over the held-out windows fewer); ``held_out_cache``: the teacher's hidden states of the held-out
    windows, kept between scorings (`held_out_loss`'s ``cache``); ``group`` (`hf_tensorcomp.distributed`, the same
    call on every rank): data-parallel — each step's batch split over the ranks, the gradients and losses summed,
    the held-out windows shared out (every rank then takes the same steps).

    Returns {"losses": per step, "held_out": [(step, kl, ppl), ...] or [], "best_step": int or None}.
    """
    s = settings
    if not params:
        raise ValueError("distill: nothing to train (no parameters given)")
    if group is not None and min(s.batch_size, ids.shape[0]) < group.world:
        raise ValueError(f"heal: batch_size={s.batch_size} windows a step ({ids.shape[0]} to train on) for {group.world} "
                         f"processes; allowed: a batch of at least one window per process (batch_size >= {group.world})")
    sync = None if group is None else functools.partial(_sync, group, params)
    with only_training(student, params):
        steps_of = RelativeSteps(params) if s.relative else None
        opt = torch.optim.Adam(steps_of.delta if s.relative else params, lr=s.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, (lambda step: lr_schedule(step, s.steps, s.warmup)) if s.schedule else (lambda step: 1.0))
        losses: list[float] = []
        was_training = student.training
        device = next(student.parameters()).device
        s_loss, t_loss = LogitLoss(student, ids), LogitLoss(teacher, ids)
        held = _HeldOutScores(student, teacher, held_out, params, s, (s_loss, t_loss),
                              [] if held_out_cache is None else held_out_cache, group)
        student.train(s.train_mode)
        try:
            if held_out is not None:
                held.score(0, start)
            bar = tqdm(_batches(ids, s, device), total=s.steps, desc=s.desc, disable=not s.progress, unit="step")
            for step, batch in enumerate(bar):
                rows = None if group is None else distributed.share(group, batch.shape[0])
                losses.append(adam_step(opt, _step_loss(s_loss, t_loss, batch, s, rows), steps_of, sync))
                sched.step()
                if held_out is not None and ((step + 1) % s.eval_every == 0 or step + 1 == s.steps):
                    held.score(step + 1)
                # the last held-out score beside the loss, so that a run stopped early still shows where it stood
                last = held.scores[-1] if held.scores else None
                bar.set_postfix(loss=f"{losses[-1]:.4g}", **({"held_out_kl": f"{last[1]:.4g}",
                                                              "held_out_ppl": f"{last[2]:.4g}"} if last else {}))
            if held_out is not None:
                held.restore()
        finally:
            student.train(was_training)
    return {"losses": losses, "held_out": held.scores, "best_step": held.best_step}
