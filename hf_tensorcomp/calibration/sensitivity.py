"""How much the loss cares about each module's output: the mean squared gradient (diagonal Fisher).

One forward and backward pass of the dense model over the calibration batch, language-modelling
loss, no weight gradients kept. For module m with outputs y, ``f_m[j] = mean over tokens of
(∂L/∂y_j)²``; to second order, an output error ΔY costs about ½ Σ_j f_m[j] ‖ΔY_j‖² of loss (the
Fisher approximation of the Hessian, diagonal over output channels). That puts the truncation losses
of different matrices in one unit, the loss, so a global budget can trade them against each other.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..layout import first_output


def output_fisher(model: nn.Module, layer_list: nn.ModuleList, names: list[str], ids: torch.Tensor,
                  prefix: str = "layers", batch_size: int = 2,
                  extra: dict[str, nn.Module] | None = None, group=None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``({name: f_m}, fallback)``: float64 vectors over output channels for modules named relative to
    the decoder-layer list (``"3.mlp.down_proj"``), and the full names of the modules that fell back.
    `extra`: more modules, outside the decoder layers (the output head), under the names given.

    Fallback: a module whose outputs get no gradient at all on this data (its output does not reach
    the loss, e.g. behind a zeroed projection) would weigh every error by zero and divide by zero in
    the allocation; it gets the mean Fisher of the other modules on every channel instead (its error
    counts like an average module's), with a warning. If no module gets a gradient: a ValueError.
    `group` (`hf_tensorcomp.distributed`): this rank runs batches ``rank, rank + world, ...``, the squared
    gradients and counts summed over the ranks. The pass multiplies in bfloat16 where the device does so natively
    (a third less time on an AVX512-BF16 CPU; the Fisher only weighs errors against each other).
    """
    modules = {n: layer_list.get_submodule(n) for n in names} | dict(extra or {})
    names = list(modules)
    acc = {n: 0.0 for n in names}
    count = {n: 0 for n in names}
    handles = []

    def hook_for(name):
        def hook(module, args, out):
            if out.requires_grad:
                def grad_hook(g):
                    g = g.detach().reshape(-1, g.shape[-1])
                    acc[name] = acc[name] + g.double().pow(2).sum(0).cpu()
                    count[name] += g.shape[0]
                out.register_hook(grad_hook)
        return hook

    for n in names:
        handles.append(modules[n].register_forward_hook(hook_for(n)))
    emb = model.get_input_embeddings()
    handles.append(emb.register_forward_hook(lambda m, a, out: out.requires_grad_(True)))
    try:
        _loss_backward(model, _mine(ids, batch_size, group), batch_size, fast=True)
    finally:
        for h in handles:
            h.remove()
    if group is not None:
        for n in names:
            got = acc[n] if isinstance(acc[n], torch.Tensor) else torch.zeros(modules[n].weight.shape[0], dtype=torch.float64)
            acc[n] = group.sum_(got, "the Fisher pass")
        counts = group.sum_(torch.tensor([count[n] for n in names], dtype=torch.int64), "the Fisher pass")
        count = dict(zip(names, counts.tolist()))
    fisher = {n: acc[n] / count[n] for n in names if count[n] and bool((acc[n] > 0).any())}
    zero = [n for n in names if n not in fisher]
    if not zero:
        return fisher, []
    if not fisher:
        raise ValueError("TensorCompressionConfig.weighting: the loss gradient of every targeted module's output is zero on "
                         "the calibration data; allowed: other calibration data, or weighting=None with allocation='relative'")
    mean = float(sum(f.mean() for f in fisher.values()) / len(fisher))
    full = [n if n in (extra or {}) else f"{prefix}.{n}" for n in zero]
    warnings.warn(f"hf_tensorcomp: Fisher weighting: the outputs of {full} get no loss gradient on the calibration data; "
                  "they are weighted by the mean Fisher of the other modules instead", stacklevel=2)
    for n in zero:
        fisher[n] = torch.full((modules[n].weight.shape[0],), mean, dtype=torch.float64)
    return fisher, full


def weight_gradients(model: nn.Module, layer_list: nn.ModuleList, names: list[str], ids: torch.Tensor,
                     batch_size: int = 2, group=None) -> dict[str, dict[str, torch.Tensor]]:
    """``{name: {parameter name: dL/dW}}`` for the direct and nested parameters of modules named
    relative to the decoder-layer list: the language-modelling loss (mean over the tokens of each
    sequence) summed over the calibration sequences, one backward pass of the dense model. Only
    these parameters get gradients; every ``requires_grad`` flag is restored afterwards. `group`
    (`hf_tensorcomp.distributed`): this rank runs batches ``rank, rank + world, ...``, the gradients summed."""
    params = {n: dict(layer_list.get_submodule(n).named_parameters()) for n in names}
    wanted = [p for ps in params.values() for p in ps.values()]
    for p in wanted:
        p.grad = None
    try:
        _loss_backward(model, _mine(ids, batch_size, group), batch_size, wanted)
        out = {n: {k: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for k, p in ps.items()}
               for n, ps in params.items()}
    finally:
        for p in wanted:
            p.grad = None
    if group is not None:
        for grads in out.values():
            for g in grads.values():
                group.sum_(g, "the weight-gradient pass")
    return out


def _mine(ids: torch.Tensor, batch_size: int, group) -> torch.Tensor:
    """The sequences of this rank's batches (``rank, rank + world, ...``; all of them without a `group`). The one short
    batch, if any, is the last: joined, they split into the same batches again."""
    if group is None:
        return ids
    mine = group.deal(ids.split(batch_size))
    return torch.cat(mine) if mine else ids[:0]


def _loss_backward(model: nn.Module, ids: torch.Tensor, batch_size: int, trainable=(), fast: bool = False) -> None:
    """Backward of the language-modelling loss (mean over each sequence's tokens, summed over the
    sequences) in eval mode, gradients only for `trainable`; requires_grad flags and mode restored. `fast`: matrix
    products in bfloat16 where the device multiplies it natively (`resolve_precision`; the loss and reductions in
    float32), for gradients that only weigh (the output Fisher)."""
    from ..training import precision_autocast, resolve_precision

    fast = fast and resolve_precision("auto", next(model.parameters()).device) == "bfloat16"
    flags = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    device = next(model.parameters()).device
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        for p in trainable:
            p.requires_grad_(True)
        model.eval()
        with torch.enable_grad(), precision_autocast(device, "bfloat16" if fast else "float32"):
            for batch in ids.split(batch_size):
                batch = batch.to(device)
                out = model(input_ids=batch, labels=batch, use_cache=False)
                (out.loss * batch.shape[0]).backward()
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(was_training)


def measured_kl(runner, groups: dict[int, dict[str, nn.Module]], weight, every: int = 4) -> dict[int, float]:
    """``{group: KL}``: the mean KL divergence (nats per token) of the model's next-token distribution from the
    dense model's when the modules of one group take other weights, on the runner's first calibration batch.

    `groups` maps a decoder layer's index to its modules (``{name: module}``), or ``len(runner.layers)`` to
    the output head; ``weight(name)`` gives a module's replacement weight (called once, when its group is
    measured). Each group runs from its own layer on: the dense inputs of every layer are computed once and
    the layers before the group's are not run again. `every`: the head scores every `every`-th position only
    (its context still runs through every layer; on a large vocabulary the head costs more than the layers).
    The dense model is left as it was."""
    model, layers = runner.model, runner.layers
    stack = model.get_submodule(runner.prefix.rpartition(".")[0])
    norm, head = getattr(stack, "norm", None), model.get_output_embeddings()
    if norm is None or head is None:
        raise ValueError("TensorCompressionConfig.allocation='measured' scores the model's output through its final "
                         "`norm` and output head, which this architecture does not have as such; allowed: "
                         "allocation='relative' | 'fisher'")
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    kwargs = runner.kwargs[0]

    def log_probs(h):
        z = head(norm(h[:, ::every])).float()
        return (torch.tanh(z / cap) * cap if cap else z).log_softmax(-1)

    def layer(j, h):
        o = layers[j](h, **kwargs[j])
        return first_output(o)

    def from_layer(li, h):
        for j in range(li, len(layers)):
            h = layer(j, h)
        return h

    out = {}
    with torch.no_grad():
        inputs = [runner.hidden[0]]
        for j in range(len(layers)):
            inputs.append(layer(j, inputs[j]))
        dense = log_probs(inputs[-1])
        p = dense.exp()
        for li in sorted(groups):
            saved = {n: mod.weight.data for n, mod in groups[li].items()}
            try:
                for n, mod in groups[li].items():
                    mod.weight.data = weight(n).to(mod.weight.dtype)
                q = log_probs(from_layer(li, inputs[li]) if li < len(layers) else inputs[-1])
            finally:
                for n, mod in groups[li].items():
                    mod.weight.data = saved[n]
            out[li] = max(float((p * (dense - q)).sum(-1).mean()), 0.0)
    return out

