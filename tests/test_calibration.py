"""Calibration: the layer-by-layer pipeline, whitening, and the global budget."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_tensorcomp import LowRankLinear, TensorCompressionConfig
from hf_tensorcomp.calibration import LayerwiseRunner, calibration_ids
from hf_tensorcomp.decompositions.allocation import allocate
from hf_tensorcomp.decompositions.svd import truncated_svd, whitened_svd, whitening_factor
from hf_tensorcomp.plan import find_decoder_layers
from hf_tensorcomp.methods.base import Context
from tiny import ARCHS, VOCAB, rel_err


def calib_ids(n=6, length=16, seed=3):
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def load(path, **cfg):
    cfg.setdefault("progress", False)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=TensorCompressionConfig(**cfg))


def test_whitening_identity_and_optimality():
    """‖(W - W') Xᵀ‖ equals the norm of the dropped whitened singular values, and beats plain SVD."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(20, 12, generator=g, dtype=torch.float64)
    x = torch.randn(200, 12, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, 12, dtype=torch.float64)
    s = whitening_factor(x.T @ x, damping=0.0)
    assert torch.allclose(s @ s.T, x.T @ x)
    for r in (1, 4, 8):
        u, v, sv = whitened_svd(w, r, s)
        err = torch.linalg.norm((w - u.double() @ v.double()) @ x.T)
        assert err.item() == pytest.approx(sv[r:].pow(2).sum().sqrt().item(), rel=1e-4)
        pu, pv = truncated_svd(w, r)
        assert err < torch.linalg.norm((w - pu.double() @ pv.double()) @ x.T)  # the output error is what it minimises
    u, v, _ = whitened_svd(w, 12, s)
    assert torch.allclose(u.double() @ v.double(), w, atol=1e-4)


def test_asvd_scaling_is_exact_at_full_rank():
    w = torch.randn(9, 7, dtype=torch.float64)
    u, v, _ = whitened_svd(w, 7, torch.rand(7, dtype=torch.float64) + 0.1)
    assert torch.allclose(u.double() @ v.double(), w, atol=1e-5)


def test_allocation_meets_budget_and_prefers_cheap_loss():
    # two matrices: "a" loses little per rank, "b" a lot; costs 10 per rung
    ladders = {"a": ([10, 20, 30, 40], [0.3, 0.2, 0.1, 0.0]), "b": ([10, 20, 30, 40], [9.0, 4.0, 1.0, 0.0])}
    rungs = allocate(ladders, budget=60)
    assert rungs == {"a": 1, "b": 3}  # b's steps save more loss per unit of cost: b climbs to the top first
    assert sum(ladders[k][0][j] for k, j in rungs.items()) <= 60
    with pytest.raises(ValueError, match="below the cheapest"):
        allocate(ladders, budget=15)


@pytest.mark.parametrize("target", [0.3, 0.55, 0.8])
def test_global_budget_is_met_exactly(target, tiny_dirs):
    """Kept parameters never exceed the budget and fall short of it by less than one rank step."""
    m = load(tiny_dirs["llama"], method="laser", target=target, whiten=True, calibration=calib_ids())
    st = m.config.quantization_config.stats
    a = st["allocation"]["0"]
    _, layers = find_decoder_layers(m)
    kept = sum(p.numel() for n, p in layers.named_parameters() if n.endswith("weight") and "proj" in n)
    assert kept == a["params_kept"] <= target * a["params_targeted"]
    assert target * a["params_targeted"] - kept < 48 + 96  # one rank of the widest matrix (in + out)
    ranks = {n: s["rank"] for n, s in st["modules"].items()}
    assert len(set(ranks.values())) > 1  # not one rank for every matrix


@pytest.mark.parametrize("allocation", ["global", "uniform"])
def test_pivoted_budget_counts_stored_numbers_and_buys_rank(allocation, tiny_dirs, ids):
    """With pivoted=True (the default) a rank-r matrix costs r (in + out - r): the budget holds on the stored
    parameters, every matrix gets at least the rank of the plain form (pivoted=False) at the same target, and the
    model is closer to dense."""
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()
    kw = dict(method="laser", target=0.6, whiten=True, allocation=allocation, calibration=calib_ids())
    plain, piv = load(tiny_dirs["llama"], pivoted=False, **kw), load(tiny_dirs["llama"], **kw)
    _, layers = find_decoder_layers(piv)
    kept = sum(p.numel() for n, p in layers.named_parameters() if n.endswith("weight") and "proj" in n)
    targeted = sum(p.numel() for n, p in find_decoder_layers(dense)[1].named_parameters()
                   if n.endswith("weight") and "proj" in n)
    assert kept <= 0.6 * targeted
    if allocation == "global":
        assert kept == piv.config.quantization_config.stats["allocation"]["0"]["params_kept"]
    ranks = [{n: s["rank"] for n, s in m.config.quantization_config.stats["modules"].items()} for m in (plain, piv)]
    assert sum(ranks[1].values()) > sum(ranks[0].values())
    if allocation == "uniform":
        assert all(ranks[1][n] > ranks[0][n] for n in ranks[0])
    pivoted = [m for m in piv.modules() if isinstance(m, LowRankLinear)]
    assert pivoted and all(m.pivots is not None for m in pivoted)
    with torch.no_grad():
        ref = dense(ids).logits
        assert rel_err(piv(ids).logits, ref) < rel_err(plain(ids).logits, ref)


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHS)
def test_whitened_full_rank_is_exact(arch, tiny_dirs, ids):
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch])
    for whiten in (True, "asvd"):
        comp = load(tiny_dirs[arch], method="laser", rank=1.0, whiten=whiten, calibration=calib_ids())
        assert sum(isinstance(m, LowRankLinear) for m in comp.modules()) == 21
        assert rel_err(comp(ids).logits, dense(ids).logits) <= 1e-4


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHS)
def test_captured_layer_calls_reproduce_the_model(arch, tiny_dirs):
    """Each layer is called with its own masks and position embeddings (Gemma3: sliding and global)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch]).eval()
    prefix, layers = find_decoder_layers(model)
    x = calib_ids(n=4, length=20)  # longer than Gemma's sliding window (8): the two masks differ
    runner = LayerwiseRunner(model, prefix, layers, x, batch_size=3)
    ref = model(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states
    hidden = runner.hidden
    for li in range(len(layers)):
        assert torch.allclose(torch.cat(hidden), ref[li], atol=1e-5)
        hidden = runner._forward(li, hidden)
    if arch == "gemma3":
        kinds = {model.config.layer_types[li]: runner.kwargs[0][li]["attention_mask"] for li in range(3)}
        sliding, full = kinds["sliding_attention"], kinds["full_attention"]
        assert sliding is not None and (full is None or not torch.equal(sliding, full))


@torch.no_grad()
def test_propagation_changes_later_inputs(tiny_dirs):
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()
    prefix, layers = find_decoder_layers(model)
    runner = LayerwiseRunner(model, prefix, layers, calib_ids())
    name = "1.self_attn.q_proj"
    grams = {}
    for propagate in (True, False):
        seen = {}

        def on_layer(li, stats):
            if li == 0:
                layers[0].mlp.down_proj.weight.mul_(0.5)  # "compress" layer 0
            seen.update(stats)
            return li == 0

        runner.run({1: {name: frozenset({"gram"})}}, on_layer, last=1, propagate=propagate, progress=False)
        layers[0].mlp.down_proj.weight.mul_(2.0)
        grams[propagate] = seen[name].gram
    assert not torch.allclose(grams[True], grams[False])
    # without propagation layer 1 sees the dense model's inputs
    dense = {}
    runner.run({1: {name: frozenset({"gram"})}}, lambda li, st: dense.update(st) or False, last=1, progress=False)
    assert torch.allclose(dense[name].gram, grams[False])


def test_same_seed_same_factors(tiny_dirs):
    a = load(tiny_dirs["qwen3"], method="laser", target=0.5, whiten=True, calibration=calib_ids(n=12), calibration_samples=4)
    b = load(tiny_dirs["qwen3"], method="laser", target=0.5, whiten=True, calibration=calib_ids(n=12), calibration_samples=4)
    c = load(tiny_dirs["qwen3"], method="laser", target=0.5, whiten=True, calibration=calib_ids(n=12), calibration_samples=4,
             calibration_seed=1)
    sa, sb, sc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(sa[k].shape != sc[k].shape or not torch.equal(sa[k], sc[k]) for k in sa)


def test_whitened_checkpoint_reloads_without_calibration(tiny_dirs, tmp_path, ids):
    m = load(tiny_dirs["gemma3"], method="laser", target=0.6, whiten=True, calibration=calib_ids())
    m.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.config.quantization_config.calibration == {"described": "token ids (6, 16)"}
    with torch.no_grad():
        assert torch.equal(again(ids).logits, m(ids).logits)


def test_calibration_texts_windows_are_seeded_and_disjoint_from_eval():
    from transformers import AutoTokenizer

    from hf_tensorcomp.assets import load_text, model_path

    tok = AutoTokenizer.from_pretrained(model_path("smollm2"))
    a = calibration_ids("wikipedia", tok, samples=8, length=64, seed=0)
    assert a.shape == (8, 64)
    assert torch.equal(a, calibration_ids("wikipedia", tok, samples=8, length=64, seed=0))
    assert not torch.equal(a, calibration_ids("wikipedia", tok, samples=8, length=64, seed=1))
    own = calibration_ids(["A sentence of my own text, repeated."] * 40, tok, samples=3, length=16, seed=0)
    assert own.shape == (3, 16)
    calib, held_out = load_text("wikipedia", "calib"), load_text("wikipedia", "eval")
    assert not set(calib) & set(held_out)
    with pytest.raises(ValueError, match="calibration_length"):
        calibration_ids(["too short"], tok, samples=1, length=64, seed=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="laser", whiten=True, calibration="wiki"), "calibration"),
    (dict(method="laser", whiten="pca", calibration="wikipedia"), "whiten"),
    (dict(method="laser", rank=0.5, target=0.8), "target"),
    (dict(method="laser", target=1.5), "target"),
    (dict(method="laser", allocation="best", target=0.5), "allocation"),
    (dict(method="laser", calibration=[1, 2]), "calibration"),
    (dict(method="laser", calibration="wikipedia", calibration_samples=0), "calibration_samples"),
    (dict(method="laser", calibration="wikipedia", propagate="yes"), "propagate"),
    (dict(method="rotor", target=0.5, calibration="wikipedia"), "target"),  # a method without a budget
    (dict(method="laser", correct=True, calibration="wikipedia"), "correct"),
    (dict(method="laser", weighting="hessian", calibration="wikipedia"), "weighting"),
    (dict(method="laser", pivoted="yes", target=0.5, calibration="wikipedia"), "pivoted"),
])
def test_bad_calibration_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=f"TensorCompressionConfig.{match}"):
        TensorCompressionConfig(**kwargs)


def test_error_correction_fits_the_dense_outputs():
    """With C = X_denseᵀ X the whitened truncation of W C G⁻¹ matches W X_dense better than plain whitening."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(16, 10, generator=g, dtype=torch.float64)
    xd = torch.randn(300, 10, generator=g, dtype=torch.float64)
    x = xd + 0.3 * torch.randn(300, 10, generator=g, dtype=torch.float64)  # what the compressed model feeds in
    s = whitening_factor(x.T @ x, damping=0.0)
    target = w @ (xd.T @ x) @ torch.cholesky_inverse(s)
    for r in (2, 5, 10):
        uc, vc, _ = whitened_svd(target, r, s)
        up, vp, _ = whitened_svd(w, r, s)
        err = lambda u, v: torch.linalg.norm(xd @ w.T - x @ (u.double() @ v.double()).T)  # noqa: E731
        assert err(uc, vc) < err(up, vp)
    # at full rank it is the least-squares map, whose residual is orthogonal to the inputs
    uc, vc, _ = whitened_svd(target, 10, s)
    resid = xd @ w.T - x @ (uc.double() @ vc.double()).T
    assert torch.linalg.norm(x.T @ resid) < 1e-5 * torch.linalg.norm(x.T @ xd @ w.T)  # factors are float32


@torch.no_grad()
def test_error_correction_exact_at_full_rank(tiny_dirs, ids):
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    full = load(tiny_dirs["llama"], method="laser", rank=1.0, whiten=True, correct=True, damping=0.0,
                calibration=calib_ids(n=12, length=32), calibration_samples=12)  # more tokens than dims: G invertible
    assert rel_err(full(ids).logits, dense(ids).logits) <= 1e-4


@torch.no_grad()
def test_cross_statistics_pair_dense_and_compressed_inputs(tiny_dirs):
    """"cross" is X_denseᵀ X on the same tokens: the dense stream is carried beside the compressed one."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()
    prefix, layers = find_decoder_layers(model)
    x = calib_ids()
    runner = LayerwiseRunner(model, prefix, layers, x, batch_size=4)
    name = "1.mlp.down_proj"
    rows = {}

    def grab(tag):
        return layers[1].mlp.down_proj.register_forward_hook(
            lambda m, a, o: rows.setdefault(tag, []).append(a[0].reshape(-1, a[0].shape[-1])))

    h = grab("dense")
    model(input_ids=x, use_cache=False)
    h.remove()
    seen = {}

    def on_layer(li, stats):
        seen.update(stats)
        if li == 0:
            layers[0].mlp.up_proj.weight.mul_(0.5)
        return li == 0

    runner.run({1: {name: frozenset({"gram", "cross"})}}, on_layer, last=1, progress=False)
    h = grab("compressed")
    model(input_ids=x, use_cache=False)
    h.remove()
    xd, xc = torch.cat(rows["dense"]).double(), torch.cat(rows["compressed"]).double()
    assert torch.allclose(seen[name].cross, xd.T @ xc, rtol=1e-4, atol=1e-4)
    assert torch.allclose(seen[name].gram, xc.T @ xc, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(seen[name].cross, seen[name].gram, rtol=1e-3)


def test_model_card_reports_the_budget(tiny_dirs):
    from hf_tensorcomp import model_card

    m = load(tiny_dirs["llama"], method="laser", target=0.6, whiten=True, calibration=calib_ids())
    card = model_card(m)
    a = m.config.quantization_config.stats["allocation"]["0"]
    assert f"target 0.6 of {a['params_targeted']:,} parameters, kept {a['params_kept']:,}" in card
    assert f"{len(a['kept_dense'])} matrices left dense" in card


def test_calibration_tokenizer_accepts_a_path_object_as_well_as_a_string(tiny_with_tokenizer):
    """A pathlib.Path to a tokenizer's folder is loaded like the same path as a string (not used as a tokenizer)."""
    from pathlib import Path

    from hf_tensorcomp.calibration.data import calibration_tokenizer

    texts = ["w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"]
    by_str = calibration_tokenizer(None, texts, str(tiny_with_tokenizer))
    by_path = calibration_tokenizer(None, texts, Path(tiny_with_tokenizer))
    assert calibration_ids(texts, by_path, 2, 4, 0).tolist() == calibration_ids(texts, by_str, 2, 4, 0).tolist()
    assert calibration_ids(texts, by_path, 2, 4, 0).shape == (2, 4)


def test_module_stats_move_their_sums_to_the_layers_device_and_keep_the_rows():
    """The summed statistics (float64, gathered on the host) go where the layer is; the rows stay on the host.
    ("meta" stands in for an accelerator here: tests/test_gpu.py runs the real thing.)"""
    from hf_tensorcomp.calibration.stats import ModuleStats

    st = ModuleStats({"gram", "abs_mean", "cross", "inputs"})
    x = torch.randn(7, 5)
    st.add(x)
    st.fisher, st.weight_grad = torch.rand(3), {"weight": torch.rand(3, 5)}
    want = x.double().T @ x.double()
    assert torch.allclose(st.gram, want) and st.gram.dtype == torch.float64
    st.to("meta")
    for t in (st.gram, st.cross, st.abs_mean, st.fisher, st.weight_grad["weight"]):
        assert t.device.type == "meta"
    assert st.inputs.device.type == "cpu" and torch.equal(st.inputs, x)


def test_relative_allocation_ignores_the_fisher_scale():
    """allocation="relative" compares relative errors even when weighting="fisher" gathered the Fisher (for the
    SVD): scaling the Fisher leaves its ladder unchanged, while the global rule's losses scale with it."""
    from hf_tensorcomp.calibration.stats import ModuleStats
    from hf_tensorcomp.methods.base import get_method

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(12, 10, bias=False)
    lin.weight.data = torch.randn(10, 12, generator=g)
    x = torch.randn(100, 12, generator=g) * torch.logspace(-1, 1, 12)
    fisher = torch.rand(10, generator=g, dtype=torch.float64) + 0.1
    laser = get_method("laser")
    losses = {}
    for allocation in ("global", "relative"):
        entry = TensorCompressionConfig(method="laser", target=0.8, whiten=True, weighting="fisher",
                                        allocation=allocation, calibration=["x"]).entries[0]
        for scale in (1.0, 100.0):
            st = ModuleStats({"gram"})
            st.add(x)
            st.fisher = fisher * scale
            ctx = Context(config=None, prefix="", n_layers=0, allocation=laser.start_allocation(entry))
            losses[allocation, scale] = laser.ladder("m", lin, st, entry, ctx).losses
    assert losses["relative", 1.0] == pytest.approx(losses["relative", 100.0])
    assert losses["relative", 1.0][0] < 1.0 and losses["relative", 1.0][-1] == 0.0  # fractions of the whole
    assert losses["global", 100.0][0] == pytest.approx(100.0 * losses["global", 1.0][0])
