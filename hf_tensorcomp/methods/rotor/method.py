"""Rotor layers: Q / K / V projections composed from Clifford-algebra rotors, trained on real activations.

Pence et al., "Composing Linear Layers from Irreducibles". Each targeted projection is replaced by a
freshly initialised stand-in and trained by MSE to reproduce the dense projection's (pre-RoPE)
outputs on that projection's real input activations — nothing is derived from the weights, so the
method needs calibration data.

``structure`` picks the stand-in, so the paper's comparison is one option away:

- ``"rotor"``: `RotorLinear`, the rotor gadget (``chunk``, ``chunking``, ``depth``, ``width``, ``double``);
- ``"lr1"`` / ``"lr4"``: `LowRankLinear` of rank 1 / 4, both factors trained;
- ``"bh1"``: `BlockHadamardLinear`, block-diagonal (``blocks``) after a fixed Hadamard transform.

``init="closed_form"`` (default): LR and BH start from their least-squares fit on the calibration
inputs (whitened SVD; per-block least squares), so training can only improve on the closed form;
``init="random"``: the paper's seeded random start. Training keeps its best iterate (`fit`), so a
trained stand-in never ends worse than where it started.

Training (`hf_tensorcomp.training.fit`): Adam, one epoch, seeded shuffle, linear warm-up then cosine
decay per step; learning rate 0.05 and batch size 64 (the paper's rotor setting) for every structure,
so the comparison trains all of them alike (see `FIT_DEFAULTS`).

``retrain_o=True`` (the paper's protocol): after q/k/v of an attention block are replaced, its
o_proj is replaced by a *fresh* dense Linear (seeded init) trained for ``o_epochs`` epochs (the
paper: 15) by MSE to the dense block's output, on the calibration batches run through the block
with the new q/k/v (Adam at ``o_lr``, batch ``batch_size``, the same schedule). The new o_proj is a
plain ``nn.Linear`` (saved as dense weights); its parameters are reported in its stats, and
``attn_rel_mse_before`` / ``attn_rel_mse`` there give the block's relative output error with the
original and with the retrained o_proj. This needs the ``"attention"`` calibration statistic (the
block's calls), which the method asks for only when the option is on.

Calibration contract: the method declares ``needs(entry) == {"inputs"}``; ``compress`` reads
``ctx.stats[name].inputs`` (or ``ctx.stats[name]["inputs"]``), a float tensor (tokens x in_features)
of the module's real input activations, ``name`` as passed in ``modules`` (relative to the decoder
layer list, e.g. ``"12.self_attn.q_proj"``; the full module name is accepted too). Without stats it
raises, telling the user to set ``calibration=``.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ...decompositions.hadamard import hadamard_transform
from ...decompositions.svd import whitened_svd, whitening_factor
from ...layers import BlockHadamardLinear, LowRankLinear
from ...layers.block_hadamard import check_blocks
from ...layout import first_output
from ...training import fit, relative_mse
from ...validation import choices, fail, is_int, is_number
from ..base import Method, check_schedule_options, register_method
from .layer import CHUNKINGS, RotorLinear, check_layout, hidden_width

STRUCTURES = ("rotor", "lr1", "lr4", "bh1")
PROJECTIONS = ("q_proj", "k_proj", "v_proj")
#: (learning rate, batch size) per structure: the paper's rotor setting (its Table 5) for all. Its
#: LR / BH setting (0.01, 256) left them far from converged in one epoch of 16k SmolLM2 tokens
#: (LR1 relative MSE 0.99 against 0.21 at 0.05 / 64, its closed-form optimum); pass lr= / batch_size=
#: to use it.
INITS = ("closed_form", "random")
FIT_DEFAULTS = {"rotor": (0.05, 64), "lr1": (0.05, 64), "lr4": (0.05, 64), "bh1": (0.05, 64)}
LOSS_POINTS = 50  # the loss history kept in stats is thinned to about this many points


def build(structure: str, d_in: int, d_out: int, opts: dict, bias: torch.Tensor | None = None, device=None) -> nn.Module:
    """A freshly initialised (float32, seeded) stand-in for a d_out x d_in projection."""
    seed = opts["seed"]
    if structure == "rotor":
        return RotorLinear.create(d_in, d_out, seed=seed, bias_init=bias, device=device, chunk=opts["chunk"],
                                  chunking=opts["chunking"], depth=opts["depth"], width=opts["width"], double=opts["double"],
                                  iters=opts["iters"], grad_steps=opts["grad_steps"])
    if structure == "bh1":
        return BlockHadamardLinear.create(d_in, d_out, blocks=opts["blocks"], seed=seed, bias_init=bias, device=device)
    rank = int(structure[2:])
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(d_out, rank, generator=g) / rank**0.5
    v = torch.randn(rank, d_in, generator=g) / d_in**0.5
    return LowRankLinear.from_factors(u.to(device), v.to(device), bias, dtype=torch.float32)


@torch.no_grad()
def closed_form_start(new: nn.Module, dense: nn.Linear, x: torch.Tensor) -> None:
    """Put `new` at its least-squares fit of ``dense`` on the inputs `x` where one has a closed form: a
    `LowRankLinear` at the whitened truncated SVD (the best rank-r map for the output error on `x`), a
    `BlockHadamardLinear` at each block's least squares on the Hadamard-mixed inputs. A rotor has none
    and keeps its seeded start."""
    w = dense.weight.detach().float()
    if isinstance(new, LowRankLinear):
        u, v, _ = whitened_svd(w, new.rank, whitening_factor(x.T.double() @ x.double(), 1e-6))
        new.weight.copy_(torch.cat([v, u.T], dim=1).to(new.weight))
    elif isinstance(new, BlockHadamardLinear):
        h = torch.nn.functional.pad(x, (0, new.padded - new.in_features))
        h = hadamard_transform(h).view(-1, new.blocks, new.padded // new.blocks).double()
        y = (x @ w.T).view(-1, new.blocks, new.out_features // new.blocks).double()
        for b in range(new.blocks):
            new.weight[b].copy_(torch.linalg.lstsq(h[:, b], y[:, b]).solution.T.to(new.weight))


def num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@register_method
class Rotor(Method):
    name = "rotor"
    default_targets = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    default_rank = None
    layer_types = ("rotor", "lowrank", "block_hadamard")
    remedy = "another structure, more epochs, or another lr (a trained stand-in can fall short of zeros when training diverges)"
    option_defaults = {
        "structure": "rotor",
        # rotor gadget (the authors' released configuration)
        "chunk": None, "chunking": "wrap", "depth": 2, "width": 3, "double": True, "iters": 50, "grad_steps": 1,
        # block-Hadamard
        "blocks": 64,
        # training
        "lr": None, "batch_size": None, "epochs": 1, "warmup": 0.05, "seed": 0, "init": "closed_form",
        # the paper's retraining of a fresh dense o_proj after q/k/v are replaced (not part of the count there)
        "retrain_o": False, "o_epochs": 15, "o_lr": 1e-3,
    }

    def needs(self, entry) -> frozenset:
        """What the calibration pipeline must collect for this entry: each target's input activations."""
        return frozenset({"inputs", "attention"} if entry.options["retrain_o"] else {"inputs"})

    def validate_options(self, options):
        o = super().validate_options(options)
        if o["structure"] not in STRUCTURES:
            fail("structure", o["structure"], choices(STRUCTURES))
        if o["chunk"] is not None and not (is_int(o["chunk"], 4) and o["chunk"] & (o["chunk"] - 1) == 0):
            fail("chunk", o["chunk"], "None (automatic) or a power of two >= 4 (the rotor maps' hidden width)")
        if o["chunking"] not in CHUNKINGS:
            fail("chunking", o["chunking"], choices(CHUNKINGS))
        if not is_int(o["depth"], 0):
            fail("depth", o["depth"], "an int >= 0 (hidden rotor levels between the input and output maps)")
        if not is_int(o["width"], 1):
            fail("width", o["width"], "an int >= 1 (parallel rotor maps per hidden level)")
        if o["init"] not in INITS:
            fail("init", o["init"], choices(INITS) + " (closed_form: LR / BH start from their least-squares fit on the "
                 "calibration inputs; the rotor, which has none, from its seeded random init)")
        for flag in ("double", "retrain_o"):
            if not isinstance(o[flag], bool):
                fail(flag, o[flag], "True | False")
        for field in ("iters", "grad_steps", "epochs", "blocks", "o_epochs"):
            if not is_int(o[field], 1):
                fail(field, o[field], "an int >= 1")
        if o["lr"] is not None and (not is_number(o["lr"]) or not o["lr"] > 0):
            fail("lr", o["lr"], "None (the paper's per-structure default) or a number > 0")
        if not is_number(o["o_lr"]) or not o["o_lr"] > 0:
            fail("o_lr", o["o_lr"], "a number > 0 (Adam's rate for the retrained o_proj)")
        if o["batch_size"] is not None and not is_int(o["batch_size"], 1):
            fail("batch_size", o["batch_size"], "None (the paper's per-structure default) or an int >= 1")
        check_schedule_options(o)
        return o

    def validate_rank(self, rank, options):
        if rank is not None:
            fail("rank", rank, "None for rotor (the size is set by structure / chunk / depth / width)")
        return None

    def check_unit(self, modules, entry, ctx):
        if entry.mode == "dense":
            fail("mode", entry.mode, "'factorized' for method 'rotor' (rotor layers are not linear: LayerNorm and "
                 "PReLU sit between the rotor maps; and the baselines are compared as trained)")
        o = entry.options
        for name, lin in modules.items():
            leaf = name.rpartition(".")[2]
            if leaf not in PROJECTIONS or not isinstance(lin, nn.Linear):
                fail("targets", f"{ctx.prefix}.{name}", f"attention projections named {' | '.join(PROJECTIONS)}")
            d_in, d_out = lin.in_features, lin.out_features
            if o["structure"] == "rotor":
                check_layout(d_in, d_out, o["chunk"] or hidden_width(d_in, d_out, o["chunking"]), o["chunking"])
            elif o["structure"] == "bh1":
                check_blocks(d_in, d_out, o["blocks"])

    def _inputs(self, ctx, name: str) -> torch.Tensor:
        stats = getattr(ctx, "stats", None)
        if not stats:
            raise ValueError("method 'rotor' trains every replaced projection on that projection's real input "
                             "activations, and none were collected: set TensorCompressionConfig(calibration=...) "
                             "(e.g. calibration='wikipedia')")
        if name not in stats:
            raise ValueError(f"rotor: the calibration stats hold no entry for {ctx.prefix}.{name}; got entries for "
                             f"{sorted(stats)[:6]}{' ...' if len(stats) > 6 else ''}")
        x = getattr(stats[name], "inputs", None)
        if not isinstance(x, torch.Tensor) or x.ndim != 2:
            raise ValueError(f"rotor: ctx.stats[{name!r}].inputs must be a (tokens x in_features) tensor; got "
                             f"{type(x).__name__}{tuple(x.shape) if isinstance(x, torch.Tensor) else ''}")
        return x

    def compress(self, modules, entry, ctx):
        o = entry.options
        structure = o["structure"]
        lr_default, bs_default = FIT_DEFAULTS[structure]
        lr, batch_size = o["lr"] or lr_default, o["batch_size"] or bs_default
        progress = bool(getattr(ctx, "progress", False))
        out, replaced = {}, {}
        for name, lin in modules.items():
            x = self._inputs(ctx, name)
            dev = lin.weight.device
            x = x.to(device=dev, dtype=torch.float32)
            if x.shape[1] != lin.in_features:
                raise ValueError(f"rotor: calibration inputs for {name} are {tuple(x.shape)}, expected (tokens, {lin.in_features})")
            bias = lin.bias.detach().float() if lin.bias is not None else None
            new = build(structure, lin.in_features, lin.out_features, o, bias=bias, device=dev)
            if o["init"] == "closed_form":
                closed_form_start(new, lin, x)
            t0 = time.perf_counter()
            history = fit(new, lin, x, lr=lr, epochs=o["epochs"], batch_size=batch_size, seed=o["seed"],
                          warmup=o["warmup"], progress=progress, desc=f"rotor[{structure}] {name}")
            seconds = time.perf_counter() - t0
            rel = relative_mse(new, lin, x)
            new = new.to(lin.weight.dtype)
            stride = max(1, len(history) // LOSS_POINTS)
            replaced[name] = new
            out[name] = (new, {
                "structure": structure, "rel_error": round(rel**0.5, 6), "rel_mse": round(rel, 6),
                "params": num_parameters(new), "params_dense": lin.weight.numel() + (lin.bias.numel() if lin.bias is not None else 0),
                "tokens": x.shape[0], "steps": len(history), "lr": lr, "batch_size": batch_size,
                "train_seconds": round(seconds, 3),
                "loss": [round(v, 6) for v in history[::stride]] + ([round(history[-1], 6)] if (len(history) - 1) % stride else []),
            })
        if o["retrain_o"]:
            out.update(self._retrain_o(replaced, ctx, o, batch_size, progress))
        return out

    def _retrain_o(self, replaced: dict, ctx, o: dict, batch_size: int, progress: bool) -> dict:
        """A fresh dense o_proj per attention block of `replaced`, fitted to the block's dense output."""
        if getattr(ctx, "layers", None) is None:
            raise ValueError("rotor: retrain_o=True re-runs the attention blocks, and no decoder layers were passed "
                             "in the context (compress outside from_pretrained: set ctx.layers)")
        blocks: dict[str, dict] = {}
        for name, new in replaced.items():
            parent, _, leaf = name.rpartition(".")
            blocks.setdefault(parent, {})[leaf] = new
        out = {}
        for parent, news in blocks.items():
            calls = self._calls(ctx, parent, news)
            attn = ctx.layers.get_submodule(parent)
            old_o = attn.o_proj
            inputs, before = _rerun(attn, news, calls)
            targets = torch.cat([c[2].reshape(-1, c[2].shape[-1]) for c in calls]).float()
            g = torch.Generator().manual_seed(o["seed"])
            fresh = nn.Linear(old_o.in_features, old_o.out_features, bias=old_o.bias is not None, device=old_o.weight.device)
            with torch.no_grad():  # nn.Linear's default init, drawn from the seeded generator
                bound = 1 / old_o.in_features**0.5
                fresh.weight.copy_(torch.rand(fresh.weight.shape, generator=g) * 2 * bound - bound)
                if fresh.bias is not None:
                    fresh.bias.copy_(torch.rand(fresh.bias.shape, generator=g) * 2 * bound - bound)
            t0 = time.perf_counter()
            history = fit(fresh, None, inputs, targets=targets, lr=o["o_lr"], epochs=o["o_epochs"], batch_size=batch_size,
                          seed=o["seed"], warmup=o["warmup"], progress=progress, desc=f"rotor retrain {parent}.o_proj")
            seconds = time.perf_counter() - t0
            with torch.no_grad():
                after = (fresh(inputs) - targets).pow(2).sum().item() / targets.pow(2).sum().item()
            out[f"{parent}.o_proj"] = (fresh.to(old_o.weight.dtype), {
                "structure": "dense (retrained)", "rel_error": round(after**0.5, 6), "rel_mse": round(after, 6),
                "attn_rel_mse_before": round(before, 6), "attn_rel_mse": round(after, 6),
                "params": num_parameters(fresh), "params_dense": num_parameters(old_o), "tokens": inputs.shape[0],
                "epochs": o["o_epochs"], "steps": len(history), "lr": o["o_lr"], "batch_size": batch_size,
                "train_seconds": round(seconds, 3)})
        return out

    def _calls(self, ctx, parent: str, news: dict) -> list:
        for leaf in news:
            item = ctx.stats.get(f"{parent}.{leaf}")
            calls = item["attention"] if isinstance(item, dict) else getattr(item, "attention", None)
            if calls:
                return calls
        raise ValueError(f"rotor: retrain_o=True needs the calls of {ctx.prefix}.{parent} (calibration statistic "
                         "'attention'); the calibration stats hold none")


@torch.no_grad()
def _rerun(attn: nn.Module, news: dict, calls: list) -> tuple[torch.Tensor, float]:
    """Run the attention block on its recorded calls with the projections in `news` swapped in.
    Returns o_proj's inputs (tokens x in, float32) and the block's relative output MSE so."""
    old = {leaf: getattr(attn, leaf) for leaf in news}
    rows: list[torch.Tensor] = []
    hook = attn.o_proj.register_forward_hook(lambda m, a, out: rows.append(a[0].reshape(-1, a[0].shape[-1]).float()))
    num = den = 0.0
    try:
        for leaf, new in news.items():
            setattr(attn, leaf, new)
        for args, kwargs, dense_out in calls:
            got = first_output(attn(*args, **kwargs))
            num += (got.float() - dense_out.float()).pow(2).sum().item()
            den += dense_out.float().pow(2).sum().item()
    finally:
        hook.remove()
        for leaf, mod in old.items():
            setattr(attn, leaf, mod)
    return torch.cat(rows), num / den
