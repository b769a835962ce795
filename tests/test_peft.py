"""LoRA on factored modules by their usual names: train a step, merge (exactly), save, reload."""

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from hf_tensorcomp import LowRankLinear, TensorCompressionConfig
from hf_tensorcomp.integration.peft import LoraLowRankLinear, load_lora, lora_config


@pytest.fixture
def trained(tiny_dirs, ids):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(rank=8, progress=False))
    pm = get_peft_model(m, lora_config(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
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
