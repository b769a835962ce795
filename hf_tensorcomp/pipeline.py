"""The compression pipeline, in one place: plan -> calibrate -> allocate -> compress layer by layer -> check -> record.

`compress_model` is the one path every compression takes (``from_pretrained(quantization_config=)``,
`hf_tensorcomp.compress`, the CLI). Its stages:

1. **plan** (`hf_tensorcomp.plan.plan`): every entry validated against the model; the units of modules.
2. **calibrate** (`hf_tensorcomp.calibration`): when a method needs data, the calibration token ids and
   a `LayerwiseRunner` holding the first decoder layer's inputs; sensitivities (Fisher, weight
   gradients) from one backward pass of the dense model, before anything changes.
3. **allocate** (`hf_tensorcomp.budget`): entries with a global ``target`` get every module's rung of its method's
   ladder (an `Allocation` per entry, which its method reads when it compresses).
4. **compress**: unit by unit (layer by layer with calibration, outputs propagated to the next layer),
   each unit checked before and after (`hf_tensorcomp.checks`) and put in place by `hf_tensorcomp.surgery`
   (module replacement only); then each method's whole-model `finish` step, and with ``embedding_bits``
   the input embedding and the head quantized (`hf_tensorcomp.embedding_tables`; a tied head stays tied).
5. **record**: ``config.compressed_modules`` and ``config.stats`` describe the model as it now is.
6. **heal** (``heal=``): a short distillation toward the dense model (`hf_tensorcomp.heal`), its
   report added to ``config.stats``.

Methods only turn statistics into modules; surgery only replaces modules. Under ``torchrun`` / ``accelerate
launch`` the same stages run on every process, sharing the calibration batches and each layer's matrices
(`hf_tensorcomp.distributed`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import replace

import torch
from torch import nn
from tqdm.auto import tqdm

from . import checks, distributed
from .calibration.data import calibration_tokenizer, describe
from .config import TensorCompressionConfig, table_entry
from .embedding_tables import final_gram, final_norm, quantize_embeddings, table_names
from .layers import FactorizedModule
from .budget import _by_layer, _layer_of, allocate
from .methods import attach, get_method
from .layout import embedding_names
from .plan import find_decoder_layers, model_context, plan
from .surgery import factored_specs, set_module


@contextlib.contextmanager
def fixed_threads():
    """Run decompositions on a fixed number of CPU threads (env ``HF_TENSORCOMP_THREADS``, default 1).

    The float sums inside SVD, CP-ALS and HOOI are split by thread, and the iterative ones amplify the
    difference (TRAWL Tucker factors differed by 1.5e-2 between 1 and 2 threads), so a fixed count is
    what makes the same seed give bitwise identical factors whatever ``torch.set_num_threads`` says.
    """
    value = os.environ.get("HF_TENSORCOMP_THREADS", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"HF_TENSORCOMP_THREADS: got {value!r}; allowed: an int >= 1 (CPU threads for decompositions)")
    before = torch.get_num_threads()
    torch.set_num_threads(int(value))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def compress_model(model: nn.Module, config: TensorCompressionConfig, work=None, stream=None) -> dict:
    """Compress in place, one unit of layers at a time (peak memory: the model plus one unit's factors).

    Runs the stages in the module docstring. Fills ``config.compressed_modules`` (factored modules)
    and ``config.stats``, and returns the stats. `stream` (`hf_tensorcomp.streaming`): the decoder
    layers live on the meta device and are loaded (``stream.load(li)``) just before they are needed
    and written out and released (``stream.release(li)``) once done; `stream.release` of every layer
    is called exactly once, in order.
    """
    work = plan(model, config) if work is None else work  # 1. plan
    distributed.agree(distributed.group(), "compress", **distributed.fields("config.entries",
                                                                            [e.to_dict() for e in config.entries]),
                      work=distributed.fingerprint(work))
    if config.embedding_bits:
        table_names(model)  # refused before any work when already quantized
    prefix, layer_list = find_decoder_layers(model)
    if stream is None:
        for _, names in work:  # every dense weight checked before any work (allocation reads them all)
            checks.check_inputs({n: layer_list.get_submodule(n) for n in names}, prefix)
    params_before = sum(p.numel() for p in model.parameters())
    bytes_before = model_bytes(model)
    t0 = time.perf_counter()
    methods = [get_method(e.method) for e in config.entries]
    for m, entry in zip(methods, config.entries):
        m.settle(entry, config.calibration is not None, stream is not None)
    was_training = model.training
    model.eval()  # calibration and statistics without dropout; trainers set their own mode
    try:
        runner = calibrate(model, config, work, methods, stream)  # 2. calibrate
        allocation = allocate(config, work, methods, layer_list, runner, stream, model)  # 3. allocate
        healer = None
        if stream is not None and config.heal:  # 6. while streaming: each layer healed while it is in memory
            from .healing import StreamHealer

            healer = StreamHealer(model, config, getattr(stream, "states_dir", None))
        module_stats, final = compress_units(model, config, work, methods, runner, allocation, stream, healer)  # 4.
        finished = {}
        ctx = model_context(model)
        for k, entry in enumerate(config.entries):  # a method's whole-model step after its units (e.g. recovery)
            done = methods[k].finish(model, entry, ctx, runner)
            if done:
                finished[str(k)] = done
        attach(model)  # what the new modules need at run time (e.g. a shared input rotation, the latent attention)
        if config.embedding_bits:
            bits = next((a.report["embedding_bits"] for a in allocation.values() if "embedding_bits" in a.report),
                        config.embedding_bits)
            if stream is not None:  # the table read, quantized and written a block of rows at a time
                module_stats.update(stream.quantize_table(bits, config.embedding_group_size, final_gram(model, runner, final)))
            else:
                ids = runner.ids if runner is not None else _calibration_ids(model, config)
                # the propagated final states are the compressed model's head inputs unless a whole-model step
                # changed it since, or the model has no final norm to take them through (a forward pass then)
                gram = None
                if final is not None and not finished and final_norm(model, runner.prefix) is not None:
                    gram = final_gram(model, runner, final)
                elif final is not None:
                    runner.drop_states(final)
                module_stats.update(quantize_embeddings(model, bits, config.embedding_group_size, ids,
                                                        config.calibration_batch_size, gram=gram))
    finally:
        model.train(was_training)
    record(model, config, (params_before, bytes_before), time.perf_counter() - t0, module_stats, finished, runner,
           allocation)  # 5.
    if healer is not None:
        config.stats = {**config.stats, "heal": healer.report()}
    elif config.heal:  # 6. heal: distil toward the dense model this one was made from
        from .healing import heal

        settings = {k: v for k, v in config.heal.items()}
        heal(model, teacher=config.stats.get("source"), calibration=config.calibration, progress=config.progress,
             tokenizer=config.calibration_tokenizer, _config=config, **settings)
    return config.stats


def calibrate(model: nn.Module, config: TensorCompressionConfig, work, methods, stream=None):
    """Stage 2: a `LayerwiseRunner` over the calibration text when any entry needs data (for its
    units, or for its global allocation), with the dense model's sensitivities attached; else None."""
    entries = config.entries
    needs = [m.needs(e) for m, e in zip(methods, entries)]
    ladder = [m.ladder_needs(e) if m.allocates(e) else frozenset() for m, e in zip(methods, entries)]
    # streaming: the table's GPTQ reads the final hidden states, which only the runner can give
    table_states = stream is not None and bool(config.embedding_bits) and config.calibration is not None
    if not any(needs) and not any(ladder) and not table_states:
        return None
    from .calibration import LayerwiseRunner

    prefix, layer_list = find_decoder_layers(model)
    ids = _calibration_ids(model, config)
    runner = LayerwiseRunner(model, prefix, layer_list, ids, config.calibration_batch_size,
                             states_dir=getattr(stream, "states_dir", None), distribute=True)
    sensitive = [n for k, names in work for n in names if "fisher" in needs[k] | ladder[k]]
    graded = [n for k, names in work for n in names if "weight_grad" in needs[k]]
    if stream is not None and (sensitive or graded):
        raise ValueError("compress_checkpoint: Fisher weighting, a Fisher-weighted or measured global allocation "
                         "(allocation='fisher' | 'measured') and weight gradients need a backward pass of the whole dense "
                         "model, which streaming never holds; "
                         "allowed: weighting=None with allocation='relative' | 'uniform', or compress in memory")
    k_table = table_entry(entries, config.embedding_bits)
    head = {}
    if k_table is not None and "fisher" in ladder[k_table]:  # the table's rungs are weighed by the head's Fisher
        head_name = embedding_names(model)[1]
        head = {head_name: model.get_submodule(head_name)} if head_name else {}
    if sensitive or head:  # one backward pass of the dense model, before anything changes
        from .calibration.sensitivity import output_fisher

        runner.fisher, runner.fisher_fallback = output_fisher(model, layer_list, sensitive, runner.ids, prefix,
                                                              extra=head, group=runner.group)
    if graded:  # the loss gradient of the dense model's weights, before anything changes
        from .calibration.sensitivity import weight_gradients

        runner.weight_grad = weight_gradients(model, layer_list, graded, runner.ids, group=runner.group)
    return runner


def compress_units(model: nn.Module, config: TensorCompressionConfig, work, methods, runner, allocation,
                   stream=None, healer=None) -> tuple[dict, object]:
    """Stage 4: every unit compressed, checked and put in place; layer by layer with calibration.

    A unit is compressed once its last layer's statistics are in; with ``config.propagate`` the
    next layer sees the compressed layer's outputs. `healer` (`hf_tensorcomp.healing.StreamHealer`,
    streaming only): every layer, compressed or not, is healed once its units are compressed and the
    calibration stream has moved on. Returns ({full module name: its stats}, the last decoder layer's
    outputs with ``embedding_bits`` when streaming or propagating — what `final_gram` reads — else None).
    """
    prefix, layer_list = find_decoder_layers(model)
    ctx = model_context(model)
    needs = [m.needs(e) for m, e in zip(methods, config.entries)]
    module_stats = {}

    group = distributed.group()

    def fit(k, names, stats):  # the unit's new modules, checked: {name: (module, stats)}
        entry = config.entries[k]
        unit_ctx = replace(ctx, stats=stats, allocation=allocation.get(k), layers=layer_list)
        mods = {n: layer_list.get_submodule(n) for n in names}
        if stream is not None:  # streamed weights are checked as they arrive
            checks.check_inputs(mods, prefix)
        with fixed_threads():
            result = methods[k].compress(mods, entry, unit_ctx)
        checks.check_outputs(result, mods, prefix, entry, methods[k].remedy)
        return result

    def place(k, result):
        entry = config.entries[k]
        for name, (new, st) in result.items():
            if entry.mode == "dense" and isinstance(new, FactorizedModule):
                new = new.to_dense()  # None for containers of shared factors: nothing to add
                if new is None:
                    continue
            if entry.factor_bits is not None and isinstance(new, FactorizedModule) and new.quantizable(entry.group_size):
                new.quantize_factors(entry.factor_bits, entry.group_size)
                st = {**st, "factor_bits": entry.factor_bits, "group_size": entry.group_size}
            set_module(layer_list, name, new)
            module_stats[f"{prefix}.{name}"] = {"method": entry.method, **st}

    def compress_layer(li, units):  # [(entry index, names, stats or None)], the units that end at layer li
        if group is None:
            for k, names, stats in units:
                place(k, fit(k, names, stats))
            return
        # distributed: the matrices of a per-matrix method (whole units of the others) dealt out over the ranks
        tasks = [(k, part, stats if stats is None else {n: stats[n] for n in part if n in stats})
                 for k, names, stats in units for part in ([[n] for n in names] if methods[k].per_matrix else [names])]
        results = group.spread([functools.partial(fit, *t) for t in tasks], f"compressing decoder layer {li}")
        for (k, _, _), result in zip(tasks, results):
            place(k, distributed.on_device(result, layer_list[li]))

    by_last: dict[int, list] = {}
    for k, names in work:
        by_last.setdefault(max(_layer_of(n) for n in names), []).append((k, names))
    if runner is None:  # no calibration: layer by layer, each unit once its last layer is in (streaming: loaded)
        layers = range(len(layer_list)) if healer is not None else sorted(by_last)  # a healer heals every layer
        for li in tqdm(layers, desc="hf_tensorcomp: compressing", disable=not config.progress, unit="layer"):
            if stream is not None:
                stream.upto(li)
            if healer is not None:
                healer.before(li)
            compress_layer(li, [(k, names, None) for k, names in by_last.get(li, [])])
            if healer is not None:
                healer.after(li)
        if stream is not None:
            stream.upto(len(layer_list) - 1, release_last=True)
        return module_stats, None
    wanted = _by_layer({n: needs[k] for k, names in work if needs[k] for n in names})
    pending: dict = {}

    def on_layer(li, stats):
        if healer is not None:
            healer.before(li)
        pending.update(stats)
        compress_layer(li, [(k, names, {n: pending.pop(n) for n in names if n in pending} if needs[k] else None)
                            for k, names in by_last.get(li, [])])
        return li in by_last

    # the final states: the table's GPTQ reads them (streaming; in memory, where they are the compressed model's)
    keep = bool(config.embedding_bits) and (stream is not None or config.propagate)
    final = runner.run(wanted, on_layer, last=len(layer_list) - 1 if keep or healer else max(by_last),
                       propagate=config.propagate, progress=config.progress, stream=stream, keep_last=keep,
                       after=healer.after if healer is not None else None)
    if stream is not None:
        stream.upto(len(layer_list) - 1, release_last=True)
    return module_stats, final


def _calibration_ids(model: nn.Module, config: TensorCompressionConfig):
    """The calibration token ids (None without calibration text), checked against the vocabulary."""
    if config.calibration is None:
        return None
    from .calibration import calibration_ids
    from .calibration.data import check_vocabulary

    ids = calibration_ids(config.calibration, calibration_tokenizer(model, config.calibration, config.calibration_tokenizer),
                          config.calibration_samples, config.calibration_length, config.calibration_seed)
    return check_vocabulary(ids, model)


def model_bytes(model: nn.Module) -> int:
    """Bytes of what a checkpoint stores (the state dict, tied tensors once): packed codes, scales and zero
    points included — a factor held in the kernel's layout counts at its stored width (`memory_bytes` counts
    what the model holds)."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() in seen and t.device.type != "meta":
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def record(model: nn.Module, config: TensorCompressionConfig, before: tuple[int, int], seconds: float, module_stats: dict,
           finished: dict, runner, allocation: dict) -> dict:
    """Stage 5: ``config.compressed_modules`` and ``config.stats`` describe the model as it now is."""
    config.compressed_modules = factored_specs(model)
    source = getattr(model, "name_or_path", None)
    config.stats = {
        **({"source": source} if source and os.path.isdir(source) else {}),
        "params_before": before[0],
        "params_after": sum(p.numel() for p in model.parameters()),
        "bytes_before": before[1],
        "bytes_after": model_bytes(model),
        "compress_seconds": round(seconds, 3),
        "modules": module_stats,
    }
    if finished:
        config.stats["finish"] = finished  # {entry index: what its method's whole-model step reports}
    if runner is not None:
        config.stats["calibration"] = {"samples": runner.samples,
                                       "tokens": runner.n_tokens, "propagate": config.propagate,
                                       "data": describe(config.calibration)}
        if runner.fisher_fallback:
            config.stats["calibration"]["fisher_fallback"] = runner.fisher_fallback
    if allocation:
        config.stats["allocation"] = {str(k): a.report for k, a in allocation.items()}
    return config.stats
