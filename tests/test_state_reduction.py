"""State reduction on tiny Qwen3.5-, Qwen3-Next- and OLMo-Hybrid-shaped models: fused [q|k|v], per-head
[q|k|v|z] and separate q/k projections; and a Gated DeltaNet wrapped into a Llama layer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import (AutoModelForCausalLM, OlmoHybridConfig, OlmoHybridForCausalLM, Qwen3_5ForCausalLM,
                          Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM)
from transformers.models.olmo_hybrid import modeling_olmo_hybrid
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_next import modeling_qwen3_next

from hf_tensorcomp import TensorCompressionConfig
from hf_tensorcomp.decompositions.key_selection import pca_projections
from hf_tensorcomp.decompositions.rrqr import strong_rrqr
from hf_tensorcomp.methods.state_reduction import conv_channels, find_mixers, qk_activations, qk_rows
from tiny import VOCAB

COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])
MODELING = {"qwen3_5": modeling_qwen3_5, "qwen3_next": modeling_qwen3_next, "olmo_hybrid": modeling_olmo_hybrid}


def tiny(arch: str):
    torch.manual_seed(0)
    if arch == "qwen3_5":
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**COMMON)).eval()
    if arch == "olmo_hybrid":
        kw = {k: v for k, v in COMMON.items() if k != "head_dim"}
        return OlmoHybridForCausalLM(OlmoHybridConfig(**kw, pad_token_id=0, eos_token_id=1, bos_token_id=1)).eval()
    return Qwen3NextForCausalLM(Qwen3NextConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                shared_expert_intermediate_size=32)).eval()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    out = {}
    for arch in MODELING:
        d = tmp_path_factory.mktemp(f"sr-{arch}")
        tiny(arch).save_pretrained(d)
        out[arch] = d
    return out


def calib(n=4, length=24):
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(2))


def load(path, **kw):
    kw.setdefault("calibration", calib())
    cfg = TensorCompressionConfig(method="state_reduction", progress=False, **kw)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg).eval()


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("arch", list(MODELING))
def test_keep_one_is_identical(dirs, ids, arch):
    ref = AutoModelForCausalLM.from_pretrained(dirs[arch]).eval()
    for scorer in ("drrqr", "l1"):
        out = load(dirs[arch], scorer=scorer, keep=1.0)
        assert out.config.linear_key_head_dim == 8
        assert torch.equal(logits(out, ids), logits(ref, ids))


class Recorder:
    """Records the (query, key, value) the mixer hands to its gated delta rule."""

    def __init__(self, module, monkeypatch):
        self.calls = []
        real = module.torch_chunk_gated_delta_rule

        def rec(query, key, value, **kw):
            self.calls.append((query.detach().clone(), key.detach().clone(), value.detach().clone()))
            return real(query, key, value, **kw)
        monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", rec)


@pytest.mark.parametrize("arch", list(MODELING))
def test_fused_projection_and_conv_sliced_with_one_index_set(dirs, ids, arch, monkeypatch):
    """The pruned mixer's q / k are exactly the kept channels of the original's (v unchanged), and the
    post-conv activations the scorers read are the ones the mixer really computes."""
    ref = AutoModelForCausalLM.from_pretrained(dirs[arch]).eval()
    out = load(dirs[arch], scorer="rand", keep=0.5, seed=3)
    rec = Recorder(MODELING[arch], monkeypatch)
    logits(ref, ids)
    logits(out, ids)
    (q0, k0, v0), (q1, k1, v1) = rec.calls
    kept = out.tensorcomp_stats["modules"]["model.layers.0.linear_attn"]["kept"]
    assert out.config.linear_key_head_dim == 4 and len(kept) == 2 and all(len(s) == 4 for s in kept)
    for h, s in enumerate(kept):
        torch.testing.assert_close(q1[:, :, h], q0[:, :, h, s])  # (a smaller GEMM may round differently)
        torch.testing.assert_close(k1[:, :, h], k0[:, :, h, s])
    torch.testing.assert_close(v1, v0)
    # end to end: the pruned model is the original whose delta rule sees only the kept q / k channels
    # (so the query scale and the L2 norms follow the kept channels)
    expected = logits(out, ids)
    real = MODELING[arch].torch_chunk_gated_delta_rule
    index = torch.tensor(kept)[None, None]  # (1, 1, heads, k)

    def sliced(query, key, value, **kw):
        take = index.expand(*query.shape[:2], -1, -1)
        return real(query.gather(-1, take), key.gather(-1, take), value, **kw)
    monkeypatch.setattr(MODELING[arch], "torch_chunk_gated_delta_rule", sliced)
    torch.testing.assert_close(logits(ref, ids), expected)
    monkeypatch.setattr(MODELING[arch], "torch_chunk_gated_delta_rule", real)
    layer = ref.model.layers[0]
    mixer = layer.linear_attn
    with torch.no_grad():
        hidden = ref.model.embed_tokens(ids)
        normed = (layer.input_layernorm if hasattr(layer, "input_layernorm") else lambda x: x)(hidden)
        q, k = qk_activations(mixer, normed)
    torch.testing.assert_close(q, q0.reshape(q.shape))
    torch.testing.assert_close(k, k0.reshape(k.shape))


def test_saved_model_reloads_with_plain_transformers_and_generates(dirs, ids, tmp_path):
    out = load(dirs["qwen3_next"], scorer="drrqr", keep=0.5)
    out.save_pretrained(tmp_path)
    from hf_tensorcomp import write_model_card

    card = (tmp_path / "README.md").read_text() if write_model_card(out, tmp_path) else ""
    assert "plain transformers loads it" in card and "| 0 | state_reduction |" in card
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["linear_key_head_dim"] == 4 and "quantization_config" not in saved
    torch.save(logits(out, ids), tmp_path / "expected.pt")
    torch.save(ids, tmp_path / "ids.pt")
    code = f"""
import sys, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}).eval()
assert "hf_tensorcomp" not in sys.modules
ids = torch.load({str(tmp_path / 'ids.pt')!r})
with torch.no_grad():
    assert torch.equal(m(ids).logits, torch.load({str(tmp_path / 'expected.pt')!r}))
g = m.generate(ids[:1], max_new_tokens=5, do_sample=False)
assert g.shape == (1, ids.shape[1] + 5), g.shape
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip().endswith("ok"), run.stderr[-2000:]


def _zero_channels(model, dead):
    """Zero the q and k projection rows of channels `dead` in every head of every mixer."""
    with torch.no_grad():
        for m in find_mixers(model).values():
            for attr, rows in qk_rows(m):
                getattr(m, attr).weight[rows[:, dead].reshape(-1)] = 0


def test_duplicated_channels_drrqr_keeps_one_of_each_pair(tmp_path):
    """A low-rank key space: channels 4..7 of every head copy channels 0..3 (q/k rows and conv filters),
    so [Q; K] has rank 4 and the only well-conditioned choice takes one channel of each pair."""
    model = tiny("qwen3_5")
    with torch.no_grad():
        for m in find_mixers(model).values():
            for attr, rows in qk_rows(m):
                w = getattr(m, attr).weight
                w[rows[:, 4:].reshape(-1)] = w[rows[:, :4].reshape(-1)]
            for ch in conv_channels(m):
                m.conv1d.weight[ch[:, 4:].reshape(-1)] = m.conv1d.weight[ch[:, :4].reshape(-1)]
    model.save_pretrained(tmp_path)
    kept = load(tmp_path, scorer="drrqr", keep=0.5).tensorcomp_stats["modules"]["model.layers.0.linear_attn"]["kept"]
    assert all(sorted(i % 4 for i in s) == [0, 1, 2, 3] for s in kept)


def test_pca_finds_a_rotated_low_rank_key_space(tmp_path):
    """q and k rows of every head in one random 4-dimensional subspace: PCA's P spans it, so P W = W."""
    model = tiny("qwen3_next")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in find_mixers(model).values():
            (qa, qr), (ka, kr) = qk_rows(m)
            w = getattr(m, qa).weight
            for h in range(m.num_k_heads):
                basis = torch.randn(8, 4, generator=g)
                for rows in (qr[h], kr[h]):
                    w[rows] = basis @ torch.randn(4, w.shape[1], generator=g)
    model.save_pretrained(tmp_path)
    st = load(tmp_path, scorer="pca", keep=0.5).tensorcomp_stats["modules"]["model.layers.0.linear_attn"]
    assert st["rel_error"] < 1e-5


@pytest.mark.parametrize("scorer", ["drrqr", "pca"])
def test_zeroed_channels_are_the_ones_dropped(tmp_path, scorer):
    dead = [1, 2, 5, 6]
    model = tiny("qwen3_next")
    _zero_channels(model, dead)
    model.save_pretrained(tmp_path)
    out = load(tmp_path, scorer=scorer, keep=0.5)
    st = out.tensorcomp_stats["modules"]["model.layers.0.linear_attn"]
    assert st["rel_error"] < 1e-6  # nothing but zero rows was dropped (or projected away)
    if scorer == "drrqr":
        assert st["kept"] == [[0, 3, 4, 7], [0, 3, 4, 7]]


def test_strong_rrqr_on_a_low_rank_key_space():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(300, 4, generator=g, dtype=torch.float64)
    mix = torch.randn(4, 4, generator=g, dtype=torch.float64)
    a = torch.cat([base, base @ mix, 1e-9 * torch.randn(300, 2, generator=g, dtype=torch.float64)], 1)  # rank 4 in 10
    idx, _ = strong_rrqr(a, 4)
    assert torch.linalg.matrix_rank(a[:, idx]) == 4 and not {8, 9} & set(idx)
    # the strong RRQR bound holds on the result: every rho_ij <= f
    b = torch.randn(200, 12, generator=g, dtype=torch.float64) * torch.logspace(0, -3, 12, dtype=torch.float64)
    idx, _ = strong_rrqr(b, 5, f=1.2)
    perm = idx + [j for j in range(12) if j not in idx]
    r = torch.linalg.qr(b[:, perm], mode="r").R
    inv = torch.linalg.inv(r[:5, :5])
    rho2 = (inv @ r[:5, 5:]).pow(2) + torch.outer(inv.norm(dim=1), r[5:, 5:].norm(dim=0)).pow(2)
    assert float(rho2.max()) <= 1.2**2 + 1e-9
    # PCA finds a rotated 2-dimensional key space
    basis = torch.linalg.qr(torch.randn(6, 2, generator=g, dtype=torch.float64)).Q
    keys = (torch.randn(500, 2, generator=g, dtype=torch.float64) @ basis.T).reshape(500, 1, 6)
    p = pca_projections(keys, 2)[0]
    torch.testing.assert_close(p.T @ p, basis @ basis.T)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "under_no_grad"])
def test_recovery_lora_distillation_is_merged(dirs, grad):
    with torch.set_grad_enabled(grad):  # from_pretrained is often called under no_grad: recovery still trains
        out = load(dirs["qwen3_5"], scorer="l1", keep=0.5, recover_steps=6, recover_lr=1e-2, lora_rank=4)
    rec = out.tensorcomp_stats["finish"]["0"]["recovery"]
    assert rec["steps"] == 6 and rec["kl_last"] < rec["kl_first"]
    assert not [n for n in out.state_dict() if "lora" in n]
    assert type(out.model.layers[0].linear_attn.in_proj_qkv) is torch.nn.Linear


@pytest.mark.parametrize("kw, field", [
    (dict(keep=0.0), "keep"), (dict(keep=1.5), "keep"), (dict(scorer="svd"), "scorer"),
])
def test_bad_settings_fail_at_construction(kw, field):
    with pytest.raises(ValueError, match=f"TensorCompressionConfig.{field}"):
        TensorCompressionConfig(method="state_reduction", calibration=calib(), **kw)


def test_bad_model_or_keep_fails_before_weights_load(dirs, tiny_dirs, monkeypatch):
    import hf_tensorcomp.pipeline as pipeline

    monkeypatch.setattr(pipeline, "compress_model", lambda *a, **k: pytest.fail("compression started"))
    with pytest.raises(ValueError, match="no linear-attention"):
        load(tiny_dirs["llama"], scorer="l1")
    with pytest.raises(ValueError, match=r"TensorCompressionConfig.keep: got 0.05.*8 key channels"):
        load(dirs["qwen3_5"], scorer="l1", keep=0.05)
    with pytest.raises(ValueError, match="TensorCompressionConfig.layers"):
        load(dirs["qwen3_5"], scorer="l1", layers=[0])


class Wrapped(torch.nn.Module):
    """A Gated DeltaNet in a Llama layer's self_attn slot (the way a linearized hybrid holds one)."""

    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.gdn = modeling_qwen3_5.Qwen3_5GatedDeltaNet(cfg, layer_idx)

    def forward(self, hidden_states, **kwargs):
        return self.gdn(hidden_states), None


def test_finder_is_structural_a_wrapped_mixer_in_a_llama_is_pruned(ids):
    from types import SimpleNamespace

    from hf_tensorcomp.pipeline import compress_model
    from tiny import tiny_llama

    model = tiny_llama(vocab_size=VOCAB)
    h = model.config.hidden_size
    cfg = SimpleNamespace(hidden_size=h, linear_num_key_heads=2, linear_key_head_dim=8, linear_num_value_heads=2,
                          linear_value_head_dim=8, linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6,
                          layer_types=["linear_attention"] * 2)
    torch.manual_seed(0)
    model.model.layers[1].self_attn = Wrapped(cfg, 1)
    assert list(find_mixers(model)) == ["model.layers.1.self_attn.gdn"]
    compress_model(model, TensorCompressionConfig(method="state_reduction", keep=0.5, calibration=calib(), progress=False))
    assert model.model.layers[1].self_attn.gdn.head_k_dim == 4
    assert torch.isfinite(logits(model, ids)).all()


def test_grad_scorer_reads_the_loss_gradient_of_the_dense_weights():
    from hf_tensorcomp.calibration.sensitivity import weight_gradients

    model = tiny("qwen3_5")
    ids = calib()
    grads = weight_gradients(model, model.model.layers, ["0.linear_attn"], ids)["0.linear_attn"]
    assert all(p.requires_grad for p in model.parameters()) and all(p.grad is None for p in model.parameters())
    for batch in ids.split(2):
        out = model(input_ids=batch, labels=batch, use_cache=False)
        (out.loss * batch.shape[0]).backward()
    w = model.model.layers[0].linear_attn.in_proj_qkv.weight
    torch.testing.assert_close(grads["in_proj_qkv.weight"], w.grad)
