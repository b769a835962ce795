"""save_pretrained writes factors; from_pretrained rebuilds the skeleton and loads them directly."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from hf_tensorcomp import LowRankLinear, TensorCompressionConfig
from tiny import ARCHS


class AllocationLog(TorchDispatchMode):
    """Records the shapes of every real (non-meta) tensor created while active."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.device.type != "meta":
            self.shapes.append(tuple(out.shape))
        return out


def compress_and_save(src, dst, **cfg):
    cfg.setdefault("progress", False)
    m = AutoModelForCausalLM.from_pretrained(src, quantization_config=TensorCompressionConfig(**cfg))
    m.save_pretrained(dst)
    return m


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHS)
def test_reload_identical_logits_no_missing_keys(arch, tiny_dirs, tmp_path, ids):
    m = compress_and_save(tiny_dirs[arch], tmp_path, rank=0.25, targets=["mlp.*", "self_attn.o_proj"], layers=[0, -1])
    again, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert torch.equal(again(ids).logits, m(ids).logits)
    assert again.config.quantization_config == m.config.quantization_config


def test_saved_tensors_are_factors(tiny_dirs, tmp_path):
    compress_and_save(tiny_dirs["llama"], tmp_path, rank=4, targets=["mlp.down_proj"], layers=[-1])
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    # down_proj is 96 -> 48: rank 4 stored pivoted (LASER's default) as (4, 96 - 4 + 48) and the int32 column order;
    # every other weight is dense
    assert shapes["model.layers.2.mlp.down_proj.weight"] == (4, 140)
    assert shapes["model.layers.2.mlp.down_proj.pivots"] == (96,)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (48, 96)
    assert "lm_head.weight" not in shapes  # tied embeddings stay tied
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["compressed_modules"] == {
        "model.layers.2.mlp.down_proj": {"layer": "lowrank", "in_features": 96, "out_features": 48, "rank": 4,
                                         "bias": False, "pivoted": True}
    }


def test_reload_creates_no_dense_weight(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DEACTIVATE_ASYNC_LOAD", "1")  # load on this thread, where the log sees it
    compress_and_save(tiny_dirs["llama"], tmp_path, rank=4, targets=["mlp.*"])
    with AllocationLog() as control:
        AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    assert (96, 48) in control.shapes  # the log does see dense weights being made
    with AllocationLog() as log:
        m = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(m.model.layers[0].mlp.up_proj, LowRankLinear)
    # MLP dense weights are (96, 48) / (48, 96); attention's (48, 48) etc. legitimately load
    assert (96, 48) not in log.shapes and (48, 96) not in log.shapes
    assert (4, 140) in log.shapes  # down_proj's factors, pivoted


def test_dense_mode_saves_ordinary_weights(tiny_dirs, tmp_path, ids):
    m = compress_and_save(tiny_dirs["llama"], tmp_path, rank=4, mode="dense")
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert tuple(f.get_slice("model.layers.0.mlp.up_proj.weight").get_shape()) == (96, 48)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(again(ids).logits, m(ids).logits)


def test_mismatched_checkpoint_fails_clearly(tiny_dirs, tmp_path):
    compress_and_save(tiny_dirs["llama"], tmp_path, rank=4, targets=["mlp.*"])
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"]["compressed_modules"]["model.layers.7.mlp.up_proj"] = cfg["quantization_config"]["compressed_modules"].pop("model.layers.0.mlp.up_proj")
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="compressed_modules.*model.layers.7"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_loading_without_import_fails_loudly(tiny_dirs, tmp_path):
    compress_and_save(tiny_dirs["llama"], tmp_path, rank=4, targets=["mlp.*"])
    code = "import transformers, sys; transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]); print('LOADED')"
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "LOADED" not in r.stdout
    assert "ignore_mismatched_sizes" in r.stderr and "tensorcomp" in r.stderr
    code_ok = "import hf_tensorcomp, transformers, sys; transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]); print('LOADED')"
    r = subprocess.run([sys.executable, "-c", code_ok, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "LOADED" in r.stdout, r.stderr
