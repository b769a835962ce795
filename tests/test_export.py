"""`hf_tensorcomp.export(model, out, format="compressed-tensors")`: every width in its own config group, 16-bit
scales, the rotation as a compressed-tensors transform, the correction as a PEFT adapter; loaded back by
transformers + compressed-tensors + PEFT, here and in a separate environment without hf_tensorcomp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_tensorcomp
from hf_tensorcomp import TensorCompressionConfig
from hf_tensorcomp.methods.qlr import QuantizedLowRankLinear

pytest.importorskip("compressed_tensors")
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import serve_check  # noqa: E402  (the loader a user without hf_tensorcomp runs)
from test_quantized import calib  # noqa: E402

MIX = {"target_bytes": 0.4, "bit_choices": [2, 4, 8], "estimate": "rtn", "allocation": "relative"}
CASES = {"mix-any-unrotated": ({**MIX, "rotate": False}, "any"),
         "mix-vllm-rotated": ({**MIX, "rotate": True}, "vllm"),
         "4bit-rank4-rotated-embeddings": ({"bits": 4, "rank": 4, "rotate": True, "embedding_bits": 4,
                                            "embedding_group_size": 16}, "vllm")}


def _qlr(tiny_dirs, **kw):
    cfg = TensorCompressionConfig(method="qlr", calibration=calib(), progress=False, **{"group_size": 16, **kw})
    return AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg).eval()


@pytest.fixture(scope="module")
def exported(tiny_dirs, tmp_path_factory):
    """{case: (model, out folder, report, (ids, the library's logits))}."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (2, 11), generator=g)
    out = {}
    for case, (kw, widths) in CASES.items():
        torch.manual_seed(0)
        m = _qlr(tiny_dirs, **kw)
        folder = tmp_path_factory.mktemp("export") / case
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = hf_tensorcomp.export(m, folder, format="compressed-tensors", widths=widths)
        with torch.no_grad():
            ref = m(ids).logits
        torch.save((ids, ref), folder / "ref.pt")
        out[case] = (m, folder, report, (ids, ref))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_every_width_in_its_config_group_and_scales_in_16_bits(exported, case):
    m, folder, report, _ = exported[case]
    widths = CASES[case][1]
    cfg = json.loads((folder / "base" / "config.json").read_text())["quantization_config"]
    scheme = {t: g["weights"] for g in cfg["config_groups"].values() for t in g["targets"]}
    stored = load_file(folder / "base" / "model.safetensors")
    chosen = set()
    for name, layer in m.named_modules():
        if isinstance(layer, QuantizedLowRankLinear):
            bits, group, _, _ = layer.qspec("weight")
            chosen.add(bits)
            want = bits if widths == "any" else (4 if bits <= 4 else 8)
            assert (scheme[name]["num_bits"], scheme[name]["group_size"]) == (want, group), name
            assert stored[f"{name}.weight_scale"].dtype == torch.float16  # the model is float32: our scales, exactly
            assert f"{name}.weight" not in stored
    if "mix" in case:
        assert len(chosen) == 3 and len({s["num_bits"] for s in scheme.values()}) == (3 if widths == "any" else 2)
        if widths == "vllm":  # said, with its bytes
            assert any(line.startswith("2-bit:") and "written as 4-bit codes" in line and "bytes instead of" in line
                       for line in report["report"])
    rotated = CASES[case][0]["rotate"]
    assert bool(cfg.get("transform_config")) == rotated
    assert any(line.startswith("rotation:") for line in report["report"]) == rotated
    assert (report["adapter"] is not None) == (folder / "adapter" / "adapter_config.json").exists()


def test_the_stored_transform_is_the_layers_rotation(exported):
    from hf_tensorcomp.decompositions.hadamard import rotate

    m, folder, _, _ = exported["mix-vllm-rotated"]
    cfg = json.loads((folder / "base" / "config.json").read_text())["quantization_config"]["transform_config"]
    stored = load_file(folder / "base" / "model.safetensors")
    for scheme_name, scheme in cfg["config_groups"].items():
        assert scheme["type"] == "random-hadamard" and scheme["head_dim"] is None
        first = scheme["apply"][0]["targets"][0]
        assert [a["location"] for a in scheme["apply"]] == ["input", "weight_input"] and scheme["apply"][1]["inverse"]
        matrix = stored[f"{first}.{scheme_name}_input.weight"]
        layer = m.get_submodule(first)
        x = torch.randn(3, layer.in_features, dtype=torch.float64)
        # the loaders compute x W / sqrt(n): the layer's own x R
        assert torch.allclose(x @ matrix.double() / matrix.shape[0] ** 0.5,
                              rotate(x, layer.input_signs.double(), layer.rotation_block), atol=1e-6)
        for t in scheme["apply"][0]["targets"]:
            assert torch.equal(m.get_submodule(t).input_signs, layer.input_signs)


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_compressed_tensors_and_peft_give_our_logits(exported, case):
    """Here (the loader of tests/serve_check.py, in this environment): our logits; without the transform, not."""
    m, folder, _, (ids, ref) = exported[case]
    with torch.no_grad():
        got = serve_check.load(folder)(ids).logits
    assert (got - ref).abs().max() <= 2 ** -8 * ref.abs().max()
    if CASES[case][0]["rotate"]:  # the check can fail: the same base without its rotation is another model
        with torch.no_grad():
            wrong = serve_check.load(folder, transforms=False)(ids).logits
        assert (wrong - ref).abs().max() > 2 ** -5 * ref.abs().max()


def _serving_python(root: Path) -> str:
    """A fresh virtual environment with only the serving packages (torch, transformers, peft,
    compressed-tensors, safetensors), made once: ``HF_TENSORCOMP_SERVING_PYTHON`` names one made before."""
    given = os.environ.get("HF_TENSORCOMP_SERVING_PYTHON")
    if given:
        return given
    import importlib.metadata as md

    venv = root / "serving-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pins = [f"{p}=={md.version(p)}" for p in ("torch", "transformers", "peft", "compressed-tensors", "safetensors",
                                              "accelerate")]
    subprocess.run([py, "-m", "pip", "install", "-q", *pins], check=True)
    return py


def test_a_separate_environment_without_hf_tensorcomp_gives_our_logits(exported, tmp_path_factory):
    py = _serving_python(tmp_path_factory.mktemp("serving"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for case, (_, folder, _, (_, ref)) in exported.items():
        run = subprocess.run([py, "-I", str(HERE / "serve_check.py"), str(folder), str(folder / "ref.pt")],
                             capture_output=True, text=True, env=env, cwd=folder)
        assert run.returncode == 0, run.stderr[-3000:]
        got = json.loads(run.stdout.strip().splitlines()[-1])
        assert got["hf_tensorcomp_importable"] is False
        assert all(kind == "Linear" for kind in got["modules"].values())  # PEFT's LoRA Linear on plain linears
        assert got["max_abs_diff"] <= 2 ** -8 * got["scale"], (case, got)


def test_bad_requests_name_the_field(tiny_dirs, tmp_path):
    m = _qlr(tiny_dirs, bits=4, rank=2, rotate=False)
    with pytest.raises(ValueError, match=r"^export: format: got 'onnx'; allowed: 'compressed-tensors'"):
        hf_tensorcomp.export(m, tmp_path / "a", format="onnx")
    with pytest.raises(ValueError, match=r"^export: widths: got 'all'; allowed: 'vllm' \| 'any'"):
        hf_tensorcomp.export(m, tmp_path / "a", widths="all")
    with pytest.raises(ValueError, match=r"^export: bits: not an option of format='compressed-tensors'; allowed: widths"):
        hf_tensorcomp.export(m, tmp_path / "a", bits=4)
    assert not (tmp_path / "a").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"^export: out: .*mine exists and is not empty; allowed: .*overwrite=True"):
        hf_tensorcomp.export(m, tmp_path / "mine")
    hf_tensorcomp.export(m, tmp_path / "mine", overwrite=True)  # replaces what it writes, keeps the rest
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine" and (tmp_path / "mine" / "base" / "config.json").exists()
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name]  # the temporary sibling was renamed away
    with pytest.raises(ValueError, match=r"^export: out: .* lies inside the input"):
        hf_tensorcomp.export(m, Path(tiny_dirs["llama"]) / "export")
    laser = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(
        rank=8, progress=False))
    with pytest.raises(ValueError, match=r"^export: format='compressed-tensors': the model has no qlr layers; allowed: "
                                         r"a model compressed with method='qlr'"):
        hf_tensorcomp.export(laser, tmp_path / "b")
    odd = _qlr(tiny_dirs, bits=4, rank=2, rotate=False, group_size=32)  # 48 inputs: one and a half groups
    with pytest.raises(ValueError, match=r"^export: group_size: .* not a multiple of its groups of 32"):
        hf_tensorcomp.export(odd, tmp_path / "b")
    assert not (tmp_path / "b").exists()
