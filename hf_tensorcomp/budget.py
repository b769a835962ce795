"""The global budget, in one room: every config entry with a global ``target`` / ``target_bytes`` gets each targeted
module's rung here, from the rungs its method prices.

The protocol with the methods (`hf_tensorcomp.methods.base`): `Method.start_allocation` makes the entry's
`Allocation` (its budget, whether its losses are measured); `Method.ladder` prices one module's rungs and returns a
`Ladder` (costs, losses, and what each rung stands for); `Method.table_ladder` the embedding table's, in a byte
budget; every hook gets a `Context` (the model's config, the decoder layers, the allocation so far) and keeps nothing.
This module alone writes an `Allocation` after it is made:

- ``share``: what the targeted modules may spend of their own size once the embedding table took its bytes;
- ``settings``, ``uniform``, ``probes``: copied from each module's `Ladder`;
- ``rungs``, ``report``: the rungs chosen (`decompositions.allocation.allocate`, the greedy climb, seeded with the
  plain setting the allocation must not lose to) and what the allocation reports;

and the measured refinement (``allocation="measured"``) rescales the ladders here. `Method.compress` then reads
``ctx.allocation.rungs`` / ``settings``. Distributed (`hf_tensorcomp.distributed`), the modules' ladders are dealt
out over the ranks and their `Ladder`s gathered.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from . import distributed
from .config import table_entry
from .decompositions.quantize import stored_bytes
from .embedding_tables import head_gram, table_names
from .methods.base import Allocation, Ladder
from .plan import model_context


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


def _table_ladder(model, config, m, entry, alloc, runner, cost: float) -> tuple[str, Ladder]:
    """(key, its `Ladder`) of the embedding table in a byte budget: one rung at fixed
    ``embedding_bits``; with ``"auto"`` the rungs 4 and 8 bits, their loss that of the output head (the
    table's error where it costs, see `quantize_embeddings`) by the entry's own rule, on the dense
    model's head inputs and output Fisher. An untied head is counted as a second table at the same bits;
    `cost`: the table's cost at its widest width (`_table_bytes`)."""
    from .calibration.stats import ModuleStats

    emb_name, head_name, emb, head, copies = _table(model)
    if config.embedding_bits != "auto":
        return emb_name, Ladder([cost], [0.0], settings=[(config.embedding_bits, 0)])
    if head is None:
        raise ValueError("TensorCompressionConfig.embedding_bits: 'auto' weighs the table by the output head's error, and "
                         "this model has no linear output head; allowed: embedding_bits=8 | 4")
    stats = ModuleStats(frozenset())
    if "gram" in m.ladder_needs(entry):
        stats.gram = head_gram(model, head, runner.ids, config.calibration_batch_size)
    stats.fisher = (getattr(runner, "fisher", None) or {}).get(head_name)
    stats.to(head.weight.device)  # gathered on the host, used beside the table
    ctx = replace(model_context(model), allocation=alloc)
    return emb_name, m.table_ladder(emb_name, head, stats, entry, ctx, TABLE_BITS, config.embedding_group_size, copies)


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
        ctx = replace(model_context(model), allocation=alloc, layers=layer_list)
        kinds = m.ladder_needs(entry)
        if kinds:
            wanted = _by_layer({n: kinds for n in names})

            def on_layer(li, stats):
                ladders.update(_ladders(m, entry, ctx, stats, f"allocating decoder layer {li}"))
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
            ladders = _ladders(m, entry, ctx, dict.fromkeys(names), "allocating")
        table = None
        if is_table:
            table, lad = _table_ladder(model, config, m, entry, alloc, runner, cost)
            ladders[table] = _record(alloc, table, lad)
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


def _ladders(m, entry, ctx, stats: dict, what: str) -> dict:
    """{module name: (costs, losses)} for the modules of `stats` ({name: its statistics or None}), each module's
    `Ladder` recorded in ``ctx.allocation`` (`_record`); distributed, dealt out over the ranks (with ``measured``
    every rank prices every module: the probes it keeps are functions). Each module's entry of `stats` is set to
    None once its ladder is priced, so that a layer's statistics are not all held to the end."""
    group = distributed.group()
    ctx = replace(ctx, scratch=[])  # this layer's, dropped with it

    def price(n):
        out = m.ladder(n, ctx.layers.get_submodule(n), stats[n], entry, ctx)
        stats[n] = None  # not read again (a 7B down_proj's Gram is 1 GB): freed before the next module's ladder
        return out

    if group is None or ctx.allocation.measured:
        priced = {n: price(n) for n in stats}
    else:
        priced = dict(zip(stats, group.spread([functools.partial(price, n) for n in stats], what)))
    return {n: _record(ctx.allocation, n, lad) for n, lad in priced.items()}


def _record(alloc: Allocation, name: str, ladder: Ladder) -> tuple[list, list]:
    """What a module's `Ladder` says beside its (costs, losses), into the allocation."""
    if ladder.settings is not None:
        alloc.settings[name] = ladder.settings
    if ladder.uniform is not None:
        alloc.uniform[name] = ladder.uniform
    if ladder.probe is not None and alloc.measured:
        alloc.probes[name] = ladder.probe
    return list(ladder.costs), list(ladder.losses)


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
