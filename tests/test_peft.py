"""LoRA on factored modules by their usual names: train a step, merge (exactly), save, reload."""

import warnings

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from hf_tensorcomp import LowRankLinear, TensorCompressionConfig
from hf_tensorcomp.integration.peft import LoraFactored, LoraLowRankLinear, load_lora, lora_config


def peft_model(model, config):
    """get_peft_model, checking that PEFT accepts the factored layers without its "Unsupported layer type" warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = get_peft_model(model, config)
    assert not [w for w in caught if "Unsupported layer type" in str(w.message)]
    return pm


@pytest.fixture
def trained(tiny_dirs, ids):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(rank=8, progress=False))
    pm = peft_model(m, lora_config(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    assert isinstance(pm.base_model.model.model.layers[0].self_attn.q_proj, LoraLowRankLinear)
    before = pm(ids).logits.detach()
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    pm(ids, labels=ids).loss.backward()
    opt.step()
    with torch.no_grad():
        after = pm(ids).logits
    assert not torch.allclose(after, before)  # the step changed the model
    only_lora = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert only_lora and all("lora_" in n for n in only_lora)
    return pm, after


def test_merge_is_exact_and_keeps_factors(trained, tmp_path, ids):
    pm, ref = trained
    merged = pm.merge_and_unload()
    q = merged.model.layers[0].self_attn.q_proj
    assert isinstance(q, LowRankLinear) and q.rank == 8 + 4
    with torch.no_grad():
        out = merged(ids).logits
    assert torch.allclose(out, ref, atol=1e-5)
    merged.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.model.layers[0].self_attn.q_proj.rank == 12
    assert torch.equal(again(ids).logits, out)


def test_unmerge_restores_rank(trained, ids):
    pm, ref = trained
    layer = pm.base_model.model.model.layers[0].self_attn.q_proj
    pm.merge_adapter()
    assert layer.get_base_layer().rank == 12
    pm.unmerge_adapter()
    assert layer.get_base_layer().rank == 8
    with torch.no_grad():
        assert torch.allclose(pm(ids).logits, ref, atol=1e-5)


def test_adapter_saves_and_reloads(trained, tiny_dirs, tmp_path, ids):
    pm, ref = trained
    pm.save_pretrained(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(rank=8, progress=False))
    again = load_lora(base, tmp_path)
    with torch.no_grad():
        assert torch.allclose(again(ids).logits, ref, atol=1e-6)


@pytest.mark.parametrize("cfg, layer", [
    ({"method": "trawl", "decomposition": "tucker", "rank": 8, "group": "fc"}, "TensorSlice"),
    ({"method": "tensorllm", "ranks": (8, 4, 2)}, "HeadTuckerProjection"),
    ({"method": "einsort", "target": 0.5, "network": "svd"}, "EinSortLinear"),
])
def test_lora_on_every_factored_layer_type(cfg, layer, tiny_dirs, tmp_path, ids):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(**cfg, progress=False))
    targets = ["down_proj", "up_proj"] if cfg["method"] == "trawl" else ["q_proj", "v_proj"]
    pm = peft_model(m, lora_config(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    adapted = [x for x in pm.modules() if isinstance(x, LoraFactored)]
    assert adapted and all(type(x.get_base_layer()).__name__ == layer for x in adapted)
    pm(ids, labels=ids).loss.backward()  # the adapter trains
    assert all(x.lora_A["default"].weight.grad is not None for x in adapted)
    with torch.no_grad():
        ref = pm(ids).logits
    pm.save_pretrained(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(**cfg, progress=False))
    with torch.no_grad():
        assert torch.allclose(load_lora(base, tmp_path)(ids).logits, ref, atol=1e-6)
    with pytest.raises(ValueError, match=f"{layer} cannot absorb.*allowed: merging into LowRankLinear"):
        pm.merge_and_unload()
