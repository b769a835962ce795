"""The compression pipeline, in one place: plan -> calibrate -> allocate -> compress layer by layer -> check -> record.

`compress_model` is the one path every compression takes (``from_pretrained(quantization_config=)``,
`hf_tensorcomp.compress`, the CLI). Its stages:

1. **plan** (`hf_tensorcomp.plan.plan`): every entry validated against the model; the units of modules.
2. **calibrate** (`hf_tensorcomp.calibration`): when a method needs data, the calibration token ids and
   a `LayerwiseRunner` holding the first decoder layer's inputs; sensitivities (Fisher, weight
   gradients) from one backward pass of the dense model, before anything changes.
3. **allocate**: entries with a global ``target`` get every module's rung of its method's ladder (an
   `Allocation` per entry, which its method fills while pricing the rungs and reads when it compresses).
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
from .decompositions.quantize import stored_bytes
from .embedding_tables import final_gram, head_gram, quantize_embeddings, table_names
from .layers import FactorizedModule
from .methods.qlr import share_input_rotations
from .methods import get_method
from .methods.base import Allocation
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
        if config.embedding_bits:
            bits = next((a.report["embedding_bits"] for a in allocation.values() if "embedding_bits" in a.report),
                        config.embedding_bits)
            if stream is not None:  # the table read, quantized and written a block of rows at a time
                module_stats.update(stream.quantize_table(bits, config.embedding_group_size, final_gram(model, runner, final)))
            else:
                ids = runner.ids if runner is not None else _calibration_ids(model, config)
                module_stats.update(quantize_embeddings(model, bits, config.embedding_group_size, ids,
                                                        config.calibration_batch_size))
    finally:
        model.train(was_training)
    record(model, config, (params_before, bytes_before), time.perf_counter() - t0, module_stats, finished, runner,
           allocation)  # 5.
    share_input_rotations(model)  # q / k / v and gate / up rotate their common input once
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
    outputs when streaming with ``embedding_bits`` — what `final_gram` reads — else None).
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

    keep = stream is not None and bool(config.embedding_bits)  # the final states: the streamed table's GPTQ reads them
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


def _layer_of(name: str) -> int:
    return int(name.split(".", 1)[0])


def _by_layer(kinds: dict[str, frozenset]) -> dict[int, dict[str, frozenset]]:
    """{module name: statistics} grouped by decoder layer, the shape `LayerwiseRunner.run` takes."""
    out: dict[int, dict[str, frozenset]] = {}
    for n, k in kinds.items():
        out.setdefault(_layer_of(n), {})[n] = k
    return out


TABLE_BITS = (4, 8)  # the rungs of ``embedding_bits="auto"``


def _table(model) -> tuple:
    """(table name, head name or None, table, head or None, copies): copies 2 for an untied head, stored beside."""
    emb_name, head_name = table_names(model)
    emb = model.get_submodule(emb_name)
    head = model.get_submodule(head_name) if head_name else None
    return emb_name, head_name, emb, head, 1 if head is None or head.weight is emb.weight else 2


def _table_bytes(model, config) -> tuple[int, float]:
    """(parameters, bf16-parameter cost at the widest width it may take) of the embedding table in a byte budget."""
    _, _, emb, _, copies = _table(model)
    bits = max(TABLE_BITS) if config.embedding_bits == "auto" else config.embedding_bits
    return copies * emb.weight.numel(), copies * stored_bytes(tuple(emb.weight.shape), bits, config.embedding_group_size) / 2


def _table_ladder(model, config, m, entry, alloc, runner, cost: float) -> tuple[str, tuple[list, list]]:
    """(key, (costs, losses)) of the embedding table in a byte budget: one rung at fixed
    ``embedding_bits``; with ``"auto"`` the rungs 4 and 8 bits, their loss that of the output head (the
    table's error where it costs, see `quantize_embeddings`) by the entry's own rule, on the dense
    model's head inputs and output Fisher. An untied head is counted as a second table at the same bits;
    `cost`: the table's cost at its widest width (`_table_bytes`)."""
    from .calibration.stats import ModuleStats

    emb_name, head_name, emb, head, copies = _table(model)
    if config.embedding_bits != "auto":
        alloc.settings[emb_name] = [(config.embedding_bits, 0)]
        return emb_name, ([cost], [0.0])
    if head is None:
        raise ValueError("TensorCompressionConfig.embedding_bits: 'auto' weighs the table by the output head's error, and "
                         "this model has no linear output head; allowed: embedding_bits=8 | 4")
    stats = ModuleStats(frozenset())
    if "gram" in m.ladder_needs(entry):
        stats.gram = head_gram(model, head, runner.ids, config.calibration_batch_size)
    stats.fisher = (getattr(runner, "fisher", None) or {}).get(head_name)
    stats.to(head.weight.device)  # gathered on the host, used beside the table
    ladder = m.ladder(emb_name, head, stats, entry, alloc, bits=TABLE_BITS, ranks=(0,), group_size=config.embedding_group_size,
                      copies=copies, table=True)
    return emb_name, ladder


def allocate(config, work, methods, layer_list, runner, stream=None, model=None) -> dict[int, Allocation]:
    """Stage 3: per entry with a global `target`, the rung of every module's ladder, meeting the budget: its
    `Allocation` (what the method's `ladder` recorded, the rungs chosen, the report). With ``embedding_bits``, a
    byte budget (`config.table_entry`) holds the embedding table too."""
    from .decompositions.allocation import allocate as allocate_rungs

    out = {}
    for k, entry in enumerate(config.entries):
        m = methods[k]
        if not m.allocates(entry):
            continue
        alloc = m.start_allocation(entry)
        names = [n for kk, ns in work if kk == k for n in ns]
        total = sum(layer_list.get_submodule(n).weight.numel() for n in names)
        is_table = k == table_entry(config.entries, config.embedding_bits)
        if is_table:  # the share the modules keep once the table took its bytes (at its widest)
            params, cost = _table_bytes(model, config)
            alloc.share = (alloc.budget * (total + params) - cost) / total
        ladders = {}
        kinds = m.ladder_needs(entry)
        if kinds:
            wanted = _by_layer({n: kinds for n in names})

            def on_layer(li, stats):
                ladders.update(_ladders(m, entry, alloc, layer_list, stats, f"allocating decoder layer {li}"))
                return False

            reading = None if stream is None else stream.reader()
            runner.run(wanted, on_layer, last=max(wanted), propagate=False, progress=config.progress,
                       desc=f"hf_tensorcomp: allocating {entry.method} target={alloc.budget}", stream=reading)
            if reading is not None:
                reading.close()
        else:
            if stream is not None:
                raise ValueError("compress_checkpoint: a data-free global allocation reads every weight first; allowed: "
                                 "calibration= (its allocation pass streams the layers), or rank=")
            ladders = _ladders(m, entry, alloc, layer_list, dict.fromkeys(names), "allocating")
        table = None
        if is_table:
            table, ladders[table] = _table_ladder(model, config, m, entry, alloc, runner, cost)
            total += params
        measured = _measured(alloc, ladders, layer_list, runner, model, table) if alloc.measured else None
        budget = alloc.budget * total
        try:
            rungs = allocate_rungs(ladders, budget, seed=_uniform_seed(alloc, ladders, budget))
        except ValueError as e:
            field = "target_bytes" if m.byte_budget else "target"
            table_note = f" (the embedding table's {ladders[table][0][0]:,.0f} included)" if table is not None else ""
            raise ValueError(f"TensorCompressionConfig.{field}: got {alloc.budget}; {e}{table_note}; allowed: a larger "
                             f"{field}" + (", or embedding_bits=4 | 'auto'" if table is not None else "")
                             + m.budget_hint(entry, alloc)) from None
        spent = sum(ladders[n][0][j] for n, j in rungs.items())
        out[k] = alloc
        alloc.report = {"target": alloc.budget, "params_targeted": total, "params_kept": spent,
                        "kept_fraction": round(spent / total, 6)}
        if measured is not None:
            alloc.report["measured_kl"] = {("head" if li == len(layer_list) else str(li)): round(v, 6) for li, v in measured.items()}
        if table is not None:
            alloc.report["embedding_bits"] = alloc.settings[table][rungs.pop(table)][0]
        alloc.rungs = rungs
        alloc.report["kept_dense"] = sorted(f"{n}" for n, j in rungs.items() if j == len(ladders[n][0]) - 1)
    return out


def _ladders(m, entry, alloc, layer_list, stats: dict, what: str) -> dict:
    """{module name: its ladder} for the modules of `stats` ({name: its statistics or None}); distributed, dealt out
    over the ranks (what a rung stands for, ``alloc.settings`` / ``alloc.uniform``, sent with each; with
    ``measured`` every rank prices every module: the probes it keeps are functions). Each module's entry of `stats`
    is set to None once its ladder is priced, so that a layer's statistics are not all held to the end."""
    group = distributed.group()

    def ladder(n):
        alloc.layers = layer_list
        try:
            out = m.ladder(n, layer_list.get_submodule(n), stats[n], entry, alloc)
        finally:
            alloc.layers = None
        stats[n] = None  # not read again (a 7B down_proj's Gram is 1 GB): freed before the next module's ladder
        return out, alloc.settings.get(n), alloc.uniform.get(n)

    if group is None or alloc.measured:
        return {n: ladder(n)[0] for n in stats}
    out = {}
    for n, (lad, settings, uniform) in zip(stats, group.spread([functools.partial(ladder, n) for n in stats], what)):
        out[n] = lad
        if settings is not None:
            alloc.settings[n] = settings
        if uniform is not None:
            alloc.uniform[n] = uniform
    return out


def _uniform_seed(alloc, ladders: dict, budget: float) -> dict | None:
    """The rungs of the most expensive plain setting every module offers (`Allocation.uniform`: qlr's one width,
    rank 0) that fits the budget, which the allocation must not lose to; None when there is none."""
    common = set.intersection(*(set(u) for u in alloc.uniform.values())) if alloc.uniform else set()
    fitting = []
    for setting in common:
        seed = {n: u[setting] for n, u in alloc.uniform.items()}
        cost = sum(ladders[n][0][seed.get(n, 0)] for n in ladders)
        if cost <= budget:
            fitting.append((cost, seed))
    return max(fitting, key=lambda f: f[0])[1] if fitting else None


def _measured(alloc, ladders: dict, layer_list, runner, model, table) -> dict[int, float]:
    """Every decoder layer's ladders (and the table's) scaled, in place, so that their cheapest rungs together
    cost what they were measured to (`measured_kl`: that layer's matrices alone on their cheapest rung; the
    table by the output head it is read as), each ladder keeping its own shape. Returns the measured KL per
    layer (``len(layer_list)``: the head)."""
    from .calibration.sensitivity import measured_kl

    groups: dict[int, dict] = {}
    for n in ladders:
        if len(ladders[n][0]) < 2:  # one rung (e.g. a table at fixed embedding_bits): nothing to weigh
            continue
        key, mod = (len(layer_list), model.get_output_embeddings()) if n == table else (_layer_of(n), layer_list.get_submodule(n))
        groups.setdefault(key, {})[n] = mod
    group = distributed.group()  # distributed: measured on the first calibration batch, which rank 0 holds
    kl = measured_kl(runner, groups, lambda n: alloc.probes.pop(n)()) if group is None or group.rank == 0 else None
    kl = kl if group is None else group.gather(kl, "measuring the allocation's losses")[0]
    alloc.probes.clear()  # those of one-rung ladders
    for key, names in groups.items():
        base = sum(ladders[n][1][0] for n in names)
        if base > 0:
            for n in names:
                costs, losses = ladders[n]
                ladders[n] = (costs, [x * kl[key] / base for x in losses])
    return kl
