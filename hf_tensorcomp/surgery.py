"""Finding targets in a model, replacing modules layer by layer, and rebuilding a saved skeleton.

Plain torch: works on any model whose decoder layers sit in one ``nn.ModuleList`` named ``...layers``
(Llama, Qwen, Gemma, Mistral, Phi, GPT-NeoX and most others in transformers).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import time
from dataclasses import replace

import torch
from torch import nn
from tqdm.auto import tqdm

from .calibration.data import describe, is_token_ids
from . import checks
from .config import TensorCompressionConfig
from .layers import FactorizedModule, build_from_spec, layer_build_order
from .methods import get_method
from .methods.base import Context


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.split(".")[-1] == "layers" and len(mod) > 0:
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise ValueError(
            f"{type(model).__name__}: no decoder-layer list (an nn.ModuleList named '...layers') found; "
            "hf_tensorcomp supports decoder-only transformers models such as Llama, Qwen3 and Gemma3"
        )
    return best


def resolve_layers(layers: list[int] | None, n: int) -> list[int]:
    if layers is None:
        return list(range(n))
    out = []
    for i in layers:
        if not -n <= i < n:
            raise ValueError(f"TensorCompressionConfig.layers: got {i}; allowed: ints in [{-n}, {n - 1}] (the model has {n} decoder layers)")
        j = i % n
        if j not in out:
            out.append(j)
    return sorted(out)


def _context(model: nn.Module) -> Context:
    prefix, layer_list = find_decoder_layers(model)
    cfg = model.config.get_text_config() if hasattr(model, "config") else None
    return Context(config=cfg, prefix=prefix, n_layers=len(layer_list))


def plan(model: nn.Module, config: TensorCompressionConfig, check_units: bool = True) -> list[tuple[int, list[str]]]:
    """Validate every entry against the (possibly meta) model and list the work.

    Returns ``[(entry index, [module names relative to the layer list, e.g. "3.mlp.up_proj"]), ...]``,
    one item per unit of layers. Raises ValueError, naming the field, before any weight is touched.
    """
    prefix, layer_list = find_decoder_layers(model)
    ctx = _context(model)
    claimed: dict[str, int] = {}
    work = []
    for k, entry in enumerate(config.entries):
        method = get_method(entry.method)
        matched_any = {t: False for t in entry.targets}
        per_layer: dict[int, list[str]] = {}
        for li in resolve_layers(entry.layers, len(layer_list)):
            for name, mod in layer_list[li].named_modules():
                hits = [t for t in entry.targets if name and fnmatch.fnmatchcase(name, t)]
                if not hits or not method.is_target(mod):
                    continue
                for t in hits:
                    matched_any[t] = True
                full = f"{prefix}.{li}.{name}"
                if full in claimed:
                    raise ValueError(
                        f"TensorCompressionConfig.entries: entries {claimed[full]} and {k} both target {full}; "
                        "allowed: each module in at most one entry"
                    )
                claimed[full] = k
                per_layer.setdefault(li, []).append(f"{li}.{name}")
        missing = [t for t, hit in matched_any.items() if not hit]
        if missing and method.no_target_error is not None and not any(matched_any.values()):
            raise ValueError(method.no_target_error)
        if missing:
            sample = sorted({n for n, m in layer_list[0].named_modules() if n and isinstance(m, method.target_types)})
            raise ValueError(
                f"TensorCompressionConfig.targets: pattern(s) {missing} match no {'/'.join(t.__name__ for t in method.target_types)} "
                f"module in the chosen layers; allowed: fnmatch patterns over names such as {sample}"
            )
        for unit in method.units(entry, sorted(per_layer), len(layer_list)):
            names = [n for li in unit for n in per_layer[li]]
            if check_units:
                method.check_unit({n: layer_list.get_submodule(n) for n in names}, entry, ctx)
            work.append((k, names))
    return work


def _set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


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


def compress_model(model: nn.Module, config: TensorCompressionConfig, work=None) -> dict:
    """Compress in place, one unit of layers at a time (peak memory: the model plus one unit's factors).

    Methods that need data (`Method.needs`) get it from the sequential calibration pipeline
    (`hf_tensorcomp.calibration`): layer by layer, statistics of the real inputs of the modules they
    compress, with the outputs of the already compressed layers fed forward (``config.propagate``).
    Entries with a ``target`` budget that a method allocates globally get their ranks first (from a
    pass over the dense model when the allocation reads statistics). Fills
    ``config.compressed_modules`` (factored modules) and ``config.stats``.
    """
    work = plan(model, config) if work is None else work
    prefix, layer_list = find_decoder_layers(model)
    ctx = _context(model)
    params_before = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    methods = [get_method(e.method) for e in config.entries]
    needs = [m.needs(e) for m, e in zip(methods, config.entries)]
    allocating = [m.allocates(e) for m, e in zip(methods, config.entries)]
    runner = None
    if any(needs) or any(a and m.ladder_needs(e) for a, m, e in zip(allocating, methods, config.entries)):
        from .calibration import LayerwiseRunner, calibration_ids

        ids = calibration_ids(config.calibration, _calibration_tokenizer(model, config), config.calibration_samples,
                              config.calibration_length, config.calibration_seed)
        runner = LayerwiseRunner(model, prefix, layer_list, ids, config.calibration_batch_size)
    sensitive = [n for k, names in work for n in names
                 if "fisher" in needs[k] | (methods[k].ladder_needs(config.entries[k]) if allocating[k] else frozenset())]
    if sensitive:  # one backward pass of the dense model, before anything changes
        from .calibration.sensitivity import output_fisher

        runner.fisher = output_fisher(model, layer_list, sensitive, runner.ids)
    graded = [n for k, names in work for n in names if "weight_grad" in needs[k]]
    if graded:  # the loss gradient of the dense model's weights, before anything changes
        from .calibration.sensitivity import weight_gradients

        runner.weight_grad = weight_gradients(model, layer_list, graded, runner.ids)
    allocation = _allocate(config, work, methods, allocating, layer_list, runner)
    module_stats = {}

    def compress_unit(k, names, stats):
        entry = config.entries[k]
        unit_ctx = replace(ctx, stats=stats, ranks=allocation.get(k, {}).get("rungs"), layers=layer_list)
        mods = {n: layer_list.get_submodule(n) for n in names}
        method = methods[k]
        checks.check_inputs(mods, prefix)
        with fixed_threads():
            result = method.compress(mods, entry, unit_ctx)
        checks.check_outputs(result, mods, prefix, entry, method.remedy)
        for name, (new, st) in result.items():
            if entry.mode == "dense" and isinstance(new, FactorizedModule):
                new = new.to_dense()  # None for containers of shared factors: nothing to add
                if new is None:
                    continue
            _set_module(layer_list, name, new)
            module_stats[f"{prefix}.{name}"] = {"method": entry.method, **st}

    if runner is None:
        for k, names in tqdm(work, desc="hf_tensorcomp: compressing", disable=not config.progress, unit="unit"):
            compress_unit(k, names, None)
    else:
        by_last: dict[int, list] = {}  # a unit is compressed once its last layer's statistics are in
        for k, names in work:
            by_last.setdefault(max(_layer_of(n) for n in names), []).append((k, names))
        wanted = _by_layer({n: needs[k] for k, names in work if needs[k] for n in names})
        pending: dict = {}

        def on_layer(li, stats):
            pending.update(stats)
            for k, names in by_last.get(li, []):
                compress_unit(k, names, {n: pending.pop(n) for n in names if n in pending} if needs[k] else None)
            return li in by_last

        runner.run(wanted, on_layer, last=max(by_last), propagate=config.propagate, progress=config.progress)
    finished = {}
    for k, entry in enumerate(config.entries):  # a method's whole-model step after its units (e.g. recovery)
        done = methods[k].finish(model, entry, ctx, runner)
        if done:
            finished[str(k)] = done
    config.compressed_modules = factored_specs(model)
    params_after = sum(p.numel() for p in model.parameters())
    config.stats = {
        "params_before": params_before,
        "params_after": params_after,
        "compress_seconds": round(time.perf_counter() - t0, 3),
        "modules": module_stats,
    }
    if finished:
        config.stats["finish"] = finished  # {entry index: what its method's whole-model step reports}
    if runner is not None:
        config.stats["calibration"] = {"samples": sum(h.shape[0] for h in runner.hidden),
                                       "tokens": runner.n_tokens, "propagate": config.propagate,
                                       "data": describe(config.calibration)}
    if allocation:
        config.stats["allocation"] = {str(k): {key: v for key, v in a.items() if key != "rungs"} for k, a in allocation.items()}
    return config.stats


def _layer_of(name: str) -> int:
    return int(name.split(".", 1)[0])


def _by_layer(kinds: dict[str, frozenset]) -> dict[int, dict[str, frozenset]]:
    """{module name: statistics} grouped by decoder layer, the shape `LayerwiseRunner.run` takes."""
    out: dict[int, dict[str, frozenset]] = {}
    for n, k in kinds.items():
        out.setdefault(_layer_of(n), {})[n] = k
    return out


def _calibration_tokenizer(model: nn.Module, config: TensorCompressionConfig):
    """The tokenizer for calibration texts: the config's (object or path), else the model's own folder's."""
    tok = config.calibration_tokenizer
    if tok is not None and not isinstance(tok, str):
        return tok
    if is_token_ids(config.calibration):
        return None
    from transformers import AutoTokenizer

    src = tok or getattr(model, "name_or_path", None)
    try:
        return AutoTokenizer.from_pretrained(src)
    except Exception as e:  # noqa: BLE001 - any failure means: tell the user how to pass one
        raise ValueError(f"TensorCompressionConfig.calibration_tokenizer: no tokenizer could be loaded from {src!r} ({e}); "
                         "allowed: a tokenizer object or path, or token ids as calibration") from None


def _allocate(config, work, methods, allocating, layer_list, runner) -> dict[int, dict]:
    """Per entry with a global `target`: the rung of every module's ladder, meeting the budget."""
    from .decompositions.allocation import allocate

    out = {}
    for k, entry in enumerate(config.entries):
        if not allocating[k]:
            continue
        m = methods[k]
        names = [n for kk, ns in work if kk == k for n in ns]
        ladders = {}
        kinds = m.ladder_needs(entry)
        if kinds:
            wanted = _by_layer({n: kinds for n in names})

            def on_layer(li, stats):
                for n, st in stats.items():
                    ladders[n] = m.ladder(n, layer_list.get_submodule(n), st, entry)
                return False

            runner.run(wanted, on_layer, last=max(wanted), propagate=False, progress=config.progress,
                       desc=f"hf_tensorcomp: allocating {entry.method} target={entry.target}")
        else:
            ladders = {n: m.ladder(n, layer_list.get_submodule(n), None, entry) for n in names}
        total = sum(layer_list.get_submodule(n).weight.numel() for n in names)
        budget = entry.target * total
        try:
            rungs = allocate(ladders, budget)
        except ValueError as e:
            raise ValueError(f"TensorCompressionConfig.target: got {entry.target}; {e}; allowed: a larger target") from None
        spent = sum(ladders[n][0][j] for n, j in rungs.items())
        out[k] = {"rungs": rungs, "target": entry.target, "params_targeted": total, "params_kept": spent,
                  "kept_fraction": round(spent / total, 6),
                  "kept_dense": sorted(f"{n}" for n, j in rungs.items() if j == len(ladders[n][0]) - 1)}
    return out


def factored_specs(model: nn.Module) -> dict[str, dict]:
    return {name: m.spec() for name, m in model.named_modules() if isinstance(m, FactorizedModule)}


def build_skeleton(model: nn.Module, config: TensorCompressionConfig, dtype: torch.dtype | None = None) -> None:
    """Replace modules by empty factored ones (on the meta device) as recorded in the saved config.

    Every spec is checked first against the model and the config's entries (`checks.check_specs`):
    only modules a method could have written, with the fields and rules of that method.
    """
    checks.check_specs(model, config, plan(model, config, check_units=False))
    specs = sorted(config.compressed_modules.items(), key=lambda kv: layer_build_order(kv[1]))
    for name, spec in specs:
        try:
            # a module the compression added (shared factors) needs only its parent to exist
            model.get_submodule(name.rpartition(".")[0] if spec.get("new") else name)
            old = None if spec.get("new") else model.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"compressed_modules: the checkpoint names module {name!r}, which this model does not have; "
                "the config.json and the model architecture do not match"
            ) from None
        for dim in ("in_features", "out_features"):
            if dim in spec and hasattr(old, dim) and getattr(old, dim) != spec[dim]:
                raise ValueError(
                    f"compressed_modules[{name!r}].{dim}: checkpoint says {spec[dim]}, model has {getattr(old, dim)}; "
                    "the config.json and the model architecture do not match"
                )
        old_w = getattr(old, "weight", None)
        dt = dtype or (old_w.dtype if old_w is not None else next(model.parameters()).dtype)
        with torch.device("meta"):
            new = build_from_spec(spec, dtype=dt, root=model, name=name)
        for dim in ("in_features", "out_features"):
            if old is not None and hasattr(old, dim) and getattr(new, dim) != getattr(old, dim):
                raise ValueError(f"compressed_modules[{name!r}]: builds a module with {dim}={getattr(new, dim)}, the model's "
                                 f"has {getattr(old, dim)}; the checkpoint's config.json is corrupt or edited")
        _set_module(model, name, new)
    checks.check_references(model, config.compressed_modules)
