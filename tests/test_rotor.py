"""Rotor layers: the Clifford algebra (exact cases, dense references, finite differences), the rotor
gadget, the LR / BH baselines, the training function and the `rotor` method on synthetic inputs."""

import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from hf_tensorcomp.methods.rotor import decomposition as cl
from hf_tensorcomp.decompositions.hadamard import hadamard_transform

torch.set_default_dtype(torch.float32)

CAL = [[1, 2, 3, 4]]  # token ids: the config needs calibration data; these tests feed inputs directly


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _bivector_with_spectrum(sigmas, n, seed=0, dtype=torch.float64):
    """Coefficients of Q (⊕ σ_i J) Qᵀ for a random orthogonal Q: known invariant decomposition."""
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=_g(seed), dtype=dtype))
    m = torch.zeros(n, n, dtype=dtype)
    for i, s in enumerate(sigmas):
        m[2 * i, 2 * i + 1], m[2 * i + 1, 2 * i] = s, -s
    return cl.from_skew(q @ m @ q.T, n), q


# ------------------------------------------------------------------------------------------- algebra


def test_blade_signs_closed_form_cases():
    # e1 e2 = e12, e2 e1 = -e12, e1 e1 = 1, e12 e12 = -1, e123 e123 = -1, e1 e23 = e123, e23 e1 = e123
    e1, e2, e3 = 1, 2, 4
    assert cl.blade_sign(e1, e2).item() == 1 and cl.blade_sign(e2, e1).item() == -1
    assert cl.blade_sign(e1, e1).item() == 1
    assert cl.blade_sign(e1 | e2, e1 | e2).item() == -1
    assert cl.blade_sign(7, 7).item() == -1
    assert cl.blade_sign(e1, e2 | e3).item() == 1 and cl.blade_sign(e2 | e3, e1).item() == 1
    assert cl.blade_sign(e2, e1 | e3).item() == -1  # e2 e1 e3 = -e1 e2 e3


def test_geometric_product_is_associative_and_squares_vectors():
    n = 4
    x, y, z = (torch.randn(2**n, generator=_g(i), dtype=torch.float64) for i in range(3))
    lhs = cl.geometric_product(cl.geometric_product(x, y, n), z, n)
    rhs = cl.geometric_product(x, cl.geometric_product(y, z, n), n)
    assert torch.allclose(lhs, rhs, atol=1e-12)
    v = torch.randn(n, generator=_g(3), dtype=torch.float64)
    vv = cl.geometric_product(cl.embed_vector(v, n), cl.embed_vector(v, n), n)
    assert torch.allclose(vv, cl.scalar(v.dot(v), n), atol=1e-12)  # v² = |v|² in Cl(n, 0)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("autograd", [False, True])
def test_vector_multiplication_matches_general_product(side, autograd):
    n = 5
    x = torch.randn(3, 2**n, generator=_g(0), dtype=torch.float64)
    a = torch.randn(3, n, generator=_g(1), dtype=torch.float64)
    av = cl.embed_vector(a, n)
    ref = cl.geometric_product(av, x, n) if side == "left" else cl.geometric_product(x, av, n)
    mul = cl.left_vector_mul if side == "left" else cl.right_vector_mul
    out = mul(x.clone().requires_grad_(autograd), a, n)
    assert out.requires_grad == autograd
    assert torch.allclose(out.detach(), ref, atol=1e-12)


def test_exp_simple_closed_form_matches_series():
    n = 4
    u, v = torch.randn(2, n, generator=_g(0), dtype=torch.float64)
    b = 1.7 * cl.from_skew(torch.outer(u, v) - torch.outer(v, u), n)  # simple: u ∧ v
    c, bv = cl.exp_simple(b)
    closed = cl.scalar(c, n) + cl.embed_bivector(bv, n)
    assert torch.allclose(closed, cl.exp_series(cl.embed_bivector(b, n), n), atol=1e-10)
    c0, b0 = cl.exp_simple(torch.zeros(cl.n_bivectors(n), dtype=torch.float64))
    assert c0.item() == 1 and not b0.any()


def test_exp_simple_gradients_match_finite_differences():
    b = torch.randn(6, dtype=torch.float64, generator=_g(2), requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: torch.cat([cl.exp_simple(t)[0][None], cl.exp_simple(t)[1]]), (b,))


@pytest.mark.parametrize("n", [4, 5, 6])
def test_invariant_decomposition_reproduces_bivector(n):
    b = torch.randn(3, cl.n_bivectors(n), generator=_g(n), dtype=torch.float64)
    parts, rot, warm = cl.invariant_decomposition(b, n, iters=500, tol=1e-13)
    assert parts.shape == (3, n // 2, cl.n_bivectors(n)) and warm.shape == (3, n // 2, n)
    assert torch.allclose(parts.sum(-2), b, atol=1e-8)
    m = cl.to_skew(parts, n)
    for i in range(n // 2):
        assert torch.linalg.matrix_rank(m[:, i]).max().item() <= 2  # simple: a single plane
        for j in range(i + 1, n // 2):  # orthogonal planes, so the parts commute
            assert torch.allclose(m[:, i] @ m[:, j], torch.zeros_like(m[:, i]), atol=1e-8)
    # the σ_i are the singular-value pairs of B
    sig = torch.linalg.vector_norm(cl.to_skew(parts, n), dim=(-2, -1)) / math.sqrt(2)
    sv = torch.linalg.svdvals(cl.to_skew(b, n))[:, : 2 * (n // 2) : 2]
    assert torch.allclose(sig, sv, atol=1e-8)


def test_decomposition_of_known_spectrum():
    n = 6
    b, q = _bivector_with_spectrum([3.0, 2.0, 0.5], n)
    parts, _, _ = cl.invariant_decomposition(b, n, iters=500, tol=1e-13)
    m = cl.to_skew(parts, n)
    for i, s in enumerate([3.0, 2.0, 0.5]):
        plane = q[:, 2 * i : 2 * i + 2]
        expect = s * (torch.outer(plane[:, 0], plane[:, 1]) - torch.outer(plane[:, 1], plane[:, 0]))
        assert torch.allclose(m[i], expect, atol=1e-8)


@pytest.mark.parametrize("n", [4, 5])
def test_rotor_sandwich_is_the_rotation_on_vectors(n):
    b = torch.randn(cl.n_bivectors(n), generator=_g(1), dtype=torch.float64)
    _, rot, _ = cl.invariant_decomposition(b, n, iters=500, tol=1e-13)
    v = torch.randn(4, n, generator=_g(2), dtype=torch.float64)
    out = cl.sandwich(cl.embed_vector(v, n), rot, n)
    rotation = torch.linalg.matrix_exp(2 * cl.to_skew(b, n))
    assert torch.allclose(cl.vector_part(out, n), v @ rotation.T, atol=1e-9)
    assert torch.allclose(out - cl.embed_vector(cl.vector_part(out, n), n), torch.zeros_like(out), atol=1e-9)


@pytest.mark.parametrize("double", [False, True])
def test_sparse_sandwich_equals_dense_reference_and_preserves_norm(double):
    n = 5
    b = torch.randn(2, 2, cl.n_bivectors(n), generator=_g(3), dtype=torch.float64)
    _, rot, _ = cl.invariant_decomposition(b, n, iters=500, tol=1e-13)
    r = cl.SimpleRotors(rot.cos[0], rot.w[0], rot.v[0])
    s = cl.SimpleRotors(rot.cos[1], rot.w[1], rot.v[1]) if double else None
    x = torch.randn(7, 2, 2**n, generator=_g(4), dtype=torch.float64)
    fast = cl.sandwich(x, r, n, s)
    ref = cl.sandwich_reference(x, r.multivector(n), n, (s or r).multivector(n))
    assert torch.allclose(fast, ref, atol=1e-10)
    tokens_last = cl.sandwich(x.permute(1, 2, 0), r, n, s, dim=-2)  # the layers' layout: (rotors, 2^n, tokens)
    assert torch.allclose(tokens_last.permute(2, 0, 1), ref, atol=1e-10)
    assert torch.allclose(fast.norm(dim=-1), x.norm(dim=-1), atol=1e-10)
    # the rotor is exp(b): compare with the series exponential of the (non-simple) bivector
    assert torch.allclose(r.multivector(n), cl.exp_series(cl.embed_bivector(b[0], n), n), atol=1e-9)
    # the dense reference map, column by column, is orthogonal; r x r† is grade-preserving
    eye = torch.eye(2**n, dtype=torch.float64)
    mat = cl.sandwich(eye[:, None, :], r, n, s)[:, 0]  # row j = image of blade j
    assert torch.allclose(mat @ mat.T, eye, atol=1e-10)
    if not double:
        g = cl.grades(n)
        assert not (mat.abs() > 1e-10)[g[:, None] != g[None, :]].any()


def test_sandwich_gradients_match_finite_differences():
    n = 4
    x = torch.randn(3, 2**n, generator=_g(0), dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, generator=_g(1), dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, n, generator=_g(2), dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, n, generator=_g(3), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, c, w, v: cl.sandwich(x, cl.SimpleRotors(c, w, v), n), (x, c, w, v))


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_matrix_representation_is_a_faithful_algebra_map(n):
    """ρ(x y) = ρ(x) ρ(y), ρ(x†) = ρ(x)ᵀ, and decoding inverts encoding (x as one token column)."""
    x, y = (torch.randn(2**n, generator=_g(i), dtype=torch.float64) for i in range(2))
    rx, ry = (cl.spin_encode(v[:, None], n)[..., 0] for v in (x, y))
    assert torch.allclose(cl.spin_encode(cl.geometric_product(x, y, n)[:, None], n)[..., 0], rx @ ry, atol=1e-12)
    assert torch.allclose(cl.spin_encode(cl.reverse(x, n)[:, None], n)[..., 0], rx.transpose(-1, -2), atol=1e-12)
    assert torch.allclose(cl.spin_decode(rx[..., None], n)[:, 0], x, atol=1e-12)


@pytest.mark.parametrize("n", [2, 3, 5, 7, 8, 9, 10])
def test_matrix_sandwich_equals_vector_products_and_dense_reference(n):
    b = torch.randn(3, 2, cl.n_bivectors(n), generator=_g(n), dtype=torch.float64)
    _, rot, _ = cl.invariant_decomposition(b, n, iters=300, tol=1e-13)
    r, s = (cl.SimpleRotors(rot.cos[:, i], rot.w[:, i], rot.v[:, i]) for i in range(2))
    x = torch.randn(3, 2**n, 4, generator=_g(1), dtype=torch.float64)  # (rotors, 2^n, tokens)
    fast = cl.spin_sandwich(x, r, n, s)
    assert torch.allclose(fast, cl.sandwich(x, r, n, s, dim=-2), atol=1e-10)
    assert torch.allclose(cl.spin_sandwich(x, r, n), cl.sandwich(x, r, n, dim=-2), atol=1e-10)
    if n <= 5:
        ref = cl.sandwich_reference(x.transpose(1, 2), r.multivector(n)[:, None], n, s.multivector(n)[:, None])
        assert torch.allclose(fast, ref.transpose(1, 2), atol=1e-10)
    assert cl.rotor_matrix(r, n).shape[-1] <= (16 if n <= 9 else 32)  # N x N, never 2^n x 2^n


def test_matrix_sandwich_gradients_match_finite_differences():
    n = 4
    x = torch.randn(1, 2**n, 3, generator=_g(0), dtype=torch.float64, requires_grad=True)
    c = torch.randn(1, 2, generator=_g(1), dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 2, n, generator=_g(2), dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, n, generator=_g(3), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, c, w, v: cl.spin_sandwich(x, cl.SimpleRotors(c, w, v), n), (x, c, w, v))


def test_decomposition_gradient_matches_finite_differences():
    """With enough replayed power steps the autograd gradient of b -> r x r† is the true derivative."""
    n = 5
    b0, _ = _bivector_with_spectrum([2.0, 0.7], n, seed=5)
    x = torch.randn(2**n, generator=_g(6), dtype=torch.float64)
    probe = torch.randn(2**n, generator=_g(7), dtype=torch.float64)

    def f(b, grad_steps=200):
        _, rot, _ = cl.invariant_decomposition(b, n, iters=2000, tol=1e-15, grad_steps=grad_steps)
        return (cl.sandwich(x, rot, n) * probe).sum()

    b = b0.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(f(b), b)
    eps = 1e-6
    fd = torch.stack([(f(b0 + eps * e) - f(b0 - eps * e)) / (2 * eps) for e in torch.eye(len(b0), dtype=torch.float64)])
    assert torch.allclose(grad, fd, rtol=1e-5, atol=1e-7)
    # the default single replayed step (the paper's) gives a biased but well-aligned gradient
    (g1,) = torch.autograd.grad(f(b, grad_steps=1), b)
    assert torch.nn.functional.cosine_similarity(g1, fd, dim=0) > 0.9


def test_hadamard_transform_matches_sylvester_matrix():
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(4):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randn(5, 16, generator=_g(0), dtype=torch.float64)
    assert torch.allclose(hadamard_transform(x), x @ h.T / 4, atol=1e-12)


# --------------------------------------------------------------------------------------------- layer

from transformers import AutoModelForCausalLM  # noqa: E402

from hf_tensorcomp import TensorCompressionConfig  # noqa: E402
from hf_tensorcomp.layers import BlockHadamardLinear, LowRankLinear, build_from_spec  # noqa: E402
from hf_tensorcomp.methods.rotor.layer import RotorLinear, rotor_param_count, windows  # noqa: E402
from hf_tensorcomp.methods import get_method  # noqa: E402
from hf_tensorcomp.training import fit, lr_schedule, relative_mse  # noqa: E402


@pytest.mark.parametrize("d_in, d_out, expect", [
    (576, 576, 737), (576, 192, 935),      # SmolLM2 q, k/v (the authors' rule)
    (640, 1024, 737), (640, 256, 705),     # Gemma-3-270M q, k/v
    (2048, 2048, 895), (2048, 512, 1076),  # LLaMA-3.2-1B q, k/v: the paper's Table 3 says <= 896, <= 1080
])
def test_parameter_counts(d_in, d_out, expect):
    assert rotor_param_count(d_in, d_out) == expect
    assert RotorLinear(d_in, d_out, device="meta").num_parameters() == expect


def test_windows_wrap_around_and_cover():
    w = windows(576, 512)
    assert w.shape == (2, 512) and w[1, 0] == 288 and w[1, -1] == 799 % 576
    assert set(w.reshape(-1).tolist()) == set(range(576))
    assert windows(192, 128).tolist()[1][:2] == [96, 97]


def _reference_gadget(m: RotorLinear, x: torch.Tensor) -> torch.Tensor:
    """The gadget recomputed from its definition: full multivectors, the O(4^n) product, F.layer_norm."""
    x = x.double()
    row = 0
    for i, lv in enumerate(m.levels):
        biv, alpha, beta = (t.double() if t is not None else None for t in m._level_params(i))
        w = m.warm[m._warm_slices[i][0] : m._warm_slices[i][1]].view(*biv.shape[:2], lv.n // 2, lv.n).double()
        _, rot, _ = cl.invariant_decomposition(biv, lv.n, warm=w, iters=m.iters)
        r_mv = cl.SimpleRotors(rot.cos[:, 0], rot.w[:, 0], rot.v[:, 0]).multivector(lv.n)
        s_mv = cl.SimpleRotors(rot.cos[:, -1], rot.w[:, -1], rot.v[:, -1]).multivector(lv.n)
        xin = torch.nn.functional.pad(x, (0, max(0, lv.chunk - lv.d_in)))
        win_in, win_out = windows(lv.d_in, lv.chunk), windows(lv.d_out, lv.chunk)
        outs = []
        for b in range(lv.branches):
            acc = torch.zeros(x.shape[0], max(lv.d_out, lv.chunk), dtype=torch.float64)
            cnt = torch.zeros(max(lv.d_out, lv.chunk), dtype=torch.float64)
            for ii in range(lv.m_in):
                for jj in range(lv.m_out):
                    p = b * lv.pairs + ii * lv.m_out + jj
                    y = cl.sandwich_reference(xin[:, win_in[ii]], r_mv[p], lv.n, s_mv[p]) * alpha[b, ii * lv.m_out + jj]
                    acc[:, win_out[jj]] += y
                    cnt[win_out[jj]] += 1
            o = (acc / cnt.clamp_min(1))[:, : lv.d_out]
            if lv.post:
                o = o[:, m.perm[row + b].long()]
                o = torch.nn.functional.layer_norm(o, (lv.d_out,))
                o = torch.nn.functional.prelu(o, m.weight[-1:].double())
            outs.append(o)
        row += lv.branches if lv.post else 0
        x = sum(beta[b] * outs[b] for b in range(lv.branches)) if beta is not None else outs[0]
    return x


@pytest.mark.parametrize("layout", [
    dict(chunking="wrap", depth=1, width=2, double=True),    # 12 -> 6: Cl(3) windows, wrap-around, averaging
    dict(chunking="wrap", depth=0, width=1, double=False),
    dict(chunking="pad", depth=1, width=2, double=True),     # one Cl(4) window, zero padding, cut output
])
def test_gadget_matches_reference(layout):
    m = RotorLinear.create(12, 6, seed=3, **layout).eval()
    x = torch.randn(5, 12, generator=_g(1))
    with torch.no_grad():
        assert torch.allclose(m(x).double(), _reference_gadget(m, x), atol=1e-4)
    n_maps = [lv.pairs * lv.branches for lv in m.levels]
    assert sum(n_maps) > len(m.levels) or layout["chunking"] == "pad"


def test_rotor_layer_refuses_dense_and_round_trips_through_safetensors(tmp_path):
    m = RotorLinear.create(40, 24, seed=1, bias_init=torch.randn(24, generator=_g(0))).eval()
    with pytest.raises(ValueError, match="mode.*'dense'.*allowed: 'factorized'"):
        m.to_dense()
    x = torch.randn(3, 7, 40, generator=_g(2))
    with torch.no_grad():
        y = m(x)
    save_file(m.state_dict(), tmp_path / "m.safetensors")
    assert set(load_file(tmp_path / "m.safetensors")) == {"weight", "bias", "perm", "warm"}
    with torch.device("meta"):
        again = build_from_spec(m.spec(), dtype=torch.float32)
    again.load_state_dict(load_file(tmp_path / "m.safetensors"), assign=True)
    again.eval()
    with torch.no_grad():
        assert torch.equal(again(x), y)
    assert m.weight.ndim == 1  # never the dense (out, in) shape


def test_block_hadamard_is_linear_and_checks_blocks():
    m = BlockHadamardLinear.create(24, 16, blocks=8, seed=0)  # input padded to 32
    x = torch.randn(4, 24, generator=_g(0))
    with torch.no_grad():
        assert torch.allclose(m(x), x @ m.dense_weight().T, atol=1e-5)
    assert m.num_parameters() == 32 * 16 // 8
    with pytest.raises(ValueError, match="blocks: got 3 .*allowed: a common divisor"):
        BlockHadamardLinear(24, 16, blocks=3)


# ------------------------------------------------------------------------------------------ training


def test_lr_schedule_warms_up_then_decays_monotonically():
    total = 100
    rates = [lr_schedule(s, total, warmup=0.1) for s in range(total)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:])) and rates[-1] == pytest.approx(0.0, abs=1e-9)


def test_fit_low_rank_recovers_a_rank_one_map_and_is_deterministic():
    torch.manual_seed(0)
    d_in, d_out = 16, 12
    dense = nn.Linear(d_in, d_out, bias=False)
    with torch.no_grad():
        dense.weight.copy_(torch.outer(torch.randn(d_out, generator=_g(1)), torch.randn(d_in, generator=_g(2))))
    x = torch.randn(2048, d_in, generator=_g(3))
    opts = {"seed": 0}
    from hf_tensorcomp.methods.rotor.method import build

    runs = []
    for _ in range(2):
        m = build("lr1", d_in, d_out, opts)
        hist = fit(m, dense, x, lr=0.05, batch_size=32, epochs=2, seed=4)
        runs.append((hist, m.weight.detach().clone()))
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])
    assert relative_mse(m, dense, x) < 1e-3 and hist[-1] < hist[0] * 1e-2


def test_fit_rotor_reduces_the_loss_deterministically():
    d_in, d_out = 32, 16
    dense = nn.Linear(d_in, d_out)
    x = torch.randn(512, d_in, generator=_g(0))
    results = []
    for _ in range(2):
        m = RotorLinear.create(d_in, d_out, seed=0, bias_init=dense.bias.detach(), depth=1, width=2)
        before = relative_mse(m, dense, x)
        hist = fit(m, dense, x, lr=0.05, batch_size=32, seed=1)
        results.append((hist, m.weight.detach().clone(), m.warm.clone()))
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1]) and torch.equal(results[0][2], results[1][2])
    after = relative_mse(m, dense, x)
    assert after < 0.6 * before, (before, after)


# ------------------------------------------------------------------------------------------- method


def _ctx(stats, prefix="model.layers"):
    return SimpleNamespace(config=None, prefix=prefix, n_layers=2, stats=stats)


@pytest.mark.parametrize("structure, layer_type", [("rotor", RotorLinear), ("lr1", LowRankLinear), ("lr4", LowRankLinear),
                                                   ("bh1", BlockHadamardLinear)])
def test_method_compresses_from_calibration_inputs(structure, layer_type):
    cfg = TensorCompressionConfig(method="rotor", structure=structure, layers=[0], blocks=8, depth=1, width=1,
                                  calibration=CAL)
    entry = cfg.entries[0]
    method = get_method("rotor")
    assert method.needs(entry) == {"inputs"}
    q, k = nn.Linear(32, 32, bias=False), nn.Linear(32, 16, bias=False)
    modules = {"0.self_attn.q_proj": q, "0.self_attn.k_proj": k}
    method.check_unit(modules, entry, _ctx(None))
    stats = {"0.self_attn.q_proj": SimpleNamespace(inputs=torch.randn(300, 32, generator=_g(0))),
             "0.self_attn.k_proj": SimpleNamespace(inputs=torch.randn(300, 32, generator=_g(1)))}
    out = method.compress(modules, entry, _ctx(stats))
    for name, lin in modules.items():
        new, st = out[name]
        assert isinstance(new, layer_type) and st["structure"] == structure
        assert st["params"] == sum(p.numel() for p in new.parameters()) < lin.weight.numel()
        assert st["tokens"] == 300 and len(st["loss"]) >= 2 and 0 < st["rel_error"]
        with torch.no_grad():
            assert new(torch.randn(2, 32)).shape == (2, lin.out_features)


def test_rotor_defaults_its_calibration_and_refuses_missing_statistics():
    assert TensorCompressionConfig(method="rotor").calibration == "wikipedia+owt"  # none named: both bundled corpora
    entry = TensorCompressionConfig(method="rotor", calibration=CAL).entries[0]
    with pytest.raises(ValueError, match=r"calibration="):
        get_method("rotor").compress({"0.self_attn.q_proj": nn.Linear(8, 8)}, entry, _ctx(None))
    with pytest.raises(ValueError, match=r"calibration="):
        get_method("rotor").compress({"0.self_attn.q_proj": nn.Linear(8, 8)}, entry,
                                     SimpleNamespace(config=None, prefix="model.layers", n_layers=1))


@pytest.mark.parametrize("options, field, allowed", [
    (dict(structure="lr2"), "structure", "'rotor' | 'lr1' | 'lr4' | 'bh1'"),
    (dict(chunk=100), "chunk", "power of two"),
    (dict(chunking="overlap"), "chunking", "'wrap' | 'pad'"),
    (dict(depth=-1), "depth", "int >= 0"),
    (dict(width=0), "width", "int >= 1"),
    (dict(double="yes"), "double", "True | False"),
    (dict(lr=0), "lr", "number > 0"),
    (dict(rank=4), "rank", "None for rotor"),
    (dict(warmup=1.0), "warmup", "[0, 1)"),
    (dict(retrain_o=1), "retrain_o", "True | False"),
    (dict(o_epochs=0), "o_epochs", "int >= 1"),
    (dict(o_lr=-1.0), "o_lr", "number > 0"),
])
def test_bad_options_name_the_field(options, field, allowed):
    with pytest.raises(ValueError, match=rf"TensorCompressionConfig\.{field}: .*allowed: .*{__import__('re').escape(allowed)}"):
        TensorCompressionConfig(method="rotor", calibration=CAL, **options)


def test_check_unit_refuses_dense_mode_non_projections_and_bad_chunks():
    m = get_method("rotor")
    lin = {"0.self_attn.q_proj": nn.Linear(576, 576, device="meta")}
    with pytest.raises(ValueError, match=r"mode: got 'dense'; allowed: 'factorized'"):
        m.check_unit(lin, TensorCompressionConfig(method="rotor", mode="dense", calibration=CAL).entries[0], _ctx(None))
    with pytest.raises(ValueError, match=r"targets: got 'model.layers.0.mlp.up_proj'; allowed: .*q_proj"):
        m.check_unit({"0.mlp.up_proj": nn.Linear(8, 8)}, TensorCompressionConfig(method="rotor", calibration=CAL).entries[0], _ctx(None))
    with pytest.raises(ValueError, match=r"chunk: got 512 with chunking='pad'.*allowed: None or a power of two >= 576"):
        m.check_unit(lin, TensorCompressionConfig(method="rotor", chunking="pad", chunk=512, calibration=CAL).entries[0], _ctx(None))
    with pytest.raises(ValueError, match=r"blocks: got 64 .*allowed: a common divisor"):
        m.check_unit({"0.self_attn.k_proj": nn.Linear(40, 24)}, TensorCompressionConfig(method="rotor", structure="bh1", calibration=CAL).entries[0],
                     _ctx(None))
    m.check_unit(lin, TensorCompressionConfig(method="rotor", chunking="pad", calibration=CAL).entries[0], _ctx(None))  # h = 1024 fits


@pytest.mark.parametrize("structure", ["rotor", "lr4"])
def test_rotor_through_from_pretrained_with_calibration_saves_and_reloads(structure, tiny_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    calib = torch.randint(0, 101, (16, 16), generator=torch.Generator().manual_seed(0))
    cfg = TensorCompressionConfig(method="rotor", structure=structure, layers=[0], targets=["self_attn.q_proj"],
                                  calibration=calib, calibration_samples=16, depth=1, width=1, epochs=10, batch_size=16,
                                  progress=False)
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg)
    st = m.config.quantization_config.stats["modules"]["model.layers.0.self_attn.q_proj"]
    assert st["tokens"] == 256 and st["structure"] == structure and st["rel_error"] < 1
    m.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 101, (1, 9))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, m(ids).logits)


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_attention_statistic_records_calls_that_replay_the_block(arch, tiny_dirs):
    """The "attention" kind: one list of calls shared by sibling projections; replaying them with the
    dense projections reproduces the block's recorded output (Gemma3: sliding-window masks too)."""
    from transformers import AutoModelForCausalLM

    from hf_tensorcomp.calibration.stats import StatsHooks
    from hf_tensorcomp.methods.rotor.method import _rerun

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch]).eval()
    layer = model.model.layers[1]
    hooks = StatsHooks(layer, {"1.self_attn.q_proj": frozenset({"inputs", "attention"}),
                               "1.self_attn.v_proj": frozenset({"attention"})}, "1.")
    model(input_ids=torch.randint(0, 101, (2, 20), generator=torch.Generator().manual_seed(0)), use_cache=False)
    model(input_ids=torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(1)), use_cache=False)
    stats = hooks.close()
    q, v = stats["1.self_attn.q_proj"], stats["1.self_attn.v_proj"]
    assert q.attention is v.attention and len(q.attention) == 2 and q.inputs.shape == (52, 48)
    rows, rel = _rerun(layer.self_attn, {}, q.attention)
    assert rows.shape == (52, layer.self_attn.o_proj.in_features) and rel < 1e-12
    zero = nn.Linear(48, layer.self_attn.v_proj.out_features, bias=False)
    nn.init.zeros_(zero.weight)
    assert _rerun(layer.self_attn, {"v_proj": zero}, q.attention)[1] == pytest.approx(1.0)  # no values: no output
    assert layer.self_attn.v_proj is not zero  # restored


def test_retrain_o_fits_the_block_output_and_reloads(tiny_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    calib = torch.randint(0, 101, (16, 16), generator=torch.Generator().manual_seed(0))
    cfg = TensorCompressionConfig(method="rotor", structure="lr4", layers=[0], calibration=calib, calibration_samples=16,
                                  epochs=10, batch_size=16, retrain_o=True, o_epochs=20, o_lr=0.01, progress=False)
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg)
    st = m.config.quantization_config.stats["modules"]["model.layers.0.self_attn.o_proj"]
    assert st["params"] == 48 * 48 and st["tokens"] == 256 and st["steps"] == 20 * 16
    assert st["attn_rel_mse"] < 0.9 * st["attn_rel_mse_before"]  # fitted to the dense block, not a copy of W_o
    o_new, o_old = m.model.layers[0].self_attn.o_proj, dense.model.layers[0].self_attn.o_proj
    assert type(o_new) is nn.Linear and not torch.allclose(o_new.weight, o_old.weight)
    assert torch.equal(m.model.layers[1].self_attn.o_proj.weight, dense.model.layers[1].self_attn.o_proj.weight)
    m.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 101, (1, 9))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, m(ids).logits)


def test_trains_when_loaded_under_no_grad(tiny_dirs):
    """from_pretrained inside torch.no_grad() (common in evaluation scripts) still trains the stand-ins."""
    cal = torch.randint(0, 101, (8, 16), generator=_g(5))
    cfg = TensorCompressionConfig(method="rotor", structure="lr4", init="random", layers=[1], lr=0.05, batch_size=16, epochs=8,
                                  calibration=cal, progress=False)
    with torch.no_grad():
        m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg)
    st = m.config.quantization_config.stats["modules"]["model.layers.1.self_attn.q_proj"]
    assert st["loss"][-1] < st["loss"][0] and st["rel_error"] < 1


@pytest.mark.parametrize("structure", ["lr1", "bh1"])
def test_trained_stand_in_never_worse_than_its_closed_form_start(tiny_dirs, structure):
    """LR and BH start from their least-squares fit; a rate that only hurts leaves them there."""
    from hf_tensorcomp.methods.rotor.method import build, closed_form_start
    from hf_tensorcomp.training import fit, relative_mse

    lin = torch.nn.Linear(48, 48)
    x = torch.randn(512, 48, generator=_g(3)) @ torch.randn(48, 48, generator=_g(4))
    opts = {"seed": 0, "blocks": 4}
    new = build(structure, 48, 48, opts, bias=lin.bias.detach())
    closed_form_start(new, lin, x)
    start = relative_mse(new, lin, x)
    rand = build(structure, 48, 48, opts, bias=lin.bias.detach())
    assert start < relative_mse(rand, lin, x)  # the closed form is a better start than the random one
    fit(new, lin, x, lr=5.0, epochs=2, batch_size=64)  # diverges
    assert relative_mse(new, lin, x) <= start + 1e-9
