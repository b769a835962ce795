"""Quantization: the quantizers and packing, quantized factors on every factored layer, and ``qlr``
(a quantized weight plus a calibrated low-rank correction)."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import hf_tensorcomp
from hf_tensorcomp import LowRankLinear, TensorCompressionConfig
from hf_tensorcomp.decompositions.quantize import (Int4Kernel, gptq_plan, int4_kernel_available, pack, quantize_gptq,
                                                  quantize_rtn, stored_bytes, unpack)
from hf_tensorcomp.decompositions.svd import whitened_svd, whitening_factor
from hf_tensorcomp.layers import FactorizedModule, QuantizedEmbedding
from hf_tensorcomp.methods.qlr import QuantizedLowRankLinear
from tiny import VOCAB, reloads_identically


def calib(n=8, length=32):
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(4))


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g)
    x = torch.randn(4000, 128, generator=g) @ torch.randn(128, 128, generator=g)
    return w, x


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_round_trip_within_half_a_step(data, bits):
    w, _ = data
    q = quantize_rtn(w, bits, 64)
    step = q.scale.float().view(48, 2).repeat_interleave(64, 1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    assert int(q.codes.max()) <= 2**bits - 1 and int(q.zero.max()) <= 2**bits - 1


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packing_is_exact_and_dense(bits):
    codes = torch.randint(0, 2**bits, (1024,), generator=torch.Generator().manual_seed(1)).to(torch.uint8)
    packed = pack(codes, bits)
    assert packed.numel() == 1024 * bits // 8 and torch.equal(unpack(packed, bits), codes)
    odd = codes[:1001]  # a count that does not fill the last byte
    assert torch.equal(unpack(pack(odd, bits), bits)[:1001], odd)


def test_gptq_beats_round_to_nearest_on_the_output_error(data):
    w, x = data
    gram = x.T @ x
    err = {name: ((w - q.dequantize()) @ x.T).norm() for name, q in
           (("rtn", quantize_rtn(w, 4, 64)), ("gptq", quantize_gptq(w, gram, 4, 64)))}
    assert err["gptq"] < 0.9 * err["rtn"]


@pytest.mark.parametrize("grid", ["minmax", "search"])
def test_gptq_in_row_blocks_gives_the_codes_of_the_whole_matrix(data, monkeypatch, grid):
    """GPTQ spreads each error along its own row, so working on a few rows at a time (what bounds the memory
    of a 262k-row embedding table) changes no code, scale or zero point."""
    from hf_tensorcomp.decompositions import quantize as qmod

    w, x = data
    whole = quantize_gptq(w, x.T @ x, 4, 64, grid=grid)
    monkeypatch.setattr(qmod, "GPTQ_BLOCK_BYTES", 4 * w.shape[1] * 5)  # blocks of 5 rows, the last one short
    assert w.shape[0] % 5
    blocks = quantize_gptq(w, x.T @ x, 4, 64, grid=grid)
    for k in ("codes", "scale", "zero"):
        assert torch.equal(getattr(whole, k), getattr(blocks, k)), k


def _scaled(data):
    """The test data with inputs of very different energy (what activation order is for)."""
    w, x = data
    return w, x * torch.logspace(-1, 1, x.shape[1])[torch.randperm(x.shape[1], generator=torch.Generator().manual_seed(3))]


def test_gptq_act_order_keeps_static_grids_and_lowers_the_output_error(data):
    w, x = _scaled(data)
    gram = x.T @ x
    plain = quantize_gptq(w, gram, 3, 64, grid="search")
    act = quantize_gptq(w, gram, 3, 64, grid="search", act_order=True)
    rtn = quantize_rtn(w, 3, 64, grid="search")
    assert torch.equal(act.scale, rtn.scale) and torch.equal(act.zero, rtn.zero)  # grids of the original weights
    err = {k: float(((w - q.dequantize()) @ x.T).norm()) for k, q in (("plain", plain), ("act", act), ("rtn", rtn))}
    assert err["act"] < err["plain"] < err["rtn"]


def test_gptq_act_order_codes_come_back_in_the_original_column_order(data, monkeypatch):
    """Swapping two whole groups of inputs swaps their codes and nothing else (the order is the Gram
    diagonal's, so a method that left the codes in quantization order would give the same codes twice);
    row blocks change no code."""
    from hf_tensorcomp.decompositions import quantize as qmod

    w, x = _scaled(data)
    p = torch.cat([torch.arange(64, 128), torch.arange(64)])
    a = quantize_gptq(w, x.T @ x, 4, 64, act_order=True)
    b = quantize_gptq(w[:, p], (x.T @ x)[p][:, p], 4, 64, act_order=True)
    assert torch.equal(a.codes.view(48, 128)[:, p], b.codes.view(48, 128))
    assert not torch.equal(a.codes, b.codes)
    monkeypatch.setattr(qmod, "GPTQ_BLOCK_BYTES", 4 * w.shape[1] * 5)
    assert torch.equal(quantize_gptq(w, x.T @ x, 4, 64, act_order=True).codes, a.codes)
    plan = gptq_plan(x.T @ x, act_order=True)
    halves = [quantize_gptq(w[r], None, 4, 64, plan=plan) for r in (slice(0, 20), slice(20, None))]
    assert torch.equal(torch.cat([q.codes for q in halves]), a.codes)  # a plan computed once, rows quantized apart
    with pytest.raises(ValueError, match="gram"):
        quantize_gptq(w, None, 4, 64)


def _qlr(tiny_dirs, **kw):
    cfg = TensorCompressionConfig(method="qlr", calibration=calib(), progress=False, **{"group_size": 16, **kw})
    return AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg).eval()


def test_rank_zero_is_the_plain_quantizer(tiny_dirs):
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    m = _qlr(tiny_dirs, rank=0, quantizer="rtn", whiten=False, grid="minmax", rotate=False)
    layer = m.model.layers[1].mlp.up_proj
    assert isinstance(layer, QuantizedLowRankLinear) and layer.rank == 0
    w = dense.model.layers[1].mlp.up_proj.weight.detach()
    assert torch.equal(layer.dense_weight(), quantize_rtn(w, 4, 16).dequantize())


def test_correction_is_the_whitened_closed_form_and_lowers_the_error(tiny_dirs):
    from hf_tensorcomp.calibration import LayerwiseRunner

    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()
    m = _qlr(tiny_dirs, rank=4, quantizer="rtn", rounds=0, propagate=False, grid="minmax", rotate=False)
    # layer 0's inputs are the same for the dense and the compressed model: the Gram of its MLP input
    grams = {}
    runner = LayerwiseRunner(dense, "model.layers", dense.model.layers, calib(), 8)
    runner.run({0: {"0.mlp.up_proj": frozenset({"gram"})}}, lambda li, st: grams.update(st) and False, last=0,
               progress=False)
    w = dense.model.layers[0].mlp.up_proj.weight.detach()
    s = whitening_factor(grams["0.mlp.up_proj"].gram, 1e-4)
    q = quantize_rtn(w, 4, 16).dequantize()
    u, v, _ = whitened_svd(w - q, 4, s)
    layer = m.model.layers[0].mlp.up_proj
    assert torch.allclose(layer.lora_B @ layer.lora_A, u @ v, atol=1e-5)
    st = m.config.quantization_config.stats["modules"]["model.layers.0.mlp.up_proj"]
    assert st["whitened_error"] < st["quant_only_error"]
    # the report's whitened errors (from the fit's own energies) are the products' (a wrong residual breaks this)
    ws = (w.double() @ s).norm()
    e = (w - q).double()
    assert st["quant_only_error"] == pytest.approx(float((e @ s).norm() / ws), rel=1e-4)
    assert st["whitened_error"] == pytest.approx(float(((e - (u @ v).double()) @ s).norm() / ws), rel=1e-4)


@pytest.mark.parametrize("rotate", [False, True])
def test_rank_zero_report_from_gptqs_whitened_error_is_the_products(tiny_dirs, rotate):
    """With no correction the report's whitened error comes from GPTQ's own (on its damped Gram), shifted to the
    whitening's damping: the same number as ‖(W - Q) S‖ / ‖W S‖ formed (a wrong damping shift breaks this)."""
    from hf_tensorcomp.calibration import LayerwiseRunner

    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()
    m = _qlr(tiny_dirs, rank=0, propagate=False, rotate=rotate)
    grams = {}
    runner = LayerwiseRunner(dense, "model.layers", dense.model.layers, calib(), 8)
    runner.run({0: {"0.mlp.up_proj": frozenset({"gram"})}}, lambda li, st: grams.update(st) and False, last=0,
               progress=False)
    w = dense.model.layers[0].mlp.up_proj.weight.detach().double()
    s = whitening_factor(grams["0.mlp.up_proj"].gram, 1e-4)
    e = w - m.model.layers[0].mlp.up_proj.dense_weight().double()
    st = m.config.quantization_config.stats["modules"]["model.layers.0.mlp.up_proj"]
    want = float((e @ s).norm() / (w @ s).norm())
    assert st["quant_only_error"] == pytest.approx(want, rel=1e-3) and st["whitened_error"] == st["quant_only_error"]


@pytest.mark.parametrize("allocation, kw", [("relative", {}), ("size", {}), ("fisher", {}),
                                             ("fisher", {"estimate": "quantizer", "grid": "search", "whiten": False}),
                                             ("fisher", {"estimate": "quantizer", "rotate": False})])
def test_every_allocation_meets_the_byte_budget(tiny_dirs, allocation, kw):
    from hf_tensorcomp.decompositions.quantize import stored_bytes

    m = _qlr(tiny_dirs, target_bytes=0.3, allocation=allocation, **kw)
    mods = m.config.quantization_config.stats["modules"]
    spent = sum(stored_bytes((v.out_features, v.in_features), st["bits"], 16) + st["rank"] * (v.in_features + v.out_features) * 2
                + (v.in_features if v.rotation_block else 0)  # the rotation's signs
                for n, st in mods.items() for v in [m.get_submodule(n)])
    assert all(bool(m.get_submodule(n).rotation_block) == kw.get("rotate", True) for n in mods)
    dense = sum(2 * m.get_submodule(n).in_features * m.get_submodule(n).out_features for n in mods)
    assert spent <= 0.3 * dense
    assert spent >= 0.2 * dense  # and spends it
    if allocation == "fisher":  # the loss itself: ranked on the dense model's output Fisher
        assert "fisher_fallback" not in m.config.quantization_config.stats["calibration"]


@pytest.mark.parametrize("target, lowest", [(0.25, 2), (0.3, 3), (0.36, 4)])
def test_default_widths_start_at_the_widest_that_fits_everywhere(tiny_dirs, target, lowest):
    # groups of 16: 3-bit codes everywhere cost (3 + 24 / 16) / 16 = 0.281 of the bf16 bytes, 4-bit 0.344; below
    # 0.281 the budget cannot be met without 2-bit matrices, so every width joins; above a width's cost the
    # narrower ones are left out
    from hf_tensorcomp.methods import get_method

    cfg = TensorCompressionConfig(method="qlr", target_bytes=target, calibration=calib(), group_size=16)
    assert min(get_method("qlr")._default_bits(cfg.entries[0])) == lowest
    m = _qlr(tiny_dirs, target_bytes=target, rotate=False, grid="minmax")
    bits = {st["bits"] for st in m.config.quantization_config.stats["modules"].values()}
    assert min(bits) == lowest if lowest == 2 else min(bits) >= lowest
    assert bits <= {2, 3, 4, 5, 6, 8}


def test_default_widths_are_measured_against_what_the_table_leaves(tiny_dirs):
    # groups of 16, the 8-bit table in the budget: 0.30 is above 3-bit codes everywhere (0.281), but the table's
    # bytes come off first and 3 bits no longer fit the rest, so the default takes every width and meets it
    # (measured against 0.30 itself it left 2 bits out and failed)
    kw = dict(target_bytes=0.30, rotate=False, grid="minmax", embedding_bits=8, embedding_group_size=16)
    m = _qlr(tiny_dirs, **kw)
    st = m.config.quantization_config.stats
    assert 2 in {v["bits"] for v in st["modules"].values()} and st["allocation"]["0"]["kept_fraction"] <= 0.30
    # without the table the same budget leaves 2 bits out
    m = _qlr(tiny_dirs, target_bytes=0.30, rotate=False, grid="minmax")
    assert 2 not in {v["bits"] for v in m.config.quantization_config.stats["modules"].values()}


def test_full_rank_correction_is_exact(tiny_dirs):
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    m = _qlr(tiny_dirs, rank=48, bits=2, rounds=0)
    w = dense.model.layers[2].mlp.down_proj.weight.detach()
    assert torch.allclose(m.model.layers[2].mlp.down_proj.dense_weight(), w, atol=1e-4)


def test_alternation_does_not_raise_the_whitened_error(tiny_dirs):
    one = _qlr(tiny_dirs, rank=4, rounds=0).config.quantization_config.stats["modules"]
    three = _qlr(tiny_dirs, rank=4, rounds=2).config.quantization_config.stats["modules"]
    assert sum(v["whitened_error"] for v in three.values()) <= sum(v["whitened_error"] for v in one.values()) * 1.001


def _tensor_bytes(folder) -> int:
    total = 0
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("method, kw", [
    ("qlr", {"rank": 8}), ("qlr", {"rank": 8, "bits": 3}), ("qlr", {"rank": 8, "bits": 6}), ("qlr", {"rank": 8, "bits": 5}),
    ("qlr", {"target_bytes": 0.3}), ("qlr", {"rank": 8, "factor_bits": 8}), ("qlr", {"target_bytes": 0.3, "rotate": False}),
    ("laser", {"rank": 8, "factor_bits": 4}), ("laser", {"rank": 8, "factor_bits": 8}),
    ("trawl", {"rank": 8, "factor_bits": 4}), ("tensorllm", {"ratio": 2.0, "factor_bits": 4}),
    ("einsort", {"target": 0.5, "factor_bits": 4}),
])
def test_save_reload_identical_and_bytes_are_the_bytes_saved(tiny_dirs, tmp_path, ids, method, kw):
    cfg = TensorCompressionConfig(method=method, progress=False, group_size=16, calibration=calib(), **kw) \
        if method == "qlr" else TensorCompressionConfig(method=method, progress=False, group_size=16, **kw)
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg).eval()
    with torch.no_grad():
        ref = m(ids).logits
    m.save_pretrained(tmp_path)
    st = m.config.quantization_config.stats
    assert st["bytes_after"] == _tensor_bytes(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref)


def test_laser_pivots_by_default_except_with_4_bit_factors(tiny_dirs):
    for bits, pivoted in ((None, True), (8, True), (4, False)):
        m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(
            method="laser", rank=8, factor_bits=bits, group_size=16, progress=False))
        assert m.config.quantization_config.entries[0].options["pivoted"] == "auto"
        assert all((mod.pivots is not None) == pivoted for mod in m.modules() if isinstance(mod, LowRankLinear))


@pytest.mark.parametrize("pivoted", [False, True])
def test_quantized_factors_shrink_laser_and_none_changes_nothing(tiny_dirs, pivoted):
    plain = TensorCompressionConfig(method="laser", rank=8, progress=False)
    assert "factor_bits" not in plain.to_dict()["entries"][0]  # checkpoints of today stay byte-identical
    sizes = {}
    for bits in (None, 8, 4):
        m = AutoModelForCausalLM.from_pretrained(
            tiny_dirs["llama"], quantization_config=TensorCompressionConfig(
                method="laser", rank=8, factor_bits=bits, group_size=16, pivoted=pivoted, progress=False))
        layer = m.model.layers[0].mlp.up_proj
        sizes[bits] = sum(b.numel() * b.element_size() for b in [*layer.parameters(), *layer.buffers()])
    r, i, o = 8, 48, 96
    cols, order = (i - r + o, 4 * i) if pivoted else (i + o, 0)  # pivoted: T and U, and the int32 column order
    assert sizes[None] == r * cols * 4 + order
    # codes stored transposed (LowRankLinear.channel_groups): one row per channel, grouped along the rank
    assert sizes[8] == stored_bytes((cols, r), 8, 16) + order and sizes[4] == stored_bytes((cols, r), 4, 16) + order


def test_lora_on_a_qlr_layer_trains_and_merges(tiny_dirs, ids):
    from peft import get_peft_model

    from hf_tensorcomp.integration.peft import lora_config

    m = _qlr(tiny_dirs, rank=4)
    peft_model = get_peft_model(m, lora_config(r=2, target_modules=["up_proj"]))
    opt = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.1)
    loss = peft_model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    with torch.no_grad():
        ref = peft_model(ids).logits
    merged = peft_model.merge_and_unload()
    assert merged.model.layers[0].mlp.up_proj.rank == 6
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, ref, atol=1e-5)


@pytest.mark.parametrize("kw, field", [
    ({"method": "laser", "rank": 4, "factor_bits": 3}, "factor_bits"),
    ({"method": "laser", "rank": 4, "factor_bits": 4, "group_size": 8}, "group_size"),
    ({"method": "laser", "rank": 4, "factor_bits": 4, "mode": "dense"}, "factor_bits"),
    ({"method": "qlr", "bits": 7, "calibration": "wikipedia"}, "bits"),
    ({"method": "qlr", "quantizer": "hqq", "calibration": "wikipedia"}, "quantizer"),
    ({"method": "qlr", "target_bytes": 1.5, "calibration": "wikipedia"}, "target_bytes"),
    ({"method": "qlr", "rank": -1, "calibration": "wikipedia"}, "rank"),
    ({"method": "qlr", "target_bytes": 0.3, "allocation": "global", "calibration": "wikipedia"}, "allocation"),
    ({"method": "qlr", "rank": 8, "grid": "mse", "calibration": "wikipedia"}, "grid"),
    ({"method": "qlr", "target_bytes": 0.3, "estimate": "gptq", "calibration": "wikipedia"}, "estimate"),
    ({"method": "qlr", "bit_choices": [3, 4], "calibration": "wikipedia"}, "bit_choices"),  # needs target_bytes
    ({"method": "qlr", "rank": 8, "act_order": "yes", "calibration": "wikipedia"}, "act_order"),
    ({"method": "qlr", "rank": 8, "rotate": 64, "calibration": "wikipedia"}, "rotate"),
    ({"method": "qlr", "target_bytes": 0.3, "bit_choices": [4, 7], "calibration": "wikipedia"}, "bit_choices"),
])
def test_bad_quantization_settings_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"TensorCompressionConfig\.{field}: got"):
        TensorCompressionConfig(**kw)


# ------------------------------------------------------------------------------------------------
# rotate=True: the codes of W R, R a random block-Hadamard rotation of the inputs
# ------------------------------------------------------------------------------------------------

def test_block_hadamard_rotation_is_orthogonal_and_rotates_the_gram(data):
    from hf_tensorcomp.decompositions.hadamard import rotate, rotate_gram, rotation_block, rotation_signs, unrotate

    w, x = data
    assert (rotation_block(576), rotation_block(1536), rotation_block(640), rotation_block(9)) == (64, 128, 128, 1)
    signs, b = rotation_signs(128), rotation_block(128)
    r = rotate(torch.eye(128, dtype=torch.float64), signs, b)  # the matrix R itself (rows of I times R)
    assert torch.allclose(r @ r.T, torch.eye(128, dtype=torch.float64), atol=1e-12)
    assert r.abs().unique().numel() == 1 and int((r != 0).sum()) == 128 * b  # ±1/sqrt(b), block-diagonal
    assert torch.allclose(unrotate(rotate(w, signs, b), signs, b), w, atol=1e-5)
    assert torch.allclose(rotate(x, signs, b) @ rotate(w, signs, b).T, x @ w.T, atol=1e-3)  # (x R)(W R)ᵀ = x Wᵀ
    gram = (x.T @ x).double()
    assert torch.allclose(rotate_gram(gram, signs, b), r.T @ gram @ r, rtol=1e-9, atol=1e-6)


def test_rotation_follows_signs_changed_in_place_or_replaced():
    """A checkpoint's signs copied into the buffer in place (load_state_dict), or a new signs tensor, are used at
    once: no stale copy of older signs (a cached float conversion would fail this)."""
    from hf_tensorcomp.decompositions.hadamard import rotate, rotation_signs, unrotate

    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    signs = rotation_signs(64)
    first = rotate(x, signs, 32)
    signs.copy_(rotation_signs(64, seed=1))  # in place, as a state dict loads
    moved = rotate(x, signs, 32)
    assert not torch.allclose(moved, first)
    assert torch.allclose(unrotate(moved, signs, 32), x, atol=1e-5)
    assert torch.allclose(moved, rotate(x, rotation_signs(64, seed=1), 32), atol=1e-6)  # a new tensor, same values
    assert torch.allclose(rotate(x.double(), signs, 32), moved.double(), atol=1e-5)  # another dtype


def test_rotation_spreads_outliers_and_lowers_the_round_trip_error():
    """Heavy-tailed rows (a few weights 30x the rest): the min-max grid of a group is set by its outlier;
    rotated, the outlier is spread over its block and the other weights get a finer step."""
    from hf_tensorcomp.decompositions.hadamard import rotate, rotation_signs, unrotate

    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g)
    w[torch.rand(64, 256, generator=g) < 0.01] *= 30
    signs = rotation_signs(256)
    plain = (quantize_rtn(w, 4, 64).dequantize() - w).norm()
    rotated = (unrotate(quantize_rtn(rotate(w, signs, 128), 4, 64).dequantize(), signs, 128) - w).norm()
    assert rotated < 0.6 * plain


def test_rotated_qlr_is_the_quantizer_of_w_r_and_computes_its_product(tiny_dirs, ids):
    from hf_tensorcomp.decompositions.hadamard import rotate, rotation_signs, unrotate

    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    m = _qlr(tiny_dirs, rank=0, quantizer="rtn", whiten=False, grid="minmax", rotate=True)
    layer = m.model.layers[1].mlp.down_proj  # 96 inputs: blocks of 32
    assert layer.rotation_block == 32 and torch.equal(layer.input_signs, rotation_signs(96))
    w = dense.model.layers[1].mlp.down_proj.weight.detach()
    expect = unrotate(quantize_rtn(rotate(w, rotation_signs(96), 32), 4, 16).dequantize(), rotation_signs(96), 32)
    assert torch.allclose(layer.dense_weight(), expect, atol=1e-6)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(layer(x), x @ layer.dense_weight().T, atol=1e-2 * float((x @ w.T).abs().max()))
    st = m.config.quantization_config.stats
    plain = _qlr(tiny_dirs, rank=0, quantizer="rtn", whiten=False, grid="minmax", rotate=False).config.quantization_config.stats
    n_in = sum(v.in_features for v in m.modules() if isinstance(v, QuantizedLowRankLinear))
    assert st["bytes_after"] - plain["bytes_after"] == n_in  # one byte per input for the signs


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_a_shared_input_is_rotated_once_with_bit_identical_outputs(tiny_dirs, ids, tmp_path, monkeypatch, arch):
    """q / k / v read the attention's input and gate / up the MLP's: with the rotation handed over by the parent,
    4 rotations a layer instead of 7, the same logits to the bit, after a reload too; a child called on
    another tensor rotates that one."""
    import hf_tensorcomp.methods.qlr.layer as qlr_layer

    cfg = TensorCompressionConfig(method="qlr", calibration=calib(), progress=False, group_size=16, rank=4, rotate=True)
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], quantization_config=cfg).eval()
    calls = []
    rotate = qlr_layer.rotate
    monkeypatch.setattr(qlr_layer, "rotate", lambda x, *a: calls.append(x.shape[-1]) or rotate(x, *a))
    with torch.no_grad():
        shared = m(ids).logits
    layers = len(m.model.layers)
    assert len(calls) == 4 * layers
    attn = m.model.layers[0].self_attn
    assert all("_rotated_input" not in p.__dict__ for p in (attn.q_proj, attn.k_proj, attn.v_proj))  # dropped after
    assert qlr_layer.share_input_rotations(m, share=False) == 0  # without the hand-off: each child rotates its input
    calls.clear()
    with torch.no_grad():
        alone = m(ids).logits
    assert len(calls) == 7 * layers and torch.equal(shared, alone)
    qlr_layer.share_input_rotations(m)
    twin = copy.deepcopy(m)  # the copy's parents hand their input to the copy's children
    calls.clear()
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, shared) and len(calls) == 4 * layers
    assert "_rotated_input" not in attn.q_proj.__dict__
    m.save_pretrained(tmp_path / "m")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    calls.clear()
    with torch.no_grad():
        assert torch.equal(back(ids).logits, shared) and len(calls) == 4 * layers
    q = back.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 3, q.in_features)
    with torch.no_grad():
        own = q(x)
        q.__dict__["_rotated_input"] = (torch.zeros_like(x), torch.zeros_like(x))  # a stale hand-off, another tensor
        assert torch.equal(q(x), own)


def test_compressed_tensors_base_refuses_a_rotated_model(tiny_dirs, tmp_path):
    from hf_tensorcomp.integration.peft import export_qlr

    pytest.importorskip("compressed_tensors")
    m = _qlr(tiny_dirs, rank=4, rotate=True)
    with pytest.raises(ValueError, match=r"rotate=True.*base_format='dequantized'"):
        export_qlr(m, tmp_path / "base", tmp_path / "adapter", base_format="compressed-tensors")
    assert not (tmp_path / "base").exists()


def test_rows_not_a_multiple_of_the_group_are_padded_per_row(data):
    """SmolLM2's 576 inputs are 4.5 groups of 128: the last group of each row is short, never spans two rows."""
    w, x = data
    w, x = w[:, :96], x[:, :96]
    q = quantize_rtn(w, 4, 64)
    assert q.scale.numel() == 48 * 2 and q.codes.numel() == 48 * 96  # no codes stored for the padding
    assert ((q.dequantize() - w).abs() <= q.scale.float().view(48, 2).repeat_interleave(64, 1)[:, :96] / 2 + 1e-6).all()
    g = quantize_gptq(w, x.T @ x, 4, 64)
    assert g.codes.numel() == q.codes.numel()
    assert ((w - g.dequantize()) @ x.T).norm() < ((w - q.dequantize()) @ x.T).norm()


@pytest.mark.parametrize("kw", [{}, {"embedding_bits": 4, "embedding_group_size": 16}, {"rotate": False}])
def test_qlr_exports_as_a_base_and_a_peft_adapter(tiny_dirs, tmp_path, ids, kw):
    """The pair loads with transformers and PEFT alone and computes the same logits (a quantized tied
    embedding: de-quantized in the base, tied again)."""
    from peft import PeftModel

    from hf_tensorcomp.integration.peft import export_qlr

    m = _qlr(tiny_dirs, rank=4, **kw)
    export_qlr(m, tmp_path / "base", tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    assert getattr(base.config, "quantization_config", None) is None
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight
    pair = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.allclose(pair(ids).logits, m(ids).logits, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# PyTorch's CPU int4 kernel for 4-bit factors (bfloat16 activations), and dtype casts
# ------------------------------------------------------------------------------------------------

needs_kernel = pytest.mark.skipif(not int4_kernel_available(), reason="this PyTorch has no CPU int4 kernel")


@needs_kernel
@pytest.mark.parametrize("out_f, in_f, group, bits", [(48, 128, 32, 4), (48, 576, 128, 4), (64, 256, 64, 4),
                                                     (48, 576, 128, 3), (64, 256, 64, 2), (48, 576, 128, 8),
                                                     (32, 100, 32, 8), (48, 576, 128, 6), (64, 256, 64, 5)])
def test_int4_kernel_computes_the_dequantized_product(out_f, in_f, group, bits):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(out_f, in_f, generator=g), torch.randn(5, 3, in_f, generator=g)
    q = quantize_rtn(w, bits, group)  # 2- and 3-bit codes are 4-bit codes using part of the range; 5, 6, 8: two calls
    kernel = Int4Kernel.build(q)
    assert kernel is not None and kernel.padded % group == 0  # 576 = 4.5 groups of 128: the short group padded
    assert kernel.repeats == (2 if bits > 4 else 1)  # 5, 6, 8 bits: one call, two nibbles
    # the layout gives the stored codes back, whole and row by row (what a module holding it saves and looks up)
    codes = q.codes[: out_f * in_f].view(out_f, in_f)
    assert torch.equal(kernel.codes(q.zero), codes)
    rows = torch.tensor([out_f - 1, 0, out_f // 2, 17])
    assert torch.equal(kernel.codes(q.zero, rows), codes[rows])
    ref = x.bfloat16().float() @ q.dequantize().T  # the same product in float32
    y = kernel(x.bfloat16())
    assert y.shape == (5, 3, out_f) and y.dtype == torch.bfloat16
    assert (y.float() - ref).abs().max() <= 0.02 * ref.abs().max()  # bfloat16 rounding of scales and output only
    if bits > 4:  # both nibbles summed in float32 in one call, rounded once: within a bfloat16 product's error
        bf16 = torch.nn.functional.linear(x.bfloat16(), q.dequantize().bfloat16()).float()
        assert (y.float() - ref).abs().max() <= 1.5 * (bf16 - ref).abs().max()
    assert Int4Kernel.build(quantize_rtn(w, 4, 48)) is None
    assert Int4Kernel.build(quantize_rtn(w[: out_f - 8], 4, group)) is None  # the kernel needs rows in multiples of 16


@needs_kernel
def test_bfloat16_model_runs_the_kernel_and_gradients_take_the_dequantized_path(tiny_dirs, tmp_path, ids):
    m = _qlr(tiny_dirs, rank=4, group_size=32)
    with torch.no_grad():
        ref = m(ids).logits
    m.save_pretrained(tmp_path)
    b = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    layer = next(x for x in b.modules() if isinstance(x, QuantizedLowRankLinear))
    with torch.no_grad():
        y = b(ids).logits
    assert layer._held("weight") is not None  # held in the kernel's layout since the load: the kernel ran
    assert (y.float() - ref).abs().max() <= 0.05 * ref.abs().max()
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()  # the kernel has no backward: this goes through the de-quantized weight
    w = layer.dense_weight()  # Q(W R) Rᵀ + B A (rotated by default)
    assert layer.rotation_block and torch.allclose(x.grad.float(), w.sum(0).float(), rtol=0.02, atol=0.02)


@needs_kernel
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_one_copy_of_the_codes_held_after_generate(tiny_dirs, tmp_path, ids, bits):
    """The layout the kernel reads is built at load, in place of the packed codes: generating builds nothing
    beside them (before: 2.3x the loaded bytes on the main job), and the state dict still holds the packed
    codes, so a save of the held model reloads to the same logits."""
    from hf_tensorcomp.eval.memory import held_bytes

    m = _qlr(tiny_dirs, rank=4, group_size=32, bits=bits, embedding_bits=8, embedding_group_size=32)
    m.save_pretrained(tmp_path / "a")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    held = [(x, n) for x in again.modules() if isinstance(x, FactorizedModule) for n in x.quantized_names()
            if x._held(n) is not None]
    # the 8-bit table and tied head too (the tiny vocabulary, 101 rows, is no multiple of 16: only a real one is)
    assert held and all(x._held(n) is not None for x in again.modules() if isinstance(x, FactorizedModule)
                        and not isinstance(x, QuantizedEmbedding) for n in x.quantized_names())
    loaded = held_bytes(again)
    with torch.no_grad():
        ref = again(ids).logits
        out = again.generate(ids[:1, :5], max_new_tokens=4, do_sample=False)
    assert held_bytes(again) == loaded
    assert not any(k.endswith("_kernel_sz") for k in again.state_dict())
    again.save_pretrained(tmp_path / "b")  # written from the held layout
    twice = AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
    for k, v in AutoModelForCausalLM.from_pretrained(tmp_path / "a").state_dict().items():
        assert torch.equal(twice.state_dict()[k], v), k
    with torch.no_grad():
        assert torch.equal(twice(ids).logits, ref)
        assert torch.equal(twice.generate(ids[:1, :5], max_new_tokens=4, do_sample=False), out)


def test_nibble_pairs_for_cuda_kernel_pack_two_codes_a_byte_high_first():
    """The input of CUDA's tinygemm packing (`_convert_weight_to_int4pack`): codes 2j in the high nibble, 2j + 1 in
    the low one; unpacked it gives the codes back (the layout tinygemm then builds is checked on the device)."""
    from hf_tensorcomp.decompositions.quantize import nibble_pairs

    codes = torch.randint(0, 16, (48, 256), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    pairs = nibble_pairs(codes)
    assert pairs.shape == (48, 128) and pairs.dtype == torch.uint8
    back = torch.stack([pairs >> 4, pairs & 15], -1).reshape(48, 256)
    assert torch.equal(back.int(), codes)


@needs_kernel
def test_compressed_layers_trace_without_graph_breaks(tiny_dirs, ids):
    """`torch.compile` (transformers' static-cache path) sees the library's layers whole: nothing in their
    forward leaves the graph (before the codes were held at load, every quantized factor broke it: 26 breaks
    on a 2-layer model, from the lazily built kernel layout's change check)."""
    m = _qlr(tiny_dirs, rank=4, group_size=32, embedding_bits=8, embedding_group_size=32)
    with torch.no_grad():
        explained = torch._dynamo.explain(m)(ids)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_held_embedding_table_looks_rows_up_and_heads_from_one_copy(bits):
    """An embedding table held in the kernel's layout (no packed copy beside it): a lookup reads its rows from
    that layout exactly, the tied head multiplies by it, and the state dict gives the packed codes back."""
    from hf_tensorcomp.decompositions.quantize import quantize_rtn
    from hf_tensorcomp.layers import QuantizedHead

    g = torch.Generator().manual_seed(0)
    emb = torch.nn.Embedding(112, 96)  # 112 rows: one whole block of 64 and a partial one of 48
    torch.nn.init.normal_(emb.weight, generator=g)
    q = QuantizedEmbedding.build(emb, bits, 32)
    head = QuantizedHead.build(torch.nn.Linear(96, 112, bias=False), bits, 32, source=q, source_name="embed")
    assert q._held("weight") is not None and isinstance(q._buffers["weight"], torch.Tensor)
    ref = quantize_rtn(emb.weight.detach(), bits, 32)
    table = ref.dequantize()
    ids = torch.tensor([[111, 0, 63, 64, 65, 100]])
    assert torch.equal(q(ids), table[ids])
    x = torch.randn(2, 96, generator=g)
    y = head(x)
    assert (y - x.bfloat16().float() @ table.T).abs().max() <= 0.02 * y.abs().max()
    assert torch.equal(q.state_dict()["weight"], pack(ref.codes, bits))
    assert torch.equal(q.weight, table)  # reading the factor de-quantizes from the held layout


@pytest.mark.parametrize("factor_bits", [None, 8])
def test_bfloat16_correction_keeps_float32_factors_and_follows_their_changes(tiny_dirs, factor_bits):
    m = _qlr(tiny_dirs, rank=4, group_size=32, factor_bits=factor_bits, rotate=False).to(torch.bfloat16)
    layer = next(x for x in m.modules() if isinstance(x, QuantizedLowRankLinear))
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)

    def uncached():  # the correction cast at every call, as before the cache
        y = layer.factor_linear(x, "weight")
        c = torch.nn.functional.linear(torch.nn.functional.linear(x.float(), layer.lora_A.float()), layer.lora_B.float())
        return y + c.to(y.dtype)

    with torch.no_grad():
        assert torch.equal(layer(x), uncached())
        a = layer.__dict__["_float_factors"][1]
        assert a.dtype == torch.float32 and torch.equal(layer(x), uncached()) and layer.__dict__["_float_factors"][1] is a
        name = "lora_A_scale" if factor_bits else "lora_A"
        getattr(layer, name).mul_(2)  # an in-place change (an optimiser step, a load) rebuilds the copies
        assert torch.equal(layer(x), uncached()) and layer.__dict__["_float_factors"][1] is not a
    assert not any("float_factors" in k for k in m.state_dict())
    if factor_bits is None:
        layer(x).float().sum().backward()  # with gradients the factors themselves are used: they get a gradient
        assert layer.lora_A.grad is not None and layer.lora_A.grad.abs().sum() > 0


def test_casting_a_quantized_model_keeps_its_stored_scales(tiny_dirs, tmp_path, ids):
    m = _qlr(tiny_dirs, rank=4, group_size=32)
    layer = next(x for x in m.modules() if isinstance(x, QuantizedLowRankLinear))
    scale = layer.weight_scale.clone()
    m.to(torch.bfloat16)  # before: the float16 scales were rounded to bfloat16 and de-quantized to float32
    assert layer.weight_scale.dtype == torch.float16 and torch.equal(layer.weight_scale, scale)
    assert layer.weight.dtype == torch.bfloat16
    m.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    twin = next(x for x in again.modules() if isinstance(x, QuantizedLowRankLinear))
    assert torch.equal(twin.weight_scale, scale) and torch.equal(twin.weight, layer.weight)
    with torch.no_grad():  # not bit-equal: a cast model also casts the rotary frequencies, a loaded one does not
        ref = m(ids).logits.float()
        assert (again(ids).logits.float() - ref).abs().max() <= 0.02 * ref.abs().max()
    with torch.enable_grad():
        m.to(torch.float32)(ids).logits.sum().backward()  # float32 again: de-quantized path, gradients flow


# ---------------------------------------------------------------------------- embeddings and the head
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])  # tied; untied; tied and scaled (Gemma)
def test_quantized_embedding_and_head_save_reload_and_keep_the_tie(tiny_dirs, tmp_path, ids, arch):
    from hf_tensorcomp.decompositions.quantize import quantize_rtn
    from hf_tensorcomp.layers import QuantizedEmbedding, QuantizedHead

    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch]).eval()
    cfg = TensorCompressionConfig(method="laser", rank=8, progress=False, embedding_bits=4, embedding_group_size=16)
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], quantization_config=cfg).eval()
    emb, head = m.get_input_embeddings(), m.get_output_embeddings()
    assert isinstance(emb, QuantizedEmbedding) and isinstance(head, QuantizedHead)
    tied = arch != "qwen3"
    assert head.tied is tied
    # the table is the round-to-nearest quantization of the dense one; lookups read exactly its rows
    want = quantize_rtn(dense.get_input_embeddings().weight, 4, 16).dequantize()
    assert torch.equal(emb.weight, want)
    scale = getattr(dense.get_input_embeddings(), "scalar_embed_scale", 1.0)
    assert torch.equal(emb(ids), want[ids] * torch.tensor(scale).to(want.dtype) if scale != 1.0 else want[ids])
    if tied:  # the head multiplies by the same codes, stored once
        assert torch.equal(head.dense_weight(), want)
        assert not [n for n in m.state_dict() if n.startswith("lm_head")]
    st = m.config.quantization_config.stats
    with torch.no_grad():
        ref = m(ids).logits
    m.save_pretrained(tmp_path)
    assert st["bytes_after"] == _tensor_bytes(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(again.get_output_embeddings(), QuantizedHead) and again.get_output_embeddings().tied is tied
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref)
    out = again.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


def test_embedding_bits_shrink_the_model_by_the_table(tiny_dirs):
    plain = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(
        method="laser", rank=8, progress=False))
    small = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(
        method="laser", rank=8, progress=False, embedding_bits=8, embedding_group_size=16))
    v, d = plain.get_input_embeddings().weight.shape
    saved = v * d * 4 - (v * d + v * (d // 16) * 3)  # fp32 table -> 8-bit codes + a scale and zero per group
    assert plain.config.quantization_config.stats["bytes_after"] - small.config.quantization_config.stats["bytes_after"] == saved


def test_embedding_bits_are_refused_twice(tiny_dirs, tmp_path):
    cfg = dict(method="laser", rank=8, progress=False, embedding_bits=4, embedding_group_size=16)
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(
        **cfg, targets=["self_attn.*"]))
    with pytest.raises(ValueError, match="embedding_bits: the embedding is quantized already"):
        hf_tensorcomp.compress(m, TensorCompressionConfig(**{**cfg, "targets": ["mlp.*"]}))
    m.save_pretrained(tmp_path / "c")
    with pytest.raises(ValueError, match="compress_checkpoint: src: .* is compressed or quantized already"):
        hf_tensorcomp.compress_checkpoint(tmp_path / "c", tmp_path / "out", TensorCompressionConfig(**{**cfg, "targets": ["mlp.*"]}))
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="embedding_bits: got 3"):
        TensorCompressionConfig(method="laser", rank=8, embedding_bits=3)


def test_with_calibration_the_tied_table_is_gptq_on_the_heads_inputs(tiny_dirs):
    from hf_tensorcomp.embedding_tables import head_gram

    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()
    cfg = TensorCompressionConfig(method="laser", rank=1.0, progress=False, embedding_bits=4, embedding_group_size=16,
                                  calibration=calib())
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg).eval()
    st = m.config.quantization_config.stats["modules"]["model.embed_tokens"]
    assert st["quantizer"] == "gptq" and st["tied_head"]
    w = dense.get_input_embeddings().weight.detach()
    gram = head_gram(dense, dense.get_output_embeddings(), calib(), 8).double()  # full rank: the same head inputs

    def out_err(q):
        d = (w - q).double()
        return float(torch.trace(d @ gram @ d.T))

    rtn = quantize_rtn(w, 4, 16).dequantize()
    assert out_err(m.get_input_embeddings().weight) < 0.9 * out_err(rtn)
    act = quantize_gptq(w.float(), gram.float(), 4, 16, act_order=True).dequantize()  # in activation order
    col = quantize_gptq(w.float(), gram.float(), 4, 16).dequantize()
    assert torch.allclose(m.get_input_embeddings().weight, act) and not torch.allclose(act, col)


def test_embedding_step_checks_calibration_ids_against_the_vocabulary(tiny_dirs):
    bad = torch.full((2, 16), VOCAB + 5)  # no method here needs calibration: the embedding step alone reads it
    cfg = TensorCompressionConfig(method="laser", rank=8, progress=False, embedding_bits=8, embedding_group_size=16,
                                  calibration=bad, calibration_length=15)
    with pytest.raises(ValueError, match=r"calibration: token id \d+ is outside the model's vocabulary"):
        AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg)


def _spent(m, group, table_group):
    """Bytes the byte budget counts: qlr layers (codes + correction at bf16) and the embedding table
    (counted twice when the head is untied)."""
    mods = m.config.quantization_config.stats["modules"]
    spent = dense = 0
    for n, st in mods.items():
        if st.get("method") == "embedding":
            continue
        v = m.get_submodule(n)
        spent += stored_bytes((v.out_features, v.in_features), st["bits"], group) + st["rank"] * (v.in_features + v.out_features) * 2
        dense += 2 * v.in_features * v.out_features
    emb = m.get_input_embeddings()
    copies = 1 if m.get_output_embeddings().tied else 2
    bits = emb.__dict__["_qfactors"]["weight"][0]
    spent += copies * stored_bytes((emb.num_embeddings, emb.embedding_dim), bits, table_group)
    dense += copies * 2 * emb.num_embeddings * emb.embedding_dim
    return spent, dense, bits


@pytest.mark.parametrize("arch, embedding_bits", [("llama", 8), ("llama", "auto"), ("qwen3", "auto")])  # tied, untied
def test_with_embedding_bits_the_byte_budget_holds_the_table(tiny_dirs, tmp_path, ids, arch, embedding_bits):
    cfg = TensorCompressionConfig(method="qlr", target_bytes=0.4, calibration=calib(), progress=False, group_size=16,
                                  embedding_bits=embedding_bits, embedding_group_size=16, allocation="fisher")
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], quantization_config=cfg).eval()
    spent, dense, bits = _spent(m, 16, 16)
    assert 0.3 * dense <= spent <= 0.4 * dense  # the table is inside the budget, which is spent
    alloc = m.config.quantization_config.stats["allocation"]["0"]
    assert alloc["embedding_bits"] == bits and bits in ((8,) if embedding_bits == 8 else (4, 8))
    assert alloc["params_targeted"] * 2 == dense
    card = hf_tensorcomp.model_card(m)  # the card says what the budget chose
    assert f"the embedding table inside it at {bits} bits" in card and f"{bits} (embedding) ×" in card
    # without the table in it, the same target gives the linears more bytes
    alone = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], quantization_config=TensorCompressionConfig(
        method="qlr", target_bytes=0.4, calibration=calib(), progress=False, group_size=16, allocation="fisher"))
    linears = lambda mm: sum(st["bits"] * 1000 + st["rank"] for st in mm.config.quantization_config.stats["modules"].values()
                             if st.get("method") != "embedding")
    assert linears(alone) > linears(m)
    reloads_identically(m, tmp_path, ids)


def test_auto_table_bits_follow_the_budget(tiny_dirs):
    def bits(target):
        cfg = TensorCompressionConfig(method="qlr", target_bytes=target, calibration=calib(), progress=False,
                                      group_size=16, embedding_bits="auto", embedding_group_size=16)
        m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg)
        return m.config.quantization_config.stats["allocation"]["0"]["embedding_bits"]

    assert bits(0.9) == 8  # room for everything: the table takes its better rung


@pytest.mark.parametrize("kw", [{"method": "qlr", "rank": 8}, {"method": "laser", "target": 0.5}])
def test_auto_table_bits_need_a_byte_budget(kw):
    """'auto' without a budget to choose it is refused up front."""
    with pytest.raises(ValueError, match="embedding_bits: got 'auto'.*target_bytes"):
        TensorCompressionConfig(calibration="wikipedia", embedding_bits="auto", **kw)


def test_a_whitened_fit_is_judged_by_its_output_error():
    from hf_tensorcomp.checks import check_outputs

    lin = torch.nn.Linear(4, 4)
    entry = TensorCompressionConfig(method="qlr", rank=0, calibration="wikipedia").entries[0]
    # 2-bit GPTQ may sit farther from W than zeros do and still give outputs far closer than zeros give
    check_outputs({"a": (lin, {"rel_error": 1.3, "whitened_error": 0.6})}, {"a": lin}, "p", entry, "more bits")
    with pytest.raises(ValueError, match="relative output error on the calibration inputs is 1.2"):
        check_outputs({"a": (lin, {"rel_error": 0.5, "whitened_error": 1.2})}, {"a": lin}, "p", entry, "more bits")
    with pytest.raises(ValueError, match="its relative error is 1.1"):
        check_outputs({"a": (lin, {"rel_error": 1.1, "whitened_error": None})}, {"a": lin}, "p", entry, "more bits")


def test_a_budget_the_table_alone_exceeds_names_the_field(tiny_dirs):
    cfg = TensorCompressionConfig(method="qlr", target_bytes=0.05, calibration=calib(), progress=False, group_size=16,
                                  embedding_bits=8, embedding_group_size=16)
    with pytest.raises(ValueError, match=r"target_bytes: got 0.05; .*embedding table.*allowed: a larger target_bytes"):
        AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg)


def test_searched_grid_never_has_a_larger_round_trip_error(data):
    w, x = data
    for bits in (2, 4):  # the search includes the min-max range, so it can only lower the error it minimises
        e = {grid: (quantize_rtn(w, bits, 32, grid).dequantize() - w).abs().pow(2.4).sum() for grid in ("minmax", "search")}
        assert e["search"] <= e["minmax"]
    gram = x.T @ x
    out = {grid: ((w - quantize_gptq(w, gram, 2, 32, grid=grid).dequantize()) @ x.T).norm() for grid in ("minmax", "search")}
    assert out["search"] < 0.95 * out["minmax"]  # on the output error GPTQ minimises, clipping pays at 2 bits


@pytest.mark.parametrize("kw", [{"bits": 4}, {"bits": 6}, {"bits": 3, "embedding_bits": 8, "embedding_group_size": 16},
                                {"target_bytes": 0.4, "bit_choices": [2, 4, 8], "estimate": "rtn", "allocation": "relative"}])
def test_qlr_exports_a_compressed_tensors_base_that_transformers_loads(tiny_dirs, tmp_path, ids, kw):
    """The codes themselves, in compressed-tensors' pack-quantized format (one config group per width):
    transformers de-quantizes them to exactly our Q(W), and with the PEFT adapter the logits are ours."""
    pytest.importorskip("compressed_tensors")
    from peft import PeftModel
    from transformers import CompressedTensorsConfig

    from hf_tensorcomp.integration.peft import export_qlr

    import json
    import re

    from safetensors.torch import load_file

    m = _qlr(tiny_dirs, group_size=16, rotate=False, **({"rank": 4} if "target_bytes" not in kw else {}), **kw)
    mods = m.config.quantization_config.stats["modules"].values()
    bits = {d["bits"] for d in mods if "bits" in d and d.get("method") != "embedding"}
    if len(bits) > 1:  # a mix: every matrix at the widest width (transformers' loader reads one scheme)
        with pytest.warns(UserWarning, match=re.escape(f"widths {sorted(bits)} written as 8-bit codes")):
            export_qlr(m, tmp_path / "base", tmp_path / "adapter", base_format="compressed-tensors")
    else:
        export_qlr(m, tmp_path / "base", tmp_path / "adapter", base_format="compressed-tensors")
    cfg = json.loads((tmp_path / "base" / "config.json").read_text())["quantization_config"]
    assert [g["weights"]["num_bits"] for g in cfg["config_groups"].values()] == [max(bits)]
    stored = load_file(tmp_path / "base" / "model.safetensors")
    assert not [k for k in stored if k.endswith("q_proj.weight")] and stored["model.layers.0.self_attn.q_proj.weight_packed"].dtype == torch.int32
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=CompressedTensorsConfig(dequantize=True))
    for name, layer in m.named_modules():
        if isinstance(layer, QuantizedLowRankLinear):  # Q(W) bit for bit, whatever its width
            assert torch.equal(base.get_submodule(name).weight, layer.weight), name
    pair = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.allclose(pair(ids).logits, m(ids).logits, atol=1e-5)


def test_compressed_tensors_base_refuses_groups_that_do_not_divide(tiny_dirs, tmp_path):
    from hf_tensorcomp.integration.peft import export_qlr

    pytest.importorskip("compressed_tensors")
    m = _qlr(tiny_dirs, rank=4, group_size=32, rotate=False)  # the tiny model's 48-wide inputs: one and a half groups
    with pytest.raises(ValueError, match=r"export_qlr: group_size: .* not a multiple of its groups of 32"):
        export_qlr(m, tmp_path / "base", tmp_path / "adapter", base_format="compressed-tensors")
    assert not (tmp_path / "base").exists()
    with pytest.raises(ValueError, match=r"export_qlr: base_format: got 'gguf'; allowed: 'dequantized' \| 'compressed-tensors'"):
        export_qlr(m, tmp_path / "base", tmp_path / "adapter", base_format="gguf")


def _runner(model, ids):
    from hf_tensorcomp.calibration import LayerwiseRunner
    from hf_tensorcomp.plan import find_decoder_layers

    prefix, layers = find_decoder_layers(model)
    return LayerwiseRunner(model, prefix, layers, ids, batch_size=4), layers


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_measured_kl_is_the_kl_of_the_model_with_the_weights_replaced(tiny_dirs, arch):
    """Each group run from its own layer on gives the KL a whole forward pass of the changed model gives;
    a zero head gives the closed form log V - H(p); the model is left as it was."""
    from hf_tensorcomp.calibration.sensitivity import measured_kl

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch]).eval()
    ids = calib(n=6, length=20)
    runner, layers = _runner(model, ids)
    batch = ids[:4]  # the runner's first batch
    with torch.no_grad():
        dense = model(batch).logits[:, ::4].float().log_softmax(-1)
    g = torch.Generator().manual_seed(3)
    new = {n: layers.get_submodule(n).weight.detach() + 0.3 * torch.randn(layers.get_submodule(n).weight.shape, generator=g)
           for n in ("1.mlp.down_proj", "1.self_attn.v_proj", "2.self_attn.q_proj")}
    head = model.get_output_embeddings()
    new["head"] = torch.zeros_like(head.weight)
    groups = {1: {n: layers.get_submodule(n) for n in ("1.mlp.down_proj", "1.self_attn.v_proj")},
              2: {"2.self_attn.q_proj": layers.get_submodule("2.self_attn.q_proj")}, 3: {"head": head}}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kl = measured_kl(runner, groups, lambda n: new[n])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    p = dense.exp()
    for li in (1, 2):
        changed = copy.deepcopy(model)
        for n in groups[li]:
            changed.get_submodule(f"model.layers.{n}").weight.data = new[n]
        with torch.no_grad():
            q = changed(batch).logits[:, ::4].float().log_softmax(-1)
        assert kl[li] == pytest.approx(float((p * (dense - q)).sum(-1).mean()), rel=1e-4)
        assert kl[li] > 0
    assert kl[3] == pytest.approx(float((p * dense).sum(-1).mean()) + float(torch.log(torch.tensor(VOCAB * 1.0))), abs=1e-6)


def test_a_measured_allocation_gives_a_layer_that_barely_matters_fewer_bytes(tiny_dirs, tmp_path, ids):
    """Layer 0 writes almost nothing into the residual stream (its o_proj and down_proj scaled by 1e-3): its
    matrices' relative errors are as large as anyone's, but what they cost the model is not. The relative
    score spends on them like on any other layer; the measured one starves them, and meets the budget."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    with torch.no_grad():
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            model.model.layers[0].get_submodule(n).weight.mul_(1e-3)
    src = tmp_path / "damped"
    model.save_pretrained(src)

    def spent(allocation):
        # every width: the default's floor (6 bits at this budget) would leave the allocation nothing to starve
        cfg = TensorCompressionConfig(method="qlr", target_bytes=0.5, calibration=calib(), progress=False, group_size=16,
                                      allocation=allocation, embedding_bits="auto", embedding_group_size=16,
                                      bit_choices=[2, 3, 4, 5, 6, 8])
        m = AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg).eval()
        mods = m.config.quantization_config.stats["modules"]
        layer0 = sum(stored_bytes((m.get_submodule(n).out_features, m.get_submodule(n).in_features), st["bits"], 16)
                     + st["rank"] * (m.get_submodule(n).in_features + m.get_submodule(n).out_features) * 2
                     for n, st in mods.items() if ".layers.0." in n)
        return m, layer0, _spent(m, 16, 16)

    rel, rel0, _ = spent("relative")
    mea, mea0, (total, dense, _) = spent("measured")
    assert mea0 < 0.8 * rel0
    assert 0.45 * dense <= total <= 0.5 * dense
    alloc = mea.config.quantization_config.stats["allocation"]["0"]
    assert set(alloc["measured_kl"]) == {"0", "1", "2", "head"}
    assert alloc["measured_kl"]["0"] < 0.1 * min(alloc["measured_kl"][k] for k in ("1", "2"))
    mea.save_pretrained(tmp_path / "measured")
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "measured").eval()(ids).logits, mea(ids).logits)


def test_a_measured_allocation_leaves_a_fixed_table_out(tiny_dirs):
    """At fixed ``embedding_bits`` the table has one rung: nothing to measure, the linears' layers measured."""
    cfg = TensorCompressionConfig(method="qlr", target_bytes=0.5, calibration=calib(), progress=False, group_size=16,
                                  allocation="measured", embedding_bits=8, embedding_group_size=16)
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg)
    assert set(m.config.quantization_config.stats["allocation"]["0"]["measured_kl"]) == {"0", "1", "2"}
    spent, dense, bits = _spent(m, 16, 16)
    assert bits == 8 and spent <= 0.5 * dense


def test_a_measured_allocation_is_refused_while_streaming(tiny_dirs, tmp_path):
    cfg = TensorCompressionConfig(method="qlr", target_bytes=0.3, calibration=calib(), progress=False, group_size=16,
                                  allocation="measured")
    with pytest.raises(ValueError, match="'measured'.*streaming never holds"):
        hf_tensorcomp.compress_checkpoint(tiny_dirs["llama"], tmp_path / "out", cfg)


def test_a_budget_climbs_from_the_uniform_setting_too():
    # non-convex ladders (equal costs 1..4): the climb from the cheapest rungs spends M0's steps first (large gains)
    # and past rung 2, and then cannot bring the last matrix to rung 2: 1.45 against 1.10 for rung 2 everywhere
    from hf_tensorcomp.decompositions.allocation import allocate, total_loss

    costs = [1.0, 2.0, 3.0, 4.0]
    ladders = {"m0": (costs, [1.0, 0.2, 0.1, 0.0]), "m1": (costs, [1.0, 0.95, 0.5, 0.49]), "m2": (costs, [1.0, 0.95, 0.5, 0.49])}
    greedy = allocate(ladders, 9.0)
    assert total_loss(ladders, greedy) == pytest.approx(1.45)
    uniform = {k: 2 for k in ladders}
    got = allocate(ladders, 9.0, seed=uniform)
    assert got == uniform and total_loss(ladders, got) == pytest.approx(1.10)
    assert allocate(ladders, 8.0, seed=uniform) == allocate(ladders, 8.0)  # a seed that does not fit: ignored
    # with more budget than the seed needs both climb and the lower loss is kept
    assert allocate(ladders, 12.0, seed=uniform) == {k: 3 for k in ladders}


def test_a_byte_budget_never_loses_to_one_width_everywhere(tiny_dirs, monkeypatch):
    # every matrix offered 2, 3, 4 and 8 bits (no correction) with losses shaped like the ladders above: the first
    # matrix's narrow steps save the most, everyone else's saving comes at 4 bits. The budget holds 4 bits
    # everywhere; the climb from 2 bits took the first matrix to 8 bits and left another below 4 bits
    from hf_tensorcomp.methods import get_method

    from hf_tensorcomp.methods.base import Ladder

    qlr = type(get_method("qlr"))
    first = []

    def ladder(self, name, module, stats, entry, ctx):
        settings = [(b, 0) for b in (2, 3, 4, 8)]
        first.append(name) if not first else None
        losses = [10.0, 2.0, 1.0, 0.8] if name == first[0] else [1.0, 0.99, 0.5, 0.49]
        return Ladder([self._rung_bytes(module, b, 0, entry) / 2 for b, _ in settings], losses, settings=settings,
                      uniform={b: j for j, (b, _) in enumerate(settings)})

    monkeypatch.setattr(qlr, "ladder", ladder)
    # groups of 16, unrotated: 4-bit codes cost (64 + 3 * 8) / 256 = 0.34375 of the bf16 bytes
    m = _qlr(tiny_dirs, target_bytes=0.3438, bit_choices=[2, 3, 4, 8], rotate=False, grid="minmax")
    bits = {v["bits"] for v in m.config.quantization_config.stats["modules"].values()}
    assert bits == {4}


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_widths_together_give_each_widths_codes_and_its_whitened_error(data, act_order):
    """The ladder's sweep of several widths at once: the codes of one call per width, and per row the output error
    on the plan's damped Gram, (w - q) H (w - q)ᵀ, from the sweep itself (W - Q = Err U)."""
    from hf_tensorcomp.decompositions.quantize import quantize_gptq_widths

    w, x = data
    gram = (x.T @ x).double()
    plan = gptq_plan(gram, 0.01, act_order)
    h = gram.clone()
    h.diagonal().add_(0.01 * h.diagonal().mean())
    together = quantize_gptq_widths(w, [3, 4, 8], 32, "search", plan, errors=torch.float32)
    for bits, (q, err) in zip([3, 4, 8], together):
        alone = quantize_gptq(w, None, bits, 32, grid="search", plan=plan)
        assert torch.equal(q.codes, alone.codes) and torch.equal(q.scale, alone.scale) and torch.equal(q.zero, alone.zero)
        d = w.double() - q.dequantize().double()
        assert torch.allclose(err.double().pow(2).sum(1), (d @ h * d).sum(1), rtol=1e-3 if bits < 8 else 2e-2)  # float32
        # Err is (W - Q) whitened by the plan's Gram: the same singular values as (W - Q) S for any S Sᵀ = H
        s = torch.linalg.cholesky(h)
        assert torch.allclose(torch.linalg.svdvals(err.double()), torch.linalg.svdvals(d @ s), rtol=2e-3 if bits < 8 else 3e-2)


def test_search_grid_coarse_to_fine_finds_the_best_of_all_factors_where_there_is_one_minimum(data):
    from hf_tensorcomp.decompositions import quantize as qm

    g = qm._groups(data[0], 32)
    errs = []
    for f in qm.SHRINKS:  # every factor's round-trip error, as the full search measured it
        scale, zero = qm._grid(g * f, 4)
        errs.append(((qm._codes(g, scale, zero, 4) - zero[:, None]) * scale[:, None] - g).abs().pow(2.4).sum(1))
    errs = torch.stack(errs, 1)
    scale, zero = qm._search_grid(g, 4)
    full = errs.argmin(1)
    for i in range(len(g)):
        s_full, z_full = qm._grid(g[i:i + 1] * qm.SHRINKS[int(full[i])], 4)
        found = ((qm._codes(g[i:i + 1], scale[i:i + 1], zero[i:i + 1], 4) - zero[i]) * scale[i] - g[i]).abs().pow(2.4).sum()
        assert found <= errs[i, int(full[i])] * (1 + 1e-6) or not _one_minimum(errs[i])


def _one_minimum(e) -> bool:
    d = torch.sign(e[1:] - e[:-1])
    return int((d[1:] != d[:-1]).sum()) <= 1


def test_spectrum_tails_exact_below_the_threshold_and_close_above(monkeypatch):
    from hf_tensorcomp.decompositions import svd

    g = torch.Generator().manual_seed(1)
    m = torch.randn(300, 200, generator=g, dtype=torch.float64) * torch.linspace(2, 0.1, 200, dtype=torch.float64)
    sv2 = torch.linalg.svdvals(m).pow(2)
    want = [float(sv2[r:].sum()) for r in (0, 4, 16, 40)]
    assert svd.spectrum_tails(m, [0, 4, 16, 40]) == pytest.approx(want, rel=1e-9)
    monkeypatch.setattr(svd, "EXACT_SPECTRUM", 50)  # the randomized range finder
    est = svd.spectrum_tails(m, [0, 4, 16, 40])
    assert est[0] == pytest.approx(want[0], rel=1e-6)
    for e, x in zip(est[1:], want[1:]):
        assert x * (1 - 1e-5) <= e <= x * 1.01  # never below the best rank's error, within 1 %


@pytest.mark.parametrize("rank", [5, 120])
def test_whitened_svd_above_the_threshold_is_as_good_as_the_svd(monkeypatch, rank):
    """A small rank by the randomized range finder, a large one by the Gram's eigenvectors: the fit's whitened
    error within 1 % (randomized) or equal (eigenvectors) to LAPACK's SVD's."""
    from hf_tensorcomp.decompositions import svd

    g = torch.Generator().manual_seed(2)
    w = torch.randn(260, 200, generator=g) * torch.linspace(2, 0.1, 200)
    x = torch.randn(400, 200, generator=g)
    s = whitening_factor((x.T @ x).double())
    u, v, _ = whitened_svd(w, rank, s)
    monkeypatch.setattr(svd, "EXACT_SPECTRUM", 50)
    u2, v2, _ = whitened_svd(w, rank, s)
    best = float(((w - u @ v).double() @ s).norm())
    got = float(((w - u2 @ v2).double() @ s).norm())
    assert best * (1 - 1e-6) <= got <= best * (1.01 if rank + 16 < 50 else 1 + 1e-6)


@pytest.mark.parametrize("n, dtype", [(600, torch.float64), (2100, torch.float32)])
def test_gptq_inverse_is_the_upper_cholesky_factor_of_the_damped_inverse_gram(n, dtype):
    """GPTQ's plan factor, made from one Cholesky of the reversed Gram and a triangular inverse by halves: LAPACK's
    upper Cholesky factor of (H + δI)⁻¹ (a dead input at 1 + δ), in the given order; float32 above 2,048 inputs."""
    from hf_tensorcomp.decompositions.quantize import gptq_inverse

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n + 50, n, generator=gen, dtype=torch.float64)
    x[:, 3] = 0  # a dead input
    gram = x.T @ x
    perm = torch.randperm(n, generator=gen)
    u = gptq_inverse(gram, 0.01, perm)
    assert u.dtype == dtype and torch.equal(u, u.triu()) and bool((u.diagonal() > 0).all())
    h = gram[perm][:, perm].clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(0.01 * h.diagonal().mean())
    want = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    assert torch.allclose(u.double(), want, rtol=0, atol=(1e-10 if dtype == torch.float64 else 1e-5) * float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lower_product_is_the_product_with_a_lower_triangular_factor(dtype):
    from hf_tensorcomp.decompositions.svd import lower_product

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 1100, generator=gen, dtype=dtype)
    s = torch.randn(1100, 1100, generator=gen, dtype=dtype).tril()
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert torch.allclose(lower_product(w, s), w @ s, rtol=0, atol=tol * float((w @ s).abs().max()))


def test_gram_energy_is_the_output_energy():
    from hf_tensorcomp.decompositions.svd import gram_energy

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(700, 1100, generator=gen, dtype=torch.float64), torch.randn(50, 1100, generator=gen, dtype=torch.float64)
    assert gram_energy(w, x.T @ x) == pytest.approx(float((w @ x.T).pow(2).sum()), rel=1e-10)


def test_whitening_factor_above_the_float64_threshold_factors_the_damped_gram():
    from hf_tensorcomp.decompositions.svd import WHITEN_FLOAT64_UP_TO, whitening_factor

    n = WHITEN_FLOAT64_UP_TO + 64
    x = torch.randn(n + 100, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    g = x.T @ x
    s = whitening_factor(g, 1e-4)
    h = g.clone()
    h.diagonal().add_(1e-4 * g.diagonal().mean())
    assert s.dtype == torch.float64 and torch.equal(s, s.tril())
    assert torch.allclose(s @ s.T, h, rtol=0, atol=1e-5 * float(h.abs().max()))


def test_in_memory_table_gram_comes_from_the_propagated_final_states(tiny_dirs, monkeypatch):
    """With calibration and propagation the table's GPTQ reads the compression pass's own final states (through the
    final norm) instead of a forward pass of the compressed model: the same Gram, so the same table."""
    import hf_tensorcomp.embedding_tables as tables
    import hf_tensorcomp.pipeline as pipeline

    cfg = dict(method="qlr", bits=4, rank=2, group_size=16, progress=False, embedding_bits=4, embedding_group_size=16,
               calibration=calib())
    calls = []
    real = tables.head_gram
    monkeypatch.setattr(tables, "head_gram", lambda *a, **k: calls.append(1) or real(*a, **k))
    fast = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(**cfg))
    assert not calls  # no forward pass of the whole model for the table
    monkeypatch.setattr(pipeline, "final_norm", lambda *a: None)  # as for a model with no final norm
    slow = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(**cfg))
    assert calls
    a, b = fast.get_input_embeddings().weight, slow.get_input_embeddings().weight
    assert torch.allclose(a, b, rtol=0, atol=1e-6), float((a - b).abs().max())


def test_gram_of_is_the_inputs_gram():
    from hf_tensorcomp.decompositions.svd import gram_of

    x = torch.randn(300, 1100, generator=torch.Generator().manual_seed(0))
    g = gram_of(x)
    assert torch.allclose(g, x.T @ x, rtol=0, atol=1e-4 * float((x.T @ x).abs().max())) and torch.equal(g, g.T)
