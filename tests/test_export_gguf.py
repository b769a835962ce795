"""`hf_tensorcomp.export(model, out, format="gguf")`: read back with gguf's own reader and de-quantizer — the codes
in GGUF blocks equal to the library's de-quantized weights (4/5-bit: up to float16 rounding of m; 6-bit exact;
8-bit re-scaled where |code - zero| > 127, within a scale step), q/k rows in llama.cpp's rope order, the llama and
tokenizer metadata, the LoRA adapter equal to lora_A / lora_B; a forward pass with llama.cpp's semantics (adjacent
pair rope, alpha-0 adapter) from the files alone gives the library's logits; refusals name the field."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import hf_tensorcomp
from hf_tensorcomp import TensorCompressionConfig
from hf_tensorcomp.integration.export_gguf import qk_rows
from hf_tensorcomp.methods.qlr import QuantizedLowRankLinear

gguf = pytest.importorskip("gguf")
sys.path.insert(0, str(Path(__file__).parent))
from test_quantized import calib  # noqa: E402

VOCAB = 101
# every width, each in the GGUF type it maps to; group sizes multiples of 32 (GGUF's blocks)
CASES = {"4bit-rank4-embeddings": {"bits": 4, "rank": 4, "embedding_bits": 4, "embedding_group_size": 32},
         "2bit-g64": {"bits": 2, "rank": 2, "group_size": 64},
         "5bit-untied-head": {"bits": 5, "rank": 3, "untied": True, "embedding_bits": 4, "embedding_group_size": 64},
         "3bit-8bit-tables": {"bits": 3, "rank": 2, "untied": True, "embedding_bits": 8, "embedding_group_size": 64},
         "6bit": {"bits": 6, "rank": 2},
         "8bit-rank0": {"bits": 8, "rank": 0}}
TYPE = {2: "Q4_1", 3: "Q4_1", 4: "Q4_1", 5: "Q5_1", 6: "Q8_0", 8: "Q8_0"}


def _tokenizer(folder: Path) -> None:
    """A byte-level BPE of 101 tokens (3 special, 27 characters, 71 merges) saved in `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + list("abcdefghijklmnopqrstuvwxyz") + ["Ġ"])}
    merges = []
    for a in "Ġabcdefghij":
        for b in "abcdefg":
            if len(vocab) < VOCAB:
                merges.append((a, b))
                vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                            unk_token="<|endoftext|>").save_pretrained(folder)


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """Tiny random Llamas whose widths are multiples of 32 (GGUF's blocks; tiny.py's are 48 wide), with a BPE
    tokenizer: {"tied": folder, "untied": folder}."""
    out = {}
    for tie in (True, False):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, rope_theta=5000.0,
                          initializer_range=0.1)  # sharper attention than 0.02: the rope order matters
        d = tmp_path_factory.mktemp("gguf-llama")
        LlamaForCausalLM(cfg).save_pretrained(d)
        _tokenizer(d)
        out["tied" if tie else "untied"] = d
    return out


def _qlr(folder, **kw):
    cfg = TensorCompressionConfig(method="qlr", calibration=calib(), progress=False,
                                  **{"group_size": 32, "rotate": False, **kw})
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=cfg).eval()


@pytest.fixture(scope="module")
def exported(llama_dirs, tmp_path_factory):
    """{case: (model, report, GGUFReader of model.gguf, GGUFReader of adapter.gguf or None, warnings)}."""
    out = {}
    for case, kw in CASES.items():
        kw = dict(kw)
        folder = llama_dirs["untied" if kw.pop("untied", False) else "tied"]
        torch.manual_seed(0)
        m = _qlr(folder, **kw)
        dest = tmp_path_factory.mktemp("gguf") / case
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = hf_tensorcomp.export(m, dest, format="gguf")
        adapter = gguf.GGUFReader(report["adapter"]) if report["adapter"] else None
        out[case] = (m, report, gguf.GGUFReader(report["base"]), adapter,
                     [str(w.message) for w in caught if "export:" in str(w.message)])
    return out


def _tensors(reader) -> dict:
    return {t.name: t for t in reader.tensors}


def _value(reader, key):
    return reader.fields[key].contents()


def _dequantized(t) -> np.ndarray:
    """gguf's own de-quantization of a stored tensor, as (rows, cols) in numpy's order."""
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))


def _qlr_layers(m):
    return {n: layer for n, layer in m.named_modules() if isinstance(layer, QuantizedLowRankLinear)}


def _gguf_name(hf: str) -> str:
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2).get_name(hf)


def _unpermute(w: np.ndarray, name: str, m) -> np.ndarray:
    """The rows of a GGUF q/k matrix back in the HF order (others as they are)."""
    heads = {"attn_q": m.config.num_attention_heads, "attn_k": m.config.num_key_value_heads}
    kind = name.split(".")[2]
    if kind not in heads:
        return w
    back = torch.argsort(qk_rows(w.shape[0], heads[kind])).numpy()
    return w[back]


def _bound(q, kind: str) -> np.ndarray:
    """The asserted bound per value of |GGUF's value - the library's|: Q4_1/Q5_1 round only m = -scale x zero to
    float16 (half an ulp: 2^-11 |m|, or 2^-25 below float16's normal range); Q8_0 is exact but for 8-bit blocks
    written at d = 2 scale (half a scale step; a whole one at |code - zero| = 255)."""
    rows, cols = q.shape
    per = lambda t: np.repeat(t.cpu().float().numpy().reshape(rows, -1), q.group_size, 1)[:, :cols]  # noqa: E731
    scale, zero = per(q.scale), per(q.zero)
    if kind in ("Q4_1", "Q5_1"):
        return np.maximum(scale * zero * 2.0**-11, 2.0**-25)
    return scale if q.bits == 8 else np.zeros_like(scale)


@pytest.mark.parametrize("case", list(CASES))
def test_codes_in_gguf_blocks_equal_the_librarys_weights(exported, case):
    m, report, reader, _, caught = exported[case]
    stored = _tensors(reader)
    bits = CASES[case]["bits"]
    assert any(line.startswith(f"{bits}-bit:") and TYPE[bits] in line for line in report["report"])
    for name, layer in _qlr_layers(m).items():
        key = _gguf_name(name)
        t = stored[f"{key}.weight"]
        assert t.tensor_type.name == TYPE[bits], name
        q = layer.quantized("weight")
        ours = q.dequantize(torch.float32).numpy()
        theirs = _unpermute(_dequantized(t), key, m)
        err = np.abs(theirs - ours)
        assert (err <= _bound(q, TYPE[bits])).all(), (name, err.max())
        if bits == 6:
            assert err.max() == 0
        if bits in (4, 5):  # the float16 d of each block is the scale itself: read from the raw bytes
            size = 20 if bits == 4 else 24
            raw = t.data.reshape(-1, size)[:, :2].copy().view(np.float16).reshape(q.shape[0], -1)
            per_block = q.scale.view(q.shape[0], -1).numpy().repeat(q.group_size // 32, 1)[:, : raw.shape[1]]
            assert np.array_equal(_unpermute(raw, key, m), per_block)
    if bits == 8:  # re-scaled somewhere (random weights, min-max grid): said and warned
        assert any("re-quantized" in line for line in report["report"]) and any("8-bit" in w for w in caught)
    else:
        assert not [w for w in caught if f"{bits}-bit" in w]


def test_the_nibble_order_is_ggmls(exported):
    """Q4_1 bytes read by hand: byte j of a block holds code j (low nibble) and code j + 16 (high nibble)."""
    m, _, reader, _, _ = exported["4bit-rank4-embeddings"]
    layer = m.get_submodule("model.layers.0.mlp.down_proj")
    q = layer.quantized("weight")
    t = _tensors(reader)["blk.0.ffn_down.weight"]
    qs = t.data.reshape(q.shape[0], -1, 20)[..., 4:]
    codes = np.concatenate([qs & 15, qs >> 4], -1).reshape(q.shape)
    assert np.array_equal(codes, q.codes[: q.shape[0] * q.shape[1]].view(q.shape).numpy())


def test_embeddings_quantized_as_blocks_and_the_head_tied_or_written(exported):
    m, report, reader, _, _ = exported["4bit-rank4-embeddings"]
    stored = _tensors(reader)
    emb = m.get_input_embeddings()
    assert stored["token_embd.weight"].tensor_type.name == "Q4_1" and "output.weight" not in stored
    err = np.abs(_dequantized(stored["token_embd.weight"]) - emb.quantized("weight").dequantize().numpy())
    assert (err <= _bound(emb.quantized("weight"), "Q4_1")).all()
    m5, _, reader5, _, _ = exported["5bit-untied-head"]
    stored5 = _tensors(reader5)
    assert stored5["token_embd.weight"].tensor_type.name == "Q4_1" and stored5["output.weight"].tensor_type.name == "Q4_1"
    m8, report8, reader8, _, _ = exported["3bit-8bit-tables"]
    stored8 = _tensors(reader8)
    assert stored8["token_embd.weight"].tensor_type.name == "Q8_0" and stored8["output.weight"].tensor_type.name == "Q8_0"
    for m_, stored_, kind in ((m5, stored5, "Q4_1"), (m8, stored8, "Q8_0")):
        for key, table in (("token_embd.weight", m_.get_input_embeddings()), ("output.weight", m_.get_output_embeddings())):
            q = table.quantized("weight")
            assert (np.abs(_dequantized(stored_[key]) - q.dequantize().numpy()) <= _bound(q, kind)).all()
    assert any(line.startswith("8-bit: 2 tensors as Q8_0") for line in report8["report"])
    m2, _, reader2, _, _ = exported["6bit"]  # no embedding_bits: the table as it is, float32
    t = _tensors(reader2)["token_embd.weight"]
    assert t.tensor_type.name == "F32" and np.array_equal(_dequantized(t), m2.get_input_embeddings().weight.detach().numpy())
    assert _tensors(reader2)["blk.1.attn_norm.weight"].tensor_type.name == "F32"


def test_q_and_k_rows_in_llama_cpp_rope_order(exported):
    """Un-permuted they are the library's rows (above); here: llama.cpp's rope (adjacent pairs) on the GGUF rows is
    HF's rope (halves) on the library's rows, moved — and the rows are not stored in the HF order."""
    m, _, reader, _, _ = exported["6bit"]  # exact codes: the comparison is exact
    stored = _tensors(reader)
    d, base = 16, 5000.0
    x = torch.randn(5, 64, dtype=torch.float64)
    pos = torch.arange(5, dtype=torch.float64)[:, None]
    for proj, key, heads in (("q_proj", "attn_q", 4), ("k_proj", "attn_k", 2)):
        w_hf = m.get_submodule(f"model.layers.1.self_attn.{proj}").quantized("weight").dequantize(torch.float64)
        w_gguf = torch.from_numpy(_dequantized(stored[f"blk.1.{key}.weight"])).double()
        assert not torch.equal(w_gguf, w_hf)
        ang = pos * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (5, d/2)
        cos, sin = ang.cos(), ang.sin()
        hf = (x @ w_hf.T).view(5, heads, 2, d // 2)  # HF: rotate_half, pairs (i, i + d/2)
        a, b = hf[:, :, 0], hf[:, :, 1]
        hf_rot = torch.stack([a * cos[:, None] - b * sin[:, None], b * cos[:, None] + a * sin[:, None]], 2)
        cpp = (x @ w_gguf.T).view(5, heads, d // 2, 2)  # llama.cpp's normal rope: pairs (2i, 2i + 1)
        a, b = cpp[..., 0], cpp[..., 1]
        cpp_rot = torch.stack([a * cos[:, None] - b * sin[:, None], b * cos[:, None] + a * sin[:, None]], -1)
        assert torch.allclose(cpp_rot.reshape(5, -1)[:, qk_rows(heads * d, heads).argsort()],
                              hf_rot.reshape(5, -1), atol=1e-12)


def test_llama_and_tokenizer_metadata(exported, llama_dirs):
    m, report, reader, _, _ = exported["4bit-rank4-embeddings"]
    f = lambda k: _value(reader, k)  # noqa: E731
    assert f("general.architecture") == "llama" and f("general.type") == "model"
    assert (f("llama.block_count"), f("llama.embedding_length"), f("llama.feed_forward_length"),
            f("llama.attention.head_count"), f("llama.attention.head_count_kv"), f("llama.rope.dimension_count"),
            f("llama.context_length"), f("llama.vocab_size")) == (2, 64, 128, 4, 2, 16, 128, VOCAB)
    assert f("llama.rope.freq_base") == 5000.0
    assert abs(f("llama.attention.layer_norm_rms_epsilon") - m.config.rms_norm_eps) < 1e-9
    assert f("general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_1
    tok = PreTrainedTokenizerFast.from_pretrained(llama_dirs["tied"])
    vocab = tok.get_vocab()
    assert f("tokenizer.ggml.model") == "gpt2" and f("tokenizer.ggml.pre") == "gpt-2"
    assert f("tokenizer.ggml.tokens") == sorted(vocab, key=vocab.get)
    assert f("tokenizer.ggml.token_type")[:4] == [3, 3, 3, 1]
    assert f("tokenizer.ggml.merges")[:2] == ["Ġ a", "Ġ b"] and len(f("tokenizer.ggml.merges")) == 71
    assert (f("tokenizer.ggml.bos_token_id"), f("tokenizer.ggml.eos_token_id"),
            f("tokenizer.ggml.unknown_token_id")) == (1, 2, 0)
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{k}.weight" for i in range(2) for k in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                                           "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
    assert set(_tensors(reader)) == expected


def test_the_adapter_holds_lora_a_and_lora_b(exported):
    m, report, reader, adapter, _ = exported["4bit-rank4-embeddings"]
    assert _value(adapter, "general.type") == "adapter" and _value(adapter, "adapter.type") == "lora"
    assert _value(adapter, "general.architecture") == "llama" and _value(adapter, "adapter.lora.alpha") == 0.0
    stored = _tensors(adapter)
    layers = _qlr_layers(m)
    assert len(stored) == 2 * len(layers)
    for name, layer in layers.items():
        key = _gguf_name(name)
        a, b = _dequantized(stored[f"{key}.weight.lora_a"]), _dequantized(stored[f"{key}.weight.lora_b"])
        assert np.array_equal(a, layer.lora_A.detach().numpy())
        assert np.array_equal(_unpermute(b, key, m), layer.lora_B.detach().numpy())
        if "attn_q" in key:
            assert not np.array_equal(b, layer.lora_B.detach().numpy())
    _, report0, _, adapter0, _ = exported["8bit-rank0"]
    assert adapter0 is None and report0["adapter"] is None and not Path(report0["base"]).with_name("adapter.gguf").exists()


def _forward(reader, adapter, ids: np.ndarray, pairs: bool = True) -> np.ndarray:
    """Logits of a Llama read from GGUF files alone, computed as llama.cpp does: adjacent-pair rope on the stored
    q/k rows (`pairs`; else HF's halves: the wrong reading), y = W x + s B (A x) with s = alpha / rank, or 1 where
    alpha is 0."""
    t = {k: _dequantized(v).astype(np.float64) for k, v in _tensors(reader).items()}
    lora = {k: _dequantized(v).astype(np.float64) for k, v in _tensors(adapter).items()} if adapter else {}
    alpha = _value(adapter, "adapter.lora.alpha") if adapter else 0.0
    f = lambda k: _value(reader, k)  # noqa: E731
    heads, kv, eps, base = (f("llama.attention.head_count"), f("llama.attention.head_count_kv"),
                            f("llama.attention.layer_norm_rms_epsilon"), f("llama.rope.freq_base"))

    def lin(x, key):
        y = x @ t[f"{key}.weight"].T
        if f"{key}.weight.lora_a" in lora:
            a, b = lora[f"{key}.weight.lora_a"], lora[f"{key}.weight.lora_b"]
            y = y + (alpha / a.shape[0] if alpha else 1.0) * ((x @ a.T) @ b.T)
        return y

    def norm(x, key):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * t[key]

    def rope(x, n):  # (seq, n * d) in pairs (2i, 2i + 1) of each head
        seq, d = x.shape[0], x.shape[1] // n
        ang = np.arange(seq)[:, None] * base ** (-np.arange(0, d, 2) / d)
        p = x.reshape(seq, n, d // 2, 2) if pairs else x.reshape(seq, n, 2, d // 2).swapaxes(-1, -2)
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        out = np.stack([p[..., 0] * c - p[..., 1] * s, p[..., 1] * c + p[..., 0] * s], -1)
        return (out if pairs else out.swapaxes(-1, -2)).reshape(seq, n, d)

    x = t["token_embd.weight"][ids]
    seq = len(ids)
    for i in range(f("llama.block_count")):
        h = norm(x, f"blk.{i}.attn_norm.weight")
        q, k = rope(lin(h, f"blk.{i}.attn_q"), heads), rope(lin(h, f"blk.{i}.attn_k"), kv)
        v = lin(h, f"blk.{i}.attn_v").reshape(seq, kv, -1)
        d = q.shape[-1]
        rep = heads // kv
        att = np.einsum("qhd,khd->hqk", q, np.repeat(k, rep, 1)) / np.sqrt(d)
        att = np.where(np.tril(np.ones((seq, seq), bool)), att, -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        x = x + lin(np.einsum("hqk,khd->qhd", att, np.repeat(v, rep, 1)).reshape(seq, -1), f"blk.{i}.attn_output")
        h = norm(x, f"blk.{i}.ffn_norm.weight")
        g = lin(h, f"blk.{i}.ffn_gate")
        x = x + lin(g / (1 + np.exp(-g)) * lin(h, f"blk.{i}.ffn_up"), f"blk.{i}.ffn_down")
    head = t.get("output.weight", t["token_embd.weight"])
    return norm(x, "output_norm.weight") @ head.T


def _reference(m, ids: np.ndarray) -> np.ndarray:
    """The library model's logits in float64 through transformers' own Llama: its de-quantized weights (`plain_base`)
    plus each correction B A (the library's forward runs its int4 kernel in bfloat16: not a reference to 1e-9)."""
    from hf_tensorcomp.integration.peft import plain_base

    base, _, factors = plain_base(m, _qlr_layers(m))
    base = base.double().eval()
    with torch.no_grad():
        for name, (a, b) in factors.items():
            base.get_submodule(name).weight += b.double() @ a.double()
        return base(torch.from_numpy(ids)[None]).logits[0].numpy()


# the largest logit difference asserted, relative to the largest logit: 6-bit codes and float32 tables are exact
# (but for transformers' rope angles in float32); Q4_1/Q5_1's float16 m moves the logits a little
TOLERANCE = {"4bit-rank4-embeddings": 1e-2, "5bit-untied-head": 1e-2, "6bit": 1e-6}


@pytest.mark.parametrize("case", list(TOLERANCE))
def test_llama_cpp_semantics_from_the_files_give_our_logits(exported, case):
    m, _, reader, adapter, _ = exported[case]
    ids = np.random.default_rng(1).integers(0, VOCAB, 24)
    ref = _reference(m, ids)
    diff = lambda got: np.abs(got - ref).max() / np.abs(ref).max()  # noqa: E731
    assert diff(_forward(reader, adapter, ids)) <= TOLERANCE[case]
    # the check can fail: read with HF's rope (rows as if not permuted), or without the adapter, it is another model
    assert diff(_forward(reader, adapter, ids, pairs=False)) > 5 * TOLERANCE[case]
    assert diff(_forward(reader, None, ids)) > 5 * TOLERANCE[case]


def test_a_bfloat16_model_keeps_its_dtype_outside_the_codes(llama_dirs, tmp_path):
    """Codes as blocks (scales are float16 whatever the model's dtype), tables in BF16, norms in F32, lora in BF16."""
    cfg = TensorCompressionConfig(method="qlr", bits=4, rank=2, group_size=32, rotate=False, calibration=calib(),
                                  progress=False)
    m = AutoModelForCausalLM.from_pretrained(llama_dirs["tied"], quantization_config=cfg, dtype=torch.bfloat16).eval()
    report = hf_tensorcomp.export(m, tmp_path / "bf16", format="gguf")
    stored = _tensors(gguf.GGUFReader(report["base"]))
    assert stored["blk.0.attn_v.weight"].tensor_type.name == "Q4_1"
    assert stored["token_embd.weight"].tensor_type.name == "BF16" and stored["output_norm.weight"].tensor_type.name == "F32"
    assert np.array_equal(_dequantized(stored["token_embd.weight"]), m.get_input_embeddings().weight.detach().float().numpy())
    lora = _tensors(gguf.GGUFReader(report["adapter"]))["blk.1.ffn_down.weight.lora_b"]
    assert lora.tensor_type.name == "BF16"
    assert np.array_equal(_dequantized(lora), m.get_submodule("model.layers.1.mlp.down_proj").lora_B.detach().float().numpy())


def test_pre_tokenizer_names_llama_cpp_knows():
    from hf_tensorcomp.integration.export_gguf import pre_tokenizer_name

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    assert pre_tokenizer_name(byte_level) == "gpt-2"
    assert pre_tokenizer_name({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, byte_level]}) == "smollm"
    assert pre_tokenizer_name({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": False}, byte_level]}) is None
    assert pre_tokenizer_name({**byte_level, "use_regex": False}) is None and pre_tokenizer_name(None) is None


def test_refusals_name_the_field_and_nothing_is_written(llama_dirs, tiny_dirs, tmp_path):
    out = tmp_path / "out"
    rotated = _qlr(llama_dirs["tied"], bits=4, rank=2, rotate=True)
    with pytest.raises(ValueError, match=r"^export: rotate: .*rotate=True.*allowed with format='gguf': a model "
                                         r"compressed with rotate=False"):
        hf_tensorcomp.export(rotated, out, format="gguf")
    g16 = _qlr(llama_dirs["tied"], bits=4, rank=2, group_size=16)
    with pytest.raises(ValueError, match=r"^export: group_size: .* groups of 16, not a multiple of GGUF's blocks of 32"):
        hf_tensorcomp.export(g16, out, format="gguf")
    narrow = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(
        method="qlr", bits=4, rank=2, group_size=16, rotate=False, calibration=calib(), progress=False))
    with pytest.raises(ValueError, match=r"^export: format='gguf': .* has 48 inputs, not a multiple of GGUF's blocks"):
        hf_tensorcomp.export(narrow, out, format="gguf")
    qwen = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen3"], quantization_config=TensorCompressionConfig(
        method="qlr", bits=4, rank=2, rotate=False, calibration=calib(), progress=False))
    with pytest.raises(ValueError, match=r"^export: format='gguf': model_type 'qwen3' .*; allowed: 'llama'"):
        hf_tensorcomp.export(qwen, out, format="gguf")
    plain = _qlr(llama_dirs["tied"], bits=4, rank=2)
    plain.name_or_path = str(tiny_dirs["llama"])  # a folder without a tokenizer
    with pytest.raises(ValueError, match=r"^export: tokenizer: none saved with the model .*; allowed with "
                                         r"format='gguf': tokenizer="):
        hf_tensorcomp.export(plain, out, format="gguf")
    with pytest.raises(ValueError, match=r"^export: widths: not an option of format='gguf'; allowed: tokenizer"):
        hf_tensorcomp.export(plain, out, format="gguf", widths="any")
    word_level = Path(tmp_path / "wordlevel")
    from tokenizers import Tokenizer, models

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                            unk_token="[UNK]").save_pretrained(word_level)
    with pytest.raises(ValueError, match=r"^export: tokenizer: a WordLevel model; allowed with format='gguf': BPE"):
        hf_tensorcomp.export(plain, out, format="gguf", tokenizer=word_level)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "tmp" in p.name]
    # the write rule: a new folder; an existing one only with overwrite=True; never inside the source
    report = hf_tensorcomp.export(plain, out, format="gguf", tokenizer=llama_dirs["tied"])
    assert Path(report["base"]) == out.resolve() / "model.gguf" and Path(report["adapter"]).exists()
    with pytest.raises(ValueError, match=r"^export: out: .* exists and is not empty; allowed: .*overwrite=True"):
        hf_tensorcomp.export(plain, out, format="gguf", tokenizer=llama_dirs["tied"])
    (out / "notes.txt").write_text("mine")
    hf_tensorcomp.export(plain, out, format="gguf", tokenizer=llama_dirs["tied"], overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and gguf.GGUFReader(out / "model.gguf").tensors
    with pytest.raises(ValueError, match=r"^export: out: .* lies inside the input"):
        hf_tensorcomp.export(_qlr(llama_dirs["tied"], bits=4, rank=2), Path(llama_dirs["tied"]) / "gguf", format="gguf")
