"""The attention that reads `LatentKVCache`, registered with transformers as ``attn_implementation="latent_kv"``.

transformers' attention modules call ``k_proj`` / ``v_proj`` (here `LatentKVLinear`, which leaves its latent on
the module), normalise and rotate the keys, hand them to ``past_key_values.update`` and call the registered
attention function with what it returns. With a `LatentKVCache` that is the cache layer: this function stores
the new tokens' latents there and then

- on the first forward (the prompt; nothing cached before) runs transformers' SDPA attention on the dense
  keys and values of the prompt, which it was given anyway (prefill uses the normal path);
- afterwards (decoding) reads the latents: the keys are rebuilt block by block (``BLOCK`` tokens at a time:
  up-projection, the module's ``k_norm`` if it has one, RoPE at each token's stored position) and scored
  against the queries; RoPE makes the score of a query and a key depend on both positions, so it cannot be
  folded into the latent (which is taken before RoPE, so that one basis serves every position); the values are
  never rebuilt: the attention weights multiply the value latents (R_v numbers a token), and each head's
  up-projection is applied once to that weighted sum (plus the bias: the weights sum to one).

On the CPU the cache lays 4-bit latents out for PyTorch's int4 kernel (`cache._KernelKeys`, `cache._KernelValues`):
their pieces ``("tokens",)`` and ``("chunk", i)`` are one kernel call each, the codes read in place.

Grouped-query attention: the queries of one KV head are scored together against that head's keys. With any
other cache (a plain forward makes a DynamicCache) the function is transformers' SDPA attention.

The mask interface ``latent_kv`` is SDPA's (a boolean mask, or None where SDPA may skip it); without it
transformers would give this function no mask at all.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .cache import LatentKVCache, LatentKVLayer, latent_layers, model_layout
from .layer import LatentKeyLinear, LatentKVLinear

NAME = "latent_kv"
BLOCK = 1024  # tokens whose keys are rebuilt at once while decoding


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def _rope(module: nn.Module, like: torch.Tensor, positions: torch.Tensor):
    """cos, sin (b, t, head_dim) at `positions` (b, t), from the model's rotary embedding (`enable` hands it over)."""
    rotary, layer_type = module.__dict__["_latent_rope"]
    if layer_type is None:
        return rotary(like, positions)
    return rotary(like, positions, layer_type)


def latent_kv_attention(module: nn.Module, query: torch.Tensor, key, value, attention_mask, dropout: float = 0.0,
                        scaling: float | None = None, **kwargs):
    k_proj, v_proj = module.k_proj, module.v_proj
    rotated = isinstance(k_proj, LatentKeyLinear)
    zk = k_proj.take_latent() if isinstance(k_proj, LatentKVLinear) else None
    zv = v_proj.take_latent() if isinstance(v_proj, LatentKVLinear) else None
    if not isinstance(key, LatentKVLayer):
        if rotated and k_proj.__dict__.get("through_latent"):
            key = _through_latent(k_proj, key)  # healing: fit the factors to the keys the cache will hold
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    layer = key
    new_k, new_v = layer.pending
    if rotated:  # the latent of the keys as the model rotated them
        zk = k_proj.latent(new_k.transpose(1, 2).flatten(2))
    if zk is None or zv is None:
        raise ValueError("latent_kv attention: the layer's k_proj / v_proj left no latent (are they LatentKVLinear, and "
                         "called once on this step's input?); allowed: a model compressed with method='latent_kv'")
    b, q = query.shape[0], query.shape[2]
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(layer.seen, layer.seen + q, device=query.device)[None]
    positions = positions.expand(b, -1)
    past = layer.held()
    layer.add(zk, zv, None if rotated else positions)
    if past == 0:
        out = sdpa_attention_forward(module, query, new_k, new_v, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    else:
        out = (_attend(module, layer, query, attention_mask, scaling), None)
    layer.forget()
    return out


def _through_latent(k_proj: LatentKeyLinear, key: torch.Tensor) -> torch.Tensor:
    """Rotated keys (b, kv_heads, t, d) as their latent gives them back (up · down, no codes): what a forward
    attends to while healing (`LatentKeyLinear.training_form`), so that the loss sees the keys' truncation and
    reaches ``down`` and ``up``; any other plain forward, like the prompt's prefill, keeps the dense keys."""
    b, h, t, d = key.shape
    return k_proj.expand(k_proj.latent(key.transpose(1, 2).reshape(b, t, h * d))).view(b, t, h, d).transpose(1, 2)


def _overlaps(runs: list, cols: slice):
    """Per run of a ``("runs", ...)`` piece (channels of one width) that has channels among the latent columns
    `cols`: those channels as indices into `cols` and into the run, and the run's planes, scale and zero."""
    for idx, *codes in runs:
        inside = (idx >= cols.start) & (idx < cols.stop)
        if inside.all():  # the whole run (one latent group: always): its codes read without a gather
            yield idx - cols.start, slice(None), codes
        elif inside.any():
            yield idx[inside] - cols.start, inside.nonzero().view(-1), codes


def _code_scores(ql: torch.Tensor, planes, scale, zero, cols) -> torch.Tensor:
    """ql (b, M, R_cols) against quantized groups, channels `cols` of theirs (a slice or indices): (b, M, n * group).
    The scales go into the query and the codes are multiplied as they are (q·(c - z)s = (q s)·c - (q s)·z), so no
    latent is de-quantized into a copy."""
    b, m = ql.shape[:2]
    qs = ql[:, None] * scale[:, :, None, cols]  # (b, n, M, R_cols)
    sc = torch.cat([torch.matmul(qs, c[:, :, cols]) for c in planes], -1) \
        - (qs * zero[:, :, None, cols]).sum(-1, keepdim=True)
    return sc.transpose(1, 2).reshape(b, m, -1)


def _code_values(wn: torch.Tensor, planes, scale, zero, cols) -> torch.Tensor:
    """Σ_t w_t z_t over quantized groups, channels `cols` of theirs: wn (b, n, M, group) -> (b, M, R_cols); the
    codes are multiplied as they are, plane by plane, and the scales and zero points applied to the sums."""
    width = planes[0].shape[3]
    wc = sum(torch.matmul(c[:, :, cols], wn[..., i * width:(i + 1) * width].transpose(2, 3))
             for i, c in enumerate(planes))  # (b, n, R_cols, M)
    sc = scale[:, :, cols]
    return (wc * sc[..., None]).sum(1).transpose(1, 2) - torch.matmul(wn.sum(-1).transpose(1, 2), zero[:, :, cols] * sc)


def _score_latent(k_proj: LatentKeyLinear, layer: LatentKVLayer, qg: torch.Tensor, total: int, dtype) -> torch.Tensor:
    """Scores (b, kv_heads, rep*q, total) of the grouped queries against the key latents taken after RoPE: each
    query is carried into its group's latent (upᵀ q, R_g numbers) and multiplied with the stored latents, the
    quantized ones in place (`_code_scores`)."""
    b, kv_heads, m, d = qg.shape
    slices = k_proj.group_slices()
    per = kv_heads // len(slices)
    up = k_proj.up.to(dtype).view(per, d, -1)  # the group's rows, head by head
    pieces = layer.k.pieces(dtype)
    out = []
    for g, cols in enumerate(slices):
        ql = torch.matmul(qg[:, g * per:(g + 1) * per], up[:, :, cols]).reshape(b, per * m, -1)  # (b, M, R_g)
        parts = []
        for piece in pieces:
            if piece[0] == "dense":
                parts.append(torch.matmul(ql, piece[1][..., cols].transpose(1, 2)))
                continue
            if piece[0] == "tokens":
                parts.append(layer.k.scores(ql, cols))
                continue
            if piece[0] == "runs":  # a width per channel: the runs' partial scores add up
                parts.append(sum(_code_scores(ql[..., at], *codes, own) for at, own, codes in _overlaps(piece[1], cols)))
                continue
            parts.append(_code_scores(ql, *piece[1:], cols))
        out.append((parts[0] if len(parts) == 1 else torch.cat(parts, -1)).view(b, per, m, total))
    return out[0] if len(out) == 1 else torch.cat(out, 1)


def _weigh_values(layer: LatentKVLayer, w: torch.Tensor, slices: list[slice], dtype) -> list[torch.Tensor]:
    """Σ_t w_t z_t over the value latents held, each group of KV heads over its own latent columns: w (b, kvh, M,
    total) -> [(b, kvh_g, M, R_g) per group]; on quantized groups the codes are multiplied as they are and the
    scales and zero points applied to the sums."""
    b, kvh, m, total = w.shape
    per = kvh // len(slices)
    pieces = layer.v.pieces(dtype)
    out = []
    for g, cols in enumerate(slices):
        wg = w[:, g * per:(g + 1) * per].reshape(b, per * m, total)
        y, start = None, 0
        for piece in pieces:
            if piece[0] == "dense":
                z = piece[1][..., cols]
                part = torch.matmul(wg[..., start:start + z.shape[1]], z)
                start += z.shape[1]
            elif piece[0] == "chunk":
                part = layer.v.chunk_product(piece[1], wg[..., start:start + layer.v.chunk], cols)
                start += layer.v.chunk
            else:
                group = layer.v.group
                n = layer.v.n_quantized // group  # the open groups (closed chunks are pieces of their own)
                wn = wg[..., start:start + n * group].reshape(b, per * m, n, group).transpose(1, 2)  # (b, n, M, group)
                start += n * group
                if piece[0] == "runs":  # a width per channel: each run fills its own columns
                    part = wn.new_zeros(b, per * m, cols.stop - cols.start)
                    for at, own, codes in _overlaps(piece[1], cols):
                        part[..., at] = _code_values(wn, *codes, own)
                else:
                    part = _code_values(wn, *piece[1:], cols)  # (b, M, R_g)
            y = part if y is None else y + part
        out.append(y.view(b, per, m, -1))
    return out


def _score_rebuilt(module, k_proj: LatentKVLinear, layer: LatentKVLayer, qg: torch.Tensor, total: int,
                   dtype) -> torch.Tensor:
    """Scores against keys rebuilt from latents taken before RoPE (``keys="latent"``), ``BLOCK`` tokens at a
    time: up-projection, the module's ``k_norm`` if it has one, RoPE at each token's stored position."""
    b, kv_heads, m, d = qg.shape
    pos = layer.token_positions()
    scores = []
    for start in range(0, total, BLOCK):
        end = min(start + BLOCK, total)
        k = k_proj.expand(layer.k.read(start, end, dtype)).view(b, end - start, kv_heads, d)
        if hasattr(module, "k_norm"):
            k = module.k_norm(k)
        cos, sin = _rope(module, k, pos[:, start:end])
        k = k * cos[:, :, None] + _rotate_half(k) * sin[:, :, None]
        scores.append(torch.matmul(qg, k.permute(0, 2, 3, 1)))
    return torch.cat(scores, -1)


def _attend(module, layer: LatentKVLayer, query: torch.Tensor, mask, scaling) -> torch.Tensor:
    """Attention of `query` (b, H, q, d) over every token `layer` holds; returns (b, q, H, d)."""
    k_proj, v_proj = module.k_proj, module.v_proj
    b, heads, q, d = query.shape
    kv_heads = k_proj.out_features // d
    rep = heads // kv_heads
    total = layer.held()
    dtype = query.dtype
    qg = query.reshape(b, kv_heads, rep * q, d)
    if isinstance(k_proj, LatentKeyLinear):
        s = _score_latent(k_proj, layer, qg, total, dtype)
    else:
        s = _score_rebuilt(module, k_proj, layer, qg, total, dtype)
    s = s.view(b, heads, q, total) * (scaling if scaling is not None else d ** -0.5)
    if mask is None:
        if q > 1:  # SDPA left the causal mask out
            causal = torch.ones(q, total, dtype=torch.bool, device=s.device).tril(total - q)
            s = s.masked_fill(~causal, float("-inf"))
    elif mask.dtype == torch.bool:
        s = s.masked_fill(~mask[..., -total:], float("-inf"))
    else:
        s = s + mask[..., -total:]
    w = torch.softmax(s.float(), -1).nan_to_num(0.0).to(dtype).view(b, kv_heads, rep * q, total)
    slices = v_proj.group_slices()
    up = v_proj.weight  # (out_g, R_v): each group's up-projection in its columns
    per = kv_heads // len(slices)
    outs = [torch.matmul(y, up[:, cols].view(per, d, -1).transpose(1, 2))  # (b, per, rep*q, d)
            for y, cols in zip(_weigh_values(layer, w, slices, dtype), slices)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 1)  # (b, kvh, rep*q, d)
    if v_proj.bias is not None:
        out = out + v_proj.bias.view(kv_heads, 1, d)
    return out.view(b, heads, q, d).transpose(1, 2).contiguous()


# under torch.compile the attention runs eagerly, a graph break at each layer: tracing the cache's Python (its codes,
# pieces and kernel layouts) took more than 120 s for 10 tokens with 4-bit codes; the rest of the model compiles
AttentionInterface.register(NAME, torch.compiler.disable(latent_kv_attention, reason="latent_kv attention: the cache's "
                                                         "Python runs eagerly"))
AttentionMaskInterface.register(NAME, sdpa_mask)


# --------------------------------------------------------------------------------------------
# switching a model to the latent cache and attention
# --------------------------------------------------------------------------------------------

class _MakeLatentCache:
    """Put in the model's place of ``_prepare_cache_for_generation``: transformers' choice, then a `LatentKVCache`
    instead of the DynamicCache it makes by default (a cache the caller passed, or another kind asked for through
    ``cache_implementation``, is left alone). An object (not a closure), so that a model holding it copies and
    pickles."""

    def __init__(self, model):
        self.model = model

    def __call__(self, generation_config, model_kwargs, *args, **kwargs):
        from transformers import DynamicCache

        model = self.model
        kind = generation_config.cache_implementation
        if (kind not in (None, "dynamic") and model_kwargs.get("past_key_values") is None
                and generation_config.use_cache is not False and model.config._attn_implementation == NAME):
            raise ValueError(f"generate: cache_implementation={kind!r} would hold dense keys and values, dropping "
                             "latent_kv's KV compression; allowed: None or 'dynamic' (a LatentKVCache), or "
                             "past_key_values=LatentKVCache(model, ...) for other cache settings")
        result = type(model)._prepare_cache_for_generation(model, generation_config, model_kwargs, *args, **kwargs)
        made = model_kwargs.get("past_key_values")
        if (type(made) is DynamicCache and not getattr(made, "_is_user_defined", False)
                and generation_config.cache_implementation in (None, "dynamic")
                and model.config._attn_implementation == NAME):
            model_kwargs["past_key_values"] = LatentKVCache(model)
        return result


def enable(model: nn.Module) -> bool:
    """Switch a model holding `LatentKVLinear` projections to the latent attention and cache (after compression
    and after a reload; a no-op, returning False, for a model without them)."""
    found = latent_layers(model)
    if not found:
        return False
    rotary = _rotary(model)
    if rotary is None:
        raise ValueError("latent_kv: found no rotary embedding (a module named rotary_emb) in the model; allowed: "
                         "decoder models with RoPE (Llama, Qwen, Gemma-3, Mistral, ...)")
    takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
    for attn in found.values():
        attn.__dict__["_latent_rope"] = (rotary, getattr(attn, "layer_type", None) if takes_type else None)
    model.set_attn_implementation(NAME)
    model.__dict__["_prepare_cache_for_generation"] = _MakeLatentCache(model)
    model.__dict__["_latent_layout"] = model_layout(model)
    if _check_cache not in model._forward_pre_hooks.values():
        model.register_forward_pre_hook(_check_cache, with_kwargs=True)
    return True


def _check_cache(model, args, kwargs):
    """Before each forward of a latent model: a `LatentKVCache` it is handed was built for it (`LatentKVCache.check`)."""
    cache = kwargs.get("past_key_values")
    if isinstance(cache, LatentKVCache):
        cache.check(model)


def _rotary(model: nn.Module):
    for name, mod in model.named_modules():
        if name.endswith("rotary_emb"):
            return mod
    return None
