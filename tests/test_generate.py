"""generate(), pipeline(), device_map on compressed models (CPU)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, pipeline

from hf_tensorcomp import TensorCompressionConfig




@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_factorized_and_reloaded(dtype, tiny_dirs, tmp_path, ids):
    cfg = TensorCompressionConfig(rank=6, progress=False)
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["gemma3"], quantization_config=cfg, dtype=dtype)
    out = m.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 23)
    m.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    assert torch.equal(again.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0), out)
    beams = again.generate(ids, max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=0)
    assert beams.shape == (2, 16)


def test_pipeline_on_compressed_model(tiny_dirs, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(97 + i): i for i in range(26)} | {" ": 26, "<unk>": 27}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<unk>", eos_token="<unk>")
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(rank=4, progress=False))
    for dt in (torch.float32, torch.bfloat16):
        pipe = pipeline("text-generation", model=m.to(dt), tokenizer=tok)
        text = pipe("the capital of", max_new_tokens=8, do_sample=False)[0]["generated_text"]
        assert text.startswith("the capital of") and len(text) > len("the capital of")


def test_device_map_auto_and_offload_refused(tiny_dirs, tmp_path, ids):
    cfg = TensorCompressionConfig(rank=4, progress=False)
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg, device_map="auto")
    ref = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(rank=4, progress=False))
    assert torch.equal(m(ids).logits, ref(ids).logits)
    m.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="auto")
    assert torch.equal(again(ids).logits, ref(ids).logits)
    with pytest.raises(ValueError, match="device_map.*offload"):
        AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(rank=4),
                                             device_map={"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu", "lm_head": "cpu"})
