"""Input-side whitening for TRAWL and TensorLLM, and TRAWL's `target` budget."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_tensorcomp import TensorCompressionConfig
from hf_tensorcomp.calibration.stats import ModuleStats
from hf_tensorcomp.decompositions.cp_tucker import fit_core
from hf_tensorcomp.methods import get_method
from hf_tensorcomp.methods.base import Context
from tiny import ARCHS, VOCAB, _tiny, rel_err


def calib_ids(n=6, length=16, seed=3):
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def load(path, **cfg):
    cfg.setdefault("progress", False)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=TensorCompressionConfig(**cfg))


def anisotropic(n, d, seed):
    """Correlated inputs whose channel scales span 2.5 decades (as normed hidden states do), rotated."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g))
    return (torch.randn(n, d, generator=g) * torch.logspace(-1.5, 1, d)) @ q


def test_fit_core_is_the_weighted_least_squares_optimum():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(9, 7, generator=g, dtype=torch.float64)
    a, b = torch.randn(9, 3, generator=g, dtype=torch.float64), torch.randn(7, 4, generator=g, dtype=torch.float64)
    xl, xr = anisotropic(50, 9, 1).double(), anisotropic(50, 7, 2).double()
    err = lambda m: torch.linalg.norm(xl @ (t - a @ (torch.diag(m) if m.ndim == 1 else m) @ b[:, :m.shape[-1]].T) @ xr.T)
    for m, shape in ((fit_core(t, a, b, xl.T @ xl, xr.T @ xr), (3, 4)),
                     (fit_core(t, a, b[:, :3], xl.T @ xl, xr.T @ xr, diagonal=True), (3,))):
        assert m.shape == shape
        for _ in range(5):  # every nearby core is worse
            assert err(m) < err(m + 1e-3 * torch.randn(shape, generator=g, dtype=torch.float64))
    # CP cores of two slots side by side, fitted jointly: T ≈ A [diag(c_0) diag(c_1)] Bᵀ, B = 7 x (2 x 3)
    bb = torch.randn(7, 6, generator=g, dtype=torch.float64)
    blocks = lambda c: torch.cat([torch.diag(c[0]), torch.diag(c[1])], 1)
    c = fit_core(t, a, bb, xl.T @ xl, xr.T @ xr, diagonal=True)
    assert c.shape == (2, 3)
    err2 = lambda c: torch.linalg.norm(xl @ (t - a @ blocks(c) @ bb.T) @ xr.T)
    for _ in range(5):
        assert err2(c) < err2(c + 1e-3 * torch.randn(2, 3, generator=g, dtype=torch.float64))
    exact = a @ blocks(c) @ bb.T  # and a tensor of that form is recovered exactly
    assert torch.allclose(fit_core(exact, a, bb, xl.T @ xl, None, diagonal=True), c)


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHS)
def test_whitened_full_rank_is_exact(arch, tiny_dirs, ids):
    """Exact at full rank on three architectures: S⁻ᵀ is folded back, and the refitted O / down_proj cores too."""
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch])
    c = dense.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    for cfg in (dict(entries=[dict(method="trawl", decomposition="tucker", group="qkvo", rank=1.0, whiten=True),
                              dict(method="trawl", decomposition="tucker", group="fc", rank=1.0, whiten=True)]),
                dict(method="trawl", decomposition="tucker", group="qkvo", rank=1.0, whiten=True, gqa="repeat"),
                dict(method="tensorllm", whiten=True,
                     ranks=(c.hidden_size, hd, 2 * c.num_attention_heads // c.num_key_value_heads + 2)),
                dict(method="tensorllm", ranks=(c.hidden_size, hd, 4), whiten=True, gqa="repeat")):
        comp = load(tiny_dirs[arch], calibration=calib_ids(), **cfg)
        groups = {k: v for k, v in comp.config.quantization_config.stats["modules"].items() if "factors" in k}
        assert len(groups) == (6 if "entries" in cfg else 3), cfg
        assert all(v["refit"] == [n for n in v["refit"] if n.endswith(("o_proj", "down_proj"))]
                   for v in groups.values() if "refit" in v)
        assert all(v.get("refit") or v.get("refit_o") for v in groups.values())  # O / down_proj refitted
        assert rel_err(comp(ids).logits, dense(ids).logits) <= 1e-4


def _unit(method, group):
    """Layer 0 of a tiny Llama (GQA) with anisotropic inputs: q/k/v (or gate/up) share one, the others their own."""
    torch.manual_seed(0)
    model = _tiny("llama")
    layer = model.model.layers[0]
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"] if group == "qkvo" else \
        ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    x = anisotropic(400, 48, 5)
    inputs = {n: x if n.split(".")[1] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
              else anisotropic(400, layer.get_submodule(n).in_features, 6) for n in names}
    stats = {}
    for n in names:
        stats[f"0.{n}"] = st = ModuleStats({"gram"})
        st.add(inputs[n])
    ctx = Context(config=model.config, prefix="model.layers", n_layers=3, stats=stats)
    modules = {f"0.{n}": layer.get_submodule(n) for n in names}
    return modules, {f"0.{n}": x for n, x in inputs.items()}, ctx


def _output_errors(method, modules, inputs, ctx, **options):
    """Relative output error ‖(W - W') Xᵀ‖ / ‖W Xᵀ‖ per matrix for the given options."""
    cfg = TensorCompressionConfig(method=method, target=0.5, calibration=calib_ids(), **options)
    out = get_method(method).compress(modules, cfg.entries[0], ctx)
    return {n: rel_err((out[n][0].dense_weight() @ inputs[n].T), (m.weight @ inputs[n].T)) for n, m in modules.items()}


@torch.no_grad()
@pytest.mark.parametrize("method,group,gqa,slack", [
    ("trawl", "qkvo", "group", 1.05), ("trawl", "qkvo", "repeat", 1.05), ("trawl", "fc", None, 1.05),
    ("tensorllm", "qkvo", "repeat", 1.05), ("tensorllm", "qkvo", "group", 1.1)])
def test_whitening_lowers_the_output_error(method, group, gqa, slack):
    """On anisotropic inputs the matrices that share the whitened input get a much lower output error; O and
    down_proj (another input: they ride along, then their cores are refitted to their own input) stay within
    5 % of the unwhitened error (without the refit, TRAWL's are 10-20 % worse; TensorLLM's grouped layout
    measures 1.07x here, still below the repeated layout's error). Fails if S⁻ᵀ is not folded back."""
    modules, inputs, ctx = _unit(method, group)
    options = dict(decomposition="tucker", group=group, slice_weight=None, **({"gqa": gqa} if gqa else {})) \
        if method == "trawl" else {"gqa": gqa, "slice_weight": None}  # the unweighted fit on both sides
    plain = _output_errors(method, modules, inputs, ctx, **options)
    white = _output_errors(method, modules, inputs, ctx, whiten=True, **options)
    for n in modules:
        if n.endswith(("o_proj", "down_proj")):
            assert white[n] <= plain[n] * slack, (n, white[n], plain[n])
        else:
            assert white[n] < 0.8 * plain[n], (n, white[n], plain[n])


@pytest.mark.parametrize("decomposition,target", [("cp", 0.3), ("tucker", 0.5), ("tucker", 0.8)])
def test_trawl_target_keeps_at_most_that_fraction(decomposition, target, tiny_dirs):
    m = load(tiny_dirs["llama"], method="trawl", decomposition=decomposition, group="qkvo", target=target)
    groups = [v for k, v in m.config.quantization_config.stats["modules"].items() if k.endswith("trawl_factors")]
    assert len(groups) == 3
    for g in groups:
        n, out_dim, in_dim = g["tensor"]
        kept = g["params_compressed"]
        params = sum(p.numel() for name, p in m.named_parameters() if name.startswith("model.layers.0.self_attn"))
        assert params == groups[0]["params_compressed"]  # what the stats say is what the model holds
        step = out_dim + in_dim + n * (max(g["ranks"]) + 1)  # one rank more on a mode
        assert target * g["params_original"] - step < kept <= target * g["params_original"]


@pytest.mark.parametrize("cfg,field", [
    (dict(method="trawl", whiten="yes", calibration="wikipedia"), "whiten"),
    (dict(method="trawl", whiten=True, formulation="segmented", calibration="wikipedia"), "whiten"),
    (dict(method="tensorllm", ratio=2, whiten=1, calibration="wikipedia"), "whiten"),
    (dict(method="trawl", target=1.5), "target"),
    (dict(method="trawl", target=0.5, rank=8), "target"),
    *[(dict(method=m, **size, **bad), field) for m, size in (("trawl", {}), ("tensorllm", {"ratio": 2}))
      for bad, field in (({"damping": -0.1}, "damping"), ({"damping": "1"}, "damping"), ({"gqa": "share"}, "gqa"),
                         ({"slice_weight": {"k_proj": 0}}, "slice_weight"), ({"n_iter_max": 0}, "n_iter_max"),
                         ({"init": "eye"}, "init"))],
])
def test_bad_whitening_and_target_settings_name_the_field(cfg, field):
    with pytest.raises(ValueError, match=field):
        TensorCompressionConfig(**cfg)


@torch.no_grad()
def test_whitened_checkpoint_reloads_without_calibration(tiny_dirs, tmp_path, ids):
    m = load(tiny_dirs["gemma3"], method="trawl", decomposition="tucker", group="qkvo", target=0.5, whiten=True,
             calibration=calib_ids())
    m.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(back(ids).logits, m(ids).logits)
