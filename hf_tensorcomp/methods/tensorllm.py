"""TensorLLM: multi-head tensorisation of Q, K, V, O^T and Tucker with factors shared by all heads.

Gu et al., "TensorLLM: Tensorising Multi-Head Attention for Enhanced Reasoning and Compression in LLMs".

Per chosen layer, each projection is split by head into d_model x d_head matrices (W_i^Q, W_i^K,
W_i^V, and (W_i^O)^T: the columns of o_proj that read head i), stacked into
W_all (d_model x d_head x m x h) and decomposed by HOOI over the first three modes only (a partial
Tucker: tensorly.partial_tucker), so U1, U2, U3 are shared by all heads and every head keeps its own
core (the paper's Eq. 10, mode 4 with an identity factor). m is the number of projections targeted:
4 by default (the paper), 1 for its ablation on a single matrix type.

Grouped-query attention (the paper's models have none), option ``gqa``:

- ``"group"`` (default): one slab per *KV group* — the n_rep query heads that read KV head g, K_g,
  V_g and those heads' O columns: W_all is d_model x d_head x (2 n_rep + 2) x n_kv. Every weight
  enters the tensor once, so a full-rank Tucker holds exactly the layer's weights and a parameter
  budget buys rank, not copies. With multi-head attention (n_rep = 1) it is the paper's tensor.
- ``"repeat"``: one slab per *query* head (i reads KV head i // n_rep, as in transformers), K and V
  repeated in every slab of their group: d_model x d_head x m x h, KV head g read back as the mean
  of its copies. The paper's one-slab-per-head structure, but a full-rank core holds n_rep copies of
  K and V (Gemma-3-270M: 2.6 M core entries for 1.6 M weights), so at a budget below the weights'
  count it pays for the copies with rank: at 80 % of the attention's parameters the reconstruction
  error of Gemma-3-270M's layers is 0.42-0.48 against 0.28-0.34 grouped.

``slice_weight``: as TRAWL's (``"balanced"``, the default: each matrix's slots scaled to the same norm, whitened
when whitened; None, the paper's unweighted fit; or {matrix name: w}), on mode 3: the fit sees w x each matrix's
slots and U3's rows are divided by w after it. Whitened, grouped, 80 % of the attention's parameters, balanced
against unweighted: SmolLM2 2.4x against 3.05x dense perplexity, Gemma-3 2.4x against 4.6x.

Ranks: ``ranks=(R1, R2, R3)``, or ``ratio=CR`` — the paper's compression rate (the layer's original
attention weight count over the compressed count, biases excluded) — for which ranks are chosen
from the mode spectra: starting at full rank, repeatedly drop the rank whose discarded squared
singular value (of that mode's unfolding) per parameter saved is smallest, until the count fits.

``whiten=True`` (needs ``calibration=``): mode 1 (d_model) is the *input* side of every Q, K and V
slab, and all of them read the same normed hidden state x. The tensor is whitened on that mode by S
(S Sᵀ = XᵀX + λI, `whitening_factor`): W_all → W_all ×1 Sᵀ, ranks are chosen from the whitened
spectra, and S⁻ᵀ is folded back into U1 — so for Q, K, V the HOOI minimises the output error
‖X (W - W')‖ and the forward costs what it costs without whitening. (W^O)ᵀ's d_model mode is its
*output* side and its input (the attention output, read through mode 2, which Q/K/V use as their
output side) is another tensor, so one shared U1 / U2 cannot whiten it: it rides along in the same
coordinates, and afterwards, when R3 = m (every matrix its own core), its per-head cores are refitted
jointly by least squares to o_proj's own output error from o_proj's input Gram (`fit_core`).
"""

from __future__ import annotations

import torch

from ..validation import fail, is_int, is_number
from ..decompositions import relative_error, tucker_hooi
from ..decompositions.allocation import multilinear_ranks
from ..decompositions.cp_tucker import fit_core, slice_scales
from ..decompositions.svd import unwhiten_factor, whiten_mode, whitening_factor
from ..layers import HeadTuckerFactors, HeadTuckerProjection
from .base import Method, check_slice_names, check_stacked_options, register_method, spec_fail

ROLE_OF = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o"}
CONTAINER = "tensorllm_factors"


def attention_shape(cfg) -> tuple[int, int, int, int]:
    """(d_model, head_dim, n_heads, n_kv_heads) of a transformers text config."""
    h = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    return cfg.hidden_size, hd, h, getattr(cfg, "num_key_value_heads", None) or h


def head_slices(weights: dict[str, torch.Tensor], head_dim: int, slabs: int) -> torch.Tensor:
    """W_all (d_model x head_dim x M x slabs), fp32, from {role: dense weight} in the order given.

    A matrix of g heads (q/o: the query heads, k/v: the KV heads) with g >= slabs fills g // slabs
    consecutive mode-3 slots of every slab (slab s holds its heads s*g//slabs ..); one with fewer
    heads than slabs (K/V, ``gqa="repeat"``) fills one slot, repeated per slab (slab i holds head
    i // (slabs // g), as transformers reads it). ``slabs`` = the query heads (``"repeat"``) or the
    KV heads (``"group"``)."""
    parts = []
    for role, w in weights.items():
        a = w.detach().float()
        a = a.T if role == "o" else a  # (g*hd, d_model): head i's rows are (W_i)^T (o: its columns, transposed)
        g = a.shape[0] // head_dim
        if g >= slabs:
            parts.append(a.view(slabs, g // slabs, head_dim, -1).permute(3, 2, 1, 0))
        else:
            parts.append(a.view(g, head_dim, -1).permute(2, 1, 0).repeat_interleave(slabs // g, dim=2).unsqueeze(2))
    return torch.cat(parts, dim=2)


def role_layout(role: str, h: int, kv: int, gqa: str) -> tuple[int, int]:
    """(n_rep, slots) of a projection: grouped, q/o fill n_rep mode-3 slots per slab and k/v one;
    repeated, every role fills one slot and k/v are read back as the mean of their n_rep copies."""
    if gqa == "group":
        return 1, (h // kv if role in "qo" else 1)
    return (h // kv if role in "kv" else 1), 1


def slots(roles, h: int, kv: int, gqa: str) -> dict[str, int]:
    """Mode-3 slots per role, in the order given."""
    return {r: role_layout(r, h, kv, gqa)[1] for r in roles}


def param_count(d_model: int, head_dim: int, m: int, h: int, ranks) -> int:
    r1, r2, r3 = ranks
    return d_model * r1 + head_dim * r2 + m * r3 + r1 * r2 * r3 * h


def ranks_for_ratio(tensor: torch.Tensor, original: int, ratio: float) -> tuple[int, int, int]:
    """Multilinear ranks (R1, R2, R3) whose parameter count is at most ``original / ratio``
    (`multilinear_ranks`: greedy on the spectra of the mode-1..3 unfoldings)."""
    d, hd, m, h = tensor.shape
    ranks = multilinear_ranks(tensor, (0, 1, 2), lambda r: param_count(d, hd, m, h, r), original / ratio)
    if ranks is None:
        most = original / param_count(d, hd, m, h, (1, 1, 1))
        raise ValueError(f"TensorCompressionConfig.ratio: got {ratio}; allowed: at most {most:.1f} for this layer "
                         "(ranks (1, 1, 1) already)")
    return tuple(ranks)


@register_method
class TensorLLM(Method):
    name = "tensorllm"
    default_targets = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    default_rank = None
    layer_types = ("head_tucker_projection",)
    remedy = "larger ranks or a smaller ratio"
    supports_target = True
    option_defaults = {"ranks": None, "ratio": None, "n_iter_max": 50, "tol": 1e-4, "init": "svd", "seed": 0,
                       "whiten": False, "damping": 1e-4, "gqa": "group", "slice_weight": "balanced"}
    saved_defaults = {"gqa": "repeat"}  # the only layout before the option existed

    def validate_options(self, options):
        o = super().validate_options(options)
        if o["ranks"] is not None and o["ratio"] is not None:
            fail("ranks", o["ranks"], "exactly one of ranks=(R1, R2, R3), ratio=<compression rate > 1> and "
                  f"target=<fraction kept>; got ratio={o['ratio']!r}")
        if o["ranks"] is not None:
            r = o["ranks"]
            if not isinstance(r, (list, tuple)) or len(r) != 3 or not all(is_int(x, 1) for x in r):
                fail("ranks", r, "three ints >= 1 (R1 for d_model, R2 for head_dim, R3 for the Q/K/V/O mode)")
            o["ranks"] = list(r)
        if o["ratio"] is not None:
            if not is_number(o["ratio"]) or not o["ratio"] > 1:
                fail("ratio", o["ratio"], "a number > 1 (original attention parameters / compressed)")
            o["ratio"] = float(o["ratio"])
        check_stacked_options(o, "the d_model mode")
        return o

    def needs(self, entry):
        return frozenset({"gram"}) if entry.options["whiten"] else frozenset()

    def validate_rank(self, rank, options):
        if rank is not None:
            fail("rank", rank, "None for tensorllm: give ranks=(R1, R2, R3), ratio=<compression rate> or target=<fraction kept>")
        if options["ranks"] is None and options["ratio"] is None:
            fail("ranks", None, "exactly one of ranks=(R1, R2, R3), ratio=<compression rate > 1> and target=<fraction kept>")
        return None

    def validate_target(self, target, options):
        target = super().validate_target(target, options)
        if options["ranks"] is not None or options["ratio"] is not None:
            fail("target", target, "either target= (the fraction of each layer's attention parameters kept, = 1 / ratio) "
                 "or ranks= / ratio=, not both")
        return target

    @staticmethod
    def _ratio(entry) -> float | None:
        """The compression rate asked for: ``ratio``, or ``1 / target`` (the same budget as a kept fraction)."""
        return entry.options["ratio"] if entry.target is None else 1.0 / entry.target

    def _layers(self, modules) -> dict[str, dict[str, str]]:
        """{layer index: {role: module name}} in q, k, v, o order."""
        out: dict[str, dict[str, str]] = {}
        for name in modules:
            layer, _, rest = name.partition(".")
            leaf = rest.rpartition(".")[2]
            if leaf not in ROLE_OF:
                fail("targets", rest, "attention projections named q_proj, k_proj, v_proj, o_proj (a subset of them)")
            out.setdefault(layer, {})[ROLE_OF[leaf]] = name
        return {k: {r: v[r] for r in "qkvo" if r in v} for k, v in out.items()}

    def check_unit(self, modules, entry, ctx):
        d, hd, h, kv = attention_shape(ctx.config)
        check_slice_names(entry.options, [n.rpartition(".")[2] for n in modules])
        for layer, roles in self._layers(modules).items():
            for role, name in roles.items():
                heads = kv if role in "kv" else h
                want = (d, heads * hd) if role == "o" else (heads * hd, d)
                got = tuple(modules[name].weight.shape)
                if got != want:
                    raise ValueError(f"tensorllm: {ctx.prefix}.{name} is {got[0]}x{got[1]}, expected {want[0]}x{want[1]} "
                                     f"from the config (hidden {d}, {h} heads, {kv} KV heads, head_dim {hd}); "
                                     "allowed: standard multi-head / grouped-query projections")
            m, n_slabs = sum(slots(roles, h, kv, entry.options["gqa"]).values()), self._slabs(ctx.config, entry)
            ratio = self._ratio(entry)
            if ratio is not None:
                original = sum(modules[n].weight.numel() for n in roles.values())
                most = original / param_count(d, hd, m, n_slabs, (1, 1, 1))
                if ratio > most:
                    fail("ratio", ratio, f"at most {most:.1f} for layer {layer} (ranks (1, 1, 1) already)")
            r = entry.options["ranks"]
            if r is not None and (r[0] > d or r[1] > hd or r[2] > m):
                raise ValueError(f"TensorCompressionConfig.ranks: got {tuple(r)}; allowed: at most ({d}, {hd}, {m}) for "
                                 f"layer {layer}'s {d} x {hd} x {m} x {n_slabs} tensor (gqa={entry.options['gqa']!r})")

    def check_spec(self, name, spec, entry, unit, ctx):
        d, hd, h, kv = attention_shape(ctx.config)
        role = ROLE_OF.get(name.rpartition(".")[2])
        n_rep, n_slots = role_layout(role, h, kv, entry.options["gqa"])
        want = {"factors": f"{name.rpartition('.')[0]}.{CONTAINER}", "role": role, "n_rep": n_rep, "slots": n_slots}
        for field, value in want.items():
            if spec.get(field, 1) != value:
                spec_fail(name, field, spec.get(field, 1), value, entry)
        return want["factors"]

    @staticmethod
    def _slabs(config, entry) -> int:
        """The tensor's fourth mode: the KV heads (``gqa="group"``) or the query heads (``"repeat"``)."""
        _, _, h, kv = attention_shape(config)
        return kv if entry.options["gqa"] == "group" else h

    def compress(self, modules, entry, ctx):
        opts = entry.options
        d, hd, h, kv = attention_shape(ctx.config)
        n_slabs = self._slabs(ctx.config, entry)
        out = {}
        for layer, roles in self._layers(modules).items():
            weights = {role: modules[name].weight for role, name in roles.items()}
            dtype, device = next(iter(weights.values())).dtype, next(iter(weights.values())).device
            tensor = head_slices(weights, hd, n_slabs)
            width = slots(roles, h, kv, opts["gqa"])  # mode-3 slots per role, in order
            first = {r: sum(list(width.values())[:j]) for j, r in enumerate(width)}
            m = tensor.shape[2]
            s = None
            if opts["whiten"]:
                if ctx.stats is None:
                    raise ValueError("TensorCompressionConfig.whiten=True needs calibration statistics; pass calibration=")
                reads_x = [r for r in roles if r != "o"]
                if reads_x:  # q/k/v: the layer's normed hidden state, through mode 1
                    s = whitening_factor(ctx.stats[roles[reads_x[0]]].gram, opts["damping"])
            fitted = tensor if s is None else whiten_mode(tensor, s, 0).float()
            # each matrix's weight in the fit, on its mode-3 slots
            scale = slice_scales(fitted, 2, {n: (first[r], width[r]) for r, n in roles.items()}, opts["slice_weight"])
            fitted = fitted * scale[:, None]
            original = sum(w.numel() for w in weights.values())
            ranks = tuple(opts["ranks"]) if opts["ranks"] else ranks_for_ratio(fitted, original, self._ratio(entry))
            t = tucker_hooi(fitted, ranks, n_iter_max=opts["n_iter_max"], tol=opts["tol"], init=opts["init"],
                            seed=opts["seed"], modes=[0, 1, 2])
            u1, u2, u3 = t.factors
            u3 = u3 / scale[:, None].to(u3)  # the fit saw scale x each matrix: its own approximation is row / scale
            core = t.core
            refit = False
            if s is not None:
                u1 = unwhiten_factor(s, u1).float()
            if opts["whiten"] and "o" in roles and ranks[2] == m:  # every matrix its own cores: refit O's
                core, u3 = torch.einsum("jr,abrh->abjh", u3, core), torch.eye(m, device=core.device)
                jo, so = first["o"], width["o"]
                p = whitening_factor(ctx.stats[roles["o"]].gram, opts["damping"])
                blocks = torch.block_diag(*[u2] * h)  # (h hd) x (h R2): head i's columns read a_i through U2
                c = fit_core(weights["o"], u1, blocks, None, p @ p.T).float()  # R1 x (h R2): [C_1 ... C_h]
                # query head i = slab * so + slot (its group's o slots)
                core[:, :, jo:jo + so, :] = c.view(ranks[0], n_slabs, so, ranks[1]).permute(0, 3, 2, 1)
                refit = True
            t = type(t)(core, [u1, u2, u3], t.modes)
            compressed = param_count(d, hd, m, n_slabs, ranks)
            container = f"{next(iter(roles.values())).rpartition('.')[0]}.{CONTAINER}"
            factors = HeadTuckerFactors(d, hd, n_slabs, ranks, dtype=dtype, device=device)
            with torch.no_grad():
                factors.u1.copy_(u1)
                factors.u2.copy_(u2)
                factors.core.copy_(t.core)
            err = relative_error(tensor, t.reconstruct())
            out[container] = (factors, {"ranks": list(ranks), "rel_error": err, "tensor": [d, hd, m, n_slabs],
                                        "params_original": original, "params_compressed": compressed,
                                        "compression_ratio": round(original / compressed, 3),
                                        **({"whitened": s is not None, "refit_o": refit} if opts["whiten"] else {})})
            for role, name in roles.items():
                lin = modules[name]
                n_rep = role_layout(role, h, kv, opts["gqa"])[0]
                proj = HeadTuckerProjection(factors, f"{ctx.prefix}.{container}", role, n_rep=n_rep, slots=width[role],
                                            bias=lin.bias is not None, dtype=dtype, device=device)
                with torch.no_grad():
                    proj.weight.copy_(u3[first[role]:first[role] + width[role]].reshape(-1))
                    if lin.bias is not None:
                        proj.bias.copy_(lin.bias)
                    proj_err = relative_error(lin.weight, proj.dense_weight())
                out[name] = (proj, {"rel_error": proj_err, "group": f"{ctx.prefix}.{container}"})
        return out
