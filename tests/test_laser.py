"""LASER through the quantizer: exactness, modes, dtypes, selection, closed-form error, bad input."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_tensorcomp
from hf_tensorcomp import LowRankLinear, TensorCompressionConfig
from hf_tensorcomp.decompositions import truncated_svd
from hf_tensorcomp.decompositions.rrqr import _greedy_pivots, pivot_order

from tiny import ARCHS, rel_err, reloads_identically


def load(path, **cfg):
    cfg.setdefault("progress", False)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=TensorCompressionConfig(**cfg))


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHS)
def test_full_rank_is_exact(arch, tiny_dirs, ids):
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch])
    comp = load(tiny_dirs[arch], method="laser", rank=1.0)
    n_factored = sum(isinstance(m, LowRankLinear) for m in comp.modules())
    assert n_factored == 3 * 7  # q,k,v,o,gate,up,down in every layer
    assert rel_err(comp(ids).logits, dense(ids).logits) <= 1e-4


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHS)
def test_factorized_and_dense_modes_agree(arch, tiny_dirs, ids):
    fac = load(tiny_dirs[arch], method="laser", rank=5)
    den = load(tiny_dirs[arch], method="laser", rank=5, mode="dense")
    assert not any(isinstance(m, LowRankLinear) for m in den.modules())
    w = den.model.layers[0].mlp.down_proj.weight
    assert torch.linalg.matrix_rank(w).item() == 5
    assert rel_err(fac(ids).logits, den(ids).logits) <= 1e-5
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch])
    assert rel_err(fac(ids).logits, dense(ids).logits) > 1e-3  # rank 5 really changed something


def test_truncated_svd_matches_eckart_young():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 30, generator=g)
    s = torch.linalg.svdvals(w)
    errs = []
    for r in (1, 5, 10, 20, 30):
        u, v = truncated_svd(w, r)
        err = torch.linalg.matrix_norm(w - u @ v).item()
        assert err == pytest.approx(s[r:].pow(2).sum().sqrt().item(), rel=1e-4, abs=1e-4)
        errs.append(err)
    assert errs == sorted(errs, reverse=True) and errs[-1] < 1e-4


@torch.no_grad()
@pytest.mark.parametrize("shape", [(40, 30, 7), (12, 50, 11), (20, 20, 19)])
def test_pivoted_form_is_the_same_product_with_fewer_numbers(shape):
    out, inp, r = shape
    g = torch.Generator().manual_seed(1)
    u, v, b = torch.randn(out, r, generator=g), torch.randn(r, inp, generator=g), torch.randn(out, generator=g)
    plain, piv = LowRankLinear.from_factors(u, v, b), LowRankLinear.pivoted_from_factors(u, v, b)
    assert piv.weight.numel() == r * (inp + out - r) < plain.weight.numel()
    assert sorted(piv.pivots.tolist()) == list(range(inp))  # a permutation of the inputs
    assert torch.allclose(piv.v[:, piv.pivots[:r].long()], torch.eye(r))  # r columns of V are the identity
    x = torch.randn(3, 5, inp, generator=g)
    assert rel_err(piv(x), plain(x)) < 1e-5 and rel_err(piv.dense_weight(), u @ v) < 1e-5
    # merging LoRA factors (append) leaves the plain form computing the sum; truncating gives the product back
    a, c = torch.randn(out, 2, generator=g), torch.randn(2, inp, generator=g)
    before = piv(x)
    piv.append_factors(a, c)
    assert piv.pivots is None and piv.rank == r + 2
    assert rel_err(piv(x), before + x @ (a @ c).T) < 1e-5
    piv.truncate(r)
    assert rel_err(piv(x), before) < 1e-5
    with pytest.raises(ValueError, match="LowRankLinear.rank"):
        LowRankLinear(inp, out, min(inp, out), pivoted=True)


@pytest.mark.parametrize("shape", [(6, 40), (40, 40), (25, 300), (50, 20)])
def test_pivot_order_is_qr_with_column_pivoting(shape):
    """The CPU path (LAPACK's geqp3) picks the greedy rule's columns — the largest residual norm first —, in order:
    the rule the loop for other devices implements."""
    g = torch.Generator().manual_seed(2)
    a = torch.randn(*shape, generator=g, dtype=torch.float64) * torch.logspace(0, -2, shape[1], dtype=torch.float64)
    k = min(shape)
    got = pivot_order(a, k)
    assert got == _greedy_pivots(a, k) and len(set(got)) == k
    assert got[0] == int(a.norm(dim=0).argmax())
    assert pivot_order(a.float(), k) == got  # any floating dtype


def test_pivoted_model_saves_and_reloads(tiny_dirs, tmp_path, ids):
    model = load(tiny_dirs["llama"], method="laser", rank=5)  # pivoted: the default
    spec = model.config.quantization_config.stats["modules"]
    assert spec and all(s["rank"] == 5 for s in spec.values())
    again = reloads_identically(model, tmp_path / "piv", ids)
    mods = [m for m in again.modules() if isinstance(m, LowRankLinear)]
    assert len(mods) == 21 and all(m.pivots is not None and m.weight.shape[0] == 5 for m in mods)
    plain = load(tiny_dirs["llama"], method="laser", rank=5, pivoted=False)
    assert all(m.pivots is None and m.weight.shape == (5, m.in_features + m.out_features)
               for m in plain.modules() if isinstance(m, LowRankLinear))
    with torch.no_grad():
        assert rel_err(again(ids).logits, plain(ids).logits) < 1e-4  # the same rank-5 products
    # a checkpoint written before the option existed (its entry without "pivoted") loads as it was made: plain
    plain.save_pretrained(tmp_path / "old")
    path = tmp_path / "old" / "config.json"
    cfg = json.loads(path.read_text())
    for entry in cfg["quantization_config"]["entries"]:
        del entry["pivoted"]
    path.write_text(json.dumps(cfg))
    old = AutoModelForCausalLM.from_pretrained(tmp_path / "old")
    assert old.config.quantization_config.entries[0].options["pivoted"] is False
    assert all(m.pivots is None for m in old.modules() if isinstance(m, LowRankLinear))
    with torch.no_grad():
        assert torch.equal(old(ids).logits, plain(ids).logits)


def test_error_decreases_with_rank_and_stats_recorded(tiny_dirs, ids):
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    ref = dense(ids).logits.detach()
    errs = []
    for r in (2, 8, 24):
        m = load(tiny_dirs["llama"], method="laser", rank=r, targets=["mlp.*"])
        st = m.config.quantization_config.stats
        assert st["params_after"] < st["params_before"] or r == 24
        mod = st["modules"]["model.layers.0.mlp.up_proj"]
        assert mod["rank"] == r
        errs.append(rel_err(m(ids).logits.detach(), ref))
    assert errs[0] > errs[1] > errs[2]


def test_layers_and_targets_select_modules(tiny_dirs):
    m = load(tiny_dirs["llama"], method="laser", rank=0.5, targets=["mlp.down_proj", "self_attn.q_proj"], layers=[-1])
    factored = sorted(n for n, mod in m.named_modules() if isinstance(mod, LowRankLinear))
    assert factored == ["model.layers.2.mlp.down_proj", "model.layers.2.self_attn.q_proj"]
    # fraction of full rank, per matrix: down_proj is 48x96 (full 48), q_proj 48x48 (full 48)
    assert m.model.layers[2].mlp.down_proj.rank == 24
    assert isinstance(m.model.layers[1].mlp.down_proj, torch.nn.Linear)


def test_several_entries_in_one_config(tiny_dirs):
    cfg = TensorCompressionConfig(progress=False, entries=[
        {"method": "laser", "rank": 4, "targets": ["self_attn.*"], "layers": [0]},
        {"method": "laser", "rank": 0.5, "targets": ["mlp.*"], "layers": [0], "mode": "dense"},
    ])
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg)
    assert m.model.layers[0].self_attn.k_proj.rank == 4
    assert type(m.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert torch.linalg.matrix_rank(m.model.layers[0].mlp.up_proj.weight.detach()).item() == 24


@pytest.mark.parametrize(
    "cfg, field",
    [
        ({"layers": [3]}, "layers"),
        ({"layers": [-4]}, "layers"),
        ({"targets": ["mlp.nonexistent"]}, "targets"),
        ({"rank": 49, "targets": ["self_attn.q_proj"]}, "rank"),
        ({"entries": [{"method": "laser", "targets": ["mlp.*"]}, {"method": "laser", "targets": ["mlp.up_proj"]}]}, "entries"),
    ],
)
def test_bad_plan_fails_before_weights_load(cfg, field, tiny_dirs):
    with pytest.raises(ValueError) as e:
        load(tiny_dirs["llama"], **cfg)
    assert field in str(e.value) and "allowed" in str(e.value)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_decomposed_in_fp32(dtype, tiny_dirs, ids):
    m16 = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=dtype,
                                               quantization_config=TensorCompressionConfig(rank=6, progress=False))
    m32 = load(tiny_dirs["llama"], rank=6)
    lr = m16.model.layers[0].mlp.up_proj
    assert lr.weight.dtype == dtype
    ref = m32.model.layers[0].mlp.up_proj.weight
    assert torch.allclose(lr.weight.float(), ref, atol=2e-2, rtol=2e-2)
    assert rel_err(m16(ids).logits, m32(ids).logits) < 5e-2


def test_compression_config_spelling(tiny_dirs, ids):
    cfg = TensorCompressionConfig(rank=3, progress=False)
    a = hf_tensorcomp.AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen3"], compression_config=cfg)
    b = load(tiny_dirs["qwen3"], rank=3)
    assert torch.equal(a(ids).logits, b(ids).logits)
    with pytest.raises(ValueError, match="not both"):
        hf_tensorcomp.AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen3"], compression_config=cfg, quantization_config=cfg)
