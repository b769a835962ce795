"""The checks every compression and every reload goes through, in one place.

- `check_inputs` / `check_outputs`: around each unit `pipeline.compress_model` compresses: dense
  weights must be finite; every factor a method returns must be finite and every reconstruction
  closer to its weight than the zero matrix is (relative error < 1). A failure names the module, the
  setting and what to try, and stops before anything is saved.
- `check_loaded`: after a compressed checkpoint's tensors load: every factor finite, every stored
  EinSort permutation a permutation.
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import FactorizedModule
from .layers.base import _layer_class
from .methods import get_method
from .layout import embedding_names
from .plan import model_context


def _setting(entry) -> str:
    opts = {k: v for k, v in entry.options.items() if v is not None}
    rank = "" if entry.rank is None else f"rank={entry.rank!r}, "
    return f"method={entry.method!r}, {rank}" + ", ".join(f"{k}={v!r}" for k, v in opts.items())


def _non_finite(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.device.type != "meta" and not bool(torch.isfinite(t).all())


def check_inputs(modules: dict[str, nn.Module], prefix: str) -> None:
    """Refuse dense weights holding NaN / Inf (no decomposition of them means anything)."""
    for name, mod in modules.items():
        for pname, p in mod.named_parameters(recurse=False):
            if _non_finite(p):
                n = int((~torch.isfinite(p)).sum())
                raise ValueError(f"hf_tensorcomp: {prefix}.{name}.{pname}: the dense weight holds {n} NaN/Inf value(s); hf_tensorcomp "
                                 "compresses only finite weights. Fix or re-download the checkpoint, or leave this "
                                 "module out of `targets` / `layers`")


def check_outputs(result: dict[str, tuple[nn.Module, dict]], modules: dict[str, nn.Module], prefix: str, entry,
                  remedy: str) -> None:
    """Refuse non-finite factors and reconstructions no better than the zero matrix, naming the module."""
    for name, (module, stats) in result.items():
        where = f"{prefix}.{name}"
        if name not in modules:  # a container of factors shared by the unit's modules
            where += f" (the factors shared by {', '.join(f'{prefix}.{n}' for n in modules)})"
        bad = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if _non_finite(t)]
        # a fit to the output error on the calibration inputs (whitened) is judged by that error: a 2-bit GPTQ
        # weight may lie farther from W than zeros do and still give outputs much closer than zeros give
        whitened = stats.get("whitened_error") is not None
        err = stats["whitened_error"] if whitened else stats.get("rel_error")
        if bad:
            what = f"its factors ({', '.join(bad)}) hold NaN/Inf"
        elif err is None or not err < 1.0:  # also NaN
            what = (f"its relative {'output error on the calibration inputs' if whitened else 'error'} is {err} "
                    "(>= 1: worse than replacing the weight by zeros)")
        else:
            continue
        raise ValueError(f"hf_tensorcomp: compressing {where} with {_setting(entry)} failed: {what}; nothing "
                         f"was kept. Try {remedy}")


def check_loaded(model: nn.Module) -> None:
    """After a compressed checkpoint loads: factors finite, EinSort permutations valid (names the module)."""
    for name, mod in model.named_modules():
        if not isinstance(mod, FactorizedModule):
            continue
        nested = getattr(mod, "nested", False)
        for tname, t in [*mod.named_parameters(recurse=nested), *mod.named_buffers(recurse=nested)]:
            if _non_finite(t):
                raise ValueError(f"{name}.{tname}: the checkpoint's factor holds NaN/Inf; the checkpoint is corrupt "
                                 "(re-create or re-download it)")
        validate = getattr(mod, "validate_loaded", None)
        if validate is not None:
            validate(name)


def check_specs(model: nn.Module, config, work) -> None:
    """Every saved spec against the model and the config's entries, before any tensor is allocated.

    `work` is `plan.plan(model, config)`: the units of modules each entry targets. A replaced
    module must be one a factorized entry targets, of a layer type that entry's method writes, and
    follow the method's own rules (`Method.check_spec`, which also names the container of shared
    factors the module must read, if any); a new module (shared factors) must be such a container.
    """
    ctx = model_context(model)
    owner = {}  # full module name -> (entry, full names of its unit), for the entries that keep factors
    for k, names in work:
        entry = config.entries[k]
        if entry.mode == "factorized":
            unit = {f"{ctx.prefix}.{n}": model.get_submodule(f"{ctx.prefix}.{n}") for n in names}
            owner.update({n: (entry, unit) for n in unit})
    if not isinstance(config.compressed_modules, dict):
        raise ValueError("compressed_modules: not a dict; the checkpoint's config.json is corrupt")
    containers = set()
    embedding = _embedding_specs(model, config)
    for name, spec in config.compressed_modules.items():
        if isinstance(spec, dict) and spec.get("new"):
            continue
        if isinstance(spec, dict) and spec.get("layer") in ("qembedding", "qhead"):
            if embedding.get(name) != spec["layer"]:
                raise ValueError(f"compressed_modules[{name!r}].layer: got {spec['layer']!r}; allowed: "
                                 + (f"{embedding} (embedding_bits={config.embedding_bits})" if embedding else
                                    "none with embedding_bits=None") + "; the checkpoint's config.json is corrupt or edited")
            _layer_class(spec).check_spec(name, spec)
            if spec.get("source") not in (None, *[n for n, k in embedding.items() if k == "qembedding"]):
                raise ValueError(f"compressed_modules[{name!r}].source: got {spec['source']!r}; allowed: the input "
                                 "embedding's name; the checkpoint's config.json is corrupt or edited")
            continue
        if name not in owner:
            raise ValueError(f"compressed_modules[{name!r}]: no factorized entry of this config targets that module; "
                             f"allowed: the modules its entries target ({len(owner)} in this model, e.g. "
                             f"{sorted(owner)[:3]}); the checkpoint's config.json is corrupt or edited")
        entry, unit = owner[name]
        method = get_method(entry.method)
        kind = spec.get("layer") if isinstance(spec, dict) else None
        if kind not in method.layer_types:
            raise ValueError(f"compressed_modules[{name!r}].layer: got {kind!r}; allowed: "
                             f"{' | '.join(map(repr, method.layer_types))} (what method {entry.method!r} writes)")
        _layer_class(spec).check_spec(name, spec)
        containers.add(method.check_spec(name, spec, entry, unit, ctx))
    for name, spec in config.compressed_modules.items():
        if isinstance(spec, dict) and spec.get("new") and name not in containers:
            raise ValueError(f"compressed_modules[{name!r}]: shared factors no compressed module of this config reads "
                             f"from there; allowed: {sorted(c for c in containers if c)}; the checkpoint's config.json "
                             "is corrupt or edited")


def _embedding_specs(model: nn.Module, config) -> dict[str, str]:
    """{module name: layer type} that ``embedding_bits`` may write: the input embedding and the output head."""
    if not getattr(config, "embedding_bits", None):
        return {}
    emb, head = embedding_names(model)
    return {n: kind for n, kind in ((emb, "qembedding"), (head, "qhead")) if n is not None}


def check_references(model: nn.Module, names) -> None:
    """Shared factors and the modules that read them agree: each slice index / role exactly once, none unread."""
    readers: dict[str, list] = {}
    for name in names:
        mod = model.get_submodule(name)
        if hasattr(mod, "factors_name"):
            readers.setdefault(mod.factors_name, []).append((name, mod))
    for name in names:
        mod = model.get_submodule(name)
        if not hasattr(mod, "n_slices") and not hasattr(mod, "n_heads"):
            continue
        got = readers.get(name, [])
        if hasattr(mod, "n_slices"):
            keys = sorted(i for _, m in got for i in range(m.index, m.index + m.slots))  # a matrix reads `slots` slices
            want, what = list(range(mod.n_slices)), "slice indices"
        else:
            keys, want, what = sorted(m.role for _, m in got), sorted({m.role for _, m in got}), "roles"
            if sum(m.slots for _, m in got) < mod.ranks[2]:  # U3 is (the readers' mode-3 slots) x R3
                want = f"distinct roles filling at least {mod.ranks[2]} mode-3 slots (R3)"
        if not got or keys != want:
            raise ValueError(f"compressed_modules[{name!r}]: read by {[n for n, _ in got]} with {what} {keys}; allowed: "
                             f"{want} (each exactly once); the checkpoint's config.json is corrupt or edited")


def check_checkpoint_tensors(model: nn.Module, names, checkpoint_files) -> None:
    """Before any tensor loads: the checkpoint holds exactly the factors the skeleton expects, at their shapes.

    Reads only the safetensors headers. A missing factor would otherwise load as uninitialised memory
    (transformers lists it as MISSING and goes on); an extra tensor under a factored module means the
    config.json and the weights do not belong together. Pickle-based files are refused, never opened.
    """
    files = [str(f) for f in checkpoint_files or []]
    for f in files:
        if not f.endswith(".safetensors"):
            raise ValueError(f"{f}: a compressed checkpoint is read only from .safetensors files (pickle-based "
                             "weights are never loaded); re-save it with hf_tensorcomp")
    if not files:
        return
    stored = read_headers(files)
    _check_unlisted(model, names, stored)
    for name in names:
        mod = model.get_submodule(name)
        nested = getattr(mod, "nested", False)  # a module whose tensors sit in its children (e.g. Gated DeltaNet)
        expected = {f"{name}.{k}": tuple(t.shape) for k, t in mod.named_parameters(recurse=nested)}
        expected.update({f"{name}.{k}": tuple(t.shape) for k, t in mod.state_dict().items()} if nested else
                        {f"{name}.{k}": tuple(t.shape) for k, t in mod.named_buffers(recurse=False)
                         if k not in mod._non_persistent_buffers_set})
        for key, shape in expected.items():
            if key not in stored:
                raise ValueError(f"{key}: missing from the checkpoint (compressed_modules[{name!r}] needs it, shape "
                                 f"{list(shape)}); the checkpoint is incomplete or corrupt")
            if stored[key] != shape:
                raise ValueError(f"{key}: the checkpoint holds shape {list(stored[key])}, compressed_modules[{name!r}] "
                                 f"needs {list(shape)}; the config.json and the weights do not belong together")
        extra = sorted(k for k in stored if k.startswith(name + ".") and k not in expected
                       and (nested or "." not in k[len(name) + 1:]))
        if extra:
            raise ValueError(f"{extra[0]}: unexpected in the checkpoint (compressed_modules[{name!r}] stores only "
                             f"{sorted(k.rpartition('.')[2] for k in expected)}); the config.json and the weights do not "
                             "belong together")


def read_headers(checkpoint_files) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of the checkpoint's safetensors files, each header checked whole and within its file
    (`shards._header`): a truncated or damaged file is refused in one line naming it, before anything loads."""
    from pathlib import Path

    from .shards import _header

    stored: dict[str, tuple[int, ...]] = {}
    for f in checkpoint_files or []:
        if str(f).endswith(".safetensors"):
            head, _ = _header(Path(f), "from_pretrained", any_dtype=True)
            stored.update({k: tuple(t["shape"]) for k, t in head.items()})
    return stored


def _check_unlisted(model: nn.Module, names, stored: dict[str, tuple[int, ...]]) -> None:
    """Tensors of the checkpoint held by a linear or embedding module that ``compressed_modules`` does not list
    (it is built dense) must be that dense module's own, at its shapes: a factor tensor there means the config.json
    lost the module's entry, and the load would ignore it and run another model."""
    listed = tuple(f"{n}." for n in names)
    for key in sorted(stored):
        owner, _, tensor = key.rpartition(".")
        if key.startswith(listed):
            continue
        try:
            mod = model.get_submodule(owner)
        except AttributeError:
            continue
        if not isinstance(mod, (nn.Linear, nn.Embedding)) or isinstance(mod, FactorizedModule):
            continue
        own = {k: tuple(t.shape) for k, t in mod.state_dict().items()}
        if own.get(tensor) != stored[key]:
            dense = ", ".join(f"{k} {list(v)}" for k, v in own.items())
            raise ValueError(f"{key} {list(stored[key])}: in the checkpoint, but compressed_modules lists no {owner!r}, "
                             f"which loads as a dense {type(mod).__name__} ({dense}); the config.json and the weights do "
                             "not belong together (was its entry deleted from config.json?)")


def checkpoint_identity(config, checkpoint_files) -> dict[str, tuple[int, int, int]]:
    """Before any tensor loads: which files the checkpoint is, to tell after loading whether another process
    rewrote the folder meanwhile (`check_unchanged`). (inode, size, modification time) of each weight file and
    of the config.json beside them; and that config.json must still hold the compressed modules this load
    read from it (a rewrite between reading the config and reading the headers changes it)."""
    import json
    import os
    from pathlib import Path

    files = [str(f) for f in checkpoint_files or []]
    if not files:
        return {}
    cfg_file = Path(files[0]).parent / "config.json"
    if cfg_file.is_file():
        files.append(str(cfg_file))
        try:
            saved = json.loads(cfg_file.read_text()).get("quantization_config", {}).get("compressed_modules")
        except (OSError, ValueError, AttributeError):
            saved = None
        if saved != json.loads(json.dumps(config.compressed_modules)):
            raise ValueError(f"{cfg_file}: changed while the checkpoint loaded (its compressed modules are no longer "
                             "those read at the start: another process is rewriting the folder); load it again once "
                             "the writer is done")
    snapshot = {}
    for f in files:
        st = os.stat(f)
        snapshot[f] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return snapshot


def check_unchanged(snapshot: dict[str, tuple[int, int, int]]) -> None:
    """After the tensors load: every file of `checkpoint_identity`'s snapshot is still the same file; else the
    headers checked and the tensors loaded may come from different saves (wrong outputs, or a crash at the
    first forward), and the load is refused."""
    import os

    for f, ident in snapshot.items():
        try:
            st = os.stat(f)
            now = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            now = None
        if now != ident:
            raise ValueError(f"{f}: changed while the checkpoint loaded (another process rewrote the folder, so the "
                             "checked headers and the loaded tensors may come from different saves); load it again "
                             "once the writer is done")
