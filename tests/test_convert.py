"""Streaming GGUF → sharded safetensors conversion (`hf_tensorcomp.convert_gguf`), on the bundled GGUF files.

The reference is transformers' own GGUF loading (the whole model de-quantized in memory, then saved: the
bundled checkpoint `assets.model_path`); the streamed conversion must write the same tensors bit for bit.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from hf_tensorcomp import compress_checkpoint, convert_gguf, TensorCompressionConfig
from hf_tensorcomp.assets import model_path
from hf_tensorcomp.assets.models import gguf_path
from hf_tensorcomp.cli import main as cli_main

pytestmark = pytest.mark.slow


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


@pytest.fixture(scope="module")
def smollm2_f32(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "smollm2-f32"
    report = convert_gguf(gguf_path("smollm2"), out, dtype="float32", max_shard_size="100MB")
    return out, report


def test_streamed_conversion_is_bit_identical_to_transformers_loading(smollm2_f32):
    out, report = smollm2_f32
    ref = Path(model_path("smollm2"))
    got, want = _tensors(out), _tensors(ref)
    assert sorted(got) == sorted(want)  # the tied head not written, as transformers saves it
    assert all(torch.equal(got[k], want[k]) for k in want)  # Q / K un-permuted as transformers does
    assert json.loads((out / "config.json").read_text()) == json.loads((ref / "config.json").read_text())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want) and index["metadata"]["total_size"] == report["bytes"]
    assert report["shards"] == len(list(out.glob("*.safetensors"))) > 1 and not report["skipped"]
    # every shard within the size, but for a shard holding one tensor larger than it (the embedding)
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            assert f.stat().st_size <= 100e6 + 1e6 or len(list(s.keys())) == 1


def test_gemma3_conversion_is_bit_identical_too(tmp_path):
    """Gemma-3's Q4_K_M / Q6_K blocks, its norms shifted by one (transformers' Gemma processor), a tied table."""
    out = tmp_path / "gemma3"
    report = convert_gguf(gguf_path("gemma3"), out, dtype="float32", max_shard_size="400MB", tokenizer=False)
    got, want = _tensors(out), _tensors(Path(model_path("gemma3")))
    assert sorted(got) == sorted(want) and report["shards"] >= 2
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_converted_checkpoint_loads_and_generates_like_the_reference(smollm2_f32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = smollm2_f32
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    assert ids.tolist() == AutoTokenizer.from_pretrained(model_path("smollm2"))("The capital of France is",
                                                                                 return_tensors="pt").input_ids.tolist()
    a = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(model_path("smollm2"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
        assert torch.equal(a.generate(ids, max_new_tokens=5, do_sample=False), b.generate(ids, max_new_tokens=5, do_sample=False))


def test_dequantized_in_row_blocks_equals_one_call():
    from gguf import GGUFReader, dequantize

    from hf_tensorcomp.convert import _dequantized, _Info

    path = gguf_path("smollm2")
    reader = GGUFReader(path)
    quantized = [t for t in reader.tensors if t.data.ndim == 2 and t.tensor_type not in (0, 1)][:3]
    assert quantized
    with open(path, "rb") as f:
        for t in quantized:
            info = _Info(t.name, t.tensor_type, t.data.shape, t.data.dtype, int(t.n_elements), int(t.data_offset))
            whole = dequantize(t.data, t.tensor_type)
            for chunk in (1, 1000, 1 << 24):  # one row a block, a few rows, the whole tensor at once
                assert np.array_equal(_dequantized(f, info, chunk=chunk), whole)


def test_cli_converts_to_bf16(tmp_path):
    out = tmp_path / "bf16"
    assert cli_main(["convert-gguf", str(gguf_path("smollm2")), "--out", str(out), "--max-shard-size", "300MB"]) == 0
    got, want = _tensors(out), _tensors(Path(model_path("smollm2")))
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
    assert json.loads((out / "hf_tensorcomp_source.json").read_text())["dtype"] == "bfloat16"


def test_peak_memory_is_a_shard_and_a_few_tensors_not_the_model(tmp_path):
    """In a subprocess: converting SmolLM2 (538 MB in float32) with 50 MB shards stays under two shards and
    three float32 copies of its largest tensor (the 113 MB embedding) above the start — loading the whole
    model first, as transformers does, would not."""
    code = ("import json, sys; from hf_tensorcomp import convert_gguf; from hf_tensorcomp.assets.models import gguf_path; "
            "print(json.dumps(convert_gguf(gguf_path('smollm2'), sys.argv[1], dtype='float32', max_shard_size='50MB', "
            "tokenizer=False)))")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True, check=True)
    report = json.loads(r.stdout.strip().splitlines()[-1])
    largest = 49152 * 576 * 4
    assert report["bytes"] > 500e6
    assert report["peak_above_start_mb"] * 2**20 <= 2 * 50e6 + 3 * largest, report


def test_truncated_gguf_is_refused_and_leaves_nothing(tmp_path):
    src = gguf_path("smollm2")
    part = tmp_path / "part.gguf"
    with open(src, "rb") as f:
        part.write_bytes(f.read(src.stat().st_size // 2))  # a partial download: header whole, data cut
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="not a readable GGUF.*truncated"):
        convert_gguf(part, out)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["part.gguf"]


def test_bad_arguments_are_named_and_nothing_is_written(tmp_path):
    src = gguf_path("smollm2")
    with pytest.raises(ValueError, match="dtype.*int8.*bfloat16"):
        convert_gguf(src, tmp_path / "a", dtype="int8")
    with pytest.raises(ValueError, match="max_shard_size.*'lots'"):
        convert_gguf(src, tmp_path / "a", max_shard_size="lots")
    with pytest.raises(ValueError, match="src.*not a file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "a")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty.*overwrite=True"):
        convert_gguf(src, full)
    assert [p.name for p in full.iterdir()] == ["keep.txt"] and not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match="GGUF file.*convert_gguf"):
        compress_checkpoint(src, tmp_path / "c", TensorCompressionConfig(method="laser", rank=8))
