"""No silent non-finite or useless results: what compression and reload refuse, naming the module."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_tensorcomp import LowRankLinear, TensorCompressionConfig
from hf_tensorcomp import pipeline
from hf_tensorcomp.plan import plan
from hf_tensorcomp.checks import check_outputs
from hf_tensorcomp.methods.einsort import save_activation_scales
from hf_tensorcomp.config import Entry
from tiny import _tiny, rel_err

METHOD_CFGS = {
    "laser": dict(method="laser", rank=4),
    "trawl": dict(method="trawl", rank=4),
    "trawl_tucker": dict(method="trawl", rank=4, decomposition="tucker"),
    "tensorllm": dict(method="tensorllm", ranks=[8, 8, 2]),
    "einsort": dict(method="einsort", rank=4),
}


def poisoned(tmp_path, value, module="mlp.up_proj", layer=1):
    torch.manual_seed(0)
    m = _tiny("llama")
    target = m.model.layers[layer].get_submodule(module)
    with torch.no_grad():
        target.weight[3, 5] = value
    m.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", sorted(METHOD_CFGS))
def test_non_finite_dense_weight_refused_naming_module(name, value, tmp_path):
    module = "self_attn.k_proj" if name == "tensorllm" else "mlp.up_proj"
    src = poisoned(tmp_path, value, module)
    with pytest.raises(ValueError, match=rf"model\.layers\.1\.{module}\.weight: the dense weight holds 1 NaN/Inf"):
        AutoModelForCausalLM.from_pretrained(src, quantization_config=TensorCompressionConfig(progress=False, **METHOD_CFGS[name]))


@pytest.fixture
def meta_llama():
    with torch.device("meta"):  # what plan sees before any weight loads
        return _tiny("llama")


def scales_file(path, vectors):
    save_activation_scales(vectors, path)
    return str(path)


@pytest.mark.parametrize("cfg, match", [
    # TRAWL CP far above the tensor's rank: NaN factors (500) or an error of 6.06 (200) were saved silently
    (dict(method="trawl", rank=200), r"rank: got CP rank 200; allowed: at most 144 for this 3 x 96 x 48 tensor"),
    (dict(method="trawl", rank=500, layers=[0]), r"rank: got CP rank 500; allowed: at most 144"),
    (dict(method="tensorllm", ratio=1e9), r"ratio: got 1000000000.0; allowed: at most 93.1 for layer 0"),
    (dict(method="einsort", network="cp", rank=1000), r"rank: got 1000; allowed: at most 48 for network 'cp' on model\.layers\.0"),
    (dict(method="einsort", network="cp", rank=[1000]), r"rank: got \[1000\]; allowed: at most 48"),
])
def test_checks_run_before_weights_load(meta_llama, cfg, match):
    with pytest.raises(ValueError, match=match):
        plan(meta_llama, TensorCompressionConfig(progress=False, **cfg))


def test_activation_scales_checked_before_weights_load(meta_llama, tmp_path):
    good = {f"model.layers.{i}.mlp.up_proj": torch.ones(48) for i in range(3)}
    cases = {
        "missing": ({"model.layers.0.mlp.up_proj": torch.ones(48)}, r"it has none for model\.layers\.1\.mlp\.up_proj"),
        "length": ({**good, "model.layers.2.mlp.up_proj": torch.ones(47)},
                   r"for model\.layers\.2\.mlp\.up_proj a finite float vector of length 48 .*got shape \[47\]"),
        "nan": ({**good, "model.layers.1.mlp.up_proj": torch.full((48,), float("nan"))}, r"model\.layers\.1\.mlp\.up_proj a finite"),
    }
    for case, (vectors, match) in cases.items():
        cfg = TensorCompressionConfig(method="einsort", rank=4, targets=["mlp.up_proj"], progress=False,
                                      activation_scales=scales_file(tmp_path / f"{case}.safetensors", vectors))
        with pytest.raises(ValueError, match=r"TensorCompressionConfig\.activation_scales: .*" + match):
            plan(meta_llama, cfg)
    bad = tmp_path / "bad.safetensors"
    bad.write_text("not a safetensors file")
    cfg = TensorCompressionConfig(method="einsort", rank=4, targets=["mlp.up_proj"], activation_scales=str(bad), progress=False)
    with pytest.raises(ValueError, match=r"activation_scales: .*allowed: a safetensors file written by save_activation_scales"):
        plan(meta_llama, cfg)
    ok = TensorCompressionConfig(method="einsort", rank=4, targets=["mlp.up_proj"], progress=False,
                                 activation_scales=scales_file(tmp_path / "ok.safetensors", good))
    assert len(plan(meta_llama, ok)) == 3


def test_check_outputs_refuses_nan_factor_and_error_above_one():
    lin = LowRankLinear.from_factors(torch.ones(6, 2), torch.ones(2, 5))
    entry = Entry("laser", rank=2)
    mods = {"0.mlp.up_proj": torch.nn.Linear(5, 6)}
    check_outputs({"0.mlp.up_proj": (lin, {"rel_error": 0.5})}, mods, "model.layers", entry, "x")  # fine
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj with method='laser', rank=2.*relative error is 1\.2"):
        check_outputs({"0.mlp.up_proj": (lin, {"rel_error": 1.2})}, mods, "model.layers", entry, "x")
    with pytest.raises(ValueError, match="relative error is nan"):
        check_outputs({"0.mlp.up_proj": (lin, {"rel_error": float("nan")})}, mods, "model.layers", entry, "x")
    with torch.no_grad():
        lin.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj .*its factors \(weight\) hold NaN/Inf"):
        check_outputs({"0.mlp.up_proj": (lin, {"rel_error": 0.5})}, mods, "model.layers", entry, "x")


def test_all_zero_weight_compresses_exactly(tiny_dirs, tmp_path):
    torch.manual_seed(0)
    m = _tiny("llama")
    with torch.no_grad():
        m.model.layers[0].mlp.down_proj.weight.zero_()
    m.save_pretrained(tmp_path)
    c = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=TensorCompressionConfig(
        method="laser", rank=2, targets=["mlp.down_proj"], layers=[0], progress=False))
    assert c.config.quantization_config.stats["modules"]["model.layers.0.mlp.down_proj"]["rel_error"] == 0.0


# -- reload: every spec validated, every factor present, finite, and valid -----------------------------------

from safetensors.torch import load_file, save_file  # noqa: E402

import json  # noqa: E402


def compressed(src, dst, **cfg):
    m = AutoModelForCausalLM.from_pretrained(src, quantization_config=TensorCompressionConfig(progress=False, **cfg))
    m.save_pretrained(dst)
    return m


def edit_config(d, fn):
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg["quantization_config"]["compressed_modules"])
    p.write_text(json.dumps(cfg))


def edit_tensors(d, fn):
    p = d / "model.safetensors"
    tensors = load_file(p)
    fn(tensors)
    save_file(tensors, p, metadata={"format": "pt"})


@pytest.fixture
def laser_ckpt(tiny_dirs, tmp_path):
    compressed(tiny_dirs["llama"], tmp_path, rank=4, targets=["mlp.*"])
    return tmp_path


@pytest.mark.parametrize("case, match", [
    ("missing", r"model\.layers\.0\.mlp\.up_proj\.weight: missing from the checkpoint"),
    ("unexpected", r"model\.layers\.0\.mlp\.up_proj\.lora_B: unexpected in the checkpoint"),
    ("wrong_shape", r"model\.layers\.0\.mlp\.up_proj\.weight: the checkpoint holds shape \[3, 140\]"),
    ("nan", r"model\.layers\.0\.mlp\.up_proj\.weight: the checkpoint's factor holds NaN/Inf"),
    ("inf_bias_free", r"model\.layers\.1\.mlp\.down_proj\.weight: the checkpoint's factor holds NaN/Inf"),
])
def test_corrupt_factor_tensors_refused(laser_ckpt, case, match):
    def fn(t):
        if case == "missing":
            del t["model.layers.0.mlp.up_proj.weight"]
        elif case == "unexpected":
            t["model.layers.0.mlp.up_proj.lora_B"] = torch.zeros(3)
        elif case == "wrong_shape":
            t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:3].clone()
        elif case == "nan":
            t["model.layers.0.mlp.up_proj.weight"][1, 2] = float("nan")
        else:
            t["model.layers.1.mlp.down_proj.weight"][0, 0] = float("inf")
    edit_tensors(laser_ckpt, fn)
    with pytest.raises(ValueError, match=match):
        AutoModelForCausalLM.from_pretrained(laser_ckpt)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.__setitem__("lm_head", {"layer": "lowrank", "in_features": 48, "out_features": 0, "rank": 1, "bias": False}),
     r"compressed_modules\['lm_head'\]: no factorized entry of this config targets that module"),
    (lambda c: c["model.layers.0.mlp.up_proj"].pop("rank"), r"compressed_modules\['model\.layers\.0\.mlp\.up_proj'\]\.rank: missing"),
    (lambda c: c["model.layers.0.mlp.up_proj"].__setitem__("rank", "4"),
     r"compressed_modules\['model\.layers\.0\.mlp\.up_proj'\]\.rank: got '4'; allowed: an int >= 1"),
    (lambda c: c["model.layers.0.mlp.up_proj"].__setitem__("layer", "tensor_slice"),
     r"\.layer: got 'tensor_slice'; allowed: 'lowrank'"),
    (lambda c: c["model.layers.0.mlp.up_proj"].__setitem__("in_features", 96),
     r"compressed_modules\['model\.layers\.0\.mlp\.up_proj'\]\.in_features: checkpoint says 96, model has 48"),
    (lambda c: c.__setitem__("model.layers.0.mlp.up_proj", [1, 2]), r"up_proj'\]\.layer: got None; allowed: 'lowrank'"),
])
def test_edited_specs_refused(laser_ckpt, edit, match):
    edit_config(laser_ckpt, edit)
    with pytest.raises(ValueError, match=match):
        AutoModelForCausalLM.from_pretrained(laser_ckpt)


def test_trawl_slice_pointed_at_another_layers_factors_refused(tiny_dirs, tmp_path):
    compressed(tiny_dirs["llama"], tmp_path, method="trawl", rank=4, layers=[0, 1])
    edit_config(tmp_path, lambda c: c["model.layers.1.mlp.up_proj"].__setitem__("factors", "model.layers.0.mlp.trawl_factors"))
    with pytest.raises(ValueError, match=r"compressed_modules\['model\.layers\.1\.mlp\.up_proj'\]\.factors: got "
                                         r"'model\.layers\.0\.mlp\.trawl_factors'; allowed: 'model\.layers\.1\.mlp\.trawl_factors'"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_trawl_orphan_or_swapped_slices_refused(tiny_dirs, tmp_path):
    compressed(tiny_dirs["llama"], tmp_path, method="trawl", rank=4, layers=[0])

    def swap(c):
        c["model.layers.0.mlp.up_proj"]["index"], c["model.layers.0.mlp.gate_proj"]["index"] = 0, 1
    edit_config(tmp_path, swap)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.(up|gate)_proj'\]\.index: got [01]; allowed: [01]"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_tensorllm_role_edit_refused(tiny_dirs, tmp_path):
    compressed(tiny_dirs["llama"], tmp_path, method="tensorllm", ranks=[8, 8, 2], layers=[0])
    edit_config(tmp_path, lambda c: c["model.layers.0.self_attn.k_proj"].__setitem__("role", "q"))
    with pytest.raises(ValueError, match=r"self_attn\.k_proj'\]\.role: got 'q'; allowed: 'k'"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.fixture
def einsort_ckpt(tiny_dirs, tmp_path):
    compressed(tiny_dirs["llama"], tmp_path, method="einsort", rank=4, targets=["mlp.up_proj"], layers=[0])
    return tmp_path


def test_einsort_mapping_edit_refused(einsort_ckpt):
    edit_config(einsort_ckpt, lambda c: c["model.layers.0.mlp.up_proj"]["einsort"].__setitem__("mapping", ["pow", 0.25]))
    with pytest.raises(ValueError, match=r"up_proj'\]\.einsort\.mapping: got \['pow', 0\.25\]; allowed: \['pow', 0\.5\]"):
        AutoModelForCausalLM.from_pretrained(einsort_ckpt)


def test_einsort_malformed_layout_refused(einsort_ckpt):
    edit_config(einsort_ckpt, lambda c: c["model.layers.0.mlp.up_proj"]["einsort"].__setitem__("core_shapes", [[3]]))
    with pytest.raises(ValueError, match=r"up_proj'\]\.einsort: not a valid EinSort layout"):
        AutoModelForCausalLM.from_pretrained(einsort_ckpt)


def test_einsort_corrupt_permutation_refused(einsort_ckpt):
    edit_tensors(einsort_ckpt, lambda t: t["model.layers.0.mlp.up_proj.perm"].fill_(255))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj: the stored permutation indices are not permutations"):
        AutoModelForCausalLM.from_pretrained(einsort_ckpt)


def test_pickle_weights_never_loaded(laser_ckpt, tmp_path_factory):
    # a compressed checkpoint whose weights come as a pickle that would run code when unpickled
    marker = tmp_path_factory.mktemp("marker") / "unpickled"
    (laser_ckpt / "model.safetensors").unlink()
    code = f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')"

    class Evil:
        def __reduce__(self):
            return (exec, (code,))
    import pickle
    (laser_ckpt / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Evil()}))
    with pytest.raises((ValueError, OSError)):
        AutoModelForCausalLM.from_pretrained(laser_ckpt)
    assert not marker.exists()


def test_scaled_einsort_reloads_without_the_scales_file(tiny_dirs, tmp_path, ids):
    # before: the saved config re-checked that the calibration file exists, so the checkpoint could not be
    # reloaded anywhere else (or after the file was removed)
    path = save_activation_scales({f"model.layers.{i}.mlp.up_proj": torch.rand(48) + 0.5 for i in range(3)},
                                  tmp_path / "scales.safetensors")
    m = compressed(tiny_dirs["llama"], tmp_path / "ckpt", method="einsort", rank=4, targets=["mlp.up_proj"],
                   activation_scales=path)
    (tmp_path / "scales.safetensors").unlink()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert torch.equal(again(ids).logits, m(ids).logits)


@pytest.mark.parametrize("cfg", [dict(method="trawl", rank=16, decomposition="tucker"), dict(method="trawl", rank=16),
                                 dict(method="laser", rank=8), dict(method="tensorllm", ranks=[16, 8, 2])])
def test_factors_bitwise_identical_across_thread_counts(cfg):
    # before: TRAWL Tucker factors differed by 1.5e-2 between 1 and 2 threads, CP by 6e-3
    before = torch.get_num_threads()
    states = []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            torch.manual_seed(0)
            m = _tiny("llama")
            pipeline.compress_model(m, TensorCompressionConfig(progress=False, **cfg))
            assert torch.get_num_threads() == threads  # the user's setting is restored
            states.append(m.state_dict())
    finally:
        torch.set_num_threads(before)
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


# -- architectures: refused before weights load, or handled exactly ---------------------------------------

def _meta(build):
    with torch.device("meta"):
        return build()


def test_unsupported_models_refused_before_weights_load():
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = TensorCompressionConfig(method="laser", rank=4, targets=["mlp.*"], progress=False)
    gpt2 = _meta(lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=101, bos_token_id=0, eos_token_id=0)))
    bert = _meta(lambda: BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                    intermediate_size=64, vocab_size=101)))
    for m in (gpt2, bert):
        with pytest.raises(ValueError, match=rf"{type(m).__name__}: no decoder-layer list .* supports decoder-only"):
            plan(m, cfg)
    moe = _meta(lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, vocab_size=101)))
    for targets in (["mlp.*"], ["mlp.experts.*"]):  # fused expert tensors are not nn.Linear
        with pytest.raises(ValueError, match=r"targets: pattern\(s\) .* match no Linear module .* allowed: .*self_attn\.q_proj"):
            plan(moe, TensorCompressionConfig(method="laser", rank=4, targets=targets, progress=False))


@torch.no_grad()
@pytest.mark.parametrize("arch", ["phi3", "gpt_neox"])
def test_fused_qkv_models_compress_exactly_at_full_rank(arch, tmp_path):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    if arch == "phi3":  # qkv_proj and gate_up_proj fused
        m = Phi3ForCausalLM(Phi3Config(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=0))
        target = "self_attn.qkv_proj"
    else:  # query_key_value fused
        m = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4))
        target = "attention.query_key_value"
    m.eval().save_pretrained(tmp_path / "dense")
    x = torch.randint(0, 101, (1, 7))
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=TensorCompressionConfig(
        method="laser", rank=1.0, targets=[target], progress=False))
    assert len(full.config.quantization_config.compressed_modules) == 2
    assert rel_err(full(x).logits, m(x).logits) < 1e-4
    full.save_pretrained(tmp_path / "c")
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "c")(x).logits, full(x).logits)
