"""The CUDA path: every method compresses on the GPU, matches the CPU result, reloads onto the GPU with
identical logits and generates; the calibration pipeline and the EinSort KV cache run on the GPU.

Skipped where no CUDA device is present (CI machines have none); run on a GPU machine with
``pytest tests/test_gpu.py`` (all pass on an H200 with torch 2.11 / CUDA 13).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hf_tensorcomp import EinSortCache, TensorCompressionConfig
from tiny import VOCAB, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CAL = torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(5))

CONFIGS = {
    "laser": dict(method="laser", rank=0.5),
    "laser_whitened_global": dict(method="laser", target=0.7, whiten=True, calibration=CAL),
    "laser_fisher": dict(method="laser", target=0.7, whiten=True, weighting="fisher", calibration=CAL),
    "trawl_cp": dict(method="trawl", rank=8, decomposition="cp"),
    "trawl_tucker": dict(method="trawl", rank=[2, 8, 8], decomposition="tucker"),
    "tensorllm": dict(method="tensorllm", ratio=2),
    "tensorllm_whitened": dict(method="tensorllm", targets=["self_attn.*_proj"], whiten=True, target=0.8, calibration=CAL),
    "trawl_whitened": dict(method="trawl", decomposition="tucker", group="qkvo", whiten=True, target=0.8, calibration=CAL),
    "einsort": dict(method="einsort", target=0.8),
    "rotor": dict(method="rotor", targets=["self_attn.q_proj"], layers=[1], depth=1, width=1, lr=0.05, batch_size=16, epochs=8,
                  calibration=CAL),
    "qlr_rank": dict(method="qlr", bits=4, group_size=16, rank=4, calibration=CAL),
    "qlr_rtn": dict(method="qlr", bits=4, group_size=16, rank=4, quantizer="rtn", calibration=CAL),
    "qlr_bytes": dict(method="qlr", target_bytes=0.4, group_size=16, grid="search", estimate="quantizer", calibration=CAL),
    "laser_int8_factors": dict(method="laser", rank=0.5, factor_bits=8, group_size=16),
    "lr4": dict(method="rotor", structure="lr4", layers=[1], lr=0.05, batch_size=16, epochs=8, calibration=CAL),
}


def load(path, device, **cfg):
    cfg = dict(cfg, progress=False)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=TensorCompressionConfig(**cfg),
                                                device_map=device).eval()


@torch.no_grad()
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_compress_on_gpu_matches_cpu_and_reloads(name, tiny_dirs, ids, tmp_path):
    cfg = CONFIGS[name]
    cpu = load(tiny_dirs["llama"], "cpu", **cfg)
    gpu = load(tiny_dirs["llama"], "cuda", **cfg)
    assert all(p.device.type == "cuda" for p in gpu.parameters())
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()(ids).logits
    want, got = cpu(ids).logits, gpu(ids.cuda()).logits.cpu()
    if CONFIGS[name].get("quantizer", "gptq") == "gptq" and name.startswith("qlr"):
        # GPTQ feeds each column's rounding error into the next columns': the GPU's activations, a last bit off the
        # CPU's, flip a rounding here and there and the rest of the row follows another, equally good path. So the
        # two models differ by as much as either differs from the dense one; what must hold is the same quality
        assert rel_err(got, dense) < 1.25 * rel_err(want, dense), (name, rel_err(got, dense), rel_err(want, dense))
    else:
        # the GPU's decompositions differ from the CPU's by rounding (and signs): the compressed models agree far
        # more closely than either agrees with the dense model
        assert rel_err(got, want) < 1e-2 * max(rel_err(want, dense), 1e-3) + 1e-4, (name, rel_err(got, want))
    gpu.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cuda").eval()
    # the same weights; only the memory alignment of the factor views may differ (rounding in the last bit)
    assert rel_err(again(ids.cuda()).logits, gpu(ids.cuda()).logits) < 1e-6
    out = again.generate(ids[:1].cuda(), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 5) and out.device.type == "cuda"


@torch.no_grad()
def test_einsort_cache_lossless_on_gpu(tiny_dirs):
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], device_map="cuda").eval()
    ids = torch.randint(1, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3)).cuda()
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=DynamicCache(config=model.config))
    cache = EinSortCache(model.config, rank=1000, segment=4, residual=3)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=cache)
    assert torch.equal(out, ref)


@torch.no_grad()
def test_streaming_on_gpu_matches_cpu(tiny_dirs, ids, tmp_path):
    """``compress_checkpoint(..., device="cuda")``: each layer, its statistics and decompositions, the calibration
    states and the table's GPTQ on the GPU; the checkpoint is written from the host and reloads anywhere."""
    import hf_tensorcomp

    cfg = dict(method="laser", target=0.7, whiten=True, allocation="relative", calibration=CAL, embedding_bits=8,
               embedding_group_size=16, progress=False)
    hf_tensorcomp.compress_checkpoint(tiny_dirs["llama"], tmp_path / "cpu", TensorCompressionConfig(**cfg))
    report = hf_tensorcomp.compress_checkpoint(tiny_dirs["llama"], tmp_path / "gpu", TensorCompressionConfig(**cfg),
                                               device="cuda")
    assert report["stats"]["modules"]["model.embed_tokens"]["quantizer"] == "gptq"
    cpu = AutoModelForCausalLM.from_pretrained(tmp_path / "cpu").eval()
    gpu = AutoModelForCausalLM.from_pretrained(tmp_path / "gpu").eval()
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()(ids).logits
    want, got = cpu(ids).logits, gpu(ids).logits
    assert rel_err(got, want) < 1e-2 * max(rel_err(want, dense), 1e-3) + 1e-4


@pytest.mark.parametrize("mode", ["e2e", "both"])
def test_healing_on_gpu_lowers_the_held_out_loss(tiny_dirs, mode):
    """`heal` on a model on the GPU: the teacher (reloaded from the recorded source) goes beside it, the training runs
    there under the device's precision, windows sampled from the teacher included, and the best iterate is kept."""
    import hf_tensorcomp
    from hf_tensorcomp.training import resolve_precision

    model = load(tiny_dirs["llama"], "cuda", method="laser", rank=4)
    cal = torch.randint(0, VOCAB, (16, 32), generator=torch.Generator().manual_seed(5))
    report = hf_tensorcomp.heal(model, steps=40, lr=3e-3, calibration=cal, samples=16, length=32, eval_every=10,
                                mode=mode, generated=4 if mode == "e2e" else 0, progress=False)
    assert report["improved"] and report["held_out_kl_after"] < 0.9 * report["held_out_kl_before"], report
    assert report["precision"] == resolve_precision("auto", torch.device("cuda"))
    assert all(p.device.type == "cuda" for p in model.parameters())


def test_quantized_healing_on_gpu_trains_scales_keeps_codes_and_reloads(tiny_dirs, ids, tmp_path):
    """`qlr` healed on the GPU with ``train="all"`` and ``every=2``: corrections, norms and scales train there, codes and
    zero points stay, the scales go back to float16 buffers on the device, and the saved model reloads with the same
    logits."""
    import hf_tensorcomp

    model = load(tiny_dirs["llama"], "cuda", method="qlr", rank=2, bits=2, group_size=16, quantizer="rtn", whiten=False,
                 calibration=CAL)
    layer = model.model.layers[0].mlp.up_proj
    codes, zero, scale = (layer._buffers[k].clone() for k in ("weight", "weight_zero", "weight_scale"))
    cal = torch.randint(0, VOCAB, (16, 32), generator=torch.Generator().manual_seed(5))
    report = hf_tensorcomp.heal(model, steps=30, lr=3e-2, calibration=cal, samples=16, length=32, eval_every=10,
                                train="all", every=2, progress=False)
    assert report["improved"] and report["held_out_kl_after"] < report["held_out_kl_before"], report
    buf = layer._buffers
    assert buf["weight_scale"].dtype == torch.float16 and buf["weight_scale"].device.type == "cuda"
    assert not torch.equal(buf["weight_scale"], scale)
    assert torch.equal(buf["weight"], codes) and torch.equal(buf["weight_zero"], zero)
    with torch.no_grad():
        ref = model(ids.cuda()).logits
        model.save_pretrained(tmp_path)
        again = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cuda").eval()
        assert torch.equal(again(ids.cuda()).logits, ref)


@torch.no_grad()
@pytest.mark.parametrize("bits", [4, 8])
def test_qlr_on_gpu_runs_tinygemm_from_one_copy(tiny_dirs, ids, tmp_path, bits):
    """4- and 8-bit codes moved to CUDA are held in tinygemm's layout (its codes read back equal, or the layer
    keeps the packed codes and de-quantizes), run through it, give the de-quantized product's logits to
    bfloat16 tolerance, and save the packed codes as the CPU model does."""
    from hf_tensorcomp.methods.qlr import QuantizedLowRankLinear

    cpu = load(tiny_dirs["llama"], "cpu", method="qlr", bits=bits, group_size=32, rank=4, calibration=CAL)
    cpu.save_pretrained(tmp_path / "cpu")
    gpu = AutoModelForCausalLM.from_pretrained(tmp_path / "cpu", device_map="cuda", dtype=torch.bfloat16).eval()
    layers = [m for m in gpu.modules() if isinstance(m, QuantizedLowRankLinear)]
    assert all(m._held("weight") is not None and m.weight_kernel_sz.is_cuda for m in layers)
    ref = cpu.to(torch.bfloat16)(ids).logits.float()
    assert rel_err(gpu(ids.cuda()).logits.float().cpu(), ref) < 0.03
    gpu.save_pretrained(tmp_path / "gpu")
    for k, v in AutoModelForCausalLM.from_pretrained(tmp_path / "gpu").state_dict().items():
        assert torch.equal(v, AutoModelForCausalLM.from_pretrained(tmp_path / "cpu").state_dict()[k]), k
