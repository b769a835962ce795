"""Linearize: softmax attention layers -> Gated DeltaNet (transformers' Qwen3.5 mixer), distilled, saved, reloaded."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hf_tensorcomp import TensorCompressionConfig
from hf_tensorcomp.layers import GatedDeltaNetAttention
from hf_tensorcomp.hybrid import distill_logits
from tiny import VOCAB


def _calibration():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (8, 24), generator=g)


@pytest.fixture(scope="module")
def hybrid(tiny_dirs, tmp_path_factory):
    """The tiny Llama (3 layers, 6 query / 2 KV heads of 8) with layer 1 linearized, saved: (model, folder)."""
    cfg = TensorCompressionConfig(method="linearize", layers=[1], calibration=_calibration(), epochs=8, progress=False)
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg).eval()
    out = tmp_path_factory.mktemp("hybrid")
    m.save_pretrained(out)
    return m, out


def test_init_from_attention(tiny_dirs):
    dense = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    attn = dense.model.layers[0].self_attn
    new = GatedDeltaNetAttention.from_attention(attn, 48, 6, 2, 8, layer_idx=0)
    g = new.gdn
    assert (g.num_k_heads, g.head_k_dim, g.num_v_heads, g.head_v_dim) == (6, 8, 6, 8)
    q, k, v = g.in_proj_qkv.weight.split([48, 48, 48])
    assert torch.equal(q, attn.q_proj.weight)
    # KV head j serves query heads 3j..3j+2 (transformers' repeat_kv order)
    k_heads, kv_heads = k.reshape(6, 8, 48), attn.k_proj.weight.reshape(2, 8, 48)
    assert all(torch.equal(k_heads[h], kv_heads[h // 3]) for h in range(6))
    assert torch.equal(v.reshape(6, 8, 48)[4], attn.v_proj.weight.reshape(2, 8, 48)[1])
    assert torch.equal(g.out_proj.weight, attn.o_proj.weight)
    conv = g.conv1d.weight  # (channels, 1, taps): identity = last tap 1
    assert torch.equal(conv[:, 0, -1], torch.ones(144)) and not conv[:, 0, :-1].any()
    x = torch.randn(2, 5, 48)
    out, weights = new(x, position_embeddings=None, attention_mask=None)
    assert out.shape == (2, 5, 48) and weights is None
    assert not out.any()  # the output gate starts at zero


def test_layerwise_distillation_reduces_error(hybrid):
    m, _ = hybrid
    st = m.config.quantization_config.stats["modules"]
    assert list(st) == ["model.layers.1.self_attn"]
    assert st["model.layers.1.self_attn"]["rel_mse_init"] == 1.0
    assert st["model.layers.1.self_attn"]["rel_mse"] < 0.5
    assert isinstance(m.model.layers[1].self_attn, GatedDeltaNetAttention)
    assert not isinstance(m.model.layers[0].self_attn, GatedDeltaNetAttention)


def test_default_layers_every_third(tiny_dirs):
    cfg = TensorCompressionConfig(method="linearize", every=2, calibration=_calibration(), epochs=4, progress=False)
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg)
    assert [i for i, layer in enumerate(m.model.layers) if isinstance(layer.self_attn, GatedDeltaNetAttention)] == [1]


@torch.no_grad()
def test_save_reload_identical_and_generate(hybrid, ids):
    m, out = hybrid
    spec = m.config.quantization_config.compressed_modules["model.layers.1.self_attn"]
    assert spec == {"layer": "gated_deltanet", "hidden_size": 48, "num_k_heads": 6, "head_k_dim": 8, "num_v_heads": 6,
                    "head_v_dim": 8, "conv_kernel": 4, "layer_idx": 1, "norm_eps": 1e-6}
    again, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert torch.equal(again(ids).logits, m(ids).logits)
    cached = again.generate(ids[:1], max_new_tokens=6, min_new_tokens=6, do_sample=False)
    plain = again.generate(ids[:1], max_new_tokens=6, min_new_tokens=6, do_sample=False, use_cache=False)
    assert cached.shape == (1, 17) and torch.equal(cached, plain)


@torch.no_grad()
def test_left_padding_is_exact(hybrid, ids):
    m, _ = hybrid
    x = ids[:1, :7]
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), x], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)], 1)
    a = m(x).logits[0, -1]
    b = m(padded, attention_mask=mask).logits[0, -1]
    assert torch.allclose(a, b, atol=1e-4)


def test_end_to_end_distillation_trains_only_new_layers(hybrid, tiny_dirs):
    m, out = hybrid
    student = AutoModelForCausalLM.from_pretrained(out)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()
    frozen = {n: p.clone() for n, p in student.named_parameters() if ".self_attn.gdn." not in n}
    losses = distill_logits(student, teacher, _calibration(), steps=6, lr=1e-3, batch_size=4, progress=False)
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, frozen[n]) for n, p in student.named_parameters() if n in frozen)
    assert not torch.equal(student.model.layers[1].self_attn.gdn.in_proj_qkv.weight,
                           m.model.layers[1].self_attn.gdn.in_proj_qkv.weight)


def test_bad_input_fails_clearly(tiny_dirs):
    with pytest.raises(ValueError, match=r"layers: got 7; allowed: ints in \[-3, 2\]"):
        AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(
            method="linearize", layers=[7], calibration=_calibration(), progress=False))
    with pytest.raises(ValueError, match="mode.*'factorized' for method 'linearize'"):
        AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(
            method="linearize", mode="dense", calibration=_calibration(), progress=False))
    assert TensorCompressionConfig(method="linearize").calibration == "wikipedia+owt"  # none named: both corpora
    with pytest.raises(ValueError, match="every: got 0; allowed: an int >= 1"):
        TensorCompressionConfig(method="linearize", every=0, calibration="wikipedia")


def test_plain_transformers_would_stop(hybrid):
    """A (1,)-shaped tensor sits under the softmax attention's q_proj.weight (48 x 48): transformers without
    hf_tensorcomp stops there with a size mismatch (that path is run end to end in test_save_reload)."""
    _, out = hybrid
    with safe_open(out / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (1,)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (48, 48)
    assert shapes["model.layers.1.self_attn.gdn.in_proj_qkv.weight"] == (144, 48)


@torch.no_grad()
def test_key_channels_sliced_in_place_save_and_reload(hybrid, tmp_path, ids):
    """The contract with a key-channel pruning method: slice gdn.in_proj_qkv / gdn.conv1d rows in place, update
    head_k_dim / key_dim / conv_dim, save: the spec follows the live module and the smaller model reloads."""
    _, out = hybrid
    model = AutoModelForCausalLM.from_pretrained(out)
    g = model.model.layers[1].self_attn.gdn
    nk, dk = g.num_k_heads, g.head_k_dim
    keep = torch.cat([torch.arange(h * dk, h * dk + dk // 2) for h in range(nk)])  # per head, the same count
    rows = torch.cat([keep, g.key_dim + keep, 2 * g.key_dim + torch.arange(g.value_dim)])  # [q | k | v]
    g.in_proj_qkv.weight = torch.nn.Parameter(g.in_proj_qkv.weight[rows].clone())
    g.conv1d.weight = torch.nn.Parameter(g.conv1d.weight[rows].clone())
    g.head_k_dim, g.key_dim = dk // 2, nk * dk // 2
    g.conv_dim = g.in_proj_qkv.out_features = 2 * g.key_dim + g.value_dim
    ref = model(ids).logits
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.config.quantization_config.compressed_modules["model.layers.1.self_attn"]["head_k_dim"] == dk // 2
    assert again.model.layers[1].self_attn.gdn.in_proj_qkv.weight.shape == (2 * 24 + 48, 48)
    assert torch.equal(again(ids).logits, ref)


@torch.no_grad()
def test_generate_with_first_layer_linear(tiny_dirs, ids):
    """The cache's length is read from layer 0: it must stay right when layer 0 is the Gated DeltaNet one."""
    cfg = TensorCompressionConfig(method="linearize", layers=[0, 2], calibration=_calibration(), epochs=4, progress=False)
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg).eval()
    cached = m.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    plain = m.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, use_cache=False)
    assert torch.equal(cached, plain)


def test_cli_recipe_parses_and_refuses_a_full_folder(tmp_path, capsys):
    from hf_tensorcomp.cli import build_parser, main
    from hf_tensorcomp.hybrid import DEFAULTS

    (tmp_path / "x").write_text("")
    recipe_file = str(Path(__file__).parent.parent / "recipes" / "linearize_smollm2.json")
    assert main(["linearize", "--recipe", recipe_file, "--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
    args = build_parser().parse_args(["linearize", "--out", "o"])
    assert {k: getattr(args, k) for k in DEFAULTS} == DEFAULTS  # the CLI's defaults are the bundled recipe's
    import json

    recipe = json.loads(Path(recipe_file).read_text())
    assert {k: v for k, v in recipe.items() if k in DEFAULTS} == {k: v for k, v in DEFAULTS.items() if k in recipe}


def test_missing_mixer_tensor_fails_before_loading(hybrid, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    _, out = hybrid
    for f in out.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.gdn.A_log"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.gdn.A_log: missing from the checkpoint"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_state_reduction_on_the_hybrid_through_compress(hybrid, tmp_path, ids):
    """The README's state-reduction flow on a linearized checkpoint (which carries its own hf_tensorcomp config, so
    from_pretrained ignores a second one): load, `hf_tensorcomp.compress`, save, reload."""
    import hf_tensorcomp

    _, out = hybrid
    model = AutoModelForCausalLM.from_pretrained(out)
    cfg = TensorCompressionConfig(method="state_reduction", scorer="drrqr", keep=0.5, calibration=_calibration(),
                                  progress=False)
    assert hf_tensorcomp.compress(model, cfg) is model
    g = model.model.layers[1].self_attn.gdn
    assert (g.head_k_dim, g.in_proj_qkv.weight.shape[0]) == (4, 2 * 24 + 48)
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    saved = again.config.quantization_config
    assert [e.method for e in saved.entries] == ["linearize"]  # pruning reshaped the layer; nothing else to rebuild
    assert saved.compressed_modules["model.layers.1.self_attn"]["head_k_dim"] == 4
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref)


def test_compress_a_loaded_dense_model_equals_compressing_at_load(tiny_dirs, tmp_path, ids):
    import hf_tensorcomp

    cfg = dict(method="laser", rank=4, targets=["mlp.*"], progress=False)
    at_load = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(**cfg))
    model = hf_tensorcomp.compress(AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]), TensorCompressionConfig(**cfg))
    with torch.no_grad():
        ref = model(ids).logits
        assert torch.equal(ref, at_load(ids).logits)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.config.quantization_config.compressed_modules == at_load.config.quantization_config.compressed_modules
    with torch.no_grad():
        assert torch.allclose(again(ids).logits, ref, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="TensorCompressionConfig"):
        hf_tensorcomp.compress(again, {"method": "laser"})


def test_factoring_a_hybrid_stacks_its_entries(hybrid, tmp_path, ids):
    """compression_config= on a checkpoint that is already a hf_tensorcomp model compresses it further."""
    import hf_tensorcomp

    _, out = hybrid
    cfg = TensorCompressionConfig(method="laser", rank=4, targets=["mlp.*"], progress=False)
    model = hf_tensorcomp.AutoModelForCausalLM.from_pretrained(out, compression_config=cfg)
    assert isinstance(model.model.layers[1].self_attn, GatedDeltaNetAttention)
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert [e.method for e in again.config.quantization_config.entries] == ["linearize", "laser"]
    assert type(again.model.layers[0].mlp.up_proj).__name__ == "LowRankLinear"
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref)


def test_model_card_names_the_layers_a_method_changed():
    """layers=None (linearize's every-k default) shows the layers it actually changed, not "all"."""
    from types import SimpleNamespace

    from hf_tensorcomp.integration.hub import _layers

    stats = {"modules": {f"model.layers.{i}.self_attn": {"method": "linearize"} for i in (2, 5, 8)}}
    assert _layers(SimpleNamespace(layers=None, method="linearize"), stats, 9) == "2, 5, 8"
    assert _layers(SimpleNamespace(layers=None, method="linearize"), stats, 3) == "all"
    assert _layers(SimpleNamespace(layers=[0], method="linearize"), stats, 9) == "0"
    assert _layers(SimpleNamespace(layers=[-1, 2, -7], method="linearize"), stats, 9) == "2, 8"  # counted from the end, once each
