"""Tiny random models for shape and exactness tests (quality is measured on real models elsewhere)."""

from __future__ import annotations

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

VOCAB = 101


def _tiny(arch: str):
    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128)
    if arch == "llama":  # grouped-query attention, tied embeddings (like SmolLM2)
        return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    if arch == "qwen3":  # q/k norms, explicit head_dim
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, tie_word_embeddings=False))
    if arch == "gemma3":  # sliding + global layers, 4/1-style GQA, head dim larger than hidden/heads
        return Gemma3ForCausalLM(Gemma3TextConfig(**{**common, "num_attention_heads": 4, "num_key_value_heads": 1},
                                                  head_dim=32, sliding_window=8,
                                                  layer_types=["sliding_attention", "sliding_attention", "full_attention"]))
    raise ValueError(arch)


ARCHS = ["llama", "qwen3", "gemma3"]


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tiny_llama(vocab_size=64, seed=0):
    """A seeded 2-layer Llama for evaluation tests (any vocabulary size)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def reloads_identically(model, path, ids):
    """Save `model` to `path` and reload it; asserts the reloaded model's logits on `ids` equal `model`'s bit for bit."""
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(path)
    again = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref)
    return again


def reloads_without_option(model, path, option, ids):
    """Save `model`, delete `option` from its first config entry (a checkpoint written before the option
    existed) and reload it; asserts identical logits and returns the reloaded model's value of the option."""
    import json

    from transformers import AutoModelForCausalLM

    model.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]["entries"][0][option]
    (path / "config.json").write_text(json.dumps(cfg))
    again = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    return again.config.quantization_config.entries[0].options[option]
