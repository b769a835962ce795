"""``method="latent_kv"``: latent key / value projections, the latent cache and the attention that reads it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hf_tensorcomp import TensorCompressionConfig
from hf_tensorcomp.healing import heal
from hf_tensorcomp.methods.latent_kv import LatentKVCache, LatentKVLinear, dense_cache_bytes
from hf_tensorcomp.methods.latent_kv.layer import LatentKeyLinear
from hf_tensorcomp.methods.latent_kv import attention as latent_attention
from tiny import ARCHS, VOCAB


def load(path, **kw):
    cfg = TensorCompressionConfig(method="latent_kv", **{"whiten": False, **kw})
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg).eval()


def dense(path):
    return AutoModelForCausalLM.from_pretrained(path).eval()


@torch.no_grad()
def decode_logits(model, ids, prefill: int, cache=None):
    """Logits of every position: `prefill` tokens at once, then one token a step through `cache` (default: the
    model's own choice, a LatentKVCache for a latent model, else a DynamicCache)."""
    if cache is None:
        cache = LatentKVCache(model) if latent_attention.latent_layers(model) else DynamicCache(config=model.config)
    out = [model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits]
    for t in range(prefill, ids.shape[1]):
        out.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, 1), cache


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def long_ids(n=40, batch=2, seed=3):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------------------
# exactness at full rank and full precision
# --------------------------------------------------------------------------------------------------------------

LATENT_KEYS = lambda m: [x for x in m.modules() if isinstance(x, (LatentKVLinear, LatentKeyLinear))]  # noqa: E731


@pytest.mark.parametrize("keys", ["rotated", "latent"])
@pytest.mark.parametrize("arch", ARCHS)
def test_full_rank_full_precision_equals_dynamic_cache(tiny_dirs, arch, keys, monkeypatch):
    monkeypatch.setattr(latent_attention, "BLOCK", 7)  # keys="latent": keys rebuilt in several blocks
    model, ref = load(tiny_dirs[arch], rank=1.0, bits=16, keys=keys), dense(tiny_dirs[arch])
    kind = LatentKeyLinear if keys == "rotated" else LatentKVLinear
    assert isinstance(model.model.layers[0].self_attn.k_proj, kind)
    assert model.config._attn_implementation == "latent_kv"
    ids = long_ids()
    want, _ = decode_logits(ref, ids, 9)
    got, cache = decode_logits(model, ids, 9)
    assert isinstance(cache, LatentKVCache)
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item() + 1e-6


@pytest.mark.parametrize("keys", ["rotated", "latent"])
def test_full_rank_exact_with_one_latent_per_kv_head(tiny_dirs, keys):
    model, ref = load(tiny_dirs["llama"], rank=1.0, bits=16, head_groups=1, keys=keys), dense(tiny_dirs["llama"])
    assert model.model.layers[0].self_attn.k_proj.ranks == [8, 8]  # 2 KV heads of 8 dims, one latent each
    ids = long_ids()
    got, _ = decode_logits(model, ids, 5)
    want, _ = decode_logits(ref, ids, 5)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("keys", ["rotated", "latent"])
def test_lower_rank_is_not_exact(tiny_dirs, keys):
    """The decode path really reads the latents: a rank-2 latent gives other logits than the dense model."""
    model, ref = load(tiny_dirs["llama"], rank=2, bits=16, keys=keys), dense(tiny_dirs["llama"])
    ids = long_ids()
    assert rel(decode_logits(model, ids, 5)[0], decode_logits(ref, ids, 5)[0]) > 1e-3


def test_rotated_key_scores_are_those_of_the_keys_the_latent_stands_for(tiny_dirs):
    """keys="rotated", rank 3 of 16: the attention scores the queries against the stored latents; the logits are
    those of an attention over the keys up · z (the dense keys' projection, rotated keys in, rotated keys out)
    and the rank-3 values."""
    model = load(tiny_dirs["llama"], rank=3, bits=16, keys="rotated")
    ref = dense(tiny_dirs["llama"])
    for a, b in zip(model.model.layers, ref.model.layers):
        k = a.self_attn.k_proj
        proj = k.up.detach() @ k.down.detach()  # rank 3, acting on the rotated keys
        assert torch.linalg.matrix_rank(proj) == 3
        b.self_attn.__dict__["_key_projection"] = proj
        b.self_attn.v_proj = a.self_attn.v_proj  # the values at rank 3 too (their dense form: bits=16)
    ids = long_ids(n=20)
    want = _decode_with_projected_keys(ref, ids, 5)
    got, _ = decode_logits(model, ids, 5)
    assert (got[:, 5:] - want[:, 5:]).abs().max().item() < 1e-4 * want.abs().max().item()
    assert rel(got[:, 5:], decode_logits(ref, ids, 5)[0][:, 5:]) > 1e-3


@torch.no_grad()
def _decode_with_projected_keys(ref, ids, prefill):
    """A DynamicCache decode in which the cached (rotated) keys of decode steps are projected by each layer's
    ``_key_projection``: the prompt's keys go through it as well, as the latent cache stores them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attn(module, q, k, v, mask, **kw):
        p = module.__dict__["_key_projection"]
        kp = (k.transpose(1, 2).flatten(2) @ p.T).view(k.shape[0], k.shape[2], k.shape[1], -1).transpose(1, 2)
        return sdpa_attention_forward(module, q, kp if q.shape[2] == 1 else k, v, mask, **kw)

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("projected_keys_test", attn)
    AttentionMaskInterface.register("projected_keys_test", sdpa_mask)
    ref.set_attn_implementation("projected_keys_test")
    try:
        return decode_logits(ref, ids, prefill, cache=DynamicCache(config=ref.config))[0]
    finally:
        ref.set_attn_implementation("sdpa")


def test_rotated_key_covariance_is_that_of_the_normed_keys(tiny_dirs):
    """A model with a k_norm (Qwen3): the covariance the rotated keys' basis is taken from is that of the keys the
    attention block really gives on the calibration inputs (each token's key divided by its own RMS), not the
    norm-weight-scaled W G Wᵀ, in which a few tokens with large keys dominate."""
    from hf_tensorcomp.calibration.stats import ModuleStats
    from hf_tensorcomp.methods.latent_kv.method import LatentKV

    ref = dense(tiny_dirs["qwen3"])
    attn = ref.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(5)
    n = 64
    x = torch.randn(n, ref.config.hidden_size, generator=gen)
    x[::9] *= 30  # a few tokens with large activations
    stats = ModuleStats({"gram", "inputs"})
    stats.add(x)
    seen = []
    hook = attn.k_norm.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    with torch.no_grad():
        pos = torch.arange(n)[None]
        attn(hidden_states=x[None], position_embeddings=ref.model.rotary_emb(x[None], pos), attention_mask=None)
    hook.remove()
    k = seen[0].reshape(n, -1).double()
    want = k.T @ k / n
    got = LatentKV()._key_covariance(attn.k_proj, stats, None, attn.k_norm, ref.config)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    stats_without_inputs = ModuleStats({"gram"})
    stats_without_inputs.add(x)

    class Entry:
        options = {"whiten": True, "damping": 0.0}

    old = LatentKV()._key_covariance(attn.k_proj, stats_without_inputs, Entry, attn.k_norm, ref.config)
    assert rel(old / old.trace(), want / want.trace()) > 0.1


def test_rotation_average_is_the_mean_over_positions():
    """`rotation_average` in closed form against the mean of R_t M R_tᵀ built position by position."""
    from hf_tensorcomp.methods.latent_kv.method import rotation_average

    d, heads, n = 8, 2, 50
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, 1), torch.cat([ang.sin()] * 2, 1)
    a = torch.randn(heads * d, heads * d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    m = a @ a.T
    half = torch.zeros(d, d, dtype=torch.float64)  # rotate_half as a matrix
    half[: d // 2, d // 2:] = -torch.eye(d // 2)
    half[d // 2:, : d // 2] = torch.eye(d // 2)
    j = torch.block_diag(*[half] * heads)
    want = sum((torch.diag(c.repeat(heads)) + torch.diag(s.repeat(heads)) @ j) @ m
               @ (torch.diag(c.repeat(heads)) + torch.diag(s.repeat(heads)) @ j).T for c, s in zip(cos, sin)) / n
    assert torch.allclose(rotation_average(m, cos, sin), want, atol=1e-10)


# --------------------------------------------------------------------------------------------------------------
# the error falls as the budget grows
# --------------------------------------------------------------------------------------------------------------

def test_error_falls_with_rank(tiny_dirs):
    ids, ref = long_ids(), dense(tiny_dirs["llama"])
    want, _ = decode_logits(ref, ids, 5)
    errs = [rel(decode_logits(load(tiny_dirs["llama"], rank=r, bits=16), ids, 5)[0], want) for r in (2, 8, 14, 16)]
    assert errs[0] > errs[1] > errs[2] > errs[3] and errs[3] < 1e-5, errs


def test_error_falls_with_bits(tiny_dirs):
    ids, ref = long_ids(), dense(tiny_dirs["llama"])
    want, _ = decode_logits(ref, ids, 5)
    errs = [rel(decode_logits(load(tiny_dirs["llama"], rank=1.0, bits=b, group=8, window=0), ids, 5)[0], want)
            for b in (2, 4, 8)]
    assert errs[0] > errs[1] > errs[2] > 0, errs


def test_error_falls_with_kv_bytes_and_ranks_follow_the_budget(tiny_dirs):
    ids, ref = long_ids(), dense(tiny_dirs["qwen3"])
    want, _ = decode_logits(ref, ids, 5)
    errs, sizes = [], []
    for budget in (0.05, 0.12, 0.25):
        model = load(tiny_dirs["qwen3"], kv_bytes=budget, bits=4, group=8, window=0)
        latents = [m.latent_size for m in LATENT_KEYS(model)]
        # each latent value costs 4/8 + 3/8 bytes a token, a dense bf16 one 2: 32 dims of k and v a layer
        assert sum(latents) * (0.5 + 3 / 8) <= budget * 2 * 32 * 2 * 3 + 1e-9
        sizes.append(sum(latents))
        errs.append(rel(decode_logits(model, ids, 5)[0], want))
    assert sizes[0] < sizes[1] < sizes[2] and errs[0] > errs[1] > errs[2], (sizes, errs)


def test_the_budget_picks_the_widest_codes_that_keep_every_channel(tiny_dirs, tmp_path):
    """bits=None under kv_bytes: every latent channel kept at the widest (key_bits, bits) pair that fits, the values
    narrowed first below 3 bits (groups of 8: a b-bit value costs b/8 + 3/8 bytes; keys at 3 bits and values at 2
    cost (0.75 + 0.625) / 4 = 0.34375 of a bf16 cache), and below two 2-bit streams (0.3125) 2-bit codes with
    channels cut; the widths chosen are recorded in the saved config and used by the cache's two streams, after a
    reload too."""
    full = 32 * 2 * 3  # k and v latents of 32 dims, 3 layers
    model = load(tiny_dirs["qwen3"], kv_bytes=0.35, group=8, window=0)
    o = model.config.quantization_config.entries[0].options
    assert (o["key_bits"], o["bits"]) == (3, 2)
    assert sum(m.latent_size for m in LATENT_KEYS(model)) == full
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    o = again.config.quantization_config.entries[0].options
    assert (o["key_bits"], o["bits"]) == (3, 2)
    _, cache = decode_logits(again, long_ids(n=24), 5)
    layer = cache.layers[0]
    assert (layer.k.bits, layer.v.bits) == (3, 2) and layer.k.n_quantized == layer.v.n_quantized > 0
    assert 2 * layer.k.codes.shape[-1] == 3 * layer.v.codes.shape[-1]  # 3 bytes a group of 8 codes against 2
    small = load(tiny_dirs["qwen3"], kv_bytes=0.2, group=8, window=0)
    latents = sum(m.latent_size for m in LATENT_KEYS(small))
    o = small.config.quantization_config.entries[0].options
    assert (o["key_bits"], o["bits"]) == (2, 2)
    assert latents < full and latents * (2 / 8 + 3 / 8) <= 0.2 * 2 * full + 1e-9
    o = load(tiny_dirs["qwen3"], rank=1.0).config.quantization_config.entries[0].options
    assert (o["key_bits"], o["bits"]) == (4, 4)
    o = load(tiny_dirs["qwen3"]).config.quantization_config.entries[0].options  # the defaults: every channel at 4 bits
    assert (o["kv_bytes"], o["group"], o["key_bits"], o["bits"], o["widths"]) == (0.28, 64, 4, 4, "stream")
    o = load(tiny_dirs["qwen3"], kv_bytes=0.25).config.quantization_config.entries[0].options
    assert (o["key_bits"], o["bits"], o["widths"]) == (3, 3, "stream")
    assert sum(m.latent_size for m in LATENT_KEYS(load(tiny_dirs["qwen3"]))) == full


def test_prompt_widths_take_the_average_the_budget_allows_and_reload(tiny_dirs, tmp_path):
    """widths='prompt', bits=None: the average width at which every channel fits kv_bytes, in eighths of a bit
    (groups of 8: (2 · 0.35 - 3/8) · 8 = 2.6 -> 2.5 bits; 2.5/8 + 3/8 = 0.6875 bytes of a bf16 value's 2, within
    0.35), every channel kept; the cache chooses each channel's width from the prompt, averaging at most that, and
    a reload does the same."""
    full = 32 * 2 * 3
    model = load(tiny_dirs["qwen3"], kv_bytes=0.35, group=8, window=0, widths="prompt")
    o = model.config.quantization_config.entries[0].options
    assert (o["key_bits"], o["bits"], o["widths"]) == (2.5, 2.5, "prompt")
    assert sum(m.latent_size for m in LATENT_KEYS(model)) == full
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = long_ids(n=24)
    a, cache = decode_logits(model, ids, 9)
    b, cache2 = decode_logits(again, ids, 9)
    assert torch.allclose(a, b, atol=1e-5)
    for layer in (cache.layers[0], cache2.layers[0]):
        runs = [(len(idx), w) for idx, w in layer.v.runs]
        assert sum(n for n, _ in runs) == 32 and sum(n * w for n, w in runs) <= 2.5 * 32
        assert len(runs) > 1 and layer.v.n_quantized > 0


def test_whitened_fit_minimises_the_output_error_on_the_calibration_inputs(tiny_dirs):
    """whiten=True: the recorded whitened error is the first projection's output error on the calibration inputs
    (ids of four tokens of the vocabulary here), far below the plain SVD's there; the model stays closer too."""
    calib = torch.randint(0, 4, (8, 32), generator=torch.Generator().manual_seed(7))
    plain = load(tiny_dirs["llama"], rank=3, bits=16, keys="latent")
    white = load(tiny_dirs["llama"], rank=3, bits=16, whiten=True, calibration=calib, metric="output", keys="latent")
    ref = dense(tiny_dirs["llama"])
    stats = white.config.quantization_config.stats["modules"]
    assert all(0 < s["whitened_error"] < 1 for s in stats.values())
    with torch.no_grad():
        x = ref.model.layers[0].input_layernorm(ref.model.embed_tokens(calib))
        want = ref.model.layers[0].self_attn.k_proj(x)
        errs = [rel(m.model.layers[0].self_attn.k_proj(x), want) for m in (white, plain)]
    assert abs(errs[0] - stats["model.layers.0.self_attn.k_proj"]["whitened_error"]) < 0.02
    assert errs[0] < 0.5 * errs[1], errs
    ids = torch.randint(0, 4, (2, 40), generator=torch.Generator().manual_seed(8))
    want, _ = decode_logits(ref, ids, 5)
    assert rel(decode_logits(white, ids, 5)[0], want) < 0.8 * rel(decode_logits(plain, ids, 5)[0], want)


# --------------------------------------------------------------------------------------------------------------
# bytes
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keys", ["rotated", "latent"])
def test_nbytes_is_what_the_cache_holds(tiny_dirs, keys):
    model = load(tiny_dirs["llama"], rank=4, bits=4, group=8, window=0, sink=0, keys=keys)
    ids = long_ids(n=33, batch=1)
    _, cache = decode_logits(model, ids, 17)
    # 3 layers x (k + v): 32 tokens as 4 groups of 8, 4 channels: codes 4 x 4 x 8 / 2, scales 2 and zeros 1 a channel
    # and group; the 33rd token's latents in float16 (4 + 4 numbers a layer; the model is float32); positions int32
    # where keys are rebuilt and rotated later (keys="latent")
    per_stream = 4 * 4 * 8 // 2 + 4 * 4 * 3 + 1 * 4 * 2
    assert cache.nbytes() == 3 * 2 * per_stream + (33 * 4 if keys == "latent" else 0)
    assert dense_cache_bytes(model.config, 33) == 3 * 2 * 2 * 8 * 33 * 2


def test_the_first_tokens_stay_in_16_bits(tiny_dirs):
    """``sink``: the first tokens (attention sinks) are never quantized; they cost 16 bits a value, and the logits of
    2-bit latents come closer to the exact ones with them."""
    ids, ref = long_ids(n=48, batch=1), dense(tiny_dirs["llama"])
    want, _ = decode_logits(ref, ids, 20)
    caches, errs = [], []
    for sink in (0, 8):
        model = load(tiny_dirs["llama"], rank=1.0, bits=2, group=8, window=0, sink=sink)
        got, cache = decode_logits(model, ids, 20)
        caches.append(cache)
        errs.append(rel(got[:, 20:], want[:, 20:]))
    assert caches[1].layers[0].k.n_head == 8 and caches[1].layers[0].k.n_quantized == 40
    assert caches[1].nbytes() - caches[0].nbytes() == 3 * 2 * (8 * 16 * 2 - 16 * 8 // 4 - 16 * 3)
    assert errs[1] < errs[0], errs


def test_sliding_window_layers_forget_what_no_query_reaches(tiny_dirs):
    """Gemma-3's sliding layers (window 8 here) hold a bounded number of tokens; the logits stay exact."""
    model, ref = load(tiny_dirs["gemma3"], rank=1.0, bits=16, group=8), dense(tiny_dirs["gemma3"])
    ids = long_ids(n=60, batch=1)
    got, cache = decode_logits(model, ids, 4)
    want, _ = decode_logits(ref, ids, 4)
    assert (got - want).abs().max().item() < 1e-5
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    assert sliding and all(layer.held() <= 8 + 8 and layer.offset > 0 for layer in sliding)
    assert cache.layers[2].held() == 60  # the global layer keeps everything


# --------------------------------------------------------------------------------------------------------------
# generate, save / reload, weight compression beside it
# --------------------------------------------------------------------------------------------------------------

def test_generate_variants_equal_the_dense_model_at_full_rank(tiny_dirs):
    model, ref = load(tiny_dirs["llama"], rank=1.0, bits=16), dense(tiny_dirs["llama"])
    ids = long_ids(n=6)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    out = model.generate(ids, do_sample=False, return_dict_in_generate=True, **kw)
    assert isinstance(out.past_key_values, LatentKVCache)
    assert torch.equal(out.sequences, ref.generate(ids, do_sample=False, **kw))
    assert torch.equal(model.generate(ids, num_beams=3, do_sample=False, **kw),
                       ref.generate(ids, num_beams=3, do_sample=False, **kw))
    torch.manual_seed(5)
    sampled = model.generate(ids, do_sample=True, top_k=20, **kw)
    torch.manual_seed(5)
    assert torch.equal(sampled, ref.generate(ids, do_sample=True, top_k=20, **kw))


def test_generate_with_quantized_latents_runs_and_stays_close(tiny_dirs):
    model = load(tiny_dirs["gemma3"], kv_bytes=0.3, bits=4, group=8, window=4)
    ids = long_ids(n=6)
    out = model.generate(ids, max_new_tokens=30, do_sample=False, num_beams=2, pad_token_id=0)
    assert out.shape == (2, 36)


def test_prompt_widths_at_one_width_decode_as_that_width(tiny_dirs):
    """widths='prompt' averaging 8 bits gives every channel 8 bits: generate (beam search over left-padded rows, a
    model with sliding-window layers that forget groups) picks the same tokens as one 8-bit width a stream, so
    the per-width runs follow the beams' reorders, selections and drops as the plain stream does."""
    model = load(tiny_dirs["gemma3"], rank=1.0, bits=8, group=8, window=4, sink=2)
    ids = long_ids(n=10)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, num_beams=3, pad_token_id=0)
    assert torch.equal(model.generate(ids, past_key_values=LatentKVCache(model, widths="prompt"), **kw),
                       model.generate(ids, past_key_values=LatentKVCache(model), **kw))


def test_save_reload_uses_latent_cache_without_arguments(tiny_dirs, tmp_path):
    model = load(tiny_dirs["llama"], kv_bytes=0.2, bits=4, group=8, window=2)
    ids = long_ids()
    before, _ = decode_logits(model, ids, 5)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config._attn_implementation == "latent_kv"
    assert [m.ranks for m in LATENT_KEYS(again)] == [m.ranks for m in LATENT_KEYS(model)]
    assert isinstance(again.model.layers[0].self_attn.k_proj, LatentKeyLinear)
    after, cache = decode_logits(again, ids, 5)
    assert cache.settings == {"bits": 4, "group": 8, "window": 2, "sink": 16, "grid": "search", "key_bits": 4,
                              "widths": "stream"}
    assert torch.equal(after, before)
    # a checkpoint written before the options (no "grid", no "key_bits" saved) keeps the min-max range its codes were measured with
    import json
    conf = json.loads((tmp_path / "config.json").read_text())
    for option in ("grid", "key_bits"):
        del conf["quantization_config"]["entries"][0][option]
    (tmp_path / "config.json").write_text(json.dumps(conf))
    settings = LatentKVCache(AutoModelForCausalLM.from_pretrained(tmp_path)).settings
    assert settings["grid"] == "minmax" and settings["key_bits"] == settings["bits"] == 4
    out = again.generate(ids[:, :4], max_new_tokens=8, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    assert isinstance(out.past_key_values, LatentKVCache)
    assert torch.equal(out.sequences, model.generate(ids[:, :4], max_new_tokens=8, do_sample=False, pad_token_id=0))


def test_combines_with_weight_compression(tiny_dirs, tmp_path):
    from hf_tensorcomp.methods.qlr import QuantizedLowRankLinear

    cfg = TensorCompressionConfig(entries=[
        {"method": "qlr", "rank": 4, "quantizer": "rtn", "whiten": False, "targets": ["self_attn.q_proj", "self_attn.o_proj", "mlp.*"]},
        {"method": "latent_kv", "kv_bytes": 0.25, "whiten": False, "group": 8},
    ])
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg).eval()
    attn = model.model.layers[1].self_attn
    assert isinstance(attn.q_proj, QuantizedLowRankLinear) and isinstance(attn.v_proj, LatentKVLinear)
    ids = long_ids(n=6)
    out = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(again.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0), out)


def test_text_generation_pipeline(tiny_with_tokenizer):
    from transformers import AutoTokenizer, pipeline

    tok = AutoTokenizer.from_pretrained(tiny_with_tokenizer)
    texts = [pipeline("text-generation", model=m, tokenizer=tok)("w1 w2 w3", max_new_tokens=6, do_sample=False)
             for m in (load(tiny_with_tokenizer, rank=1.0, bits=16), dense(tiny_with_tokenizer))]
    assert texts[0] == texts[1]


def test_a_plain_forward_keeps_working(tiny_dirs):
    """Without generate (a DynamicCache, or no cache) the latent attention is SDPA on the projections' outputs."""
    model, ref = load(tiny_dirs["qwen3"], rank=1.0, bits=16), dense(tiny_dirs["qwen3"])
    ids = long_ids()
    with torch.no_grad():
        assert (model(ids).logits - ref(ids).logits).abs().max().item() < 1e-5
        assert (model(ids, use_cache=False).logits - ref(ids).logits).abs().max().item() < 1e-5


# --------------------------------------------------------------------------------------------------------------
# bad settings, refused before any weight loads
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, field", [
    ({"kv_bytes": 0}, "kv_bytes"), ({"kv_bytes": 1.5}, "kv_bytes"), ({"kv_bytes": "0.1"}, "kv_bytes"),
    ({"bits": 7}, "bits"), ({"bits": 4.0}, "bits"), ({"bits": True}, "bits"),
    ({"group": 12}, "group"), ({"window": -1}, "window"), ({"sink": 1.5}, "sink"), ({"rank": 0}, "rank"),
    ({"rank": 4, "kv_bytes": 0.1}, "rank"), ({"head_groups": 0}, "head_groups"), ({"whiten": "yes"}, "whiten"), ({"grid": "mse"}, "grid"), ({"key_bits": 16, "bits": 4}, "key_bits"), ({"key_bits": 7}, "key_bits"),
    ({"keys": "pre"}, "keys"), ({"widths": "channel"}, "widths"), ({"bits": 2.5}, "bits"),
    ({"widths": "prompt", "bits": 9}, "bits"), ({"widths": "prompt", "key_bits": 1}, "key_bits"),
    ({"target": 0.5}, "target"),
])
def test_bad_settings_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b.*allowed"):
        TensorCompressionConfig(method="latent_kv", **kw)


@pytest.mark.parametrize("kw, field", [
    ({"rank": 17}, "rank"), ({"head_groups": 3, "rank": 2}, "head_groups"),
    ({"targets": ["self_attn.k_proj"], "rank": 2}, "targets"), ({"targets": ["self_attn.q_proj", "self_attn.k_proj"], "rank": 2}, "targets"),
    ({"kv_bytes": 0.001}, "kv_bytes"),
])
def test_bad_settings_for_the_model_refused_before_weights_load(tiny_dirs, kw, field, monkeypatch):
    from hf_tensorcomp.methods.latent_kv.method import LatentKV

    def never(*a, **k):
        raise AssertionError("compress ran")

    monkeypatch.setattr(LatentKV, "compress", never)
    with pytest.raises(ValueError, match=rf"\b{field}\b.*allowed"):
        AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(
            method="latent_kv", whiten=False, **kw))


def test_bad_cache_settings_name_the_field(tiny_dirs):
    model = load(tiny_dirs["llama"], rank=2)
    with pytest.raises(ValueError, match=r"\bbits\b.*allowed"):
        LatentKVCache(model, bits=1)
    with pytest.raises(ValueError, match=r"\bgroup\b.*allowed"):
        LatentKVCache(model, group=10)
    with pytest.raises(ValueError, match=r"\bwidths\b.*allowed"):
        LatentKVCache(model, widths="channel")
    with pytest.raises(ValueError, match=r"\bbits\b.*allowed"):
        LatentKVCache(model, bits=1.5, widths="prompt")


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_codes_come_back_from_their_planes_in_token_order(bits):
    """Every width packs into exactly bits / 8 bytes a code (3, 5, 6: parts of widths dividing a byte) and comes
    back as the same codes, in token order."""
    from hf_tensorcomp.methods.latent_kv.stores import _pack_planes, _planes

    codes = torch.randint(0, 2**bits, (7, 64), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = _pack_planes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 64 * bits // 8)
    assert torch.equal(torch.cat(_planes(packed.view(1, 1, 7, -1), bits, 64), -1).view(7, 64), codes)


@pytest.mark.parametrize("bits, widths", [(2, "stream"), (3, "stream"), (4, "stream"), (3.5, "prompt")])
def test_attention_on_codes_equals_attention_on_dequantized_latents(bits, widths):
    """The decode attention multiplies the codes as they are (scales and zero points folded into the query and
    the sums; with a width per channel, run by run); the result is the product with the de-quantized latents
    `read` gives, sink and window included."""
    from hf_tensorcomp.methods.latent_kv.cache import LatentKVLayer, _Positions

    gen = torch.Generator().manual_seed(0)
    layer = LatentKVLayer(_Positions(), bits=bits, key_bits=bits, group=8, window=3, sink=2, widths=widths)
    layer.lazy_initialization(torch.zeros(1), None)
    spread = torch.tensor([0.1, 3.0, 1.0, 0.01, 10.0, 0.5])  # channels of different ranges: different widths
    for n in (5, 1, 17, 1, 9):
        layer.add(torch.randn(2, n, 6, generator=gen) * spread, torch.randn(2, n, 6, generator=gen) * spread, None)
    total = layer.held()
    assert layer.v.n_quantized == 24 and layer.v.n_head == 2
    if widths == "prompt":  # several runs, interleaved with the head groups' columns
        assert len(layer.k.runs) > 1 and len(layer.v.runs) > 1
    k_proj = LatentKeyLinear(4, 8, [3, 3])  # 2 KV heads of 4 dims, a latent of 3 each
    torch.nn.init.normal_(k_proj.up, generator=gen)
    qg = torch.randn(2, 2, 5, 4, generator=gen)
    got = latent_attention._score_latent(k_proj, layer, qg, total, torch.float32)
    z = layer.k.read(0, total, torch.float32)
    keys = k_proj.expand(z).view(2, total, 2, 4).permute(0, 2, 3, 1)  # (b, kvh, d, total)
    assert torch.allclose(got, torch.matmul(qg, keys), atol=1e-5)
    w = torch.softmax(torch.randn(2, 2, 5, total, generator=gen), -1)
    z = layer.v.read(0, total, torch.float32)
    got = latent_attention._weigh_values(layer, w, [slice(0, 3), slice(3, 6)], torch.float32)  # a group a KV head
    for g in range(2):
        assert torch.allclose(got[g], torch.matmul(w[:, g:g + 1], z[:, None, :, 3 * g:3 * g + 3]), atol=1e-5)


def test_water_filling_gives_the_bits_to_the_energy():
    """Closed form: one channel 4^4 times the energy of three others, 3 bits a channel on average, at least 2
    each: the 4 spare bits all go to it (each quarters its error; the first saves 12, the last 0.19, more than a
    bit anywhere else, 0.05), and the widths average what they may."""
    from hf_tensorcomp.decompositions.allocation import water_fill_widths
    from hf_tensorcomp.decompositions.quantize import BITS

    assert water_fill_widths(torch.tensor([4.0**4, 1, 1, 1]), 3, BITS) == [6, 2, 2, 2]
    assert water_fill_widths(torch.tensor([1.0, 1, 1, 1]), 2, BITS) == [2, 2, 2, 2]
    assert sum(water_fill_widths(torch.rand(50), 3.3, BITS)) <= 3.3 * 50


def test_prompt_widths_keep_the_latents_better_than_one_width_at_the_same_bytes():
    """Channels whose ranges differ (a projection's singular directions do): widths from the prompt's variances,
    averaging 3 bits, hold the later tokens with less squared error than 3 bits on every channel, in no more
    bytes."""
    from hf_tensorcomp.methods.latent_kv.cache import LatentKVLayer, _Positions

    gen = torch.Generator().manual_seed(1)
    spread = torch.logspace(0, -2, 32)
    z = torch.randn(1, 1024, 32, generator=gen) * spread
    err, held = {}, {}
    for widths in ("stream", "prompt"):
        layer = LatentKVLayer(_Positions(), bits=3, key_bits=3, group=64, window=64, sink=0, widths=widths)
        layer.lazy_initialization(torch.zeros(1), None)
        layer.add(z[:, :512], z[:, :512], None)  # the prompt
        for t in range(512, 1024, 64):
            layer.add(z[:, t:t + 64], z[:, t:t + 64], None)
        err[widths] = (layer.v.read(0, 1024, torch.float32) - z).pow(2).sum().item()
        held[widths] = layer.nbytes()
    assert held["prompt"] <= held["stream"]
    assert err["prompt"] < 0.7 * err["stream"]


def _kernel_layer(monkeypatch, r=40, chunk=128, batch=2):
    """A full-attention 4-bit layer on the CPU (the int4 kernel's layouts), chunks of `chunk` tokens, holding
    latents whose channels' ranges span 100x (the latents' singular directions do)."""
    from hf_tensorcomp.methods.latent_kv import cache, stores

    monkeypatch.setattr(stores, "CHUNK", chunk)
    gen = torch.Generator().manual_seed(0)
    layer = cache.LatentKVLayer(cache._Positions(), bits=4, group=64, window=64, sink=16, rotated_keys=True)
    layer.lazy_initialization(torch.zeros(1), None)
    base = cache.LatentKVLayer(cache._Positions(), bits=4, group=64, window=64, sink=16)  # per-channel codes
    base.lazy_initialization(torch.zeros(1), None)
    spread = torch.logspace(0, -2, r)
    zk, zv = [], []
    for n in (300, 1, 90, 1, 17):
        zk.append(torch.randn(batch, n, r, generator=gen) * spread)
        zv.append(torch.randn(batch, n, r, generator=gen) * spread)
        layer.add(zk[-1], zv[-1], None)
        base.add(zk[-1], zv[-1], None)
    return layer, base, torch.cat(zk, 1), torch.cat(zv, 1)


def test_kernel_layouts_keep_the_latents_as_well_as_per_channel_codes(monkeypatch):
    """On the CPU a full-attention 4-bit layer lays its codes out for PyTorch's int4 kernel: the values keep their
    per-channel codes (closed chunks read back as the open codes do), the keys are quantized per token after a
    fixed per-channel norm and a Hadamard rotation, which must keep them as well as per-channel codes do."""
    from hf_tensorcomp.methods.latent_kv import cache

    layer, base, zk, zv = _kernel_layer(monkeypatch)
    assert isinstance(layer.k, cache._KernelKeys) and isinstance(layer.v, cache._KernelValues)
    total = layer.held()
    assert total == 409 and len(layer.v.chunks) == 2 and layer.k.n_quantized == 320  # 16 sink, 73 in the window
    v, v_base = layer.v.read(0, total, torch.float32), base.v.read(0, total, torch.float32)
    assert rel(v, v_base) < 5e-3  # the same codes; the kernel's products in bfloat16
    assert rel(layer.v.read(100, 300, torch.float32), v[:, 100:300]) < 5e-3
    k, k_base = layer.k.read(0, total, torch.float32), base.k.read(0, total, torch.float32)
    assert rel(k, zk) < 1.1 * rel(k_base, zk)
    assert rel(k, zk) < 0.1 and rel(k[:, :16], zk[:, :16]) < 1e-3  # the sink stays in 16 bits
    want = sum(t.numel() * t.element_size() for s in (layer.k, layer.v) for t in s.tensors())
    assert layer.nbytes() == want and len(layer.v.tensors()) == 2 * 2 + 3 + 2  # 2 chunks, 1 open group, head, tail


def test_attention_through_the_kernel_equals_attention_on_the_latents_it_holds(monkeypatch):
    """Scores through the int4 kernel (keys) and weighted sums over closed chunks (values) equal the products with
    the latents each stream reads back, bfloat16 products aside; beam reordering moves every piece."""
    layer, _, _, _ = _kernel_layer(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    total = layer.held()
    k_proj = LatentKeyLinear(4, 64, [20, 20])  # 2 KV heads of 32 dims, a latent of 20 each
    torch.nn.init.normal_(k_proj.up, generator=gen)
    for _ in range(2):
        qg = torch.randn(2, 2, 5, 32, generator=gen)
        got = latent_attention._score_latent(k_proj, layer, qg, total, torch.float32)
        keys = k_proj.expand(layer.k.read(0, total, torch.float32)).view(2, total, 2, 32).permute(0, 2, 3, 1)
        assert rel(got, torch.matmul(qg, keys)) < 1e-2
        w = torch.softmax(torch.randn(2, 2, 5, total, generator=gen), -1)
        z = layer.v.read(0, total, torch.float32)
        got = latent_attention._weigh_values(layer, w, [slice(0, 20), slice(20, 40)], torch.float32)
        for g in range(2):
            assert rel(got[g], torch.matmul(w[:, g:g + 1], z[:, None, :, 20 * g:20 * g + 20])) < 1e-2
        layer.reorder_cache(torch.tensor([1, 0]))  # the second round reads the rows swapped


def test_decoding_through_the_kernel_layouts_stays_with_the_per_channel_cache(tiny_dirs, monkeypatch):
    """A tiny Llama at 4 bits, groups of 64 tokens, decoding past a closed chunk: the kernel layouts give the
    logits the per-channel codes give, within what 4-bit codes move them anyway."""
    from hf_tensorcomp.methods.latent_kv import cache, stores

    monkeypatch.setattr(stores, "CHUNK", 128)
    model, ref = load(tiny_dirs["llama"], rank=1.0, bits=4, group=64), dense(tiny_dirs["llama"])
    ids = long_ids(n=330)
    got, c = decode_logits(model, ids, prefill=290)
    assert isinstance(c.layers[0].k, cache._KernelKeys) and len(c.layers[0].v.chunks) == 1 and c.layers[0].v.n_quantized == 64
    monkeypatch.setattr(cache, "kernel_ready", lambda *a: False)
    plain, c = decode_logits(model, ids, prefill=290)
    assert type(c.layers[0].k) is cache._Latents
    want = decode_logits(ref, ids, prefill=290)[0]
    assert rel(got[:, 290:], want[:, 290:]) < 2 * rel(plain[:, 290:], want[:, 290:]) + 1e-3
    assert rel(got[:, 290:], plain[:, 290:]) < 0.05


# --------------------------------------------------------------------------------------------------------------
# the Hub, PEFT, streaming
# --------------------------------------------------------------------------------------------------------------

CAL = torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(7))

PUSH = """
import sys, torch, hf_tensorcomp
from transformers import AutoModelForCausalLM
src, repo, out = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = hf_tensorcomp.TensorCompressionConfig(method="latent_kv", kv_bytes=0.3, bits=4, group=8, window=4, whiten=False,
                                            progress=False)
model = AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg)
ids = torch.arange(3, 23).reshape(2, 10)
torch.save(model.generate(ids, max_new_tokens=16, do_sample=False), out)
hf_tensorcomp.push_to_hub(model, repo)
"""

PULL = """
import sys, torch
from transformers import AutoModelForCausalLM
from hf_tensorcomp.methods.latent_kv import LatentKVCache
repo, ref = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(repo)
assert model.config._attn_implementation == "latent_kv", model.config._attn_implementation
ids = torch.arange(3, 23).reshape(2, 10)
out = model.generate(ids, max_new_tokens=16, do_sample=False, return_dict_in_generate=True)
assert isinstance(out.past_key_values, LatentKVCache), type(out.past_key_values)
assert torch.equal(out.sequences, torch.load(ref))
print("PULLED")
"""


def test_push_to_hub_and_pull_decode_through_the_latent_cache(tiny_dirs, tmp_path):
    """Pushed to a Hub server on localhost and pulled by its repo id in a fresh process: the model comes back with
    the latent attention and cache, and greedy decoding gives the tokens it gave before the push."""
    from hub_server import HubServer, hub_env, run_python

    ref = tmp_path / "tokens.pt"
    with HubServer() as hub:
        run_python(PUSH, hub_env(hub, tmp_path / "push"), args=[str(tiny_dirs["gemma3"]), "user/tiny-latent", str(ref)])
        assert {"config.json", "model.safetensors", "README.md"} <= set(hub.repo_files("user/tiny-latent"))
        out = run_python(PULL, hub_env(hub, tmp_path / "pull"), args=["user/tiny-latent", str(ref)])
    assert "PULLED" in out.stdout


def test_lora_on_the_other_modules_decodes_through_the_latent_cache(tiny_dirs):
    """PEFT LoRA on q_proj, o_proj and down_proj of a latent model (full rank, no codes: exact) trains, and its
    decoding through the latent cache gives the logits of the dense model carrying the same adapters."""
    from peft import get_peft_model

    from hf_tensorcomp.integration.peft import lora_config

    ids = long_ids(24)
    cfg = lambda: lora_config(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "down_proj"])  # noqa: E731
    pm = get_peft_model(load(tiny_dirs["llama"], rank=1.0, bits=16), cfg())
    ref = get_peft_model(dense(tiny_dirs["llama"]), cfg())
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        pm(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    lora = {k: v for k, v in pm.state_dict().items() if "lora_" in k}
    assert any(k.endswith("lora_B.default.weight") and v.abs().max() > 0 for k, v in lora.items())
    missing = ref.load_state_dict(lora, strict=False)
    assert not missing.unexpected_keys
    got, cache = decode_logits(pm, ids, 6)
    assert isinstance(cache, LatentKVCache)
    want, _ = decode_logits(ref, ids, 6)
    assert rel(got, want) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_compress_checkpoint_gives_the_in_memory_latents(tiny_dirs, tmp_path, arch):
    """Streaming compression (`compress_checkpoint`, one decoder layer at a time) writes the checkpoint in-memory
    compression gives (a byte budget, whitened, the attention metric, rotated keys), and it decodes alike."""
    import hf_tensorcomp

    kw = dict(method="latent_kv", kv_bytes=0.3, bits=4, group=8, window=4, calibration=CAL, progress=False)
    memory = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], quantization_config=TensorCompressionConfig(**kw)).eval()
    hf_tensorcomp.compress_checkpoint(tiny_dirs[arch], tmp_path / "out", TensorCompressionConfig(**kw))
    streamed = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    a, b = memory.state_dict(), streamed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert streamed.config._attn_implementation == "latent_kv"
    ids = long_ids(30)
    assert torch.equal(decode_logits(memory, ids, 5)[0], decode_logits(streamed, ids, 5)[0])


def test_healing_attends_to_the_keys_the_cache_holds(tiny_dirs):
    """Healing must see the rotated keys' truncation: in its training form the keys go through up · down, so a
    forward gives what the latent cache reads (bits=16: no codes) and the loss reaches the key factors; out of it
    a plain forward keeps the dense keys, as the prompt's prefill does. `heal` then moves the key factors."""
    from hf_tensorcomp.healing import TrainingForms

    model = load(tiny_dirs["llama"], rank=2, bits=16)
    k_proj = model.model.layers[0].self_attn.k_proj
    assert isinstance(k_proj, LatentKeyLinear)
    ids = long_ids(12, batch=1)
    with torch.no_grad():
        plain = model(ids).logits
        cached, _ = decode_logits(model, ids, 1)  # every later token scored against the stored key latents
    forms = TrainingForms(model)
    healing = model(ids).logits
    assert rel(healing[:, 1:], cached[:, 1:]) < 1e-5  # the training forward is the cache's, not the dense one
    assert rel(plain[:, 1:], cached[:, 1:]) > 1e-3
    healing.logsumexp(-1).mean().backward()
    assert k_proj.down.grad is not None and k_proj.down.grad.abs().sum() > 0
    assert k_proj.up.grad is not None and k_proj.up.grad.abs().sum() > 0
    forms.close(keep=True)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain)  # back to dense keys
    down = k_proj.down.detach().clone()
    heal(model, teacher=dense(tiny_dirs["llama"]), calibration=long_ids(32, batch=12, seed=5), steps=10,
         train="factors", progress=False, held_out=0.25)
    assert not torch.equal(k_proj.down, down)
