"""``latent_kv``: the key and value projections as calibrated low-rank maps to a latent, and a KV cache of latents.

Palu / Eigen Attention on a trained model, without training: each ``k_proj`` / ``v_proj`` W (out x in) becomes a
`LatentKVLinear`, per group of ``head_groups`` KV heads (default: all the heads of a layer share one latent) a
down-projection U_rᵀ W_g to r numbers and the up-projection U_r, where U are the output directions of W_g S
(S Sᵀ = XᵀX of the projection's inputs on the calibration text, ``whiten=True``: `decompositions.svd.output_basis`),
so the dropped singular values are exactly the output error on those inputs. The model then caches the latents
(`LatentKVCache`: ``bits``-bit codes per channel over groups of ``group`` tokens, the last ``window`` tokens in
full precision) and attends with the registered ``latent_kv`` attention, which ``generate`` uses without further
arguments, and a reload too.

Sizes: ``kv_bytes`` (default 0.28: every channel of both streams at 4 bits), a fraction of the bytes a bfloat16 DynamicCache holds for the same tokens:
each latent value costs bits/8 bytes plus 3 bytes (a float16 scale and a uint8 zero point) per ``group`` tokens.
Unless ``bits`` or ``key_bits`` is given, the budget first picks the code widths of the two streams
(`budget_bits`: the widest pair at which every channel fits, the values narrowed before the keys; with
``widths="prompt"``, a width per channel chosen by the cache from the prompt, averaging `budget_mean`), then the
ranks of every group of every layer, keys and values alike, are chosen together by the greedy rule of
`decompositions.allocation` on each projection's relative whitened loss, so the latent costs at most
``kv_bytes`` of the bf16 keys and values (the full-precision window and the positions come on top: at 2,048 tokens
with the default window of 64, ``window / tokens`` of the latents' full-precision cost). ``rank=`` instead:
every group that rank (an int, or a fraction of the group's rows), 4-bit codes unless told. At full rank with
``bits=16`` the model and its cache compute what the dense model computes with a DynamicCache.
"""

from __future__ import annotations

import math

import torch

from ...decompositions import relative_error
from ...decompositions.quantize import BITS
from ...decompositions.svd import output_basis, whitening_factor
from ...validation import fail, is_int, is_number, resolve_rank
from ..base import Allocation, Ladder, Method, register_method, spec_fail
from ...layout import head_dim as _head_dim
from .cache import BITS_ALLOWED, CACHE_DEFAULTS, check_settings
from .layer import LatentKeyLinear, LatentKVLinear

DEFAULT_KV_BYTES = 0.28  # every channel at 4 bits: the widths PyTorch's CPU int4 kernel reads in place
METRICS = ("attention", "output")
KEYS = ("rotated", "latent")
ROPE_SPAN = 4096  # positions over which a rotated key's covariance is averaged (the contexts the cache is for)


def _dropped(bases, ranks) -> float:
    """The relative error of keeping the first `ranks` directions of each group's (U, σ): sqrt of the energy share
    dropped."""
    kept = sum(float(sv[:r].pow(2).sum()) for (_, sv), r in zip(bases, ranks))
    energy = sum(float(sv.pow(2).sum()) for _, sv in bases) or 1.0
    return round(max(1 - kept / energy, 0.0) ** 0.5, 6)


def rope_tables(config, layer_type: str | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (length, head_dim) of the model's own rotary embedding at positions 0..length-1 (its class in
    transformers, built from the config: the fit runs before, and apart from, the model's own module)."""
    import importlib
    import inspect

    kind = config.model_type
    for name in (kind, kind.rpartition("_")[0]):
        try:
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except (ImportError, ValueError):
            continue
        found = [c for n, c in vars(module).items() if n.endswith("RotaryEmbedding") and isinstance(c, type)
                 and c.__module__ == module.__name__]
        if found:
            rotary = found[0](config)
            pos = torch.arange(length)[None]
            x = torch.zeros(1, dtype=torch.float32)
            takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
            cos, sin = rotary(x, pos, layer_type) if takes_type else rotary(x, pos)
            return cos[0].double(), sin[0].double()
    fail("keys", "rotated", f"'latent' for a model whose rotary embedding is not found in transformers (model_type "
         f"{kind!r})")


def rotation_average(m: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """E_t[R_t M R_tᵀ] for the covariance M (n x n, heads of head_dim side by side) of keys before RoPE, R_t the
    rotation at position t (cos, sin: (positions, head_dim)): the covariance of the same keys after RoPE, if
    their positions are spread evenly over the table's. R_t = diag(c_t) + diag(s_t) J (J: rotate_half), so the
    average is four Hadamard products with E[c cᵀ], E[c sᵀ], E[s cᵀ], E[s sᵀ]."""
    d = cos.shape[1]
    reps = m.shape[0] // d
    c, s = cos.repeat(1, reps), sin.repeat(1, reps)
    half = torch.arange(m.shape[0]).view(reps, 2, d // 2)
    src = half.flip(1).reshape(-1)  # (J x)_i = ∓ x_src(i)
    sign = torch.ones(m.shape[0], dtype=m.dtype).view(reps, 2, d // 2)
    sign[:, 0] = -1
    sign = sign.reshape(-1)
    jm = sign[:, None] * m[src]  # J M
    mj = m[:, src] * sign[None]  # M Jᵀ
    jmj = sign[:, None] * mj[src]  # J M Jᵀ
    n = cos.shape[0]
    return ((c.T @ c) * m + (c.T @ s) * mj + (s.T @ c) * jm + (s.T @ s) * jmj) / n


def _dense(module) -> torch.Tensor:
    """A projection's weight (float64), dense: an nn.Linear's, or a factored module's product."""
    w = module.weight if isinstance(module, torch.nn.Linear) else module.dense_weight()
    return w.detach().double()


def value_bytes(bits: int, group: int) -> float:
    """Bytes a latent value costs per token: its `bits`-bit code, and its group's scale and zero point shared by
    `group` tokens (bits=16: a bfloat16 value)."""
    return 2.0 if bits >= 16 else bits / 8 + 3 / group


def stream_bits(name: str, o: dict) -> int:
    """The code width of the latent `name` (a module path) is cached at: ``key_bits`` for k_proj, else ``bits``."""
    return o["key_bits"] if name.endswith("k_proj") else o["bits"]


#: (key_bits, bits) pairs ``kv_bytes`` chooses among, widest first; below 3 bits the values narrow before the keys,
#: whose codes cost more perplexity. Keys at 4 bits beside narrower values are left out: on the CPU 4-bit keys are
#: quantized per token for the int4 kernel, which held them no better than 3-bit codes per channel (SmolLM2 at
#: 2,048 tokens of context: keys 4 / values 3 bits ×1.022 at 0.290 of the bf16 bytes, both 3 bits ×1.013 at 0.257)
BUDGET_WIDTHS = ((8, 8), (6, 6), (5, 5), (4, 4), (3, 3), (3, 2), (2, 2))


def budget_bits(kv_bytes: float, group: int) -> tuple[int, int]:
    """The code widths (key_bits, bits) that ``bits=None`` takes under a `kv_bytes` budget: the first pair of
    `BUDGET_WIDTHS` at which every latent channel fits (full rank costs the mean of the two streams' `value_bytes`
    over a bf16 value's 2 bytes); below the narrowest, (2, 2), and the allocation cuts channels. Narrower codes on
    every channel rather than fewer channels, because on the bundled models dropping channels costs far more:
    SmolLM2 at 2,048 tokens of context, ×1.21 with every channel at 2 bits against ×2.96 with 55 % of them at 4
    bits, for the same bytes; 90 % of the channels at 3 bits, ×1.11, against ×0.98 with all of them."""
    fits = [(k, v) for k, v in BUDGET_WIDTHS
            if (value_bytes(k, group) + value_bytes(v, group)) / 4 <= kv_bytes + 1e-12]
    return fits[0] if fits else BUDGET_WIDTHS[-1]


def budget_mean(kv_bytes: float, group: int) -> float:
    """``widths="prompt"``: the average code width (keys and values alike) that ``bits=None`` takes under a `kv_bytes`
    budget: the widest, in eighths of a bit, at which every latent channel fits (`value_bytes`), within the
    quantizer's widths (below 2 bits: 2, and the allocation cuts channels)."""
    mean = math.floor((2 * kv_bytes - 3 / group) * 64 + 1e-9) / 8
    return min(max(mean, BITS[0]), BITS[-1])


@register_method
class LatentKV(Method):
    name = "latent_kv"
    default_targets = ("self_attn.k_proj", "self_attn.v_proj")
    default_rank = None
    layer_types = ("latent_kv", "latent_kv_key")
    remedy = "a larger rank or kv_bytes"
    option_defaults = {"kv_bytes": None, **CACHE_DEFAULTS, "bits": None, "key_bits": None, "head_groups": None,
                       "whiten": True, "damping": 1e-4, "metric": "attention",
                       "key_weight": 1.0, "keys": "rotated"}
    # checkpoints from before these options: the key latent taken before RoPE, each group's codes on its min-max range
    saved_defaults = {"keys": "latent", "grid": "minmax"}

    def validate_options(self, options):
        o = super().validate_options(options)
        t = o["kv_bytes"]
        if t is not None and (not is_number(t) or not 0 < t <= 1):
            fail("kv_bytes", t, "None, or a float in (0, 1]: the fraction of a bfloat16 DynamicCache's bytes the latent "
                 "cache may hold")
        if o["bits"] is None:  # chosen later (`validate_rank`): the key width, when valid, stands in for the check
            check_settings({**o, "bits": o["key_bits"] if o["key_bits"] in BITS_ALLOWED else 4})
        else:
            check_settings(o)
        if o["head_groups"] is not None and not is_int(o["head_groups"], 1):
            fail("head_groups", o["head_groups"], "None (one latent for all the KV heads of a layer) or an int >= 1 (KV "
                 "heads sharing one latent; it must divide the model's KV heads)")
        if not isinstance(o["whiten"], bool):
            fail("whiten", o["whiten"], "True (fit to the projection's output on the calibration text) | False (plain SVD)")
        if not is_number(o["damping"]) or not 0 <= o["damping"] <= 10:
            fail("damping", o["damping"], "a number in [0, 10]")
        if not is_number(o["key_weight"]) or not 0 < o["key_weight"] <= 100:
            fail("key_weight", o["key_weight"], "a number in (0, 100]: how much a key's relative error counts in the "
                 "kv_bytes allocation against a value's")
        if o["keys"] not in KEYS:
            fail("keys", o["keys"], "'rotated' (the key latent taken after RoPE: queries are scored against it, no key "
                 "rebuilt) | 'latent' (a latent k_proj before RoPE: keys rebuilt and rotated at every step)")
        if o["metric"] not in METRICS:
            fail("metric", o["metric"], " | ".join(map(repr, METRICS)) + " (the error each fit minimises: what the "
                 "attention reads, or the projection's own output)")
        return o

    def validate_rank(self, rank, options):
        if rank is None:
            if options["kv_bytes"] is None:
                options["kv_bytes"] = DEFAULT_KV_BYTES
            if options["bits"] is None and options["key_bits"] is None:
                self._budget_widths(options)
            self._pair(options)
            return None
        if options["kv_bytes"] is not None:
            fail("rank", rank, "None with kv_bytes= (the ranks are allocated from the byte budget)")
        if options["bits"] is None and options["key_bits"] is None:
            options["bits"] = 4
        self._pair(options)
        return super().validate_rank(rank, options)

    @staticmethod
    def _budget_widths(options) -> None:
        """``bits=None``: the widths the budget allows: one width a stream (`budget_bits`), or with
        ``widths="prompt"`` the average `budget_mean` for both. Not chosen for the user: on SmolLM2 at 2,048 tokens
        of context (1,536 tokens scored) an average of 2.5 bits a channel held 0.228 of the bf16 bytes at ×1.021 ±
        0.007 against keys 3 / values 2 bits at ×1.049 ± 0.012 in the same bytes, but on Gemma-3 at 4,096 tokens
        (384 scored) ×1.213 ± 0.049 against ×1.091 ± 0.031."""
        kv, group = options["kv_bytes"], options["group"]
        if options["widths"] == "prompt":
            options["key_bits"] = options["bits"] = budget_mean(kv, group)
        else:
            options["key_bits"], options["bits"] = budget_bits(kv, group)

    @staticmethod
    def _pair(options) -> None:
        """One of ``bits`` / ``key_bits`` given: the other is the same width."""
        if options["bits"] is None:
            options["bits"] = options["key_bits"]
        if options["key_bits"] is None:
            options["key_bits"] = options["bits"]
        check_settings(options)

    def validate_target(self, target, options):
        fail("target", target, "None: latent_kv's budget is kv_bytes= (a fraction of the bf16 KV-cache bytes)")

    def needs(self, entry):
        kinds = {"gram"} if entry.options["whiten"] else set()
        if entry.options["whiten"] and entry.options["keys"] == "rotated":
            kinds.add("inputs")  # a k_norm's keys: their covariance is measured (`_key_covariance`)
        return frozenset(kinds)

    def allocates(self, entry):
        return entry.options["kv_bytes"] is not None

    def ladder_needs(self, entry):
        return self.needs(entry)

    def start_allocation(self, entry) -> Allocation:
        return Allocation(budget=entry.options["kv_bytes"])

    # ------------------------------------------------------------------ checks before any weight loads
    def _groups(self, entry, cfg) -> int:
        """Latent groups per projection."""
        per = entry.options["head_groups"] or cfg.num_key_value_heads
        return cfg.num_key_value_heads // per

    def check_unit(self, modules, entry, ctx):
        from ...layout import resolve_layers

        cfg, o = ctx.config, entry.options
        kv, d = cfg.num_key_value_heads, _head_dim(cfg)
        if o["head_groups"] is not None and kv % o["head_groups"]:
            fail("head_groups", o["head_groups"], f"a divisor of the model's {kv} KV heads")
        groups = self._groups(entry, cfg)
        layers: dict[str, set] = {}
        for name, mod in modules.items():
            li, _, rest = name.partition(".")
            layers.setdefault(li, set()).add(rest.rpartition(".")[2])
            where = f"{ctx.prefix}.{name} ({mod.out_features}x{mod.in_features})"
            if mod.out_features != kv * d:
                fail("targets", entry.targets, f"the key and value projections only ({where} has {mod.out_features} "
                     f"outputs, not {kv} KV heads x {d})")
            rows = mod.out_features // groups
            if isinstance(entry.rank, int) and entry.rank > rows:
                fail("rank", entry.rank, f"an int in [1, {rows}] (the rows of one group of {rows // d} KV heads of {where}) "
                     "or a float in (0, 1]")
        for li, kinds in layers.items():
            if kinds != {"k_proj", "v_proj"}:
                fail("targets", entry.targets, f"both k_proj and v_proj of each layer (layer {li}: {sorted(kinds)})")
        sliding = [i for i, kind in enumerate(getattr(cfg, "layer_types", None) or []) if kind == "sliding_attention"]
        chosen = set(resolve_layers(entry.layers, ctx.n_layers)) & set(sliding)
        if chosen and len(chosen) < len(sliding):  # one mask serves every sliding layer (`LatentKVCache`)
            fail("layers", entry.layers, f"all of the model's sliding-window layers {sliding} or none of them (these layers take "
                 f"{sorted(chosen)}); its full-attention layers as you like")
        if o["kv_bytes"] is not None:
            least = groups * (value_bytes(o["key_bits"], o["group"]) + value_bytes(o["bits"], o["group"])) / (4 * kv * d)
            if o["kv_bytes"] < least:
                fail("kv_bytes", o["kv_bytes"], f"at least {least:.4f} (rank 1 for each of the {groups} latent group(s) "
                     f"of a projection at key_bits={o['key_bits']}, bits={o['bits']}, group={o['group']})")

    def check_spec(self, name, spec, entry, unit, ctx):
        groups = self._groups(entry, ctx.config)
        if len(spec["ranks"]) != groups:
            spec_fail(name, "ranks", spec["ranks"], f"{groups} rank(s), one per latent group", entry)
        return None

    # ------------------------------------------------------------------ the fit
    @staticmethod
    def _whitening(stats, entry):
        """The whitening factor of the projection's inputs (``whiten=True``), else None."""
        if not entry.options["whiten"]:
            return None
        if stats is None or stats.gram is None:
            raise ValueError("TensorCompressionConfig.whiten=True needs calibration statistics; pass calibration= "
                             "or whiten=False")
        return whitening_factor(stats.gram, entry.options["damping"])

    def _basis(self, module, stats, entry, groups: int, metrics=None):
        """Per group of rows: (U, σ) of its whitened (and, with `metrics`, weighted) output, float64."""
        s = self._whitening(stats, entry)
        w = module.weight.detach().float()
        return [output_basis(wg, s, None if metrics is None else metrics[g]) for g, wg in enumerate(w.chunk(groups, 0))]

    def _key_covariance(self, module, stats, entry, norm, config) -> torch.Tensor:
        """The covariance of the keys before RoPE (float64, out x out). Without a k_norm: the whitened output
        covariance W G Wᵀ. With one (Qwen3, Gemma-3: an RMSNorm per head), the keys are each divided by their own
        RMS, so tokens with large keys no longer dominate: the covariance of the normed keys themselves, the
        projection and the norm run on the calibration inputs (W G Wᵀ scaled by the norm's weights instead left
        Gemma-3's rotated keys at 1.34x perplexity where the keys before RoPE gave 1.18x)."""
        if norm is not None and stats is not None and "inputs" in stats.kinds and stats.n:
            d, out = _head_dim(config), module.weight.shape[0]
            cov = torch.zeros(out, out, dtype=torch.float64)
            with torch.no_grad():
                for rows in stats.inputs.split(4096):
                    k = torch.nn.functional.linear(rows.to(module.weight.dtype), module.weight, module.bias)
                    k = norm(k.view(rows.shape[0], -1, d)).reshape(rows.shape[0], -1).double()
                    cov += k.T @ k
            return cov / stats.n
        w, sf = _dense(module), self._whitening(stats, entry)
        ws = w if sf is None else w @ sf.double()
        m = ws @ ws.T
        if norm is not None:  # no calibration inputs: its weights scale the channels (the 1/rms taken as common)
            d = _head_dim(config)
            with torch.no_grad():
                g = norm(torch.ones(1, d, dtype=next(norm.parameters()).dtype)).double().reshape(-1)
            g = g.repeat(m.shape[0] // d)
            m = g[:, None] * m * g[None]
        return m

    def _key_basis(self, name, module, stats, entry, groups: int, config, layers, metrics=None):
        """``keys="rotated"``: per group of rows, (U, σ) of the keys' covariance after RoPE (`_key_covariance`
        averaged over the rotations of `ROPE_SPAN` positions; `rotation_average`), weighted by `metrics`; float64."""
        norm = None if layers is None else getattr(layers[int(name.partition(".")[0])].self_attn, "k_norm", None)
        m = self._key_covariance(module, stats, entry, norm, config)
        types = getattr(config, "layer_types", None)
        layer_type = types[int(name.partition(".")[0])] if types else None
        cos, sin = rope_tables(config, layer_type, ROPE_SPAN)
        m = rotation_average(m, cos, sin)
        out, rows = [], m.shape[0] // groups
        for g in range(groups):
            mg = m[g * rows:(g + 1) * rows, g * rows:(g + 1) * rows]
            if metrics is not None:
                a = metrics[g].double()
                mg = a[:, None] * mg * a[None]
            lam, u = torch.linalg.eigh((mg + mg.T) / 2)
            out.append((u.flip(1), lam.flip(0).clamp_min(0).sqrt()))
        return out

    def _rotated(self, name, entry) -> bool:
        return entry.options["keys"] == "rotated" and name.endswith("k_proj")

    def _metrics(self, name, lin, stats, entry, ctx, groups: int):
        """``metric="attention"``: per group, the weights of its output error by what reads it. A key's error counts
        by the energy of the queries scored against it, per channel (E q² on the calibration inputs, summed over
        the KV head's query heads, averaged over each RoPE pair: a relative rotation mixes the pair); a value's by
        the ``o_proj`` columns of its query heads (the Cholesky factor of their Gram, per KV head). None: no
        weighting (``metric="output"``, or no decoder layers at hand)."""
        if entry.options["metric"] != "attention" or ctx.layers is None:
            return None
        attn = ctx.layers[int(name.partition(".")[0])].self_attn
        d = _head_dim(ctx.config)
        kv = lin.out_features // d
        rep = ctx.config.num_attention_heads // kv
        if name.endswith("k_proj"):
            wq = _dense(attn.q_proj)
            g = stats.gram.double() if stats is not None and stats.gram is not None else None
            energy = (wq @ g * wq).sum(1) if g is not None else wq.pow(2).sum(1)
            e = energy.view(kv, rep, d).sum(1)
            e = (e + e.roll(d // 2, -1)) / 2  # the pair (i, i + d/2) rotates together
            a = (e.flatten() / e.mean()).clamp_min(1e-8).sqrt()
            return list(a.chunk(groups))
        wo = _dense(attn.o_proj).view(-1, kv, rep * d)
        blocks = []
        for j in range(kv):
            cols = wo[:, j].reshape(-1, rep, d).permute(1, 0, 2).reshape(-1, d)  # its query heads' columns, stacked
            m = cols.T @ cols
            m = m / m.diagonal().mean()
            m.diagonal().add_(1e-6)
            blocks.append(torch.linalg.cholesky(m).T)  # ‖L^T Δv‖ = ‖W_o Δv‖
        per = kv // groups
        return [torch.block_diag(*blocks[g * per:(g + 1) * per]) for g in range(groups)]

    def ladder(self, name, module, stats, entry, ctx):
        groups = self._groups(entry, ctx.config)
        metrics = self._metrics(name, module, stats, entry, ctx, groups)
        bases = self._key_basis(name, module, stats, entry, groups, ctx.config, ctx.layers, metrics) \
            if self._rotated(name, entry) else self._basis(module, stats, entry, groups, metrics)
        spectra = [sv.pow(2) for _, sv in bases]
        total = float(sum(float(p.sum()) for p in spectra)) or 1.0
        if name.endswith("k_proj"):
            total /= entry.options["key_weight"]
        o = entry.options
        unit = module.weight.numel() * value_bytes(stream_bits(name, o), o["group"]) / (2 * module.out_features)  # a latent dim's cost
        ranks = [1] * groups
        loss = sum(float(p[1:].sum()) for p in spectra)
        steps = sorted(((float(p[j]), g) for g, p in enumerate(spectra) for j in range(1, len(p))), reverse=True)
        costs, losses, settings = [unit * groups], [loss / total], [list(ranks)]
        for energy, g in steps:
            ranks[g] += 1
            loss -= energy
            costs.append(costs[-1] + unit)
            losses.append(max(loss, 0.0) / total)
            settings.append(list(ranks))
        return Ladder(costs, losses, settings=settings)

    def compress(self, modules, entry, ctx):
        groups = self._groups(entry, ctx.config)
        out = {}
        for name, lin in modules.items():
            stats = (ctx.stats or {}).get(name)
            metrics = self._metrics(name, lin, stats, entry, ctx, groups)
            rotated = self._rotated(name, entry)
            bases = self._key_basis(name, lin, stats, entry, groups, ctx.config, ctx.layers, metrics) if rotated \
                else self._basis(lin, stats, entry, groups, metrics)
            if ctx.allocation is not None:
                ranks = ctx.allocation.settings[name][ctx.allocation.rungs[name]]
            else:
                ranks = [resolve_rank(entry.rank, u.shape[1]) for u, _ in bases]
            w = lin.weight.detach().float()
            ups, downs = [], []
            if rotated:  # the rotated keys' own basis: down = U_rᵀ A, up = A⁻¹ U_r (A: the query metric)
                for g, ((u, _), r) in enumerate(zip(bases, ranks)):
                    a = torch.ones(u.shape[0], dtype=torch.float64) if metrics is None else metrics[g].double()
                    ups.append((u[:, :r] / a[:, None]).float())
                    downs.append((u[:, :r] * a[:, None]).T.float())
                bias = None if lin.bias is None else lin.bias.detach()
                new = LatentKeyLinear.build(lin.weight.detach(), bias, ups, downs, lin.weight.dtype)
                out[name] = (new, {**self._report(name, bases, ranks, entry, lin),  # the rotated keys' error: the weight is kept
                                   "rel_error": _dropped(bases, ranks)})
                continue
            for g, ((u, _), r, wg) in enumerate(zip(bases, ranks, w.chunk(groups, 0))):
                u = u[:, :r]
                a = None if metrics is None else metrics[g].double()
                if a is None:
                    up, down = u, u.T @ wg.double()
                elif a.ndim == 1:
                    up, down = u / a[:, None], (u * a[:, None]).T @ wg.double()
                else:  # a = metric block, upper triangular: up = a⁻¹ U_r, down = U_rᵀ a W
                    up = torch.linalg.solve_triangular(a, u, upper=True)
                    down = u.T @ a @ wg.double()
                ups.append(up.float())
                downs.append(down.float())
            bias = None if lin.bias is None else lin.bias.detach()
            new = LatentKVLinear.build(ups, downs, bias, lin.weight.dtype)
            out[name] = (new, {**self._report(name, bases, ranks, entry, lin),
                               "rel_error": relative_error(w, new.dense_weight().detach().float())})
        return out

    @staticmethod
    def _report(name, bases, ranks, entry, lin) -> dict:
        """Ranks, the share of the (whitened; rotated keys: after RoPE) output energy dropped, the bytes' share."""
        return {"ranks": ranks, "rank": sum(ranks),
                **({"whitened_error": _dropped(bases, ranks)} if entry.options["whiten"] else {}),
                "kv_fraction": round(sum(ranks) * value_bytes(stream_bits(name, entry.options), entry.options["group"])
                                     / (2 * lin.out_features), 6)}

    def attach(self, model):
        from .attention import enable

        enable(model)  # latent k/v projections: their attention and cache (a no-op without them)
