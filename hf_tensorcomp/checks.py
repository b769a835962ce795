"""The checks every compression and every reload goes through, in one place.

- `check_inputs` / `check_outputs`: around each unit `surgery.compress_model` compresses: dense
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
        err = stats.get("rel_error")
        if bad:
            what = f"its factors ({', '.join(bad)}) hold NaN/Inf"
        elif err is None or not err < 1.0:  # also NaN
            what = (f"its relative error is {err} (>= 1: worse than replacing the weight by zeros)")
        else:
            continue
        raise ValueError(f"hf_tensorcomp: compressing {where} with {_setting(entry)} failed: {what}; nothing "
                         f"was kept. Try {remedy}")


def check_loaded(model: nn.Module) -> None:
    """After a compressed checkpoint loads: factors finite, EinSort permutations valid (names the module)."""
    for name, mod in model.named_modules():
        if not isinstance(mod, FactorizedModule):
            continue
        for tname, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            if _non_finite(t):
                raise ValueError(f"{name}.{tname}: the checkpoint's factor holds NaN/Inf; the checkpoint is corrupt "
                                 "(re-create or re-download it)")
        validate = getattr(mod, "validate_loaded", None)
        if validate is not None:
            validate(name)
