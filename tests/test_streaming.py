"""Streaming compression (`hf_tensorcomp.compress_checkpoint`): the same factors as in memory, one layer at a time."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_tensorcomp
from hf_tensorcomp import TensorCompressionConfig
from tiny import VOCAB, _tiny

CAL = torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Each tiny architecture saved in many small shards (tied embeddings on the Llama and the Gemma, untied on the
    Qwen3)."""
    out = {}
    for arch in ("llama", "gemma3", "qwen3"):
        torch.manual_seed(0)
        d = tmp_path_factory.mktemp(f"sharded-{arch}")
        _tiny(arch).save_pretrained(d, max_shard_size="20KB")
        assert len(list(d.glob("*.safetensors"))) > 5
        out[arch] = d
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kw", [dict(method="laser", rank=4),
                                dict(method="laser", target=0.7, whiten=True, allocation="relative", calibration=CAL),
                                dict(method="laser", target=0.7, whiten=True, allocation="relative", pivoted=True,
                                     calibration=CAL),
                                dict(method="qlr", rank=4, group_size=16, calibration=CAL),
                                dict(method="tensorllm", ratio=2.0)])
def test_streaming_gives_the_factors_of_in_memory_compression(sharded, tmp_path, arch, kw, ids):
    memory = AutoModelForCausalLM.from_pretrained(sharded[arch], quantization_config=TensorCompressionConfig(progress=False, **kw))
    report = hf_tensorcomp.compress_checkpoint(sharded[arch], tmp_path / "out", TensorCompressionConfig(progress=False, **kw))
    assert (tmp_path / "out" / "model.safetensors.index.json").exists() and len(report["seconds_per_layer"]) == 3
    streamed = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    a, b = memory.state_dict(), streamed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(memory(ids).logits, streamed(ids).logits)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
@pytest.mark.parametrize("kw", [dict(method="qlr", rank=4, group_size=16, calibration=CAL, embedding_bits=4),
                                dict(method="laser", rank=4, embedding_bits=8),
                                dict(method="qlr", target_bytes=0.5, group_size=16, calibration=CAL, allocation="relative",
                                     embedding_bits=8)])
def test_streaming_quantizes_the_embedding_table_as_in_memory(sharded, tmp_path, arch, kw, ids, monkeypatch):
    """``embedding_bits``: the table (GPTQ on the compressed model's final hidden states through the final norm;
    round to nearest without calibration or for an untied embedding) is read, quantized and written a few rows
    at a time, and the checkpoint is bit-identical to in-memory compression's — the tie kept, the table in the
    byte budget counted once. Blocks of 8 rows here: a block boundary that changed a code would show."""
    from hf_tensorcomp import layer_stream

    monkeypatch.setattr(layer_stream, "TABLE_BLOCK_BYTES", 8 * 48 * 8)
    kw = {**kw, "embedding_group_size": 16}
    memory = AutoModelForCausalLM.from_pretrained(sharded[arch], quantization_config=TensorCompressionConfig(progress=False, **kw))
    report = hf_tensorcomp.compress_checkpoint(sharded[arch], tmp_path / "out", TensorCompressionConfig(progress=False, **kw))
    streamed = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    a, b = memory.state_dict(), streamed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "model.embed_tokens.weight_scale" in a and ("lm_head.weight_scale" in a) == (arch == "qwen3")
    tables = {k: v for k, v in report["stats"]["modules"].items() if v["method"] == "embedding"}
    want = {k: v for k, v in memory.config.quantization_config.stats["modules"].items() if v["method"] == "embedding"}
    # the same codes (above); while streaming the error is summed a block of rows at a time, so its last bit may
    # differ and round (to 6 decimals) the other way
    err = {k: (v.pop("rel_error"), want[k].pop("rel_error")) for k, v in tables.items()}
    assert tables == want and all(a == pytest.approx(b, abs=1.5e-6) for a, b in err.values()), err
    assert tables["model.embed_tokens"]["quantizer"] == ("gptq" if "calibration" in kw and arch != "qwen3" else "rtn")
    if "target_bytes" in kw:
        assert report["stats"]["allocation"] == memory.config.quantization_config.stats["allocation"]
    with torch.no_grad():
        assert torch.equal(memory(ids).logits, streamed(ids).logits)


HEAL = {"mode": "layerwise", "layer_steps": 8, "samples": 8, "batch_size": 2}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kw, heal", [
    (dict(method="laser", rank=1, calibration=CAL), {"lr": 1e-2}),  # no statistics: no calibration runner
    (dict(method="laser", rank=1, pivoted=True, calibration=CAL), {"lr": 1e-2}),  # trained plain, stored pivoted
    # scales too; round to nearest on min-max grids, unrotated: what leaves this tiny model something for healing to
    # improve (GPTQ's codes leave it too little since the float32 sweep)
    (dict(method="qlr", bits=2, rank=2, group_size=16, calibration=CAL, quantizer="rtn", grid="minmax", rotate=False,
          rounds=2),
     {"lr": 3e-3, "train": "all"}),
])
def test_streaming_heals_each_layer_as_layerwise_healing_after_in_memory_compression(sharded, tmp_path, arch, kw, heal,
                                                                                     ids):
    """``heal={"mode": "layerwise"}`` while streaming: each layer trained toward its dense outputs while it is in
    memory gives the checkpoint that in-memory compression followed by layer-wise healing gives, bit for bit
    (same windows, same order: the calibration stream never sees a healed layer, the healing stream does)."""
    heal = {**HEAL, **heal}
    plain = AutoModelForCausalLM.from_pretrained(sharded[arch], quantization_config=TensorCompressionConfig(progress=False, **kw))
    memory = AutoModelForCausalLM.from_pretrained(sharded[arch], quantization_config=TensorCompressionConfig(
        progress=False, heal=heal, **kw))
    mem_report = memory.config.quantization_config.stats["heal"]
    assert mem_report["improved"]  # else in-memory healing puts the model back and there is nothing to compare
    report = hf_tensorcomp.compress_checkpoint(sharded[arch], tmp_path / "out", TensorCompressionConfig(progress=False,
                                                                                                      heal=heal, **kw))
    streamed = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    a, b, c = memory.state_dict(), streamed.state_dict(), plain.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)  # healing changed the model
    got = report["stats"]["heal"]
    assert got["streamed"] and got["layerwise"] == mem_report["layerwise"] and got["tokens"] == mem_report["tokens"]
    assert all(r["mse_after"] <= r["mse_before"] for r in got["layerwise"]["layers"])
    assert streamed.config.quantization_config.stats["heal"]["streamed"]
    assert "healed: layer by layer while streaming" in (tmp_path / "out" / "README.md").read_text()  # the card
    if "bits" in kw:  # the healing stream's states on disk too: the same checkpoint, and no file left behind
        (tmp_path / "states").mkdir()
        hf_tensorcomp.compress_checkpoint(sharded[arch], tmp_path / "disk", TensorCompressionConfig(progress=False, heal=heal,
                                                                                                   **kw), states_dir=tmp_path / "states")
        d = AutoModelForCausalLM.from_pretrained(tmp_path / "disk").state_dict()
        assert all(torch.equal(d[k], b[k]) for k in b) and not list((tmp_path / "states").iterdir())
    with torch.no_grad():  # equal weights; a reloaded tensor's (unaligned) address can move a product by an ulp
        torch.testing.assert_close(memory(ids).logits, streamed(ids).logits, rtol=0, atol=1e-6)


def test_streaming_refuses_table_settings_it_cannot_honour(sharded, tmp_path):
    for kw, field in [(dict(method="qlr", target_bytes=0.5, group_size=16, calibration=CAL, allocation="relative",
                            embedding_bits="auto"), "embedding_bits"),
                      (dict(method="qlr", rank=4, group_size=16, calibration=CAL, embedding_bits=8, propagate=False),
                       "propagate")]:
        with pytest.raises(ValueError, match=rf"TensorCompressionConfig\.{field}: got .*; allowed: .*compress_checkpoint"):
            hf_tensorcomp.compress_checkpoint(sharded["llama"], tmp_path / "x", TensorCompressionConfig(progress=False, **kw))
        assert not (tmp_path / "x").exists()
    for device in ("tpu", "cuda:7" if torch.cuda.device_count() < 8 else "tpu"):
        with pytest.raises(ValueError, match=r"compress_checkpoint\.device: got .*; allowed: 'cpu', or 'cuda'"):
            hf_tensorcomp.compress_checkpoint(sharded["llama"], tmp_path / "x", TensorCompressionConfig(method="laser", rank=4),
                                              device=device)


def test_a_failed_run_leaves_no_output_and_overwrite_is_explicit(sharded, tmp_path, monkeypatch):
    from hf_tensorcomp import streaming

    def boom(self, li, write):
        raise RuntimeError("killed")

    cfg = dict(method="laser", rank=4, progress=False)
    with monkeypatch.context() as m:
        m.setattr(streaming.LayerStream, "_release", boom)
        with pytest.raises(RuntimeError, match="killed"):
            hf_tensorcomp.compress_checkpoint(sharded["llama"], tmp_path / "out", TensorCompressionConfig(**cfg))
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir()]
    hf_tensorcomp.compress_checkpoint(sharded["llama"], tmp_path / "out", TensorCompressionConfig(**cfg))
    with pytest.raises(ValueError, match="out: .* exists and is not empty; allowed: .* overwrite=True"):
        hf_tensorcomp.compress_checkpoint(sharded["llama"], tmp_path / "out", TensorCompressionConfig(**cfg))
    hf_tensorcomp.compress_checkpoint(sharded["llama"], tmp_path / "out", TensorCompressionConfig(**cfg), overwrite=True)


@pytest.mark.parametrize("kw, match", [
    (dict(method="laser", target=0.7, whiten=True, weighting="fisher", calibration=CAL), "backward pass of the whole"),
    (dict(method="trawl", rank=4, formulation="whole_model"), "spans several decoder layers"),
    (dict(method="laser", rank=4, calibration=CAL, heal=True), r"heal\.mode: got 'e2e'; allowed: 'layerwise'"),
    (dict(method="laser", rank=4, calibration=CAL, heal={"mode": "both"}), r"heal\.mode: got 'both'"),
    (dict(method="laser", rank=4, calibration=CAL, heal={"mode": "layerwise"}, embedding_bits=8),
     r"embedding_bits: got 8; allowed: None with compress_checkpoint and heal="),
])
def test_what_needs_the_whole_model_is_refused_up_front(sharded, tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        hf_tensorcomp.compress_checkpoint(sharded["llama"], tmp_path / "out", TensorCompressionConfig(progress=False, **kw))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kw", [dict(method="laser", rank=4),
                                dict(method="laser", target=0.7, whiten=True, allocation="relative", calibration=CAL)])
def test_at_most_one_decoder_layer_is_ever_in_memory(sharded, tmp_path, monkeypatch, kw):
    from hf_tensorcomp import streaming

    most = []
    real = streaming.LayerStream._load

    def load(self, li):
        real(self, li)
        most.append(sum(any(p.device.type != "meta" for p in layer.parameters()) for layer in self.layers))

    monkeypatch.setattr(streaming.LayerStream, "_load", load)
    hf_tensorcomp.compress_checkpoint(sharded["gemma3"], tmp_path / "out", TensorCompressionConfig(progress=False, **kw))
    assert most and max(most) == 1


DISK_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk",
            "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


def test_a_compressed_checkpoint_reloads_with_layers_offloaded_to_disk(tiny_dirs, tmp_path, ids):
    """Compressing while accelerate offloads is refused; reloading a compressed checkpoint with offload works."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(
        method="laser", rank=4, progress=False))
    model.save_pretrained(tmp_path / "c")
    with torch.no_grad():
        ref = model(ids).logits
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "c", device_map=DISK_MAP, offload_folder=tmp_path / "off")
    assert again.hf_device_map["model.layers.2"] == "disk"
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref)


@pytest.mark.parametrize("kw", [dict(method="tensorllm", ratio=2.0), dict(method="qlr", rank=4, group_size=16, calibration=CAL),
                                dict(method="trawl", rank=4), dict(method="einsort", target=0.5),
                                dict(method="laser", rank=4, factor_bits=4, group_size=16)])
def test_offloading_shared_or_quantized_factors_is_refused(tiny_dirs, tmp_path, kw):
    """Before, TensorLLM's shared factors offloaded to disk gave wrong logits silently (a container's tensors
    are read by other modules, so accelerate's hooks never bring them back)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(progress=False, **kw))
    model.save_pretrained(tmp_path / "c")
    with pytest.raises(ValueError, match="offloads part of the model.*outputs would be wrong"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "c", device_map=DISK_MAP, offload_folder=tmp_path / "off")


_MEMORY_SCRIPT = r"""
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
import hf_tensorcomp
from hf_tensorcomp import TensorCompressionConfig

src, warm, out, variant = sys.argv[1:5]
def make(path, layers, vocab, hidden, inter):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="50MB")
make(src, 12, 64000, 768, 1536)
make(warm, 2, 1000, 64, 128)
ids = torch.randint(0, 1000, (8, 64), generator=torch.Generator().manual_seed(0))
extra = (dict(embedding_bits=8) if variant == "table" else
         dict(heal={"mode": "layerwise", "samples": 8, "layer_steps": 2, "batch_size": 2}))
cfg = lambda: TensorCompressionConfig(method="laser", rank=64, whiten=True, calibration=ids, progress=False, **extra)
hf_tensorcomp.compress_checkpoint(warm, out + "-warm", cfg())  # imports and first-call allocations out of the way
report = hf_tensorcomp.compress_checkpoint(src, out, cfg())
report.pop("stats")
print(json.dumps(report))
"""


@pytest.mark.parametrize("variant", ["table", "heal"])
def test_streaming_peak_memory_stays_within_the_bound(tmp_path, variant):
    """Measured in a fresh process on a model with enlarged layers and a large untied vocabulary (12 layers of
    24 MB and two 197 MB embedding matrices in float32, 676 MB in all), both tables quantized to 8 bits
    ("table") or every layer healed layer-wise while it is in memory ("heal"): the peak resident memory
    above the start stays within 1.5 x (one layer + its compressed form + the calibration states + its
    statistics + a block of table rows | healing's states and training), itself well below the model.
    Holding every layer, or reading or quantizing a table whole, breaks it."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(tmp_path / "src"), str(tmp_path / "warm"),
                          str(tmp_path / "out"), variant], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    model_mb = sum(f.stat().st_size for f in (tmp_path / "src").glob("*.safetensors")) / 2**20
    assert model_mb > 600
    assert report["within_bound"], {k: v for k, v in report.items() if k not in ("src", "out", "seconds_per_layer")}
    assert report["peak_above_start_mb"] <= report["bound_mb"]["bound"] < model_mb / 2, report
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert again.lm_head.weight.shape == (64000, 768)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_calibration_states_on_disk_give_the_same_checkpoint(sharded, tmp_path, arch):
    """``states_dir``: the calibration hidden states go to files there, one per batch, read back one at a time
    (GPTQ's and the correction's statistics, propagation and the paired dense stream alike); the checkpoint is
    bit-identical, the folder is left as it was, and the bound counts one batch of states instead of all."""
    from hf_tensorcomp.calibration.pipeline import DiskStates, LayerwiseRunner
    from hf_tensorcomp.plan import find_decoder_layers

    cfg = lambda: TensorCompressionConfig(method="qlr", rank=4, group_size=16, calibration=CAL, calibration_batch_size=2,
                                          progress=False)
    (tmp_path / "states").mkdir()
    (tmp_path / "states" / "mine.txt").write_text("kept")
    plain = hf_tensorcomp.compress_checkpoint(sharded[arch], tmp_path / "plain", cfg())
    disk = hf_tensorcomp.compress_checkpoint(sharded[arch], tmp_path / "disk", cfg(), states_dir=tmp_path / "states")
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "plain").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "disk").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [p.name for p in (tmp_path / "states").iterdir()] == ["mine.txt"]
    assert disk["bound_mb"]["calibration_states"] < plain["bound_mb"]["calibration_states"]  # 2 of 8 samples
    model = AutoModelForCausalLM.from_pretrained(sharded[arch])
    runner = LayerwiseRunner(model, *find_decoder_layers(model), CAL, batch_size=2, states_dir=tmp_path / "runner")
    assert isinstance(runner.hidden, DiskStates) and len(list((tmp_path / "runner").rglob("*.safetensors"))) == 4
    memory = LayerwiseRunner(model, *find_decoder_layers(model), CAL, batch_size=2)
    assert all(torch.equal(x, y) for x, y in zip(runner.hidden, memory.hidden))
    assert (runner.samples, runner.n_tokens) == (memory.samples, memory.n_tokens) == (8, 8 * 32)
    runner.close()
    assert not list((tmp_path / "runner").rglob("*.safetensors"))
    with pytest.raises(ValueError, match=r"compress_checkpoint\.states_dir: got .*; allowed: None \(states in memory\) or an existing folder"):
        hf_tensorcomp.compress_checkpoint(sharded[arch], tmp_path / "x", cfg(), states_dir=tmp_path / "missing")


def test_qlr_auto_allocation_is_fisher_in_memory_and_relative_when_streaming(sharded, tmp_path, ids):
    """``allocation="auto"`` (qlr's default) settles to ``"fisher"`` in memory and to ``"relative"`` while streaming
    (no backward pass of the whole model there): each run equals the one naming its allocation, and the saved
    config records which ran."""
    kw = dict(method="qlr", target_bytes=0.4, group_size=16, calibration=CAL, progress=False)
    auto = AutoModelForCausalLM.from_pretrained(sharded["llama"], quantization_config=TensorCompressionConfig(**kw))
    fisher = AutoModelForCausalLM.from_pretrained(sharded["llama"], quantization_config=TensorCompressionConfig(
        allocation="fisher", **kw))
    assert auto.config.quantization_config.entries[0].options["allocation"] == "fisher"
    a, f = auto.state_dict(), fisher.state_dict()
    assert a.keys() == f.keys() and all(torch.equal(a[k], f[k]) for k in a)
    hf_tensorcomp.compress_checkpoint(sharded["llama"], tmp_path / "auto", TensorCompressionConfig(**kw))
    hf_tensorcomp.compress_checkpoint(sharded["llama"], tmp_path / "rel", TensorCompressionConfig(allocation="relative", **kw))
    s_auto = AutoModelForCausalLM.from_pretrained(tmp_path / "auto")
    s_rel = AutoModelForCausalLM.from_pretrained(tmp_path / "rel")
    assert s_auto.config.quantization_config.entries[0].options["allocation"] == "relative"
    a, r = s_auto.state_dict(), s_rel.state_dict()
    assert all(torch.equal(a[k], r[k]) for k in a)
