"""The TRAWL / LASER papers' experiment: one layer at a time — decompose, evaluate, revert.

`layer_sweep` keeps one dense model in memory; for every (layer, option set, rank) it writes the
approximation into the model's own weights, evaluates, and puts the original weights back, so no
model is reloaded between points. Works for every method (the approximation is the one `mode="dense"`
would write).
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from .config import TensorCompressionConfig
from .layers import FactorizedModule
from .methods import get_method
from .pipeline import fixed_threads
from .plan import find_decoder_layers, model_context, plan


def apply_approximation(model: nn.Module, config: TensorCompressionConfig) -> tuple[Callable[[], None], dict]:
    """Write the config's approximation into the model's dense weights in place.

    Returns ``(restore, info)``: calling ``restore()`` puts the original weights back; ``info`` has
    the parameter count the factored form would have, the dense count it replaces, the relative
    errors, each module's full stats (as `compressed_modules` stats would hold them) and the compression time.
    """
    _, layer_list = find_decoder_layers(model)
    ctx = model_context(model)
    backups: list[tuple[torch.Tensor, torch.Tensor]] = []
    info = {"factored_params": 0, "dense_params": 0, "rel_errors": {}, "stats": {}, "seconds": 0.0}
    t0 = time.perf_counter()
    with torch.no_grad(), fixed_threads():
        for k, names in plan(model, config):
            entry = config.entries[k]
            mods = {n: layer_list.get_submodule(n) for n in names}
            info["dense_params"] += sum(m.weight.numel() for m in mods.values())
            for name, (new, st) in get_method(entry.method).compress(mods, entry, ctx).items():
                info["factored_params"] += sum(p.numel() for p in new.parameters(recurse=False))
                info["rel_errors"][name] = st["rel_error"]
                info["stats"][name] = st
                if name not in mods or not isinstance(new, FactorizedModule):
                    continue
                w = mods[name].weight
                backups.append((w, w.data.clone()))
                w.data.copy_(new.dense_weight().to(w.dtype))
    info["seconds"] = round(time.perf_counter() - t0, 3)

    def restore() -> None:
        with torch.no_grad():
            for w, original in backups:
                w.data.copy_(original)

    return restore, info


def layer_sweep(model: nn.Module, method: str, layers: list[int], ranks: list, evaluate: Callable[[nn.Module], dict],
                option_sets: list[dict] | None = None, targets: list[str] | None = None, progress: bool = True) -> list[dict]:
    """Evaluate ``method`` on each layer alone, for each option set and rank; the model is left unchanged.

    ``evaluate(model) -> dict`` of metrics (e.g. perplexity, accuracy). Returns one row per point plus a
    ``layer=None`` row with the unmodified model's metrics. Configs are validated before any work.
    """
    option_sets = option_sets or [{}]
    points = list(itertools.product(layers, option_sets, ranks))
    configs = [TensorCompressionConfig(method=method, rank=r, layers=[li], targets=targets, progress=False, **opts)
               for li, opts, r in points]
    for cfg in configs:  # every plan checked against the model before the first decomposition
        plan(model, cfg)
    rows = [{"layer": None, "rank": None, **evaluate(model)}]
    n = len(find_decoder_layers(model)[1])
    for (li, opts, r), cfg in tqdm(list(zip(points, configs)), desc="hf_tensorcomp: sweep", disable=not progress):
        restore, info = apply_approximation(model, cfg)
        try:
            metrics = evaluate(model)
        finally:
            restore()
        errs = list(info["rel_errors"].values())
        rows.append({"layer": li % n, "rank": r, **opts, "factored_params": info["factored_params"],
                     "dense_params": info["dense_params"], "mean_rel_error": round(sum(errs) / len(errs), 6),
                     "compress_s": info["seconds"], **metrics})
    return rows
