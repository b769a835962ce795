"""No silent non-finite or useless results: what compression and reload refuse, naming the module."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_tensorcomp import LowRankLinear, TensorCompressionConfig
from hf_tensorcomp.checks import check_outputs
from hf_tensorcomp.config import Entry
from tiny import _tiny

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


@pytest.mark.parametrize("rank", [200, 500])
def test_trawl_cp_divergence_refused(rank, tiny_dirs):
    # CP-ALS far above the tensor's rank: NaN factors (500) or an error worse than zeros (200); before: saved silently
    cfg = TensorCompressionConfig(method="trawl", rank=rank, layers=[0], progress=False)
    with pytest.raises(ValueError, match=rf"compressing model\.layers\.0\.mlp\.trawl_factors .*rank={rank}") as e:
        AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg)
    assert "model.layers.0.mlp.up_proj" in str(e.value) and "Try a smaller rank" in str(e.value)


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
