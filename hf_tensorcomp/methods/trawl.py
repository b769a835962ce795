"""TRAWL: stack a layer's Q,K,V,O (or FFN) matrices into a 3-way tensor and decompose it (CP or Tucker).

Luo et al., "TRAWL: Tensor Reduced and Approximated Weights for Large Language Models".

Stacking (the tensor is n x O x N, one slice per matrix; the first largest matrix sets O x N):
- a matrix of shape O x N is stacked as is (the paper's QKVO when all four are square);
- a matrix of shape N x O is stacked transposed (the paper transposes one FFN matrix: for a gated
  MLP, down_proj; for a two-matrix MLP, fc_out; also Gemma's o_proj, whose shape is Q's transposed);
- grouped-query attention (K and V have n_kv * head_dim rows instead of n_heads * head_dim; the
  paper's models have none), option ``gqa``:
  - ``"group"`` (default): the slices are K's shape (n_kv * head_dim) x d_model; Q fills n_rep of
    them (slice r: the query heads g * n_rep + r of every KV group g) and so does O, stacked
    transposed (its columns that read those heads); K and V one each. The tensor is
    (2 n_rep + 2) x (n_kv * head_dim) x d_model and every weight enters it once; with multi-head
    attention (n_rep = 1) it is the paper's QKVO (O transposed when it is not square).
  - ``"repeat"``: K and V are stacked once per query head (query head h reads KV head h // n_rep, as
    in transformers) beside Q and O as they are; the approximation of K is the mean of its copies.
    K and V take n_rep times more room in the tensor than in the model (SmolLM2: 3x), which weights
    them more in the fit, and the factor A must serve n_heads * head_dim rows for all four. At 80 %
    of SmolLM2's attention parameters (Tucker, unwhitened) the grouped layout cuts Q's and O's
    errors for a little more on K's and V's (layer 15: Q 0.44 -> 0.27, K 0.20 -> 0.27, V 0.27 -> 0.33,
    O 0.58 -> 0.32). Whitened, whole model, unweighted fit: Gemma-3 13.7x -> 4.6x dense perplexity,
    SmolLM2 2.9x -> 3.6x (worse in closed form on its calibration kind of text; better on another kind
    and healed); with ``slice_weight="balanced"`` (the default) grouped: Gemma-3 2.4x, SmolLM2 2.6x.
``slice_weight`` (`slice_scales`): {matrix name: w}, e.g. {"k_proj": 0.3, "v_proj": 0.3}, makes the decomposition
fit w x that matrix's slices (each of its slots), so it spends more of the shared factors on a matrix weighted up
and less on one weighted down; the weight is then divided back out of the slice's row of the mode-0 factor (CP: its
coefficients; Tucker: its row of C, folded into its own core when R0 = n). ``"balanced"`` (the default): each
matrix's w is 1 / its RMS slice norm (whitened: in the whitened space), so the fit minimises the sum of the
matrices' relative errors; None is the paper's fit (every slice weighs 1), whose absolute error the matrix with
the largest norm dominates (SmolLM2's layer 0, unwhitened, per slice: K 132, Q 94, O 21, V 16). The stored model
and its forward are the same either way. Whole model (Tucker, 80 % of the attention's parameters, whitened,
grouped), balanced against unweighted: SmolLM2 2.6x against 3.6x dense perplexity, Gemma-3 2.4x against 4.6x;
K and V at a fixed 0.3 helped SmolLM2 (2.8x) and hurt Gemma-3 (8.2x).
Formulations: ``per_layer`` (default, the paper's), ``segmented`` (the model's early / middle / late
thirds, each one tensor over its chosen layers) and ``whole_model`` (one tensor over all chosen layers).

``rank``: CP rank R (int, or a fraction of min(O, N)); for Tucker an int R (ranks (n, R, R)), a float
fraction of O and N, or three ints (R0, R1, R2). ``target=<fraction>`` instead: each group keeps at
most that fraction of its matrices' weight parameters (K/V counted at their size in the model): CP
takes the largest R that fits; Tucker keeps R0 = n and chooses (R1, R2) greedily from the mode spectra
as TensorLLM does.

``whiten=True`` (needs ``calibration=``, ``per_layer``): the input mode N is read by every matrix
stacked as is; in a layer, Q, K, V (or gate, up) read the same normed hidden state x. The tensor is
whitened on that mode by S (S Sᵀ = XᵀX + λI of x, `whitening_factor`): T_i → T_i S, and S⁻ᵀ is
folded back into the shared factor B, so for those matrices the decomposition minimises the output
error ‖(W - W') Xᵀ‖ instead of ‖W - W'‖ (exactly so for each HOOI/ALS step) and the forward costs the
same. The other matrices (O, reading the attention output; down_proj, stacked transposed, whose N
mode is its *output*) ride along in the same coordinates — one shared B cannot carry a second S —
and afterwards their own slice core (CP: c_i; Tucker: M_i, when R0 = n) is refitted by least squares
to their own output error, from their own input Gram, for the factors that were found (`fit_core`;
O's slots in the grouped layout jointly, since they read parts of one input).
"""

from __future__ import annotations

import torch

from ..validation import choices, fail, is_int
from ..decompositions import CP, Tucker, cp_als, relative_error, tucker_hooi
from ..decompositions.allocation import multilinear_ranks
from ..decompositions.cp_tucker import fit_core, slice_scales
from ..decompositions.svd import unwhiten_factor, whiten_mode, whitening_factor
from ..layers import SharedFactors, TensorSlice
from .base import Method, check_slice_names, check_stacked_options, register_method, spec_fail

DECOMPOSITIONS = ("cp", "tucker")
GROUPS = {"qkvo": ("self_attn.*_proj",), "fc": ("mlp.*",)}
FORMULATIONS = ("per_layer", "segmented", "whole_model")
CONTAINER = "trawl_factors"


def _head_dim(cfg) -> int:
    hd = getattr(cfg, "head_dim", None)
    return hd or cfg.hidden_size // cfg.num_attention_heads


def stacking_plan(shapes: dict[str, tuple[int, int]], head_dim: int | None,
                  gqa: str = "repeat") -> tuple[tuple[int, int], dict[str, tuple[bool, int, int]]]:
    """The slices' shape (O, N) and how each matrix enters the n x O x N tensor: {name: (transposed, n_rep,
    slots)}, n = the sum of the slots; raises ValueError if one cannot."""
    ref = max(shapes.values(), key=lambda s: s[0] * s[1])
    out_dim, in_dim = ref
    plan = {}
    for name, (o, n) in shapes.items():
        if (o, n) == ref:
            plan[name] = (False, 1)
        elif (n, o) == ref:
            plan[name] = (True, 1)
        elif n == in_dim and out_dim % o == 0 and head_dim and o % head_dim == 0:
            plan[name] = (False, out_dim // o)
        else:
            raise ValueError(
                f"trawl: {name} ({o}x{n}) cannot be stacked with {out_dim}x{in_dim} matrices; allowed: the same shape, "
                "its transpose, or fewer rows by a whole number of attention heads (grouped-query K/V)"
            )
    n_rep = max(r for _, r in plan.values())
    if gqa == "repeat" or n_rep == 1:
        return ref, {name: (t, r, 1) for name, (t, r) in plan.items()}
    grouped = {}  # the slices as tall as K: Q and O (transposed: its columns read the heads) fill n_rep each
    for name, (o, n) in shapes.items():
        if plan[name][1] > 1:
            grouped[name] = (False, 1, 1)
        elif name.rpartition(".")[2] == "o_proj" and (n, o) == ref:
            grouped[name] = (True, 1, n_rep)
        elif (o, n) == ref and name.rpartition(".")[2] != "o_proj":
            grouped[name] = (False, 1, n_rep)
        else:
            raise ValueError(f"trawl: gqa='group' cannot stack {name} ({o}x{n}) by heads; allowed: query-shaped "
                             f"{ref[0]}x{ref[1]} matrices, o_proj ({ref[1]}x{ref[0]}) and K/V; or gqa='repeat'")
    return (ref[0] // n_rep, ref[1]), grouped


def stack(weights: dict[str, torch.Tensor], plan: dict[str, tuple[bool, int, int]], head_dim: int) -> torch.Tensor:
    slices = []
    for name, w in weights.items():
        transposed, n_rep, n_slots = plan[name]
        w = w.detach().float()
        if transposed:
            w = w.T
        n = w.shape[1]
        if n_rep > 1:
            kv = w.shape[0] // head_dim
            w = w.view(kv, 1, head_dim, n).expand(kv, n_rep, head_dim, n).reshape(kv * n_rep * head_dim, n)
        if n_slots > 1:  # slot r: the heads g * n_slots + r
            slices.extend(w.view(-1, n_slots, head_dim, n).transpose(0, 1).reshape(n_slots, -1, n))
        else:
            slices.append(w)
    return torch.stack(slices)


def slice_starts(plan: dict[str, tuple[bool, int, int]]) -> dict[str, int]:
    """Each matrix's first slice in the stack (its slots follow it)."""
    starts, i = {}, 0
    for name, (_, _, n_slots) in plan.items():
        starts[name], i = i, i + n_slots
    return starts


@register_method
class Trawl(Method):
    name = "trawl"
    default_rank = 64
    layer_types = ("tensor_slice",)
    supports_target = True
    remedy = ("a smaller rank (CP-ALS above the tensor's rank diverges), decomposition='tucker' (HOOI is stable), "
              "or init='random'")
    option_defaults = {"decomposition": "cp", "group": "fc", "formulation": "per_layer",
                       "n_iter_max": 100, "tol": 1e-6, "init": "svd", "seed": 0,
                       "whiten": False, "damping": 1e-4, "gqa": "group", "slice_weight": "balanced"}
    saved_defaults = {"gqa": "repeat"}  # the only layout before the option existed

    def validate_options(self, options):
        o = super().validate_options(options)
        if o["decomposition"] not in DECOMPOSITIONS:
            fail("decomposition", o["decomposition"], choices(DECOMPOSITIONS))
        if o["group"] not in GROUPS:
            fail("group", o["group"], choices(GROUPS))
        if o["formulation"] not in FORMULATIONS:
            fail("formulation", o["formulation"], choices(FORMULATIONS))
        check_stacked_options(o, "the shared input mode")
        if o["whiten"] and o["formulation"] != "per_layer":
            fail("whiten", o["whiten"], "False with formulation="
                 f"{o['formulation']!r} (matrices of different layers read different inputs), or formulation='per_layer'")
        return o

    def needs(self, entry):
        return frozenset({"gram"}) if entry.options["whiten"] else frozenset()

    def validate_rank(self, rank, options):
        if options["decomposition"] == "tucker" and isinstance(rank, (list, tuple)):
            if len(rank) != 3 or not all(is_int(r, 1) for r in rank):
                fail("rank", rank, "for Tucker: an int, a float in (0, 1], or three ints >= 1 (R0, R1, R2)")
            return list(rank)
        return super().validate_rank(rank, options)

    def targets_for(self, options):
        return GROUPS[options["group"]]

    def units(self, entry, layers, n_layers):
        f = entry.options["formulation"]
        if f == "per_layer":
            return [[i] for i in layers]
        if f == "whole_model":
            return [list(layers)] if layers else []
        thirds: dict[int, list[int]] = {}
        for i in layers:
            thirds.setdefault(min(2, i * 3 // n_layers), []).append(i)
        return [thirds[k] for k in sorted(thirds)]

    @staticmethod
    def _count(kind: str, n: int, out_dim: int, in_dim: int, ranks) -> int:
        """Parameters of a group's factors and slices (biases excluded)."""
        r0, r1, r2 = ranks
        return r0 * (out_dim + in_dim + n) if kind == "cp" else out_dim * r1 + in_dim * r2 + r0 * r1 * r2 + n * r0

    def _ranks(self, entry, n: int, out_dim: int, in_dim: int, original: int = 0, tensor=None) -> tuple[int, int, int]:
        r = entry.rank
        kind = entry.options["decomposition"]
        if entry.target is not None:  # a budget: at most target x the group's weight parameters
            budget = entry.target * original
            if kind == "cp":
                r = int(budget // (out_dim + in_dim + n))
                return (r, r, r)
            if tensor is None:  # planning on the meta model: the smallest setting must fit
                return (n, 1, 1) if self._count(kind, n, out_dim, in_dim, (n, 1, 1)) <= budget else (n, 0, 0)
            r12 = multilinear_ranks(tensor, (1, 2), lambda q: self._count(kind, n, out_dim, in_dim, (n, *q)), budget)
            return (n, *r12)
        if kind == "cp":
            r = r if isinstance(r, int) else max(1, round(r * min(out_dim, in_dim)))
            return (r, r, r)
        if isinstance(r, list):
            return tuple(r)
        if isinstance(r, float):
            return (n, max(1, round(r * out_dim)), max(1, round(r * in_dim)))
        return (n, min(r, out_dim), min(r, in_dim))

    def check_unit(self, modules, entry, ctx):
        if len(modules) < 2:
            raise ValueError(f"trawl: group {entry.options['group']!r} found only {sorted(modules)}; allowed: a group of at least 2 matrices")
        (out_dim, in_dim), plan = stacking_plan({k: tuple(m.weight.shape) for k, m in modules.items()},
                                                _head_dim(ctx.config), entry.options["gqa"])
        n = sum(p[2] for p in plan.values())
        check_slice_names(entry.options, [k.rpartition(".")[2] for k in modules])
        original = sum(m.weight.numel() for m in modules.values())
        r0, r1, r2 = self._ranks(entry, n, out_dim, in_dim, original)
        if min(r0, r1, r2) < 1:
            least = self._count(entry.options["decomposition"], n, out_dim, in_dim,
                                (1, 1, 1) if entry.options["decomposition"] == "cp" else (n, 1, 1))
            fail("target", entry.target, f"at least {least / original:.4f} for this {n} x {out_dim} x {in_dim} "
                 "group (its smallest factors)")
        most = n * out_dim * in_dim // max(n, out_dim, in_dim)
        if entry.options["decomposition"] == "cp" and r0 > most:
            raise ValueError(f"TensorCompressionConfig.rank: got CP rank {r0}; allowed: at most {most} for this "
                             f"{n} x {out_dim} x {in_dim} tensor (the largest CP rank a tensor of that shape can "
                             "have: more cannot help, and CP-ALS above it diverges)")
        if entry.options["decomposition"] == "tucker" and (r0 > n or r1 > out_dim or r2 > in_dim):
            raise ValueError(f"TensorCompressionConfig.rank: got Tucker ranks {(r0, r1, r2)}; allowed: at most "
                             f"({n}, {out_dim}, {in_dim}) for this {n} x {out_dim} x {in_dim} tensor")

    def check_spec(self, name, spec, entry, unit, ctx):
        hd = _head_dim(ctx.config)
        _, plan = stacking_plan({n: tuple(m.weight.shape) for n, m in unit.items()}, hd, entry.options["gqa"])
        transposed, n_rep, n_slots = plan[name]
        want = {"factors": f"{next(iter(unit)).rpartition('.')[0]}.{CONTAINER}", "index": slice_starts(plan)[name],
                "transposed": transposed, "n_rep": n_rep, "slots": n_slots}
        if n_rep > 1 or n_slots > 1:
            want["head_dim"] = hd
        for field, value in want.items():
            if spec.get(field, 1) != value:  # `slots` is left out of the spec when 1
                spec_fail(name, field, spec.get(field, 1), value, entry)
        return want["factors"]

    def compress(self, modules, entry, ctx):
        opts = entry.options
        hd = _head_dim(ctx.config)
        weights = {k: m.weight for k, m in modules.items()}
        (out_dim, in_dim), plan = stacking_plan({k: tuple(w.shape) for k, w in weights.items()}, hd, opts["gqa"])
        tensor = stack(weights, plan, hd)
        n, starts = len(tensor), slice_starts(plan)
        s, shared = None, set(weights)
        if opts["whiten"]:
            if ctx.stats is None:
                raise ValueError("TensorCompressionConfig.whiten=True needs calibration statistics; pass calibration=")
            ref = next(k for k in weights if not plan[k][0])  # Q or gate: read the layer's normed hidden state
            s = whitening_factor(ctx.stats[ref].gram, opts["damping"])
            shared = {k for k in weights if not plan[k][0] and torch.equal(ctx.stats[k].gram, ctx.stats[ref].gram)}
            fitted = whiten_mode(tensor, s, 2).float()
        else:
            fitted = tensor
        scale = slice_scales(fitted, 0, {k: (starts[k], plan[k][2]) for k in plan}, opts["slice_weight"])
        fitted = fitted * scale[:, None, None]
        original = sum(w.numel() for w in weights.values())
        ranks = self._ranks(entry, n, out_dim, in_dim, original, fitted)
        kw = dict(n_iter_max=opts["n_iter_max"], tol=opts["tol"], init=opts["init"], seed=opts["seed"])
        dtype = next(iter(weights.values())).dtype
        cp = opts["decomposition"] == "cp"
        if cp:
            c, a, b = cp_als(fitted, ranks[0], **kw).weights_folded
            core = None
        else:
            d = tucker_hooi(fitted, ranks, **kw)
            c, a, b = d.factors
            core = d.core
        c = c / scale[:, None].to(c)  # slice i of the fit is scale_i x T_i: its own approximation is row i / scale_i
        refit = []
        if s is not None:
            b = unwhiten_factor(s, b).float()
            if not cp and ranks[0] == n:  # slice cores free: M_i = G[i], C = I
                core, c = torch.einsum("ik,kab->iab", c, core), torch.eye(n, device=core.device)
            for name, (transposed, n_rep, n_slots) in plan.items():
                if name in shared or n_rep > 1 or (not cp and ranks[0] < n):
                    continue
                p = whitening_factor(ctx.stats[name].gram, opts["damping"])
                p = p @ p.T  # this matrix's own input metric: on T_i's rows if stacked transposed, else its columns
                i = starts[name]
                if n_slots == 1:
                    m = fit_core(tensor[i], a, b, *((p, None) if transposed else (None, p)), diagonal=cp).float()
                else:  # O's slots read parts of one input: W[:, slot order] = B [M_0ᵀ .. M_{s-1}ᵀ] diag(Aᵀ, .., Aᵀ)
                    cols = torch.arange(p.shape[0], device=p.device).view(-1, n_slots, hd).transpose(0, 1).reshape(-1)
                    m = fit_core(weights[name].detach().float()[:, cols], b, torch.block_diag(*[a] * n_slots), None,
                                 p[cols][:, cols], diagonal=cp).float()
                    m = m if cp else m.T.reshape(n_slots, -1, m.shape[0])  # -> (slots, R1, R2): M_r
                if cp:
                    c[i:i + n_slots] = m
                else:
                    core[i:i + n_slots] = m
                refit.append(name)
        recon = CP([c, a, b]) if cp else Tucker(core, [c, a, b])
        group_err = relative_error(tensor, recon.reconstruct())
        first = next(iter(modules))
        container_name = f"{first.rpartition('.')[0]}.{CONTAINER}"
        factors = SharedFactors(opts["decomposition"], n, out_dim, in_dim, ranks, dtype=dtype, device=a.device)
        with torch.no_grad():
            factors.out_factor.copy_(a)
            factors.in_factor.copy_(b)
            if core is not None:
                factors.core.copy_(core)
        info = {"ranks": list(ranks), "rel_error": group_err, "tensor": [n, out_dim, in_dim],
                "params_original": original, "params_compressed": self._count(opts["decomposition"], n, out_dim, in_dim, ranks)}
        if s is not None:
            info.update(whitened=sorted(shared), refit=refit)
        out = {container_name: (factors, info)}
        for name, lin in modules.items():
            transposed, n_rep, n_slots = plan[name]
            i = starts[name]
            sl = TensorSlice(factors, f"{ctx.prefix}.{container_name}", i, transposed, n_rep, hd,
                             bias=lin.bias is not None, dtype=dtype, device=a.device, slots=n_slots)
            with torch.no_grad():
                sl.weight.copy_(c[i:i + n_slots].reshape(-1))
                if lin.bias is not None:
                    sl.bias.copy_(lin.bias)
                err = relative_error(lin.weight, sl.dense_weight())
            out[name] = (sl, {"rel_error": err, "group": f"{ctx.prefix}.{container_name}", "group_rel_error": group_err})
        return out
