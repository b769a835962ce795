"""Fitting a stand-in module to a dense projection on real input activations (MSE, Adam).

`fit` is the training loop of the rotor method and of its LR / BH baselines, written against
tensors so it does not care where the activations came from (the calibration pipeline, a test).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm


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
    tokens in a seeded shuffle: the same seed, module and data give the same result. The module is
    left in eval mode. Returns the loss of every step.

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
            loss = F.mse_loss((out[0] if isinstance(out, tuple) else out).float(), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            history.append(loss.item())
            bar.update(1)
            if progress and s % 20 == 0:
                bar.set_postfix(loss=f"{history[-1]:.4g}")
    bar.close()
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
