"""TRAWL: stacking (incl. grouped-query K/V), CP/Tucker exactness, modes, formulations, save/reload, sweep."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hf_tensorcomp import TensorCompressionConfig
from hf_tensorcomp.decompositions import cp_als, relative_error, tucker_hooi
from hf_tensorcomp.layers import SharedFactors, TensorSlice
from hf_tensorcomp.methods.trawl import stack, stacking_plan
from hf_tensorcomp.sweep import layer_sweep
from tiny import ARCHS, rel_err, reloads_without_option


def load(path, **cfg):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=TensorCompressionConfig(method="trawl", progress=False, **cfg))


def test_cp_recovers_known_rank_and_is_deterministic():
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.linalg.qr(torch.randn(n, 3, generator=g))[0] * torch.tensor([3.0, 2.0, 1.0]) for n in (4, 30, 20))
    t = torch.einsum("ir,jr,kr->ijk", a, b, c)
    cp = cp_als(t, 3, n_iter_max=300, tol=1e-10)
    assert relative_error(t, cp.reconstruct()) < 1e-4
    x = torch.randn(4, 30, 20, generator=g)
    one, two = cp_als(x, 5, seed=7), cp_als(x, 5, seed=7)
    assert all(torch.equal(p, q) for p, q in zip(one.weights_folded, two.weights_folded))
    assert relative_error(x, tucker_hooi(x, (4, 30, 20)).reconstruct()) < 1e-5


def test_gqa_kv_stacked_per_query_head():
    # 6 query heads, 2 KV heads, head dim 8: query head h reads KV head h // 3
    hd, n_rep = 8, 3
    q, k = torch.randn(48, 16), torch.randn(16, 16)
    ref, plan = stacking_plan({"q": (48, 16), "k": (16, 16), "o": (16, 48)}, hd)
    assert ref == (48, 16) and plan == {"q": (False, 1, 1), "k": (False, 3, 1), "o": (True, 1, 1)}
    t = stack({"q": q, "k": k, "o": torch.randn(16, 48)}, plan, hd)
    for h in range(6):
        assert torch.equal(t[1, h * hd:(h + 1) * hd], k[(h // n_rep) * hd:(h // n_rep + 1) * hd])
    with pytest.raises(ValueError, match="cannot be stacked"):
        stacking_plan({"q": (48, 16), "x": (20, 16)}, hd)


def test_gqa_grouped_stacks_every_weight_once_by_slot():
    # the same heads grouped: slices as tall as K, Q and O^T in 3 slots each (slot r: heads r and 3 + r)
    hd = 8
    w = {"a.q_proj": torch.randn(48, 16), "a.k_proj": torch.randn(16, 16), "a.v_proj": torch.randn(16, 16),
         "a.o_proj": torch.randn(16, 48)}
    ref, plan = stacking_plan({k: tuple(v.shape) for k, v in w.items()}, hd, "group")
    assert ref == (16, 16) and plan == {"a.q_proj": (False, 1, 3), "a.k_proj": (False, 1, 1),
                                        "a.v_proj": (False, 1, 1), "a.o_proj": (True, 1, 3)}
    t = stack(w, plan, hd)
    assert t.shape == (8, 16, 16) and t.norm() ** 2 == pytest.approx(sum(x.norm() ** 2 for x in w.values()))
    for r in range(3):
        for g in range(2):
            h = g * 3 + r
            assert torch.equal(t[r, g * hd:(g + 1) * hd], w["a.q_proj"][h * hd:(h + 1) * hd])
            assert torch.equal(t[5 + r, g * hd:(g + 1) * hd], w["a.o_proj"][:, h * hd:(h + 1) * hd].T)
    assert torch.equal(t[3], w["a.k_proj"]) and torch.equal(t[4], w["a.v_proj"])
    with pytest.raises(ValueError, match="gqa='repeat'"):  # an o_proj that is not Q's transpose
        stacking_plan({"a.q_proj": (48, 16), "a.k_proj": (16, 16), "a.o_proj": (48, 16)}, hd, "group")


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("group, gqa", [("qkvo", "group"), ("qkvo", "repeat"), ("fc", "group")])
def test_tucker_full_rank_exact(arch, group, gqa, tiny_dirs, ids):
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch])
    m = load(tiny_dirs[arch], decomposition="tucker", group=group, rank=1.0, gqa=gqa)
    assert sum(isinstance(x, TensorSlice) for x in m.modules()) == 3 * (4 if group == "qkvo" else 3)
    assert rel_err(m(ids).logits, dense(ids).logits) <= 1e-4


@torch.no_grad()
@pytest.mark.parametrize("gqa", ["group", "repeat"])
@pytest.mark.parametrize("decomposition, rank", [("cp", 6), ("tucker", [2, 12, 10])])
def test_factorized_and_dense_agree_and_reload(decomposition, rank, gqa, tiny_dirs, ids, tmp_path):
    fac = load(tiny_dirs["llama"], decomposition=decomposition, group="qkvo", rank=rank, layers=[-1], gqa=gqa)
    den = load(tiny_dirs["llama"], decomposition=decomposition, group="qkvo", rank=rank, layers=[-1], mode="dense",
               gqa=gqa)
    assert type(den.model.layers[-1].self_attn.k_proj) is torch.nn.Linear
    assert rel_err(fac(ids).logits, den(ids).logits) <= 1e-5
    fac.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    r0 = 6 if decomposition == "cp" else 2
    slots, rows = (3, 16) if gqa == "group" else (1, 48)  # grouped: 6 query heads, 2 KV heads of 8: slices of 16 rows
    assert shapes["model.layers.2.self_attn.k_proj.weight"] == (r0,)
    assert shapes["model.layers.2.self_attn.q_proj.weight"] == (slots * r0,)
    assert shapes["model.layers.2.self_attn.trawl_factors.out_factor"] == (rows, 6 if decomposition == "cp" else 12)
    assert ("model.layers.2.self_attn.trawl_factors.core" in shapes) == (decomposition == "tucker")
    again, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(again(ids).logits, fac(ids).logits)


@torch.no_grad()
@pytest.mark.parametrize("decomposition, rank", [("cp", 6), ("tucker", [8, 6, 6])])
def test_slice_weight_moves_the_fit_between_matrices(decomposition, rank, tiny_dirs, ids):
    """A slice weighted up is fitted closer and one weighted down less close; at full rank the weights change nothing."""
    def err(m, name):
        return m.config.quantization_config.stats["modules"][f"model.layers.0.self_attn.{name}"]["rel_error"]

    kw = dict(decomposition=decomposition, group="qkvo", rank=rank, layers=[0], n_iter_max=200)
    plain = load(tiny_dirs["llama"], **kw)
    up = load(tiny_dirs["llama"], slice_weight={"k_proj": 4.0}, **kw)
    down = load(tiny_dirs["llama"], slice_weight={"k_proj": 0.25, "v_proj": 0.25}, **kw)
    assert err(up, "k_proj") < err(plain, "k_proj") < err(down, "k_proj")
    assert err(down, "q_proj") < err(plain, "q_proj")
    full = load(tiny_dirs["llama"], decomposition="tucker", group="qkvo", rank=1.0, slice_weight={"k_proj": 0.1})
    assert rel_err(full(ids).logits, AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])(ids).logits) <= 1e-4
    with pytest.raises(ValueError, match="slice_weight.*matches none"):
        load(tiny_dirs["llama"], slice_weight={"kv_proj": 0.5}, **kw)


def test_balanced_slice_weight_ignores_a_matrix_scale(tiny_dirs, tmp_path):
    """'balanced' fits relative errors: scaling one matrix by 10 changes nothing; unweighted, that matrix takes over."""
    scaled = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    with torch.no_grad():
        scaled.model.layers[0].self_attn.k_proj.weight.mul_(10)
    scaled.save_pretrained(tmp_path)

    def errs(path, weight):
        m = load(path, decomposition="tucker", group="qkvo", rank=[8, 6, 6], layers=[0], slice_weight=weight)
        mods = m.config.quantization_config.stats["modules"]
        return [mods[f"model.layers.0.self_attn.{p}_proj"]["rel_error"] for p in "qkvo"]

    assert errs(tmp_path, "balanced") == pytest.approx(errs(tiny_dirs["llama"], "balanced"), rel=1e-3)
    plain, big = errs(tiny_dirs["llama"], None), errs(tmp_path, None)
    assert big[1] < plain[1] and big[0] > plain[0]


def test_error_decreases_with_cp_rank(tiny_dirs):
    errs = []
    for r in (2, 8, 32):
        m = load(tiny_dirs["qwen3"], decomposition="cp", group="fc", rank=r, layers=[0], n_iter_max=200)
        errs.append(m.config.quantization_config.stats["modules"]["model.layers.0.mlp.trawl_factors"]["rel_error"])
    assert errs[0] > errs[1] > errs[2]


@torch.no_grad()
@pytest.mark.parametrize("formulation, n_groups", [("whole_model", 1), ("segmented", 3), ("per_layer", 3)])
def test_formulations_share_factors_across_layers(formulation, n_groups, tiny_dirs, ids, tmp_path):
    m = load(tiny_dirs["llama"], decomposition="tucker", group="fc", rank=1.0, formulation=formulation)
    groups = [x for x in m.modules() if isinstance(x, SharedFactors)]
    assert len(groups) == n_groups and sum(g.n_slices for g in groups) == 9
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    assert rel_err(m(ids).logits, dense(ids).logits) <= 1e-4
    m.save_pretrained(tmp_path)
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, m(ids).logits)


@pytest.mark.parametrize("cfg, field", [
    ({"decomposition": "svd"}, "decomposition"),
    ({"group": "mlp"}, "group"),
    ({"formulation": "thirds"}, "formulation"),
    ({"n_iter_max": 0}, "n_iter_max"),
    ({"gqa": "mean"}, "gqa"),
    ({"slice_weight": {"k_proj": 0}}, "slice_weight"),
    ({"slice_weight": [0.3, 0.3]}, "slice_weight"),
    ({"slice_weight": "relative"}, "slice_weight"),
    ({"decomposition": "tucker", "rank": [3, 4]}, "rank"),
])
def test_bad_options(cfg, field):
    with pytest.raises(ValueError) as e:
        TensorCompressionConfig(method="trawl", **cfg)
    assert field in str(e.value) and "allowed" in str(e.value)


def test_tucker_rank_too_large_fails_before_loading(tiny_dirs):
    with pytest.raises(ValueError, match="rank.*at most"):
        load(tiny_dirs["llama"], decomposition="tucker", group="fc", rank=[4, 10, 10])


def test_layer_sweep_reverts_and_full_rank_matches_dense(tiny_dirs, ids):
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def evaluate(m):
        with torch.no_grad():
            return {"loss": m(ids, labels=ids).loss.item()}

    rows = layer_sweep(model, "trawl", [0, -1], [2, 1.0], evaluate, option_sets=[{"group": "fc", "decomposition": "tucker"}],
                       progress=False)
    assert len(rows) == 1 + 2 * 2 and rows[0]["layer"] is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    full = [r for r in rows if r["rank"] == 1.0]
    assert all(abs(r["loss"] - rows[0]["loss"]) < 1e-5 for r in full)
    assert all(r["loss"] != rows[0]["loss"] for r in rows if r["rank"] == 2)
    with pytest.raises(ValueError, match="layers"):
        layer_sweep(model, "trawl", [7], [2], evaluate, progress=False)


def test_config_round_trip_with_trawl_options():
    c = TensorCompressionConfig(method="trawl", decomposition="tucker", rank=[2, 16, 8], group="qkvo", formulation="segmented")
    assert TensorCompressionConfig.from_dict(json.loads(c.to_json_string())) == c


def test_checkpoint_written_before_the_gqa_option_loads_as_repeated(tiny_dirs, ids, tmp_path):
    """A saved entry without ``gqa`` was written when K and V were always repeated; a new config groups."""
    m = load(tiny_dirs["llama"], decomposition="tucker", group="qkvo", rank=[2, 12, 10], layers=[-1], gqa="repeat")
    assert reloads_without_option(m, tmp_path, "gqa", ids) == "repeat"
    assert TensorCompressionConfig(method="trawl", group="qkvo").entries[0].options["gqa"] == "group"
