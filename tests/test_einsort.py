"""EinSort: sorted tensorization math (methods.einsort.decomposition / decompositions.tensor_networks) and the einsort weight method."""

import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hf_tensorcomp import TensorCompressionConfig
from hf_tensorcomp.methods.einsort import decomposition as einsort
from hf_tensorcomp.decompositions.tensor_networks import bond_ranks, decompose, fit_network, gauge_fix
from hf_tensorcomp.methods.einsort import EinSortLinear
from hf_tensorcomp.methods.einsort import activation_scales, save_activation_scales

from tiny import ARCHS, rel_err


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


SORTS = {"none": {}, "shared": {"sort_axis": -1, "reduce_over": 1}, "full": {"sort_axis": -1}}


# ------------------------------------------------------------------------------------------------
# exactness
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("network", ["svd", "tt", "tr", "tucker"])
@pytest.mark.parametrize("sort", list(SORTS))
@pytest.mark.parametrize("nonnegative, gauge", [(False, None), (True, "block_identity"), (True, "canonical")])
def test_exact_at_full_rank(network, sort, nonnegative, gauge):
    x = randn(2, 4, 6, 5)
    a = einsort.fit(x, network, 10_000, mapping=("pow", 0.5), reduction="prod", nonnegative=nonnegative, gauge=gauge,
                    **SORTS[sort])
    assert a.relative_error(x) < 1e-5
    if nonnegative:  # the signs really came back from the bits: the decomposed tensor was all >= 0
        assert (a.network.contract() >= -1e-4).all()


def test_cp_reaches_a_tensor_of_cp_rank_r():
    g = torch.Generator().manual_seed(0)
    factors = [torch.randn(n, 3, generator=g) for n in (6, 5, 4)]
    x = torch.einsum("ir,jr,kr->ijk", *factors)
    als = einsort.fit(x, "cp", 3, n_iter_max=500, tol=1e-12, gauge="canonical")
    assert als.relative_error(x) < 2e-3  # ALS stalls slightly short of exact here ...
    tuned = einsort.fit(x, "cp", 3, n_iter_max=500, tol=1e-12, gauge="canonical", steps=300, lr=0.01)
    assert tuned.relative_error(x) < 1e-5  # ... and the gradient steps on the einsum finish the job


@pytest.mark.parametrize("mapping", ["linear", ("pow", 0.5), ("pow", 0.7), ("exp", 1.0), ("add_log", 1.0), ("mul_log", 1e4)])
def test_every_mapping_is_inverted_on_reconstruction(mapping):
    x = randn(6, 8) * 0.5
    x = x.sign() * x.abs().clamp_min(1e-3)  # mul_log's clamp floor (4.4e-5 / p) stays below every |x|
    a = einsort.fit(x, "svd", 6, sort_axis=1, reduce_over=None, mapping=mapping, nonnegative=True)
    assert a.relative_error(x) < 1e-5


# ------------------------------------------------------------------------------------------------
# permutations and bits
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 8, 100, 577])
def test_permutation_indices_round_trip_through_their_bits(n):
    perms = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(s)) for s in range(7)])
    w = einsort.index_bits(n)
    assert w == (math.ceil(math.log2(n)) if n > 1 else 0)
    packed = einsort.pack_bits(einsort.to_bits(perms, w))
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(perms.numel() * w / 8)
    back = einsort.from_bits(einsort.unpack_bits(packed, perms.numel() * w), w, perms.numel()).reshape(perms.shape)
    assert torch.equal(back, perms)


def test_sign_bits_round_trip_exactly():
    x = randn(3, 5, 7)
    x[0, 0, :3] = 0.0  # zeros count as positive
    packed = einsort.pack_signs(x)
    assert packed.numel() == math.ceil(x.numel() / 8)
    signs = einsort.unpack_signs(packed, x.shape)
    assert torch.equal(signs * x.abs(), x)


def test_sorting_is_reversible_and_shared_along_the_reduced_axis():
    x = randn(2, 4, 16, 8)  # (batch, kv_heads, tokens, head_dim): the KV-cache segment layout
    perm = einsort.sort_permutation(x, sort_axis=-1, reduce_over=1, mapping=("pow", 0.5), reduction="prod", nonnegative=True)
    assert perm.shape == (2, 1, 16, 8)  # one head_dim permutation per (batch, token), shared by the 4 heads
    y = einsort.apply_permutation(x, perm, 3)
    assert torch.equal(einsort.invert_permutation(y, perm, 3), x)
    metric = einsort.reduce(x.abs().pow(0.5), (1,), "prod")
    assert (metric.gather(3, perm).diff(dim=3) >= 0).all()  # sorted by the reduced metric
    full = einsort.sort_permutation(x, sort_axis=-1)
    assert full.shape == x.shape and (einsort.apply_permutation(x, full, 3).diff(dim=3) >= 0).all()


@pytest.mark.parametrize("how, ref", [("mean", lambda t: t.mean(1)), ("max", lambda t: t.amax(1)), ("min", lambda t: t.amin(1)),
                                      ("median", lambda t: t.median(1).values), ("std", lambda t: t.std(1, correction=0))])
def test_reductions_match_torch(how, ref):
    x = randn(5, 3, 7)
    assert torch.allclose(einsort.reduce(x, (1,), how), ref(x)[:, None], atol=1e-6)


def test_prod_reduction_orders_like_the_product():
    x = randn(40, 3).abs() + 0.1
    x[::3, 0] *= -1
    assert torch.equal(torch.argsort(einsort.reduce(x, (1,), "prod")[:, 0]), torch.argsort(x.prod(1)))
    long = randn(8, 4000).abs()  # a product of 4000 values would underflow; the order still holds
    assert torch.isfinite(einsort.reduce(long, (1,), "prod")).all()


def test_to_dict_from_dict_is_exact_and_storage_is_what_is_stored():
    x = randn(2, 4, 16, 8)
    a = einsort.fit(x, "tt", 4, sort_axis=-1, reduce_over=1, nonnegative=True, gauge="block_identity", dtype=torch.bfloat16)
    tensors, meta = a.to_dict()
    json.dumps(meta)  # JSON-able
    assert set(tensors) == {"cores", "pivots", "perm", "signs"}
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == einsort.EinSortTensor.tensor_specs(meta)
    b = einsort.EinSortTensor.from_dict({k: v.clone() for k, v in tensors.items()}, meta)
    assert torch.equal(b.perm, a.perm) and torch.equal(b.signs, a.signs)
    assert torch.equal(b.reconstruct(), a.reconstruct())
    st = a.storage()
    assert st["total"] == a.nbytes() == sum(t.numel() * t.element_size() for t in tensors.values())
    assert st["perm"] == math.ceil(2 * 16 * 8 * 3 / 8)  # 256 indices of ceil(log2 8) = 3 bits
    assert st["signs"] == x.numel() // 8
    assert st["factors"] == tensors["cores"].numel() * 2  # bfloat16


# ------------------------------------------------------------------------------------------------
# the paper's theory: Lemma D.1 and Proposition D.2
# ------------------------------------------------------------------------------------------------

def _rank1_error(m):
    s = torch.linalg.svdvals(m)
    return (s[1:].pow(2).sum() / s.pow(2).sum()).sqrt().item()


@pytest.mark.parametrize("dist", ["uniform", "normal", "laplace"])
def test_row_sorted_iid_matrix_is_near_rank_one(dist):
    """Lemma D.1: sorting every row of an i.i.d. matrix leaves ~ mean-quantile rank-one structure."""
    g = torch.Generator().manual_seed(0)
    m = {"uniform": torch.rand(200, 400, generator=g) * 2 - 1, "normal": torch.randn(200, 400, generator=g),
         "laplace": torch.distributions.Laplace(0, 1).icdf(torch.rand(200, 400, generator=g).clamp(1e-6, 1 - 1e-6))}[dist]
    perm = einsort.sort_permutation(m, sort_axis=1)  # full sorting: one permutation per row
    sorted_m = einsort.apply_permutation(m, perm, 1)
    assert _rank1_error(sorted_m) < 0.15  # heavy-tailed Laplace converges slowest (0.11 here; normal 0.07)
    assert _rank1_error(m) > 0.9
    a = einsort.fit(m, "svd", 1, sort_axis=1)
    b = einsort.fit(m, "svd", 1)
    assert a.relative_error(m) < 0.15 < 0.9 < b.relative_error(m)


def test_independent_row_and_column_permutations_leave_singular_values_unchanged():
    """Proposition D.2: P_r W P_c has W's singular values, so one permutation per axis cannot help SVD."""
    w = randn(30, 50)
    rows = einsort.sort_permutation(w, sort_axis=0, reduce_over=1, reduction="mean")  # one row order for all columns
    cols = einsort.sort_permutation(w, sort_axis=1, reduce_over=0, reduction="max")  # one column order for all rows
    assert rows.shape == (30, 1) and cols.shape == (1, 50)
    p = einsort.apply_permutation(einsort.apply_permutation(w, rows, 0), cols, 1)
    assert not torch.equal(p, w)
    assert torch.allclose(torch.linalg.svdvals(p), torch.linalg.svdvals(w), atol=1e-4)
    plain = einsort.fit(w, "svd", 5).relative_error(w)
    globally_sorted = einsort.fit(w, "svd", 5, sort_axis=1, reduce_over=0).relative_error(w)
    assert globally_sorted == pytest.approx(plain, rel=1e-4)


# ------------------------------------------------------------------------------------------------
# gauge, budget, refinement
# ------------------------------------------------------------------------------------------------

def test_block_identity_gauge_stores_fewer_entries_and_keeps_the_value():
    y = randn(6, 7, 8)
    net = decompose(y, "tt", 4)
    fixed = gauge_fix(net, "block_identity")
    assert torch.allclose(fixed.contract(), net.contract(), atol=1e-4)
    r = bond_ranks("tt", y.shape, 4)  # [1, 4, 4, 1]
    entries, _ = fixed.entries_and_bits()
    assert entries == sum(c.numel() for c in net.cores) - sum(k * k for k in r[1:-1])
    for k, piv in enumerate(fixed.pivots):
        if piv is not None:
            m = fixed.cores[k].reshape(-1, fixed.cores[k].shape[-1])
            assert torch.equal(m[piv], torch.eye(m.shape[1]))
    canon = gauge_fix(net, "canonical")
    q = canon.cores[0].reshape(-1, canon.cores[0].shape[-1])
    assert torch.allclose(q.T @ q, torch.eye(q.shape[1]), atol=1e-5)
    assert torch.allclose(canon.contract(), net.contract(), atol=1e-4)


@pytest.mark.parametrize("network", ["svd", "tt", "tr", "cp", "tucker"])
def test_byte_budget_picks_the_largest_rank_that_fits(network):
    x = randn(8, 12, 16)
    kw = dict(sort_axis=2, reduce_over=1, nonnegative=True, dtype=torch.bfloat16,
              gauge=None if network == "cp" else "block_identity", fold=(96, 16) if network == "svd" else None)
    a = einsort.fit(x, network, 0.3, **kw)
    budget = int(0.3 * x.numel() * 2)
    assert a.nbytes() <= budget
    over = einsort.overhead_bytes(x.shape, 2, 1, True)
    r = einsort.rank_for_budget(budget, network, a.network.shape, kw["gauge"], torch.bfloat16, over)
    assert einsort.network_bytes(network, a.network.shape, r + 1, kw["gauge"], torch.bfloat16) + over > budget \
        or bond_ranks(network, a.network.shape, r + 1) == bond_ranks(network, a.network.shape, r)
    with pytest.raises(ValueError, match="rank.*permutation and sign bits alone"):
        einsort.fit(x, network, 0.05, **{**kw, "reduce_over": None})


@pytest.mark.parametrize("network", ["tt", "cp"])
def test_gradient_refinement_never_worsens_the_fit(network):
    y = randn(6, 7, 8)
    base = fit_network(y, network, 3, n_iter_max=5)
    tuned = fit_network(y, network, 3, n_iter_max=5, steps=40, lr=0.05)
    err = lambda n: ((n.contract() - y).norm() / y.norm()).item()  # noqa: E731
    assert err(tuned) <= err(base) + 1e-6


def test_fit_of_a_kv_segment_is_fast():
    """A 64-token segment of one layer's cache (8 KV heads, head_dim 128) fits in milliseconds (~10 ms idle)."""
    import time

    x = randn(1, 8, 64, 128)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: one thread (and no stalls when the CPU is shared)
    try:
        einsort.fit(x, "svd", 8, sort_axis=-1, reduce_over=1, nonnegative=True, gauge="block_identity")
        t0 = time.perf_counter()
        for _ in range(5):
            a = einsort.fit(x, "svd", 8, sort_axis=-1, reduce_over=1, nonnegative=True, gauge="block_identity")
            a.reconstruct()
        assert (time.perf_counter() - t0) / 5 < 0.5
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kw, field", [
    ({"network": "mps"}, "network"), ({"reduction": "sum"}, "reduction"), ({"mapping": ("pow", -1)}, "mapping"),
    ({"mapping": "sqrt"}, "mapping"), ({"sort_axis": 1, "reduce_over": 1}, "reduce_over"), ({"sort_axis": 5}, "sort_axis"),
    ({"network": "cp", "gauge": "block_identity"}, "gauge"), ({"fold": (7, 7)}, "fold"), ({"rank": 1.5}, "rank"),
    ({"reduce_over": 0}, "reduce_over"),
])
def test_bad_fit_arguments_name_the_field(kw, field):
    kw = {"network": "svd", "rank": 2, **kw}
    with pytest.raises(ValueError, match=f"{field}.*allowed"):
        einsort.fit(randn(4, 6), kw.pop("network"), kw.pop("rank"), **kw)


# ------------------------------------------------------------------------------------------------
# the weight method through the quantizer
# ------------------------------------------------------------------------------------------------

def load(path, **cfg):
    cfg.setdefault("progress", False)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=TensorCompressionConfig(method="einsort", **cfg))


@torch.no_grad()
@pytest.mark.parametrize("arch, opts", [  # every layout once, every architecture at least once
    ("llama", {"sort": "shared", "network": "svd"}), ("qwen3", {"sort": "full", "network": "svd", "sort_dim": "out"}),
    ("gemma3", {"sort": "none", "network": "tt", "nonnegative": False}),
    ("llama", {"sort": "shared", "network": "tucker", "group": 4}),
])
def test_method_full_rank_is_exact(arch, opts, tiny_dirs, ids):
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch])
    m = load(tiny_dirs[arch], rank=10_000 if opts["network"] != "svd" else 48, targets=["mlp.*"], **opts)
    assert sum(isinstance(x, EinSortLinear) for x in m.modules()) == 3 * 3
    assert rel_err(m(ids).logits, dense(ids).logits) < 1e-4


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHS)
def test_save_reload_identical_logits_and_bits_in_safetensors(arch, tiny_dirs, tmp_path, ids):
    m = load(tiny_dirs[arch], target=0.5, network="svd", factor_dtype="bfloat16")
    m.save_pretrained(tmp_path)
    again, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert torch.equal(again(ids).logits, m(ids).logits)
    a, b = m.model.layers[1].mlp.up_proj, again.model.layers[1].mlp.up_proj
    assert torch.equal(a.perm, b.perm) and torch.equal(a.signs, b.signs) and b.weight.dtype == torch.bfloat16
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.1.mlp.up_proj.perm").get_dtype() == "U8"
    assert {"model.layers.1.mlp.up_proj.perm", "model.layers.1.mlp.up_proj.signs",
            "model.layers.1.mlp.up_proj.pivots", "model.layers.1.mlp.up_proj.weight"} <= keys
    for name, st in m.config.quantization_config.stats["modules"].items():
        assert st["byte_ratio"] <= 0.5 and st["bytes"] == m.get_submodule(name).nbytes()


def test_loading_without_import_fails_loudly(tiny_dirs, tmp_path):
    """Each EinSort layer stores a tensor under the dense weight's name with another shape, which is what makes
    transformers without hf_tensorcomp stop with a size mismatch (checked end to end in test_save_reload)."""
    m = load(tiny_dirs["llama"], rank=4, targets=["mlp.*"])
    m.save_pretrained(tmp_path)
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).state_dict()
    names = [n for n, spec in m.config.quantization_config.compressed_modules.items() if spec["layer"] == "einsort_linear"]
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert len(names) == 9 and all(f.get_slice(f"{n}.weight").get_shape() != list(dense[f"{n}.weight"].shape)
                                       for n in names)


@torch.no_grad()
def test_dense_mode_writes_the_approximation(tiny_dirs, ids):
    fac = load(tiny_dirs["llama"], target=0.4, targets=["mlp.*"], network="tr")
    den = load(tiny_dirs["llama"], target=0.4, targets=["mlp.*"], network="tr", mode="dense")
    assert not any(isinstance(x, EinSortLinear) for x in den.modules())
    assert rel_err(fac(ids).logits, den(ids).logits) < 1e-5


@pytest.mark.parametrize("cfg, field", [
    ({"network": "peps"}, "network"), ({"sort": "partial"}, "sort"), ({"group": 0}, "group"), ({"group": 7}, "group"),
    ({"reduction": "sum"}, "reduction"), ({"mapping": ["pow", 0]}, "mapping"), ({"network": "cp", "gauge": "block_identity"}, "gauge"),
    ({"sort": "full", "target": 0.3}, "target"), ({"rank": 0.3}, "rank"), ({"rank": 49, "targets": ["mlp.*"]}, "rank"), ({"fold": [5, 5]}, "fold"),
    ({"activation_scales": "/nonexistent.safetensors"}, "activation_scales"), ({"factor_dtype": "int8"}, "factor_dtype"),
    ({"cache_weight": "yes"}, "cache_weight"),
])
def test_bad_config_fails_before_weights_load(cfg, field, tiny_dirs):
    with pytest.raises(ValueError) as e:
        load(tiny_dirs["llama"], **cfg)
    assert field in str(e.value) and "allowed" in str(e.value)


def test_weight_is_rebuilt_once_and_after_a_move_or_change(tiny_dirs, tmp_path, ids, monkeypatch):
    m = load(tiny_dirs["llama"], target=0.5, targets=["mlp.*"], network="svd")
    lin = m.model.layers[0].mlp.up_proj
    builds = []
    real = EinSortLinear._weight_fp32
    monkeypatch.setattr(EinSortLinear, "_weight_fp32", lambda self: builds.append(self) or real(self))
    with torch.no_grad():
        ref = m(ids).logits
        assert len(builds) == 9 and torch.equal(m(ids).logits, ref) and len(builds) == 9  # kept: no rebuild
        assert lin.cached_nbytes() == lin.out_features * lin.in_features * 4
        x = torch.randn(3, lin.in_features)
        y = lin(x)
        lin.double()  # a dtype move drops the kept weight; the next forward rebuilds it from the moved tensors
        assert lin.cached_nbytes() == 0 and torch.allclose(lin(x.double()), y.double(), atol=1e-5) and len(builds) == 10
        lin.float()
        lin.weight.mul_(2)  # a change of the stored factors is seen
        assert not torch.equal(m(ids).logits, ref) and len(builds) == 11
        lin.weight.div_(2)
        for x in m.modules():  # today's rebuild-per-call: same logits, nothing kept
            if isinstance(x, EinSortLinear):
                x.cache_weight = False
        assert torch.equal(m(ids).logits, ref) and len(builds) == 20 and lin.cached_nbytes() == 0
        m(ids)
        assert len(builds) == 29
    with torch.inference_mode():  # a model loaded under inference mode: its tensors carry no version counter
        inf = load(tiny_dirs["llama"], target=0.5, targets=["mlp.*"], network="svd")
        assert torch.equal(inf(ids).logits, inf(ids).logits)
    off = load(tiny_dirs["llama"], target=0.5, targets=["mlp.*"], network="svd", cache_weight=False)
    off.save_pretrained(tmp_path)  # the choice is saved with the checkpoint
    assert not AutoModelForCausalLM.from_pretrained(tmp_path).model.layers[0].mlp.up_proj.cache_weight


class _Tok:
    """Stands in for a tokenizer: text -> ids below the tiny vocabulary."""

    def __call__(self, text, return_tensors=None):
        class Out:
            input_ids = torch.tensor([[ord(c) % 101 for c in text]])
        return Out()


@torch.no_grad()
def test_activation_aware_scaling_is_saved_and_exact_at_full_rank(tiny_dirs, tmp_path, ids):
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    scales = activation_scales(dense, _Tok(), texts=["the quick brown fox jumps over the lazy dog"] * 4, context_length=32)
    assert scales["model.layers.0.mlp.up_proj"].shape == (48,) and (scales["model.layers.0.mlp.up_proj"] > 0).all()
    path = save_activation_scales(scales, tmp_path / "scales.safetensors")
    m = load(tiny_dirs["llama"], rank=48, targets=["mlp.*"], activation_scales=path)
    assert m.model.layers[0].mlp.up_proj.in_scale is not None
    assert rel_err(m(ids).logits, dense(ids).logits) < 1e-4
    m.save_pretrained(tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(again(ids).logits, m(ids).logits)
    low = load(tiny_dirs["llama"], target=0.5, targets=["mlp.*"], activation_scales=path)
    for st in low.config.quantization_config.stats["modules"].values():
        assert st["byte_ratio"] <= 0.5  # the scale vector is paid for from the same budget


def test_activation_scales_from_the_calibration_pipeline(tiny_dirs, tmp_path, ids):
    """activation_scales="calibration" gives the same model as a scales file of the same mean |x|."""
    from hf_tensorcomp.methods.einsort import save_activation_scales

    calib = torch.randint(0, 101, (4, 16), generator=torch.Generator().manual_seed(2))
    a = load(tiny_dirs["llama"], target=0.5, targets=["mlp.*"], layers=[0], activation_scales="calibration",
             calibration=calib, propagate=False)
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    seen = {}
    hooks = [dense.model.layers[0].mlp.get_submodule(n).register_forward_hook(
        lambda m, args, out, n=n: seen.setdefault(n, []).append(args[0].reshape(-1, args[0].shape[-1]).abs()))
        for n in ("gate_proj", "up_proj", "down_proj")]
    with torch.no_grad():
        dense(input_ids=calib)
    for h in hooks:
        h.remove()
    path = save_activation_scales({f"model.layers.0.mlp.{n}": torch.cat(v).mean(0) for n, v in seen.items()},
                                  tmp_path / "s.safetensors")
    b = load(tiny_dirs["llama"], target=0.5, targets=["mlp.*"], layers=[0], activation_scales=path)
    a.save_pretrained(tmp_path / "a")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "a")  # reloads without calibration data
    with torch.no_grad():
        assert rel_err(a(ids).logits, b(ids).logits) < 1e-4
        assert torch.equal(again(ids).logits, a(ids).logits)
    # activation scales read calibration text: none named gives both bundled corpora
    assert TensorCompressionConfig(method="einsort", activation_scales="calibration").calibration == "wikipedia+owt"
