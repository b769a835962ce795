"""TensorLLM: per-head tensorisation (both GQA layouts), partial Tucker, factored forward, ratio, reload, Case 3."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hf_tensorcomp import TensorCompressionConfig
from hf_tensorcomp.decompositions import relative_error, tucker_hooi
from hf_tensorcomp.layers import HeadTuckerFactors, HeadTuckerProjection, LowRankLinear
from hf_tensorcomp.methods.tensorllm import head_slices, param_count, ranks_for_ratio
from tiny import ARCHS, rel_err, reloads_without_option


def load(path, **cfg):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=TensorCompressionConfig(method="tensorllm", progress=False, **cfg))


def full_ranks(model, gqa="group"):
    """(d_model, head_dim, M): M = 2 n_rep + 2 mode-3 slots per KV group (q and o: n_rep each), 4 repeated."""
    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    n_rep = c.num_attention_heads // c.num_key_value_heads
    return (c.hidden_size, hd, 2 * n_rep + 2 if gqa == "group" else 4)


def test_head_slices_layout_gqa():
    # 6 query heads, 2 KV heads, head dim 8, d_model 16
    d, hd, h, kv = 16, 8, 6, 2
    w = {"q": torch.randn(h * hd, d), "k": torch.randn(kv * hd, d), "v": torch.randn(kv * hd, d), "o": torch.randn(d, h * hd)}
    # gqa="group": KV group g's slab holds its query heads 3g..3g+2 (q, then o) and K_g, V_g, each once
    t = head_slices(w, hd, kv)
    assert t.shape == (d, hd, 8, kv) and t.numel() == sum(x.numel() for x in w.values())
    for i in range(h):
        g, s = divmod(i, h // kv)
        assert torch.equal(t[:, :, s, g], w["q"][i * hd:(i + 1) * hd].T)
        assert torch.equal(t[:, :, 5 + s, g], w["o"][:, i * hd:(i + 1) * hd])
    for g in range(kv):
        assert torch.equal(t[:, :, 3, g], w["k"][g * hd:(g + 1) * hd].T)
        assert torch.equal(t[:, :, 4, g], w["v"][g * hd:(g + 1) * hd].T)
    # gqa="repeat": query head i's slab holds K/V of KV head i // 3
    t = head_slices(w, hd, h)
    assert t.shape == (d, hd, 4, h)
    for i in range(h):
        g = i // (h // kv)
        assert torch.equal(t[:, :, 0, i], w["q"][i * hd:(i + 1) * hd].T)
        assert torch.equal(t[:, :, 1, i], w["k"][g * hd:(g + 1) * hd].T)
        assert torch.equal(t[:, :, 2, i], w["v"][g * hd:(g + 1) * hd].T)
        assert torch.equal(t[:, :, 3, i], w["o"][:, i * hd:(i + 1) * hd])
    # the i % n_kv mapping would put KV head 1 in query head 1's slab; transformers reads KV head 0 there
    assert not torch.equal(t[:, :, 1, 1], w["k"][(1 % kv) * hd:(1 % kv + 1) * hd].T)


def test_partial_tucker_keeps_one_core_per_head_and_is_exact_at_full_rank():
    x = torch.randn(12, 5, 4, 3)
    t = tucker_hooi(x, (12, 5, 4), modes=[0, 1, 2])
    assert t.core.shape == (12, 5, 4, 3) and [f.shape for f in t.factors] == [(12, 12), (5, 5), (4, 4)]
    assert relative_error(x, t.reconstruct()) < 1e-5
    errs = [relative_error(x, tucker_hooi(x, (r, 5, 4), modes=[0, 1, 2]).reconstruct()) for r in (2, 6, 10)]
    assert errs[0] > errs[1] > errs[2]


@torch.no_grad()
@pytest.mark.parametrize("gqa", ["group", "repeat"])
@pytest.mark.parametrize("arch", ARCHS)
def test_full_rank_exact(arch, gqa, tiny_dirs, ids):
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch])
    m = load(tiny_dirs[arch], ranks=full_ranks(dense, gqa), gqa=gqa)
    assert sum(isinstance(x, HeadTuckerProjection) for x in m.modules()) == 3 * 4
    assert sum(isinstance(x, HeadTuckerFactors) for x in m.modules()) == 3
    assert rel_err(m(ids).logits, dense(ids).logits) <= 1e-4
    for name, lin in dense.named_modules():
        if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")):
            assert rel_err(m.get_submodule(name).dense_weight(), lin.weight) <= 1e-4, name


@torch.no_grad()
@pytest.mark.parametrize("gqa", ["group", "repeat"])
def test_factorized_dense_mode_and_reload(gqa, tiny_dirs, ids, tmp_path):
    fac = load(tiny_dirs["llama"], ranks=(12, 6, 3), layers=[-1], gqa=gqa)
    den = load(tiny_dirs["llama"], ranks=(12, 6, 3), layers=[-1], mode="dense", gqa=gqa)
    assert type(den.model.layers[-1].self_attn.k_proj) is torch.nn.Linear
    assert not any(isinstance(x, HeadTuckerFactors) for x in den.modules())
    assert rel_err(fac(ids).logits, den(ids).logits) <= 1e-5
    k = fac.model.layers[-1].self_attn.k_proj
    x = torch.randn(3, 48)
    assert rel_err(k(x), x @ k.dense_weight().T) <= 1e-5
    fac.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    pre = "model.layers.2.self_attn"
    slots, slabs = (3, 2) if gqa == "group" else (1, 6)  # grouped: q fills n_rep = 3 slots, one core per KV group
    assert shapes[f"{pre}.k_proj.weight"] == (3,) and shapes[f"{pre}.q_proj.weight"] == (3 * slots,)
    assert shapes[f"{pre}.tensorllm_factors.u1"] == (48, 12)
    assert shapes[f"{pre}.tensorllm_factors.u2"] == (8, 6)
    assert shapes[f"{pre}.tensorllm_factors.core"] == (12, 6, 3, slabs)
    again, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(again(ids).logits, fac(ids).logits)


def test_ratio_meets_the_target_and_error_grows_with_it(tiny_dirs):
    errs = []
    for ratio in (1.5, 3.0, 8.0):
        m = load(tiny_dirs["qwen3"], ratio=ratio, layers=[0])
        st = m.config.quantization_config.stats["modules"]["model.layers.0.self_attn.tensorllm_factors"]
        assert st["params_original"] == 4 * 6 * 16 * 48 - 2 * 4 * 16 * 48
        assert st["compression_ratio"] >= ratio and st["params_compressed"] == param_count(48, 16, 8, 2, st["ranks"])
        errs.append(st["rel_error"])
    assert errs[0] < errs[1] < errs[2]


def test_ranks_for_ratio_prefers_the_mode_with_little_energy():
    # mode 2 (head_dim) of rank 2, the rest full: the greedy cuts only head_dim
    g = torch.Generator().manual_seed(0)
    core = torch.randn(20, 2, 4, 5, generator=g)
    u2 = torch.linalg.qr(torch.randn(16, 2, generator=g))[0]
    x = torch.einsum("abch,db->adch", core, u2)
    r = ranks_for_ratio(x, x.numel(), 2.0)
    assert r[0] == 20 and r[1] < 16 and r[2] == 4 and param_count(20, 16, 4, 5, r) <= x.numel() / 2
    with pytest.raises(ValueError, match="ratio.*at most"):
        ranks_for_ratio(x, x.numel(), 1e6)


@torch.no_grad()
def test_single_matrix_ablation(tiny_dirs, ids):
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["gemma3"])
    m = load(tiny_dirs["gemma3"], ranks=(48, 32, 1), targets=["self_attn.v_proj"], layers=[1])
    st = m.config.quantization_config.stats["modules"]["model.layers.1.self_attn.tensorllm_factors"]
    assert st["tensor"] == [48, 32, 1, 1]  # the one KV head's V (repeated: one copy per query head, [48, 32, 1, 4])
    assert isinstance(m.model.layers[1].self_attn.v_proj, HeadTuckerProjection)
    assert type(m.model.layers[1].self_attn.q_proj) is torch.nn.Linear
    assert rel_err(m(ids).logits, dense(ids).logits) <= 1e-4


@torch.no_grad()
def test_case3_tensorllm_on_attention_with_laser_on_ffn(tiny_dirs, ids, tmp_path):
    cfg = TensorCompressionConfig(entries=[
        {"method": "tensorllm", "ranks": (16, 8, 3), "layers": [-1]},
        {"method": "laser", "rank": 8, "targets": ["mlp.*"], "layers": [-1]},
    ], progress=False)
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen3"], quantization_config=cfg)
    layer = m.model.layers[-1]
    assert isinstance(layer.self_attn.o_proj, HeadTuckerProjection) and isinstance(layer.mlp.up_proj, LowRankLinear)
    m.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.config.quantization_config.method == "tensorllm+laser"
    assert torch.equal(again(ids).logits, m(ids).logits)


@pytest.mark.parametrize("cfg, field", [
    ({}, "ranks"),
    ({"ranks": (4, 4, 2), "ratio": 10}, "ranks"),
    ({"ranks": (4, 4)}, "ranks"),
    ({"ratio": 1.0}, "ratio"),
    ({"rank": 8, "ratio": 4}, "rank"),
    ({"ratio": 4, "init": "zeros"}, "init"),
    ({"ratio": 4, "gqa": "mean"}, "gqa"),
    ({"ratio": 4, "slice_weight": {"k_proj": -1}}, "slice_weight"),
])
def test_bad_options(cfg, field):
    with pytest.raises(ValueError) as e:
        TensorCompressionConfig(method="tensorllm", **cfg)
    assert f".{field}:" in str(e.value) and "allowed" in str(e.value)


@torch.no_grad()
def test_slice_weight_moves_the_fit_and_balanced_ignores_a_matrix_scale(tiny_dirs, ids, tmp_path):
    scaled = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    scaled.model.layers[0].self_attn.k_proj.weight.mul_(10)
    scaled.save_pretrained(tmp_path)

    def errs(path, weight):
        m = load(path, ranks=(12, 4, 6), layers=[0], slice_weight=weight)
        mods = m.config.quantization_config.stats["modules"]
        return [mods[f"model.layers.0.self_attn.{p}_proj"]["rel_error"] for p in "qkvo"]

    plain = errs(tiny_dirs["llama"], None)
    assert errs(tmp_path, "balanced") == pytest.approx(errs(tiny_dirs["llama"], "balanced"), rel=1e-3)
    assert errs(tiny_dirs["llama"], {"k_proj": 5.0})[1] < plain[1] < errs(tiny_dirs["llama"], {"k_proj": 0.2})[1]
    full = load(tiny_dirs["llama"], ranks=full_ranks(scaled), slice_weight={"v_proj": 0.1, "o_proj": 3})
    assert rel_err(full(ids).logits, AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])(ids).logits) <= 1e-4
    with pytest.raises(ValueError, match="slice_weight.*matches none"):
        load(tiny_dirs["llama"], ranks=(12, 4, 6), slice_weight={"q": 2.0})


def test_ranks_too_large_or_wrong_targets_fail_before_loading(tiny_dirs):
    with pytest.raises(ValueError, match="ranks.*at most"):
        load(tiny_dirs["llama"], ranks=(48, 9, 4))
    with pytest.raises(ValueError, match="targets.*q_proj"):
        load(tiny_dirs["llama"], ranks=(4, 4, 1), targets=["mlp.up_proj"])


def test_config_round_trip():
    c = TensorCompressionConfig(method="tensorllm", ranks=(64, 32, 3), layers=[-2])
    assert TensorCompressionConfig.from_dict(json.loads(c.to_json_string())) == c


@pytest.mark.slow
@torch.no_grad()
@pytest.mark.parametrize("name, layers", [("smollm2", [0, -1]), ("gemma3", [5])])
def test_real_model_full_rank_exact(name, layers, request):
    from hf_tensorcomp.assets import load_text, model_path

    path = model_path(name)
    dense, tok = request.getfixturevalue(name)  # the session's smollm2 / gemma3
    ids = tok(load_text("wikipedia", "eval")[0], return_tensors="pt").input_ids[:, :48]
    ref, ranks = dense(ids).logits, full_ranks(dense)
    m = load(path, ranks=ranks, layers=layers)
    assert ranks == ((576, 64, 8) if name == "smollm2" else (640, 256, 10))  # 9/3 heads x 64; 4/1 heads x 256
    assert rel_err(m(ids).logits, ref) <= 1e-4


def test_target_is_the_same_budget_as_ratio(tiny_dirs):
    """target=0.25 keeps a quarter of each layer's attention parameters: the ranks ratio=4 picks."""
    from transformers import AutoModelForCausalLM

    from hf_tensorcomp import TensorCompressionConfig

    def stats(**kw):
        m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(
            method="tensorllm", layers=[0], progress=False, **kw))
        return next(v for k, v in m.config.quantization_config.stats["modules"].items() if k.endswith("tensorllm_factors"))

    a, b = stats(target=0.25), stats(ratio=4)
    assert a["ranks"] == b["ranks"] and a["params_compressed"] <= 0.25 * a["params_original"]
    with pytest.raises(ValueError, match="TensorCompressionConfig.target"):
        TensorCompressionConfig(method="tensorllm", target=0.25, ratio=4)
    with pytest.raises(ValueError, match="TensorCompressionConfig.ranks"):
        TensorCompressionConfig(method="tensorllm")


@torch.no_grad()
def test_checkpoint_written_before_the_gqa_option_loads_as_repeated(tiny_dirs, ids, tmp_path):
    """A saved entry without ``gqa`` was written when K and V were always repeated; a new config groups."""
    m = load(tiny_dirs["llama"], ranks=(12, 6, 3), layers=[-1], gqa="repeat")
    assert reloads_without_option(m, tmp_path, "gqa", ids) == "repeat"
    assert TensorCompressionConfig(method="tensorllm", ratio=2).entries[0].options["gqa"] == "group"
