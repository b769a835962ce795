"""Linearize: softmax self-attention blocks replaced by Gated DeltaNet layers, distilled on real activations.

LoLCATs-style attention transfer (Zhang et al. 2024), with transformers' own Gated DeltaNet mixer
(`Qwen3_5GatedDeltaNet`, wrapped by `GatedDeltaNetAttention`) as the replacement. Per chosen layer:

1. the Gated DeltaNet is initialised from the block's q/k/v/o (`GatedDeltaNetAttention.from_attention`:
   as many key and value heads as query heads, each KV head repeated for the query heads sharing it,
   the attention's head dim for both, identity short convolution, out_proj = o_proj);
2. it is trained to reproduce the block's output (o_proj's output) from the block's real inputs on
   the calibration text: MSE, Adam at ``lr``, ``epochs`` passes over the calibration windows in a
   seeded shuffle, ``batch_size`` windows per step, linear warm-up and cosine decay. With
   ``propagate=True`` (the config's default) each layer is trained on the outputs of the already
   linearized layers before it.

Which layers: ``layers=[...]`` if given, else every ``every``-th layer counting from the first
(``every=3``: layers 2, 5, 8, ...; ``every=1``: all of them, the fully linear variant). The saved
checkpoint is the original model with those ``self_attn`` modules swapped; its config records each
layer's Gated DeltaNet layout (``compressed_modules``), so ``from_pretrained`` with hf_tensorcomp
imported rebuilds them. A short end-to-end distillation of the new layers (KL on the dense model's
logits) is a separate step: `hf_tensorcomp.hybrid.distill_logits`, run by ``hf-tensorcomp linearize``.

Calibration contract: ``needs(entry) == {"calls"}``: ``ctx.stats[name].calls`` holds, per calibration
batch, the block's (args, kwargs, output); the input is ``kwargs["hidden_states"]`` (or ``args[0]``).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ..layers import GatedDeltaNetAttention
from ..training import fit
from ..validation import fail, is_int, is_number
from .base import Method, check_schedule_options, register_method

LOSS_POINTS = 50  # the loss history kept in stats is thinned to about this many points


def head_layout(config, attn: nn.Module) -> tuple[int, int, int, int]:
    """(hidden, query heads, KV heads, head dim) of a softmax attention block, from the model's text config."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return hidden, heads, kv, head_dim


@register_method
class Linearize(Method):
    name = "linearize"
    default_targets = ("self_attn",)
    default_rank = None
    uses_rank = False
    target_types = (nn.Module,)
    layer_types = ("gated_deltanet",)
    remedy = "more calibration samples, more epochs or a smaller lr"
    option_defaults = {"every": 3, "epochs": 4, "lr": 1e-2, "batch_size": 4, "warmup": 0.05, "conv_kernel": 4, "seed": 0}

    def needs(self, entry) -> frozenset:
        return frozenset({"calls"})

    def validate_options(self, options):
        o = super().validate_options(options)
        for field in ("every", "epochs", "batch_size"):
            if not is_int(o[field], 1):
                fail(field, o[field], "an int >= 1")
        if not is_int(o["conv_kernel"], 1):
            fail("conv_kernel", o["conv_kernel"], "an int >= 1 (taps of the short convolution; Qwen3.5 uses 4)")
        if not is_number(o["lr"]) or not o["lr"] > 0:
            fail("lr", o["lr"], "a number > 0 (Adam's learning rate)")
        check_schedule_options(o)
        return o

    def validate_rank(self, rank, options):
        if rank is not None:
            fail("rank", rank, "None for linearize (the layout follows the attention's heads)")
        return None

    def units(self, entry, layers, n_layers):
        every = entry.options["every"]
        if entry.layers is None:
            layers = [i for i in layers if i % every == every - 1]
        return [[i] for i in layers]

    def check_unit(self, modules, entry, ctx):
        if entry.mode == "dense":
            fail("mode", entry.mode, "'factorized' for method 'linearize' (a Gated DeltaNet layer is not a linear map)")
        for name, attn in modules.items():
            if name.count(".") != 1:
                fail("targets", entry.targets, "['self_attn'] (whole attention blocks, directly under a decoder layer)")
            projs = {p: getattr(attn, p, None) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
            if not all(isinstance(p, nn.Linear) for p in projs.values()):
                fail("targets", f"{ctx.prefix}.{name}", "softmax attention blocks with q_proj / k_proj / v_proj / o_proj "
                     f"nn.Linear children (got a {type(attn).__name__})")
            if any(p.bias is not None for p in projs.values()):
                fail("targets", f"{ctx.prefix}.{name}", "attention blocks without projection biases (the Gated DeltaNet "
                     "input projection has none)")
            hidden, heads, kv, head_dim = head_layout(ctx.config, attn)
            if heads % kv or projs["q_proj"].out_features != heads * head_dim or projs["k_proj"].out_features != kv * head_dim:
                fail("targets", f"{ctx.prefix}.{name}", f"attention whose q/k projections have {heads} x {head_dim} / "
                     f"{kv} x {head_dim} rows as the config says")

    def compress(self, modules, entry, ctx):
        o = entry.options
        out = {}
        for name, attn in modules.items():
            calls = self._calls(ctx, name)
            hidden, heads, kv, head_dim = head_layout(ctx.config, attn)
            eps = getattr(ctx.config, "rms_norm_eps", 1e-6)
            layer_idx = int(name.split(".", 1)[0])
            new = GatedDeltaNetAttention.from_attention(attn, hidden, heads, kv, head_dim, layer_idx,
                                                        conv_kernel=o["conv_kernel"], norm_eps=eps, seed=o["seed"] + layer_idx)
            x = torch.cat([(c[1]["hidden_states"] if "hidden_states" in c[1] else c[0][0]) for c in calls]).float()
            y = torch.cat([c[2] for c in calls]).float()
            new = new.to(x.device)
            before = relative_mse(new, x, y)
            t0 = time.perf_counter()
            history = fit(new, None, x, targets=y, windows=True, epochs=o["epochs"], lr=o["lr"],
                          batch_size=o["batch_size"], warmup=o["warmup"], seed=o["seed"] + layer_idx)
            seconds = time.perf_counter() - t0
            rel = relative_mse(new, x, y)
            stride = max(1, len(history) // LOSS_POINTS)
            out[name] = (new.to(attn.o_proj.weight.dtype), {
                "rel_error": round(rel**0.5, 6), "rel_mse": round(rel, 6), "rel_mse_init": round(before, 6),
                "params": sum(p.numel() for p in new.parameters()),
                "params_dense": sum(p.numel() for p in attn.parameters()),
                "tokens": x.shape[0] * x.shape[1], "steps": len(history), "train_seconds": round(seconds, 3),
                "loss": [round(v, 6) for v in history[::stride]],
            })
        return out

    def _calls(self, ctx, name: str) -> list:
        stats = getattr(ctx, "stats", None) or {}
        item = stats.get(name) or stats.get(f"{ctx.prefix}.{name}")
        calls = getattr(item, "calls", None) if item is not None else None
        if not calls:
            raise ValueError("method 'linearize' trains each Gated DeltaNet layer on its attention block's real inputs "
                             f"and outputs, and none were collected for {ctx.prefix}.{name}: set "
                             "TensorCompressionConfig(calibration=...) (e.g. calibration='wikipedia')")
        return calls


@torch.no_grad()
def relative_mse(module: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 8) -> float:
    """||module(x) - y||² / ||y||² over all windows."""
    num = den = 0.0
    for i in range(0, x.shape[0], batch):
        got = module(x[i:i + batch])[0].float()
        num += (got - y[i:i + batch]).pow(2).sum().item()
        den += y[i:i + batch].pow(2).sum().item()
    return num / den
