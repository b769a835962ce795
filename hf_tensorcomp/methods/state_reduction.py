"""State reduction: prune key / query channels of Gated DeltaNet layers (a smaller recurrent state).

"The Key to State Reduction in Linear Attention: A Rank-based Perspective". Every
linear-attention mixer keeps ``keep * head_k_dim`` key channels per head (rounded half up); one index set per
head is shared by queries and keys (the mixer is invariant only under a joint transformation,
Prop. 3.1) and is applied to the q / k projection rows and the q / k channels of the short
convolution (axis-aligned selections commute with a depthwise convolution, Prop. 3.3). Values,
output projection, gates and norms are untouched (the Gated DeltaNet norms act on the value heads).
The mixer L2-normalises q and k over the channels it has and scales queries by
``head_k_dim ** -0.5`` of the q it gets, so both follow the pruned size by themselves. Scorers:
`hf_tensorcomp.decompositions.key_selection` (``"l1"``, ``"wanda"``, ``"grad"``, ``"drrqr"``,
``"rand"``, ``"pca"``).

Modules are found by structure, not class: a ``conv1d`` (``nn.Conv1d`` over [q | k | v] channels)
with ``head_k_dim`` / ``num_k_heads`` / ``key_dim`` attributes and one of three projection layouts:

- ``in_proj_qkv`` (Qwen3.5): rows [q | k | v], q and k head-major (head h: rows h·dk … h·dk+dk-1);
- ``in_proj_qkvz`` (Qwen3-Next): rows grouped per key head, [q_h | k_h | v_h | z_h] with v_h and z_h
  (num_v_heads / num_k_heads) · head_v_dim wide — q_h starts at h·width, k_h at h·width + dk;
- ``q_proj`` / ``k_proj`` (OLMo-Hybrid): separate projections, head-major.

The result is the model's own class with a smaller ``linear_key_head_dim`` in its config, so it
saves as, and reloads with, plain transformers (the quantizer drops itself: `Method.structural`).
All linear-attention layers are pruned alike (one key head dim in the config), so ``layers`` must
stay None.

Recovery (``recover_steps > 0``, the paper's App. A): LoRA (PEFT) on the pruned layers' q/k/v
projections plus the unfrozen short convolutions, trained to match the unpruned model's next-token
distribution (KL on the logits: knowledge distillation) on the calibration sequences; the LoRA
weights are merged back, so the output is still a plain model.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..decompositions import key_selection as ks
from ..training import DistillSettings, distill
from ..validation import choices, fail, is_int, is_number
from .base import Method, register_method

SCORERS = ("drrqr", "grad", "wanda", "l1", "rand", "pca")
LAYOUTS = (("qkvz", ("in_proj_qkvz",)), ("qkv", ("in_proj_qkv",)), ("separate", ("q_proj", "k_proj")))


def layout(m: nn.Module) -> str | None:
    """The projection layout of a Gated DeltaNet-like mixer, or None if `m` is not one."""
    if not isinstance(getattr(m, "conv1d", None), nn.Conv1d):
        return None
    if not all(is_int(getattr(m, a, None), 1) for a in ("head_k_dim", "num_k_heads", "key_dim")):
        return None
    for name, attrs in LAYOUTS:
        if all(isinstance(getattr(m, a, None), nn.Linear) for a in attrs):
            return name
    return None


def find_mixers(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if layout(m) is not None}


def qk_rows(m: nn.Module) -> tuple[tuple[str, torch.Tensor], tuple[str, torch.Tensor]]:
    """((q projection attribute, rows (heads, dk)), (k projection attribute, rows)) of a mixer."""
    nk, dk = m.num_k_heads, m.head_k_dim
    base = torch.arange(dk)
    kind = layout(m)
    if kind == "qkvz":
        width = m.in_proj_qkvz.out_features // nk
        starts = torch.arange(nk)[:, None] * width
        return ("in_proj_qkvz", starts + base), ("in_proj_qkvz", starts + dk + base)
    rows = torch.arange(nk * dk).view(nk, dk)
    if kind == "qkv":
        return ("in_proj_qkv", rows), ("in_proj_qkv", rows + nk * dk)
    return ("q_proj", rows), ("k_proj", rows)


def conv_channels(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The q and k channels (heads, dk) of the short convolution (its channels are [q | k | v])."""
    rows = torch.arange(m.key_dim).view(m.num_k_heads, m.head_k_dim)
    return rows, rows + m.key_dim


def qk_activations(m: nn.Module, x: torch.Tensor, post_conv: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys (tokens, heads, dk) the mixer computes from inputs x (batch, seq, hidden):
    after the causal short convolution and its activation, or (``post_conv=False``) its inputs."""
    out = []
    for (attr, rows), ch in zip(qk_rows(m), conv_channels(m)):
        lin = getattr(m, attr)
        r = rows.reshape(-1)
        y = F.linear(x.float(), lin.weight[r].float(), None if lin.bias is None else lin.bias[r].float())
        if post_conv:
            c = ch.reshape(-1)
            w = m.conv1d.weight[c].float()
            b = None if m.conv1d.bias is None else m.conv1d.bias[c].float()
            seq = y.shape[1]
            y = F.conv1d(y.transpose(1, 2), w, b, padding=w.shape[-1] - 1, groups=len(c))[..., :seq].transpose(1, 2)
            act = getattr(m, "activation", None)
            if act:
                from transformers.activations import ACT2FN

                y = ACT2FN[act](y)
        out.append(y.reshape(-1, m.num_k_heads, m.head_k_dim))
    return out[0], out[1]


def _take(t: torch.Tensor, rows: torch.Tensor, sel: list[torch.Tensor], energy: bool = False) -> torch.Tensor:
    """The rows of `t` for each head's selection: indices (a subset) or a matrix P (rows P @ t_h;
    ``energy``: (P ∘ P) @ t_h, the conv-filter adaptation of Prop. B.1)."""
    parts = []
    for h, s in enumerate(sel):
        th = t[rows[h]]
        if s.dtype == torch.long:
            parts.append(th[s])
        else:
            p = (s * s if energy else s).to(torch.float64)
            parts.append((p @ th.reshape(th.shape[0], -1).double()).reshape(-1, *th.shape[1:]).to(t.dtype))
    return torch.cat(parts)


def _linear_like(lin: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    new = nn.Linear(lin.in_features, weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        if bias is not None:
            new.bias.copy_(bias)
    new.weight.requires_grad_(lin.weight.requires_grad)
    return new


def prune(m: nn.Module, sel: list[torch.Tensor]) -> None:
    """Slice (or, for PCA matrices, project) the mixer's q / k channels in place, one selection per key head."""
    nk, dk = m.num_k_heads, m.head_k_dim
    k = sel[0].shape[0]
    kind = layout(m)
    (qa, qr), (ka, kr) = qk_rows(m)
    with torch.no_grad():
        for attr in dict.fromkeys((qa, ka)):
            lin = getattr(m, attr)
            w, b = lin.weight, lin.bias
            if kind == "separate":
                rows = qr if attr == qa else kr
                new_w, new_b = _take(w, rows, sel), None if b is None else _take(b, rows, sel)
            elif kind == "qkv":
                def build(t):
                    return torch.cat([_take(t, qr, sel), _take(t, kr, sel), t[2 * nk * dk:]])
                new_w, new_b = build(w), None if b is None else build(b)
            else:  # qkvz: per key head [q_h | k_h | v_h | z_h]
                width = lin.out_features // nk

                def build(t):
                    parts = []
                    for h in range(nk):
                        parts += [_take(t, qr[h:h + 1], sel[h:h + 1]), _take(t, kr[h:h + 1], sel[h:h + 1]),
                                  t[h * width + 2 * dk:(h + 1) * width]]
                    return torch.cat(parts)
                new_w, new_b = build(w), None if b is None else build(b)
            setattr(m, attr, _linear_like(lin, new_w, new_b))
        conv = m.conv1d
        qc, kc = conv_channels(m)

        def build_conv(t):
            return torch.cat([_take(t, qc, sel, energy=True), _take(t, kc, sel, energy=True), t[2 * nk * dk:]])
        w = build_conv(conv.weight)
        new = nn.Conv1d(w.shape[0], w.shape[0], conv.kernel_size, groups=w.shape[0], padding=conv.padding,
                        bias=conv.bias is not None, device=w.device, dtype=w.dtype)
        new.weight.copy_(w)
        if conv.bias is not None:
            new.bias.copy_(build_conv(conv.bias))
        m.conv1d = new
    m.head_k_dim, m.key_dim = k, nk * k
    if hasattr(m, "conv_dim"):
        m.conv_dim = new.out_channels


def _qk_weights(m: nn.Module, grads: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W_Q, W_K (heads, dk, in) of the mixer (or, with `grads` {param name: tensor}, those rows of the gradients)."""
    out = []
    for attr, rows in qk_rows(m):
        w = getattr(m, attr).weight if grads is None else grads[f"{attr}.weight"]
        out.append(w[rows].float())
    return out[0], out[1]


def _selection_error(m: nn.Module, sel: list[torch.Tensor]) -> float:
    """‖W − SᵀS W‖ / ‖W‖ over the q/k rows: the share of the q/k weights the selection (S) drops."""
    wq, wk = _qk_weights(m)
    w = torch.cat([wq, wk], -1).detach().double()
    num = den = 0.0
    for h, s in enumerate(sel):
        p = torch.eye(m.head_k_dim, dtype=torch.float64, device=w.device)[s.to(w.device)] if s.dtype == torch.long else s.double().to(w.device)
        num += float((w[h] - p.T @ (p @ w[h])).pow(2).sum())
        den += float(w[h].pow(2).sum())
    return (num / den) ** 0.5 if den > 0 else 0.0


@register_method
class StateReduction(Method):
    name = "state_reduction"
    default_targets = ("*",)
    uses_rank = False
    structural = True
    target_types = (nn.Module,)
    layer_types = ()
    remedy = "a larger keep, or scorer='drrqr' / 'grad'"
    option_defaults = {"scorer": "drrqr", "keep": 0.5, "seed": 0, "samples": 2048, "f": 1.5,
                       "recover_steps": 0, "lora_rank": 8, "recover_lr": 1e-4, "recover_batch_size": 2}
    no_target_error = ("TensorCompressionConfig.method: got 'state_reduction' but the model has no linear-attention "
                       "(Gated DeltaNet) layer; allowed: a model whose decoder layers hold Gated DeltaNet mixers "
                       "(a conv1d with in_proj_qkv, in_proj_qkvz or q_proj/k_proj: Qwen3.5, Qwen3-Next, OLMo-Hybrid)")

    def is_target(self, module):
        return layout(module) is not None

    def validate_options(self, options):
        o = super().validate_options(options)
        if o["scorer"] not in SCORERS:
            fail("scorer", o["scorer"], choices(SCORERS))
        keep = o["keep"]
        if not is_number(keep) or not 0 < keep <= 1:
            fail("keep", keep, "a float in (0, 1]: the fraction of each head's key channels kept")
        o["keep"] = float(keep)
        for key, lo in (("seed", None), ("samples", 1), ("recover_steps", 0), ("lora_rank", 1), ("recover_batch_size", 1)):
            if not is_int(o[key], lo):
                fail(key, o[key], "an int" + ("" if lo is None else f" >= {lo}"))
        for key, lo in (("f", 1.0), ("recover_lr", 0.0)):
            if not is_number(o[key]) or not o[key] > lo:
                fail(key, o[key], f"a number > {lo}")
        return o

    def needs(self, entry):
        kinds = {"drrqr": {"sequences"}, "pca": {"sequences"}, "wanda": {"sequences"}, "grad": {"weight_grad"}}
        need = kinds.get(entry.options["scorer"], set())
        if entry.options["recover_steps"] and not need:
            need = {"sequences"}  # recovery trains on the calibration sequences: ask for them
        return frozenset(need)

    @staticmethod
    def kept(entry, head_k_dim: int) -> int:
        return int(entry.options["keep"] * head_k_dim + 0.5)  # rounded half up

    def check_unit(self, modules, entry, ctx):
        if entry.layers is not None:
            fail("layers", entry.layers, "None: state_reduction prunes every linear-attention layer alike (the config "
                 "holds one key head dim)")
        for name, m in modules.items():
            if self.kept(entry, m.head_k_dim) < 1:
                fail("keep", entry.options["keep"], f"a float in [{0.5 / m.head_k_dim:.4g}, 1]: {ctx.prefix}.{name} has "
                     f"{m.head_k_dim} key channels per head and keep={entry.options['keep']} leaves none")

    def select(self, m, k, entry, st, seed) -> tuple[list[torch.Tensor], dict]:
        o = entry.options
        scorer = o["scorer"]
        gen = torch.Generator().manual_seed(seed)
        if scorer in ("drrqr", "pca", "wanda", "grad") and st is None:
            fail("calibration", None, f"calibration text for scorer={scorer!r} (e.g. calibration='wikipedia')")
        if scorer == "rand":
            return ks.random_subsets(m.num_k_heads, m.head_k_dim, k, gen), {}
        if scorer == "l1":
            return ks.top_k(ks.l1_scores(*_qk_weights(m)), k), {}
        if scorer == "grad":
            return ks.top_k(ks.grad_scores(*_qk_weights(m), *_qk_weights(m, st.weight_grad)), k), {}
        seqs = st.sequences
        if scorer == "wanda":
            x_norm = torch.stack([x.reshape(-1, x.shape[-1]).double().pow(2).sum(0) for x in seqs]).sum(0).sqrt()
            return ks.top_k(ks.wanda_scores(*[w.double() for w in _qk_weights(m)], x_norm), k), {}
        with torch.no_grad():
            acts = [qk_activations(m, x, post_conv=scorer == "drrqr") for x in seqs]
        q, key = torch.cat([a[0] for a in acts]), torch.cat([a[1] for a in acts])
        if scorer == "pca":
            return ks.pca_projections(key, k), {}
        rows = 2 * min(o["samples"], q.shape[0])  # DRRQR picks k columns of [Q; K] sampled to `samples` tokens each
        if rows < k:
            if o["samples"] < q.shape[0]:
                fail("samples", o["samples"], f"at least {-(-k // 2)}: DRRQR keeps {k} key channels per head and needs "
                     f"that many rows of [Q; K] (2 x samples)")
            fail("calibration", f"{q.shape[0]} tokens", f"at least {-(-k // 2)} calibration tokens for DRRQR to keep "
                 f"{k} key channels per head (more calibration_samples or a longer calibration_length)")
        sel, swaps = ks.drrqr_subsets(q, key, k, o["samples"], o["f"], gen)
        return sel, {"rrqr_swaps": swaps}

    def compress(self, modules, entry, ctx):
        out = {}
        for name, m in modules.items():
            dk = m.head_k_dim
            k = self.kept(entry, dk)
            if k == dk:  # keep=1.0: nothing to drop, the module is left exactly as it is
                out[name] = (m, {"rel_error": 0.0, "head_k_dim": [dk, dk]})
                continue
            st = (ctx.stats or {}).get(name)
            sel, extra = self.select(m, k, entry, st, entry.options["seed"] + int(name.split(".")[0]))
            if entry.options["recover_steps"]:
                m.__dict__["_state_reduction_dense"] = copy.deepcopy(m)  # the teacher (not a submodule: never saved)
            err = _selection_error(m, sel)
            prune(m, sel)
            for cfg in (ctx.config, getattr(m, "config", None)):
                if cfg is not None and hasattr(cfg, "linear_key_head_dim"):
                    cfg.linear_key_head_dim = k
            kept = {"kept": [s.tolist() for s in sel]} if sel[0].dtype == torch.long else {}
            out[name] = (m, {"rel_error": round(err, 6), "scorer": entry.options["scorer"], "head_k_dim": [dk, k],
                             **extra, **kept})
        return out

    def finish(self, model, entry, ctx, runner):
        pairs = {n: m.__dict__.pop("_state_reduction_dense") for n, m in model.named_modules()
                 if "_state_reduction_dense" in m.__dict__}
        if not entry.options["recover_steps"] or not pairs:
            return None
        return recover(model, pairs, runner.ids, entry.options)


def _swap(model: nn.Module, modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
    old = {}
    for name, new in modules.items():
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        old[name] = getattr(owner, child)
        setattr(owner, child, new)
    return old


@torch.enable_grad()  # from_pretrained may run under torch.no_grad()
def recover(model: nn.Module, dense: dict[str, nn.Module], ids: torch.Tensor, o: dict) -> dict:
    """LoRA + distillation on the pruned mixers' q/k/v projections (and their convolutions); merged back."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    names = []
    for n in dense:
        m = model.get_submodule(n)
        names += [f"{n}.{a}" for a in ("in_proj_qkv", "in_proj_qkvz", "q_proj", "k_proj", "v_proj")
                  if isinstance(getattr(m, a, None), nn.Linear)]
    flags = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    for p, _ in flags:
        p.requires_grad_(False)
    torch.manual_seed(o["seed"])
    inject_adapter_in_model(LoraConfig(r=o["lora_rank"], lora_alpha=2 * o["lora_rank"], lora_dropout=0.0,
                                       target_modules=names), model)
    convs = [model.get_submodule(n).conv1d.weight for n in dense]
    params = [p for n, p in model.named_parameters() if "lora_" in n] + convs
    for p in params:
        p.requires_grad_(True)

    def teacher(batch):  # the dense mixers swapped back in for the teacher's forward
        pruned = _swap(model, dense)
        try:
            return F.log_softmax(model(input_ids=batch, use_cache=False).logits.float(), -1)
        finally:
            _swap(model, pruned)

    try:
        settings = DistillSettings(o["recover_steps"], lr=o["recover_lr"], batch_size=o["recover_batch_size"],
                                   schedule=False, shuffle=False, train_mode=True, progress=False)
        losses = distill(model, teacher, ids, params, settings)["losses"]
    finally:
        for name, mod in list(model.named_modules()):
            if isinstance(mod, LoraLayer):
                mod.merge()
                _swap(model, {name: mod.get_base_layer()})
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(was_training)
    k = max(1, len(losses) // 10)
    return {"recovery": {"steps": len(losses), "lora_rank": o["lora_rank"], "lr": o["recover_lr"],
                         "kl_first": round(sum(losses[:k]) / k, 6), "kl_last": round(sum(losses[-k:]) / k, 6)}}
