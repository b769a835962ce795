"""EinSortCache: exactness against DynamicCache (greedy, sampling, beam, padded batches), honest bytes,
sliding and linear-attention layers left alone, pipeline per call, lossy settings, validation."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionLayer

from hf_tensorcomp import EinSortCache
from hf_tensorcomp.methods.einsort import EinSortLayer
from tiny import VOCAB, _tiny, rel_err

LOSSLESS = dict(rank=1000, segment=4, residual=3)  # several segments compressed in prefill and while decoding


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small fits and contractions run far faster on one thread on a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return _tiny("llama").eval()


@pytest.fixture(scope="module")
def padded():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (2, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    ids[1, :4] = 0
    return {"input_ids": ids, "attention_mask": mask}


def tiny_hybrid():
    cfg = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=2,
                          linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(cfg).eval()


def held_tensors(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor reachable from `obj` through attributes, lists, tuples and dicts (each once)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
        items = list(getattr(obj, "__dict__", {}).values())
        items += [getattr(obj, s) for s in getattr(obj, "__slots__", ()) if hasattr(obj, s)]
    else:
        return []
    return [t for it in items for t in held_tensors(it, seen)]


def nbytes_of(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ------------------------------------------------------------------------------------------------
# exactness: a lossless configuration gives DynamicCache's output
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("network", ["svd", "tt", "tucker"])
def test_lossless_greedy_padded_batch(llama, padded, network):
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = llama.generate(**padded, **kw)
    cache = EinSortCache(llama.config, network=network, **LOSSLESS)
    out = llama.generate(**padded, past_key_values=cache, **kw)
    assert torch.equal(out, ref)
    layer = cache.layers[0]
    assert isinstance(layer, EinSortLayer) and len(layer.segments) == 2
    assert layer.compressed_length == 20 and layer.keys.shape[-2] == 4  # 24 cached tokens: 5 segments + window
    assert cache.get_seq_length() == 13 + 12 - 1


def test_lossless_beam_search_and_sampling(llama, padded):
    kw = dict(max_new_tokens=10, pad_token_id=0)
    ref = llama.generate(**padded, num_beams=3, num_return_sequences=2, do_sample=False, **kw)
    out = llama.generate(**padded, num_beams=3, num_return_sequences=2, do_sample=False,
                         past_key_values=EinSortCache(llama.config, **LOSSLESS), **kw)
    assert torch.equal(out, ref)
    torch.manual_seed(5)
    ref = llama.generate(**padded, do_sample=True, top_k=20, **kw)
    torch.manual_seed(5)
    out = llama.generate(**padded, do_sample=True, top_k=20, past_key_values=EinSortCache(llama.config, **LOSSLESS), **kw)
    assert torch.equal(out, ref)


def test_reorder_and_batch_ops_move_rows_exactly(llama, padded):
    cache = EinSortCache(llama.config, rank=2, segment=4, residual=0)
    llama(**padded, past_key_values=cache)
    layer = cache.layers[1]
    k0, v0 = layer.reconstruct()
    layer.reorder_cache(torch.tensor([1, 0]))
    k1, v1 = layer.reconstruct()
    assert torch.equal(k1, k0.flip(0)) and torch.equal(v1, v0.flip(0))
    cache.batch_repeat_interleave(2)
    assert torch.equal(cache.layers[1].reconstruct()[0], k1.repeat_interleave(2, dim=0))
    cache.batch_select_indices(torch.tensor([0, 3]))
    assert torch.equal(cache.layers[1].reconstruct()[0], k1)
    assert cache.layers[1].keys.shape[0] == 2


# ------------------------------------------------------------------------------------------------
# bytes
# ------------------------------------------------------------------------------------------------

def test_nbytes_is_what_the_cache_holds(llama, padded):
    cache = EinSortCache(llama.config, network="tt", rank=3, segment=4, residual=2, low_memory=True)
    llama.generate(**padded, past_key_values=cache, max_new_tokens=6, do_sample=False, pad_token_id=0)
    parts = cache.storage()
    assert all(parts[k] > 0 for k in ("factors", "pivots", "perm", "signs", "window"))
    assert parts["total"] == cache.nbytes() == nbytes_of(held_tensors(cache.layers))
    # nothing dense hides in a layer: its window is all that is not packed
    layer = cache.layers[0]
    packed = [t for row in layer.segments for pair in row for s in pair for t in s.tensors.values()]
    assert all(t.dtype in (torch.uint8, torch.float32) for t in packed)
    assert nbytes_of(held_tensors(layer)) == nbytes_of(packed) + nbytes_of([layer.keys, layer.values])
    # dense_nbytes is what DynamicCache holds for the same tokens; a rank-3 cache holds less
    dyn = DynamicCache(config=llama.config)
    llama.generate(**padded, past_key_values=dyn, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert cache.dense_nbytes() == sum(nbytes_of([l.keys, l.values]) for l in dyn.layers)
    assert cache.nbytes() < cache.dense_nbytes()


@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_rank_fraction_is_a_byte_budget_per_segment(llama, padded, dtype):
    """The fraction is of the segment's bytes at the states' dtype (fp32 here), whatever the factor dtype."""
    cache = EinSortCache(llama.config, rank=0.5, segment=4, residual=0, dtype=dtype)
    llama(**padded, past_key_values=cache)
    sizes = [s.nbytes() / (4 * s.shape[0] * s.shape[1] * s.shape[2])
             for layer in cache.layers for row in layer.segments for pair in row for s in pair]
    assert max(sizes) <= 0.5 and min(sizes) > 0.3
    assert cache.layers[0].segments[0][0][0].tensors["cores"].dtype == (dtype or torch.float32)
    with pytest.raises(ValueError, match=r"EinSortCache\.rank: got 0\.01; allowed: a byte fraction >= "):
        llama(**padded, past_key_values=EinSortCache(llama.config, rank=0.01, segment=4, residual=0))


# ------------------------------------------------------------------------------------------------
# other layer kinds
# ------------------------------------------------------------------------------------------------

def test_gemma3_sliding_layers_untouched():
    torch.manual_seed(0)
    model = _tiny("gemma3").eval()
    ids = torch.randint(1, VOCAB, (2, 14), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    dyn = DynamicCache(config=model.config)
    ref = model.generate(ids, past_key_values=dyn, **kw)
    cache = EinSortCache(model.config, **LOSSLESS)
    assert torch.equal(model.generate(ids, past_key_values=cache, **kw), ref)
    assert cache.einsort_layers == [2]
    for i in (0, 1):
        assert type(cache.layers[i]) is DynamicSlidingWindowLayer
        assert torch.equal(cache.layers[i].keys, dyn.layers[i].keys)
    assert cache.storage()["other_layers"] == sum(nbytes_of([dyn.layers[i].keys, dyn.layers[i].values]) for i in (0, 1))
    # a lossy cache leaves the sliding layers (0, 1, before the only global layer) as DynamicCache has them
    lossy, dyn = EinSortCache(model.config, rank=1, segment=4, residual=0), DynamicCache(config=model.config)
    for c in (lossy, dyn):
        with torch.no_grad():
            model(ids, past_key_values=c)
            model(ids[:, :5], past_key_values=c)
    assert lossy.layers[2].compressed_length == 16
    for i in (0, 1):
        assert torch.equal(lossy.layers[i].keys, dyn.layers[i].keys) and torch.equal(lossy.layers[i].values, dyn.layers[i].values)


def test_hybrid_linear_attention_model():
    model = tiny_hybrid()
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, **kw)
    cache = EinSortCache(model.config, **LOSSLESS)
    assert torch.equal(model.generate(ids, past_key_values=cache, **kw), ref)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [LinearAttentionLayer, LinearAttentionLayer, LinearAttentionLayer, EinSortLayer]
    assert cache.storage()["other_layers"] > 0 and cache.layers[3].compressed_length > 0
    beams = model.generate(ids, num_beams=2, past_key_values=EinSortCache(model.config, **LOSSLESS), **kw)
    assert torch.equal(beams, model.generate(ids, num_beams=2, **kw))


def test_no_config_replicates_einsort_layers(llama, padded):
    cache = EinSortCache(None, **LOSSLESS)
    out = llama.generate(**padded, past_key_values=cache, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out, llama.generate(**padded, max_new_tokens=5, do_sample=False, pad_token_id=0))
    assert len(cache.einsort_layers) == 3


# ------------------------------------------------------------------------------------------------
# lossy settings: attention sees the reconstruction
# ------------------------------------------------------------------------------------------------

@torch.no_grad()
def test_lossy_changes_logits_but_stays_close(llama, padded):
    ids = torch.randint(1, VOCAB, (1, 40), generator=torch.Generator().manual_seed(6))
    ref = llama(ids).logits[:, 32:]

    def decode_logits(**cfg):
        cache = EinSortCache(llama.config, segment=16, residual=0, **cfg)
        llama(ids[:, :32], past_key_values=cache)  # prefill sees dense states, then 2 segments are compressed
        assert cache.layers[0].compressed_length == 32
        return llama(ids[:, 32:], past_key_values=cache).logits  # teacher-forced, sees the reconstruction

    exact = decode_logits(rank=1000)
    assert rel_err(exact, ref) < 1e-4
    errs = {r: rel_err(decode_logits(rank=r), ref) for r in (1, 4)}
    assert 1e-3 < errs[4] < errs[1] < 0.5
    plain = rel_err(decode_logits(rank=1, sort=None, nonnegative=False), ref)
    assert 1e-3 < plain < 0.5


# ------------------------------------------------------------------------------------------------
# pipeline, one real model
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_pipeline_per_call(smollm2):
    from transformers import pipeline

    model, tok = smollm2
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    kw = dict(max_new_tokens=12, do_sample=False, return_full_text=False)
    ref = pipe("The capital of France is", **kw)[0]["generated_text"]
    cache = EinSortCache(pipe.model.config, network="tt", rank=1000, segment=4, residual=2)
    assert pipe("The capital of France is", past_key_values=cache, **kw)[0]["generated_text"] == ref
    assert cache.layers[0].compressed_length > 0
    small = EinSortCache(pipe.model.config, network="svd", rank=0.5, segment=4, residual=2, low_memory=True)
    assert isinstance(pipe("The capital of France is", past_key_values=small, **kw)[0]["generated_text"], str)
    assert small.nbytes() < small.dense_nbytes()  # low_memory: no rebuilt segment is kept beside its factors


@pytest.mark.slow
@torch.no_grad()
def test_gemma3_real_lossless_global_layers_compressed(gemma3):
    model, tok = gemma3
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    kw = dict(max_new_tokens=10, do_sample=False)
    ref = model.generate(ids, **kw)
    cache = EinSortCache(model.config, network="tt", rank=1000, segment=4, residual=2)
    assert torch.equal(model.generate(ids, past_key_values=cache, **kw), ref)
    assert len(cache.einsort_layers) == 3  # the global layers (5, 11, 17) of 18; head dim 256
    assert all(cache.layers[i].compressed_length > 0 for i in cache.einsort_layers)


# ------------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    (dict(network="mps"), "network"), (dict(rank=0), "rank"), (dict(rank=1.5), "rank"), (dict(rank="8"), "rank"),
    (dict(segment=0), "segment"), (dict(residual=-1), "residual"), (dict(segment=True), "segment"),
    (dict(sort="rows"), "sort"), (dict(sort_span="head"), "sort_span"), (dict(network="cp", gauge="block_identity"), "gauge"),
    (dict(mapping=("pow", -1)), "mapping"), (dict(reduction="sum"), "reduction"), (dict(dtype=torch.int8), "dtype"),
])
def test_bad_settings_name_the_field(llama, kwargs, field):
    with pytest.raises(ValueError, match=rf"EinSortCache\.{field}: got .*; allowed: "):
        EinSortCache(llama.config, **kwargs)


# ------------------------------------------------------------------------------------------------
# time: all segments rebuilt by one batched call per layer and step (each once, unless low_memory);
# budgets checked at construction
# ------------------------------------------------------------------------------------------------

def _count_rebuilds(monkeypatch) -> list[int]:
    """Patch the batched rebuild: the returned list gets the number of segments of each call."""
    from hf_tensorcomp.methods.einsort import cache as einsort_cache

    calls = []
    real = einsort_cache.rebuild_segments
    monkeypatch.setattr(einsort_cache, "rebuild_segments",
                        lambda tensors, meta, dtype, **kw: calls.append(tensors["cores"].shape[:-1].numel()) or real(tensors, meta, dtype, **kw))
    return calls


def test_each_segment_rebuilt_once_unless_low_memory(llama, padded, monkeypatch):
    calls = _count_rebuilds(monkeypatch)
    outs, counts = {}, {}
    for low in (False, True):
        calls.clear()
        cache = EinSortCache(llama.config, network="tt", rank=3, segment=4, residual=2, low_memory=low)
        outs[low] = llama.generate(**padded, past_key_values=cache, max_new_tokens=12, do_sample=False, pad_token_id=0)
        held = sum(2 * len(row) for layer in cache.layers for row in layer.segments)  # key and value segments
        counts[low] = (sum(calls), held)
        parts = cache.storage()
        assert parts["total"] == cache.nbytes() == nbytes_of(held_tensors(cache.layers))
        assert (parts["rebuilt"] > 0) is (not low)
    assert torch.equal(outs[False], outs[True])  # same tokens either way
    assert 0 < counts[False][0] <= counts[False][1]  # kept: each segment rebuilt once at most
    assert counts[True][0] > 2 * counts[True][1]  # low_memory: rebuilt at every step


def test_one_batched_rebuild_per_layer_and_step(llama, monkeypatch):
    """However many segments a layer holds, a decode step rebuilds them in one call per layer (not one per segment)."""
    calls = _count_rebuilds(monkeypatch)
    cache = EinSortCache(llama.config, network="tt", rank=3, segment=4, residual=2)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]])
    with torch.no_grad():
        out = llama(ids, past_key_values=cache, use_cache=True)
        calls.clear()
        llama(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    full = [i for i in cache.einsort_layers]
    assert cache.layers[full[0]].n_segments >= 4
    assert len(calls) == len(full)  # one call per full-attention layer
    assert all(c == 2 * cache.layers[i].n_segments for c, i in zip(calls, full))  # keys and values of every segment


def test_default_holds_fewer_bytes_than_dynamic_cache():
    """Before, the default kept every rebuilt segment beside its packed form: after 63 tokens of a 2-layer
    model it held 41,244 bytes against DynamicCache's 32,256."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)).eval()
    cache = EinSortCache(model.config, segment=16, residual=16)  # the defaults otherwise (rank 8 of head_dim 64)
    ids = torch.randint(0, 64, (1, 1))
    with torch.no_grad():
        for t in range(1, 120):
            out = model(ids, past_key_values=cache, use_cache=True)
            ids = out.logits[:, -1:].argmax(-1)
            if t > 32:  # past the first segment (residual + segment tokens)
                assert cache.nbytes() < cache.dense_nbytes(), t
    assert cache.storage()["rebuilt"] == 0


def test_budget_too_small_fails_at_construction(llama):
    # before: only when the first segment filled, mid-generate
    with pytest.raises(ValueError, match=r"EinSortCache\.rank: got 0\.01; allowed: a byte fraction >= .* 2 x 4 x 8 segment of float32"):
        EinSortCache(llama.config, rank=0.01, segment=4, residual=0)
    cache = EinSortCache(None, rank=0.01, segment=4, residual=100)  # no config: at the first forward, before any token
    with pytest.raises(ValueError, match=r"EinSortCache\.rank: got 0\.01"):
        llama(torch.tensor([[1, 2]]), past_key_values=cache)
    EinSortCache(llama.config, rank=0.5, segment=4, residual=0)


@pytest.mark.parametrize("width", range(0, 21))
def test_packed_indices_read_back_exactly(width):
    from hf_tensorcomp.methods.einsort.segments import _unpack
    from hf_tensorcomp.methods.einsort.decomposition import from_bits, pack_bits, to_bits, unpack_bits

    g = torch.Generator().manual_seed(width)
    for count in (1, 3, 64, 333):
        x = torch.randint(0, 1 << width, (4, count), generator=g)
        packed = torch.stack([pack_bits(to_bits(row, width)) for row in x])
        assert torch.equal(_unpack(packed, width, count), x)
        assert torch.equal(x[1], from_bits(unpack_bits(packed[1], count * width), width, count))


@pytest.mark.parametrize("network,sort,span,nonnegative,mapping", [
    ("svd", "shared", "channel", True, ("pow", 0.5)), ("svd", "shared", "token", True, ("pow", 0.5)),
    ("svd", "shared", "segment", True, ("exp", 1.0)), ("svd", "full", "channel", True, ("linear", 1.0)),
    ("svd", None, "channel", False, ("pow", 0.5)), ("svd", "full", "token", False, ("pow", 0.5)),
    ("tt", "shared", "channel", True, ("pow", 0.5)), ("tt", "full", "segment", True, ("pow", 0.5)),
    ("tr", "shared", "token", True, ("pow", 0.5)), ("cp", "shared", "channel", False, ("pow", 0.5)),
    ("tucker", "shared", "channel", True, ("pow", 0.5)), ("tucker", None, "token", True, ("pow", 0.5)),
])
def test_batched_rebuild_equals_each_segment_rebuilt(network, sort, span, nonnegative, mapping):
    """`rebuild_segments` on stacked packed segments (pivot decoding, the flattened unsorting scatter, signs)
    gives each segment's own `reconstruct`, also when written into a strided view."""
    from hf_tensorcomp.methods.einsort.segments import EinSortCacheSettings, compress_segment, rebuild_segments

    g = torch.Generator().manual_seed(5)
    settings = EinSortCacheSettings.build(network=network, rank=3, sort=sort, sort_span=span, nonnegative=nonnegative,
                                          mapping=mapping, n_iter_max=5)
    segs = [compress_segment(torch.randn(3, 16, 8, generator=g), settings) for _ in range(6)]
    assert len({str(s.meta) for s in segs}) == 1
    stacked = {k: torch.stack([s.tensors[k] for s in segs]).reshape(2, 3, -1) for k in segs[0].tensors}  # batch dims (2, 3)
    expected = torch.stack([s.reconstruct() for s in segs]).reshape(2, 3, *segs[0].meta["shape"])
    got = rebuild_segments(stacked, segs[0].meta, torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    out = torch.full((3, 2, *segs[0].meta["shape"]), float("nan")).transpose(0, 1)  # strided
    assert rebuild_segments(stacked, segs[0].meta, torch.float32, out=out) is out
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# a quantized error (error_bits): the fit plus what it misses, quantized
# ------------------------------------------------------------------------------------------------

def _outlier_channels(g) -> torch.Tensor:
    """(heads 3, tokens 16, head_dim 8) states whose channels differ in scale a thousandfold, as keys do."""
    return torch.randn(3, 16, 8, generator=g) * torch.logspace(0, 3, 8)


@pytest.mark.parametrize("keys", [True, False])
def test_quantized_error_alone_is_within_half_a_step(keys):
    """Rank 0: the segment is its quantization; every value within half a step of its group's grid, the groups
    running along tokens (keys) or along channels (values)."""
    from hf_tensorcomp.methods.einsort.segments import EinSortCacheSettings, compress_segment

    x = _outlier_channels(torch.Generator().manual_seed(1))
    seg = compress_segment(x, EinSortCacheSettings.build(rank=0, segment=16, sort=None, nonnegative=False, error_bits=4), keys=keys)
    assert "cores" not in seg.tensors and seg.meta["error"] == (4, 8)
    groups = (x.transpose(1, 2) if keys else x).reshape(-1, 8)
    step = ((groups.amax(1) - groups.amin(1)) / 15).repeat_interleave(8)
    err = ((seg.reconstruct() - x).transpose(1, 2) if keys else seg.reconstruct() - x).reshape(-1).abs()
    assert (err <= step * 0.5 * (1 + 1e-2) + 1e-6).all()
    assert seg.storage()["error"] == 3 * 16 * 8 // 2 + 3 * 16 * 8 // 8 * 3  # 4-bit codes + fp16 scale and uint8 zero per 8


def test_quantized_error_grouping_and_bits_matter():
    """Keys grouped along tokens beat the values' grouping on outlier channels; more bits, less error; a fit
    underneath lowers it further."""
    from hf_tensorcomp.methods.einsort.segments import EinSortCacheSettings, compress_segment

    x = _outlier_channels(torch.Generator().manual_seed(2))

    def err(keys=True, bits=4, rank=0, channels=slice(None)):
        st = EinSortCacheSettings.build(rank=rank, segment=16, sort=None, nonnegative=False, error_bits=bits)
        return rel_err(compress_segment(x, st, keys=keys).reconstruct()[..., channels], x[..., channels])

    small = slice(0, 4)  # the small channels: lost in a token's group beside the large ones
    assert err(keys=True, channels=small) < 0.1 * err(keys=False, channels=small)
    errs = [err(bits=b) for b in (2, 3, 4, 8)]
    assert errs == sorted(errs, reverse=True) and errs[-1] < 1e-2
    assert err(bits=3, rank=2) < err(bits=3, rank=0)


def test_quantized_error_in_the_cache_matches_each_segment_and_the_budget(llama, padded):
    """The batched rebuild (fit + de-quantized error for keys and values) equals each packed segment's own
    reconstruction; a float rank counts the error's bytes first."""
    cache = EinSortCache(llama.config, rank=0.5, segment=8, residual=0, sort=None, nonnegative=False, error_bits=3)
    llama(**padded, past_key_values=cache)
    layer = cache.layers[0]
    k, v = layer.reconstruct()
    for b, row in enumerate(layer.segments):
        for j, (ks, vs) in enumerate(row):
            assert ks.keys and not vs.keys
            torch.testing.assert_close(k[b, :, 8 * j: 8 * (j + 1)], ks.reconstruct(), rtol=0, atol=1e-5)
            torch.testing.assert_close(v[b, :, 8 * j: 8 * (j + 1)], vs.reconstruct(), rtol=0, atol=1e-5)
            assert ks.nbytes() <= 0.5 * 4 * ks.shape[0] * ks.shape[1] * ks.shape[2]
            assert ks.storage()["factors"] > 0 and ks.storage()["error"] > 0
    parts = cache.storage()
    assert parts["error"] > 0 and parts["total"] == nbytes_of(held_tensors(cache.layers))
    assert rel_err(k, layer_dense(llama, padded)[0][:, :, : k.shape[-2]]) < 0.1


def layer_dense(llama, padded):
    dyn = DynamicCache(config=llama.config)
    llama(**padded, past_key_values=dyn)
    return dyn.layers[0].keys, dyn.layers[0].values


def test_eight_bit_error_keeps_generation(llama, padded):
    """8-bit quantization alone (rank 0) changes a greedy generation of the tiny model by nothing."""
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = llama.generate(**padded, **kw)
    cache = EinSortCache(llama.config, rank=0, segment=4, residual=2, sort=None, nonnegative=False, error_bits=8)
    assert torch.equal(llama.generate(**padded, past_key_values=cache, **kw), ref)
    assert cache.storage()["factors"] == 0 and cache.nbytes() < 0.6 * cache.dense_nbytes()  # groups of 4 here: 0.44 + window


@pytest.mark.parametrize("kwargs, field", [
    (dict(error_bits=7), "error_bits"), (dict(error_bits="4"), "error_bits"), (dict(rank=0, error_bits=None), "rank"),
])
def test_bad_error_settings_name_the_field(llama, kwargs, field):
    with pytest.raises(ValueError, match=rf"EinSortCache\.{field}: got .*; allowed: "):
        EinSortCache(llama.config, **kwargs)


def test_budget_below_the_quantized_error_fails_at_construction(llama):
    with pytest.raises(ValueError, match=r"EinSortCache\.rank: got 0\.1; allowed: a byte fraction >= .*its error at 4 bits"):
        EinSortCache(llama.config, rank=0.1, segment=4, error_bits=4)


@pytest.mark.parametrize("kwargs", [dict(), dict(rank=1000), dict(rank=1000, low_memory=False), dict(sort="full"),
                                    dict(network="tt"), dict(error_bits=4)])
def test_one_token_segments_work(llama, padded, kwargs):
    """Issue 84 row 16: ``segment=1, residual=8`` was accepted, then a reshape error once the first segment was
    compressed (a one-token segment sorted by channel needs no permutation bits: an empty part, whose rows
    ``reshape(-1, 0)`` cannot infer). It works: lossless at full rank (greedy and beams), lossy at the default."""
    kw = dict(max_new_tokens=6, pad_token_id=0, do_sample=False)
    cache = EinSortCache(llama.config, segment=1, residual=8, **kwargs)
    out = llama.generate(**padded, past_key_values=cache, **kw)
    layer = cache.layers[0]
    assert layer.n_segments == 13 + 6 - 1 - 8 and cache.nbytes() > 0
    if kwargs.get("rank") == 1000:
        assert torch.equal(out, llama.generate(**padded, **kw))
        beams = dict(num_beams=2, num_return_sequences=2)
        assert torch.equal(llama.generate(**padded, past_key_values=EinSortCache(llama.config, segment=1, residual=8,
                                                                                 **kwargs), **beams, **kw),
                           llama.generate(**padded, **beams, **kw))
