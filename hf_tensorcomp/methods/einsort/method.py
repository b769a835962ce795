"""EinSort on weights: sort, map magnitudes, tensorize each chosen linear layer (Koike-Akino et al.).

Each targeted ``nn.Linear`` W (out x in) becomes an `EinSortLinear`. How W becomes a tensor:

- ``sort_dim="in"`` (default) sorts the entries of each row (along the input axis); ``"out"``
  sorts along the output axis (the layer stores W^T).
- ``sort="shared"`` (default, EinSort): the rows are taken in consecutive groups of ``group``,
  W -> X (out/group, group, in); every row of a group uses one permutation of the inputs, computed
  from the mapped entries reduced over the group (``reduce_over=1``, ``sort_axis=2``): out/group
  permutations of ceil(log2 in) bits per index. ``"full"``: one permutation per row (the reference;
  at 16-bit factors its indices alone take ceil(log2 in)/16 of the dense bytes). ``"none"``: plain.
- the sorted tensor is decomposed as a matrix (out x in) by SVD, or, for TT / TR / CP / Tucker, as
  the 3-way tensor (out/group, group, in) unless ``fold`` gives another shape.
- ``nonnegative`` (default True, the paper's best): decompose f(|W|) (f: the ``mapping``), keep the
  sign bits. ``gauge``: ``"auto"`` = block identity (CP: canonical).
- ``cache_weight`` (default True): the layer rebuilds its dense weight once and keeps it (dense
  speed, the dense weight's memory); False rebuilds it at every forward (least memory). Saved with
  the checkpoint; ``layer.cache_weight`` can also be switched on a loaded model.

``rank``: an int (the bond rank; SVD: at most min(out, in)) or a list of bond ranks. ``target``
instead: a float in (0, 1), the byte budget per matrix as a fraction of its dense bytes at the factor
dtype — honest bytes, so permutation indices, sign bits and pivots come out of the same budget
(`check_unit` fails before loading weights if they alone exceed it). A float ``rank`` (the old
spelling of the byte budget) is refused with a message saying to write ``target=``.

Activation-aware (ASVD-style, the paper's Appendix H): ``activation_scales="calibration"`` takes
each module's mean |input| from the calibration pipeline (``calibration=`` text, layer by layer), or
``activation_scales`` names a safetensors file of per-module mean |input| vectors (`activation_scales` / `save_activation_scales` below, from
calibration text); W diag(s), s = mean|x|^alpha, is what gets sorted and decomposed.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from ...validation import fail, choices, is_int
from ...decompositions import relative_error
from ...decompositions.tensor_networks import GAUGES, NETWORKS, bond_ranks
from ..base import Method, register_method, spec_fail
from . import decomposition as es
from .layer import EinSortLinear

SORTS = ("shared", "full", "none")
SORT_DIMS = ("in", "out")
CALIBRATED = "calibration"  # activation_scales from the calibration pipeline instead of a file
FACTOR_DTYPES = (None, "float32", "bfloat16", "float16")


@register_method
class EinSort(Method):
    name = "einsort"
    default_targets = ("self_attn.*_proj", "mlp.*_proj")
    default_rank = None
    default_target = 0.5
    layer_types = ("einsort_linear",)
    remedy = ("a larger rank, network='svd', more n_iter_max, or nonnegative=False (a sorted non-negative fit of "
              "a random-like weight can be worse than zeros at low rank)")
    option_defaults = {
        "network": "svd", "sort": "shared", "group": 8, "sort_dim": "in", "mapping": ["pow", 0.5],
        "reduction": "prod", "nonnegative": True, "gauge": "auto", "fold": None, "factor_dtype": None,
        "steps": 0, "lr": 1e-2, "n_iter_max": 100, "tol": 1e-7, "seed": 0,
        "activation_scales": None, "alpha": 0.5, "cache_weight": True,
    }

    def validate_options(self, options):
        o = super().validate_options(options)
        if o["network"] not in NETWORKS:
            fail("network", o["network"], choices(NETWORKS))
        if o["sort"] not in SORTS:
            fail("sort", o["sort"], choices(SORTS))
        if not is_int(o["group"], 1):
            fail("group", o["group"], "an int >= 1 (rows sharing one permutation)")
        if o["sort_dim"] not in SORT_DIMS:
            fail("sort_dim", o["sort_dim"], choices(SORT_DIMS))
        try:
            o["mapping"] = list(es.parse_mapping(o["mapping"]))
        except ValueError:
            fail("mapping", o["mapping"], choices(es.MAPPINGS) + ", or [name, p] with p > 0")
        if o["reduction"] not in es.REDUCTIONS:
            fail("reduction", o["reduction"], choices(es.REDUCTIONS))
        for key in ("nonnegative", "cache_weight"):
            if not isinstance(o[key], bool):
                fail(key, o[key], "True | False")
        if o["gauge"] == "auto":
            pass
        elif o["gauge"] not in GAUGES:
            fail("gauge", o["gauge"], "'auto' | " + choices(GAUGES))
        elif o["gauge"] == "block_identity" and o["network"] == "cp":
            fail("gauge", o["gauge"], "'auto' | None | 'canonical' for network 'cp' (CP has only a scaling gauge)")
        if o["fold"] is not None and (not isinstance(o["fold"], (list, tuple)) or not o["fold"]
                                      or not all(is_int(s, 1) for s in o["fold"])):
            fail("fold", o["fold"], "None or a list of ints >= 1 whose product is the matrix's size")
        if o["fold"] is not None:
            o["fold"] = list(o["fold"])
            if o["network"] == "svd" and len(o["fold"]) != 2:
                fail("fold", o["fold"], "None or two ints for network 'svd'")
        if o["factor_dtype"] not in FACTOR_DTYPES:
            fail("factor_dtype", o["factor_dtype"], choices(FACTOR_DTYPES))
        for key, lo in (("steps", 0), ("n_iter_max", 1)):
            if not is_int(o[key], lo):
                fail(key, o[key], f"an int >= {lo}")
        for key in ("lr", "tol", "alpha"):
            if isinstance(o[key], bool) or not isinstance(o[key], (int, float)) or not o[key] > 0:
                fail(key, o[key], "a number > 0")
        if not isinstance(o["seed"], int) or isinstance(o["seed"], bool):
            fail("seed", o["seed"], "an int")
        path = o["activation_scales"]
        # the file itself is read by check_unit (before any weight loads), not here: a saved compressed
        # checkpoint keeps the path in its config and must reload where the file does not exist
        if path is not None and not isinstance(path, (str, os.PathLike)):
            fail("activation_scales", path, "None or the path of a safetensors file of per-module scales "
                  "(hf_tensorcomp.methods.einsort.save_activation_scales)")
        if path is not None:
            o["activation_scales"] = str(path)
        return o

    def needs(self, entry):
        return frozenset({"abs_mean"}) if entry.options["activation_scales"] == CALIBRATED else frozenset()

    supports_target = True

    def validate_rank(self, rank, options):
        if isinstance(rank, float):
            fail("rank", rank, f"an int >= 1 or a list of bond ranks; for a byte budget write target={rank} "
                 "(the fraction of each matrix's dense bytes kept; a float rank no longer means bytes)")
        if isinstance(rank, (list, tuple)):
            if not rank or not all(is_int(r, 1) for r in rank):
                fail("rank", rank, "an int >= 1 or a list of bond ranks >= 1 (byte budgets: target=<fraction>)")
            return list(rank)
        return super().validate_rank(rank, options)

    def validate_target(self, target, options):
        if not isinstance(target, (int, float)) or isinstance(target, bool) or not 0 < target < 1:
            fail("target", target, "a float in (0, 1): the fraction of each matrix's dense bytes kept")
        return float(target)

    # -- how a weight becomes the fitted tensor ---------------------------------------------
    @staticmethod
    def _layout(out_features: int, in_features: int, o: dict) -> dict:
        rows, cols = (in_features, out_features) if o["sort_dim"] == "out" else (out_features, in_features)
        g = o["group"]
        shape3 = (rows // g, g, cols) if rows % g == 0 else None
        if o["sort"] == "shared":
            shape, sort_axis, reduce_over = shape3, 2, 1
        elif o["sort"] == "full":
            shape, sort_axis, reduce_over = (rows, cols), 1, None
        else:
            shape, sort_axis, reduce_over = (rows, cols), None, None
        if o["fold"] is not None:
            fold = tuple(o["fold"])
        elif o["network"] == "svd":
            fold = (rows, cols)
        else:
            fold = shape3
        gauge = o["gauge"] if o["gauge"] != "auto" else ("canonical" if o["network"] == "cp" else "block_identity")
        return {"rows": rows, "cols": cols, "shape": shape, "sort_axis": sort_axis, "reduce_over": reduce_over,
                "fold": fold, "gauge": gauge}

    def check_unit(self, modules, entry, ctx):
        o = entry.options
        if o["activation_scales"] and o["activation_scales"] != CALIBRATED:
            _check_scales(o["activation_scales"], {f"{ctx.prefix}.{n}": m.in_features for n, m in modules.items()})
        for name, mod in modules.items():
            where = f"{ctx.prefix}.{name} ({mod.out_features}x{mod.in_features})"
            lay = self._layout(mod.out_features, mod.in_features, o)
            if lay["shape"] is None or lay["fold"] is None:
                fail("group", o["group"], f"a divisor of {lay['rows']} (the rows of {where} that are sorted)")
            if math.prod(lay["fold"]) != lay["rows"] * lay["cols"]:
                fail("fold", o["fold"], f"a shape with {lay['rows'] * lay['cols']} entries for {where}")
            full = min(mod.out_features, mod.in_features)
            if o["network"] == "svd" and isinstance(entry.rank, int) and entry.rank > full:
                fail("rank", entry.rank, f"an int in [1, {full}] for {where}, or target=<byte fraction in (0, 1)>")
            if isinstance(entry.rank, list):
                bond_ranks(o["network"], lay["fold"], entry.rank)  # raises on a wrong count
            most = math.prod(lay["fold"]) // max(lay["fold"])  # no tensor of this shape has a higher CP rank
            top = max(entry.rank) if isinstance(entry.rank, list) else entry.rank
            if o["network"] == "cp" and isinstance(top, int) and top > most:
                fail("rank", entry.rank, f"at most {most} for network 'cp' on {where} folded to {tuple(lay['fold'])} "
                      "(the largest CP rank a tensor of that shape can have)")
            if entry.target is not None:
                fdtype = _factor_dtype(o, mod.weight.dtype)
                dense = mod.out_features * mod.in_features * torch.empty(0, dtype=fdtype).element_size()
                over = es.overhead_bytes(lay["shape"], lay["sort_axis"], lay["reduce_over"], o["nonnegative"])
                over += mod.in_features * torch.empty(0, dtype=fdtype).element_size() if o["activation_scales"] else 0
                if es.rank_for_budget(int(entry.target * dense), o["network"], lay["fold"], lay["gauge"], fdtype, over) is None:
                    least = (over + es.network_bytes(o["network"], lay["fold"], 1, lay["gauge"], fdtype)) / dense
                    fail("target", entry.target, f"a byte fraction >= {least:.3f} for {where} with sort={o['sort']!r}: the "
                          f"permutation{' and sign' if o['nonnegative'] else ''} bits alone take {over / dense:.3f} of its dense bytes")

    def check_spec(self, name, spec, entry, unit, ctx):
        o, old = entry.options, unit[name]
        lay = self._layout(old.out_features, old.in_features, o)
        want = {"transposed": o["sort_dim"] == "out", "scaled": o["activation_scales"] is not None,
                "factor_dtype": o["factor_dtype"]}
        for field, value in want.items():
            if spec[field] != value:
                spec_fail(name, field, spec[field], value, entry)
        meta = spec["einsort"]
        want = {"network": o["network"], "mapping": list(o["mapping"]), "reduction": o["reduction"],
                "nonnegative": o["nonnegative"], "shape": list(lay["shape"]), "sort_axis": lay["sort_axis"]}
        for field, value in want.items():
            if meta.get(field) != value:
                spec_fail(name, f"einsort.{field}", meta.get(field), value, entry)
        return None

    def compress(self, modules, entry, ctx):
        o = entry.options
        if o["activation_scales"] == CALIBRATED:  # mean |x| of each module's inputs, from the pipeline
            scales = {f"{ctx.prefix}.{n}": st.abs_mean for n, st in (ctx.stats or {}).items()}
        else:
            scales = _load_scales(o["activation_scales"]) if o["activation_scales"] else None
        out = {}
        for name, lin in modules.items():
            w = lin.weight.detach().float()
            fdtype = _factor_dtype(o, lin.weight.dtype)
            lay = self._layout(lin.out_features, lin.in_features, o)
            s = None
            if scales is not None:
                full = f"{ctx.prefix}.{name}"
                if full not in scales:
                    raise ValueError(f"TensorCompressionConfig.activation_scales: no entry for {full} in {o['activation_scales']}; "
                                     f"allowed: a file with one vector per compressed module ({len(scales)} found)")
                s = scales[full].float().to(w.device).clamp_min(1e-6).pow(o["alpha"])
                s = s / s.mean()
            target = w * s if s is not None else w
            m = target.T if o["sort_dim"] == "out" else target
            rank = entry.rank
            if entry.target is not None:  # budget minus the scale vector, which the fit does not see
                dense = w.numel() * torch.empty(0, dtype=fdtype).element_size()
                extra = 0 if s is None else lin.in_features * torch.empty(0, dtype=fdtype).element_size()
                over = es.overhead_bytes(lay["shape"], lay["sort_axis"], lay["reduce_over"], o["nonnegative"]) + extra
                rank = es.rank_for_budget(int(entry.target * dense), o["network"], lay["fold"], lay["gauge"], fdtype, over)
            fitted = es.fit(m.reshape(lay["shape"]), o["network"], rank, sort_axis=lay["sort_axis"],
                            reduce_over=lay["reduce_over"], mapping=tuple(o["mapping"]), reduction=o["reduction"],
                            nonnegative=o["nonnegative"], gauge=lay["gauge"], fold=lay["fold"], dtype=fdtype,
                            steps=o["steps"], lr=o["lr"], n_iter_max=o["n_iter_max"], tol=o["tol"], seed=o["seed"])
            layer = EinSortLinear.from_fitted(fitted, lin.in_features, lin.out_features, transposed=o["sort_dim"] == "out",
                                              bias=None if lin.bias is None else lin.bias.detach(),
                                              in_scale=None if s is None else s.to(fdtype), factor_dtype=o["factor_dtype"],
                                              dtype=lin.weight.dtype, cache_weight=o["cache_weight"])
            approx = layer._weight_fp32()
            dense_bytes = w.numel() * torch.empty(0, dtype=fdtype).element_size()
            st = fitted.storage()
            out[name] = (layer, {
                "rank": rank if isinstance(rank, int) else list(rank),
                "ranks": bond_ranks(o["network"], lay["fold"], rank),
                "rel_error": relative_error(w, approx),
                "bytes": layer.nbytes(), "dense_bytes": dense_bytes, "byte_ratio": round(layer.nbytes() / dense_bytes, 6),
                "bytes_factors": st["factors"], "bytes_perm": st["perm"], "bytes_signs": st["signs"],
                "bytes_pivots": st["pivots"],
            })
        return out


def _factor_dtype(o: dict, weight_dtype: torch.dtype) -> torch.dtype:
    return getattr(torch, o["factor_dtype"]) if o["factor_dtype"] else weight_dtype


# --------------------------------------------------------------------------------------------
# activation-aware scaling (ASVD): mean |input| per channel of every linear layer, from calibration text
# --------------------------------------------------------------------------------------------

def _load_scales(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        fail("activation_scales", path, "None or the path of an existing safetensors file of per-module scales "
             "(hf_tensorcomp.methods.einsort.save_activation_scales)")
    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own error types for a file that is not one
        fail("activation_scales", path, f"a safetensors file written by save_activation_scales ({type(e).__name__}: {e})")


def _check_scales(path: str, widths: dict[str, int]) -> None:
    """Before any weight loads: the scales file has a finite, positive-length vector of the right size per module."""
    scales = _load_scales(path)
    for name, n in widths.items():
        if name not in scales:
            fail("activation_scales", path, f"a file with one vector per compressed module; it has none for {name} "
                 f"({len(scales)} vectors, e.g. {sorted(scales)[:2]})")
        s = scales[name]
        if tuple(s.shape) != (n,) or not s.is_floating_point() or not bool(torch.isfinite(s).all()):
            fail("activation_scales", path, f"for {name} a finite float vector of length {n} (its in_features); "
                 f"got shape {list(s.shape)}, dtype {s.dtype}")


@torch.no_grad()
def activation_scales(model: nn.Module, tokenizer, texts: list[str] | None = None, source: str = "wikipedia",
                      max_tokens: int = 8192, context_length: int = 512, progress: bool = False) -> dict[str, torch.Tensor]:
    """Mean absolute input activation per input channel of every ``nn.Linear`` (keys: full module names).

    Runs `model` over calibration text — ``texts``, else `hf_tensorcomp.assets.load_text(source, "calib")`
    (held apart from the evaluation split) — in windows of ``context_length`` tokens up to ``max_tokens``.
    """
    from tqdm.auto import tqdm

    if texts is None:
        from ...assets import load_text

        texts = load_text(source, "calib")
    ids = tokenizer("\n\n".join(texts), return_tensors="pt").input_ids[0][:max_tokens]
    sums: dict[str, torch.Tensor] = {}
    count = [0]
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            def hook(m, inp, _out, name=name):
                x = inp[0].detach().float().abs().reshape(-1, inp[0].shape[-1])
                sums[name] = sums.get(name, 0) + x.sum(0)
            hooks.append(mod.register_forward_hook(hook))
    device = next(model.parameters()).device
    try:
        for start in tqdm(range(0, len(ids), context_length), disable=not progress, desc="hf_tensorcomp: calibration"):
            chunk = ids[start: start + context_length][None].to(device)
            model(chunk)
            count[0] += chunk.numel()
    finally:
        for h in hooks:
            h.remove()
    return {k: (v / count[0]).cpu() for k, v in sums.items()}


def save_activation_scales(scales: dict[str, torch.Tensor], path) -> str:
    """Write `activation_scales` output as safetensors (the file ``activation_scales=`` expects), replacing a file
    there (a temporary sibling renamed into place)."""
    from safetensors.torch import save_file

    from ...atomic import atomic_file

    with atomic_file(path) as tmp:
        save_file({k: v.contiguous().float() for k, v in scales.items()}, str(tmp))
    return str(path)
