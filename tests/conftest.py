"""Shared fixtures: tiny dense checkpoints of three architectures, token ids, the real models (once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

import hf_tensorcomp  # noqa: F401  (registers the quantizer)
from tiny import ARCHS, VOCAB, _tiny


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One saved dense checkpoint per architecture: {arch: path}."""
    torch.manual_seed(0)
    out = {}
    for arch in ARCHS:
        d = tmp_path_factory.mktemp(f"dense-{arch}")
        _tiny(arch).save_pretrained(d)
        out[arch] = d
    return out


@pytest.fixture
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (2, 11), generator=g)


def _real(name):
    from hf_tensorcomp.assets import load_model

    return load_model(name)  # (model, tokenizer): dense fp32, eval mode


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct and its tokenizer, loaded once per session: read it, never change it."""
    return _real("smollm2")


@pytest.fixture(scope="session")
def gemma3():
    """The real Gemma-3-270M and its tokenizer, loaded once per session: read it, never change it."""
    return _real("gemma3")


@pytest.fixture(scope="session")
def tiny_with_tokenizer(tiny_dirs, tmp_path_factory):
    """The tiny Llama with a word-level tokenizer, so the CLI can run on it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tok-llama")
    for p in Path(tiny_dirs["llama"]).iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)} | {"[UNK]": 100}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def real_bigbench():
    """The real ``bigbench==1.0.0`` sdist (358 MB, cached): skipped, with the reason, where the package
    registry this machine reaches does not serve it (pip's own error is the message)."""
    from hf_tensorcomp import assets

    try:
        return assets.download_sdist("bigbench==1.0.0")
    except RuntimeError as e:
        pytest.skip(f"bigbench==1.0.0 could not be downloaded from this machine's package registry: {e}")
