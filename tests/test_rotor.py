"""Rotor layers: the Clifford algebra (exact cases, dense references, finite differences), the rotor
gadget, the LR / BH baselines, the training function and the `rotor` method on synthetic inputs."""

import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from hf_tensorcomp.decompositions import clifford as cl
from hf_tensorcomp.decompositions.hadamard import hadamard_transform

torch.set_default_dtype(torch.float32)


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
def test_vector_multiplication_matches_general_product(side):
    n = 5
    x = torch.randn(3, 2**n, generator=_g(0), dtype=torch.float64)
    a = torch.randn(3, n, generator=_g(1), dtype=torch.float64)
    av = cl.embed_vector(a, n)
    if side == "left":
        assert torch.allclose(cl.left_vector_mul(x, a, n), cl.geometric_product(av, x, n), atol=1e-12)
    else:
        assert torch.allclose(cl.right_vector_mul(x, a, n), cl.geometric_product(x, av, n), atol=1e-12)


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
