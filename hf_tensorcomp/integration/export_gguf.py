"""``export(model, out, format="gguf")``: a ``qlr`` Llama as llama.cpp reads it (``out/model.gguf``), its correction
as a GGUF LoRA adapter (``out/adapter.gguf``).

What is written:

- **the codes in GGUF blocks of 32, not re-quantized** (every group a multiple of 32 values, so each block lies
  inside one group and takes its scale and zero point): 2- to 4-bit codes as ``Q4_1`` (a 2/3-bit code is the same
  code in a nibble), 5-bit as ``Q5_1``; both compute ``d q + m``, written with ``d`` = the group's float16 scale
  (exact) and ``m`` = -scale x zero rounded to float16 (the only rounding: at most 2^-11 |m| a value). ``Q4_1``:
  16 bytes of nibbles after ``d`` and ``m``, byte j holding code j in its low nibble and code j + 16 in its high
  one; ``Q5_1`` the same low nibbles after a little-endian uint32 of the 32 fifth bits. 6- and 7-bit codes as
  ``Q8_0`` (``d q``, q int8) with d = scale and q = code - zero: exact. 8-bit codes as ``Q8_0`` too: a block whose
  |code - zero| stays within 127 exactly, the others at d = 2 scale, q = (code - zero) / 2 rounded (at most half a
  scale step, a step at |code - zero| = 255): said per width with its largest error, and warned.
- **q_proj / k_proj rows permuted** as llama.cpp's rope wants them (its "normal" rope rotates adjacent pairs, the
  HF Llama halves of each head): whole rows move, so codes, scales and zero points move with them, exactly; the
  adapter's ``lora_b`` rows the same way.
- the input embeddings and an untied head: quantized (``embedding_bits``) the same way when their groups allow it,
  else de-quantized; norms in float32; any other tensor in the model's dtype (float32, float16 or bfloat16: as held).
- the tokenizer as llama.cpp's ``gpt2`` BPE (tokens, token types, merges, bos / eos / unk / pad ids, the
  pre-tokenizer's name where it is one llama.cpp knows), from the tokenizer saved with the model or ``tokenizer=``.
- **the correction**: ``out/adapter.gguf`` (``general.type`` adapter, ``adapter.type`` lora, tensors
  ``<weight>.lora_a`` / ``.lora_b``). ``adapter.lora.alpha`` is 0, which llama.cpp reads as scale 1 for every
  layer whatever its rank (it scales by alpha / rank otherwise): y = Q(W) x + B (A x), as the layer computes.

Refused, one line naming the field: an architecture other than Llama, codes in a rotated basis (``rotate=True``:
llama.cpp has no online rotation, and folding R into the codes is not exact), groups or input widths that are not
multiples of 32, a tokenizer that is not BPE, rope scaling llama.cpp's Llama does not take here.
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import torch

ARCHS = ("llama",)
BLOCK = 32  # values per GGUF block of the types written here (Q4_1, Q5_1, Q8_0)
FILES = {"model": "model.gguf", "adapter": "adapter.gguf"}


def block_type(bits: int) -> str:
    """The GGUF block type a `bits`-bit code is written as."""
    return "Q4_1" if bits <= 4 else "Q5_1" if bits == 5 else "Q8_0"


def blockable(shape, group_size: int) -> bool:
    """Whether a quantized (rows, cols) tensor's codes map onto GGUF blocks of 32 (each block inside one group)."""
    return len(shape) == 2 and shape[1] % BLOCK == 0 and group_size % BLOCK == 0


def encode(q) -> tuple[np.ndarray, str]:
    """(uint8 array (rows, bytes a row), GGUF type name): the QTensor `q` (2-D, `blockable`) as GGUF blocks."""
    rows, cols = q.shape
    nb, per_row = cols // BLOCK, -(-cols // q.group_size)
    codes = q.codes[: rows * cols].cpu().numpy().reshape(rows, nb, BLOCK).astype(np.int16)
    g = np.arange(nb) * BLOCK // q.group_size  # each block's group
    scale = q.scale.cpu().numpy().astype(np.float16).reshape(rows, per_row)[:, g]
    zero = q.zero.cpu().numpy().reshape(rows, per_row)[:, g].astype(np.int16)
    kind = block_type(q.bits)
    if kind in ("Q4_1", "Q5_1"):
        m = (-(scale.astype(np.float32) * zero)).astype(np.float16)  # exact in float32 (11 x 5 bits), rounded once
        low = (codes & 15).astype(np.uint8)
        parts = [_bytes(scale), _bytes(m)]
        if kind == "Q5_1":
            high = ((codes >> 4) & 1).astype(np.uint32) << np.arange(BLOCK, dtype=np.uint32)
            parts.append(_bytes(high.sum(-1, dtype=np.uint32).astype("<u4")))
        parts.append(low[..., :16] | (low[..., 16:] << 4))
    else:
        v = codes - zero[..., None]
        k = np.where(np.abs(v).max(-1) > 127, 2, 1).astype(np.int16)  # 8-bit codes: |code - zero| up to 255
        d = (scale.astype(np.float32) * k).astype(np.float16)  # x1 or x2: exact
        qs = np.clip(np.round(v / k[..., None]), -127, 127).astype(np.int8)
        parts = [_bytes(d), qs.view(np.uint8)]
    return np.concatenate(parts, -1).reshape(rows, -1), kind


def _bytes(a: np.ndarray) -> np.ndarray:
    """The little-endian bytes of each element of `a` (rows, blocks) as a last axis: (rows, blocks, itemsize)."""
    return np.ascontiguousarray(a)[..., None].view(np.uint8)


def qk_rows(out_features: int, heads: int) -> torch.Tensor:
    """Row order llama.cpp wants for a Llama q_proj (`heads` = attention heads) or k_proj (key-value heads):
    row h d + 2 i + j of the GGUF matrix is row h d + j d / 2 + i of the HF one (d the head dim)."""
    d = out_features // heads
    return torch.arange(out_features).view(heads, 2, d // 2).transpose(1, 2).reshape(-1)


def _dense(t: torch.Tensor) -> tuple[np.ndarray, object]:
    """(array, raw GGUF type or None) for a tensor kept in float: 1-D in float32, the rest in its own dtype."""
    import gguf

    t = t.detach().cpu()
    if t.ndim == 1 or t.dtype not in (torch.float16, torch.bfloat16):
        return t.float().numpy(), None
    if t.dtype == torch.float16:
        return t.numpy(), None
    return t.view(torch.int16).numpy().view(np.uint16), gguf.GGMLQuantizationType.BF16


def _check_model(model, qlr: dict) -> None:
    cfg = model.config
    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHS:
        raise ValueError(f"export: format='gguf': model_type {kind!r} is not exported to GGUF here; allowed: "
                         f"{' | '.join(map(repr, ARCHS))} (SmolLM2 is a Llama)")
    rotated = sorted(n for n, m in qlr.items() if m.rotation_block)
    if rotated:
        raise ValueError(f"export: rotate: {len(rotated)} qlr layers hold the codes of W R (rotate=True, e.g. "
                         f"{rotated[0]}): llama.cpp applies no input rotation and folding R into the codes is not "
                         "exact; allowed with format='gguf': a model compressed with rotate=False")
    for name, m in qlr.items():
        bits, group, (out_f, in_f), _ = m.qspec("weight")
        if in_f % BLOCK:
            raise ValueError(f"export: format='gguf': {name} has {in_f} inputs, not a multiple of GGUF's blocks of "
                             f"{BLOCK}; allowed: a model whose matrices' input widths are multiples of {BLOCK}")
        if group % BLOCK:
            raise ValueError(f"export: group_size: {name} has groups of {group}, not a multiple of GGUF's blocks of "
                             f"{BLOCK}; allowed with format='gguf': a group_size that is a multiple of {BLOCK} "
                             "(compress again, e.g. group_size=64)")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise ValueError(f"export: rope_scaling: rope_type {rope_type!r} is not written to GGUF here; allowed: "
                         "'default' or 'linear'")


def _rope(cfg) -> tuple[float, float | None]:
    """(rope base, linear scaling factor or None) of a Llama config (transformers 5's ``rope_parameters`` or 4's)."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", rope.get("type")) == "linear" else (getattr(cfg, "rope_scaling", None) or {})
    factor = scaling.get("factor") if scaling.get("rope_type", scaling.get("type")) == "linear" else None
    return float(theta), factor


def pre_tokenizer_name(spec) -> str | None:
    """llama.cpp's name for a tokenizer.json pre-tokenizer (`spec`), or None where it is none it knows."""
    def byte_level(p):
        return p and p.get("type") == "ByteLevel" and p.get("use_regex", True)

    if byte_level(spec):
        return "gpt-2"  # llama.cpp's name (LLAMA_VOCAB_PRE_TYPE_GPT2); "gpt2" is refused by its loader
    if spec and spec.get("type") == "Sequence":
        steps = spec.get("pretokenizers", [])
        if (len(steps) == 2 and steps[0].get("type") == "Digits" and steps[0].get("individual_digits")
                and byte_level(steps[1])):
            return "smollm"  # digits one by one, then GPT-2's split
    return None


def tokenizer_fields(model, tokenizer, vocab_size: int) -> tuple[dict, list[str]]:
    """(GGUF tokenizer fields, report lines) of `tokenizer` (an HF tokenizer, its folder, or None: the one saved with
    the model); refused by name where llama.cpp's ``gpt2`` BPE cannot hold it."""
    import gguf
    from transformers import AutoTokenizer

    src = tokenizer
    if tokenizer is None:
        src = getattr(model, "name_or_path", None)
        if not (src and os.path.isdir(src) and (os.path.isfile(os.path.join(src, "tokenizer.json"))
                                                or os.path.isfile(os.path.join(src, "tokenizer_config.json")))):
            raise ValueError(f"export: tokenizer: none saved with the model ({src!r}); allowed with format='gguf': "
                             "tokenizer=<an HF tokenizer or its folder>")
    if isinstance(src, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(src)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"export: tokenizer: a {type(tokenizer).__name__} without a tokenizers backend; allowed: a "
                         "fast BPE tokenizer (tokenizer.json)")
    spec = json.loads(backend.to_str())
    if spec["model"]["type"] != "BPE":
        raise ValueError(f"export: tokenizer: a {spec['model']['type']} model; allowed with format='gguf': BPE "
                         "(llama.cpp's 'gpt2' tokenizer)")
    vocab = backend.get_vocab(with_added_tokens=True)
    if max(vocab.values()) >= vocab_size:
        raise ValueError(f"export: tokenizer: ids up to {max(vocab.values())} for a model of {vocab_size} embeddings; "
                         "allowed: the model's own tokenizer")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(gguf.TokenType.UNUSED)] * vocab_size
    for tok, i in vocab.items():
        tokens[i], types[i] = tok, int(gguf.TokenType.NORMAL)
    for added in spec.get("added_tokens", []):
        types[added["id"]] = int(gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    lines = []
    pre = pre_tokenizer_name(spec.get("pre_tokenizer"))
    if pre is None:
        pre = "default"
        lines.append("tokenizer: a pre-tokenizer llama.cpp has no name for: written as 'default' (llama.cpp then "
                     "splits text its own way)")
        warnings.warn(f"export: {lines[-1]}", stacklevel=5)
    cfg = model.config
    ids = {}
    for key in ("bos", "eos", "unk", "pad"):
        i = getattr(tokenizer, f"{key}_token_id", None)
        ids[key] = i if i is not None else getattr(cfg, f"{key}_token_id", None)
    probe = tokenizer("a")["input_ids"]
    fields = {"tokens": tokens, "types": types, "merges": merges, "pre": pre, "ids": ids,
              "add_bos": bool(probe) and ids["bos"] is not None and probe[0] == ids["bos"],
              "add_eos": bool(probe) and ids["eos"] is not None and probe[-1] == ids["eos"],
              "chat_template": getattr(tokenizer, "chat_template", None)}
    lines.insert(0, f"tokenizer: gpt2 BPE, {len(vocab)} tokens ({vocab_size - len(vocab)} unused ids padded), "
                    f"{len(merges)} merges, pre-tokenizer {pre!r}")
    return fields, lines


def _tables(model) -> tuple[dict, bool]:
    """({name: module} of the input embeddings and the head, tied?)."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    names = {m: n for n, m in model.named_modules()}
    tied = getattr(head, "tied", None)
    if tied is None:
        tied = head is not None and head.weight is emb.weight
    return {names[emb]: emb} | ({names[head]: head} if head is not None else {}), bool(tied)


def _quantized_or_dense(m) -> tuple[np.ndarray, object, tuple | None, str]:
    """(array, raw GGUF type or None, (QTensor, type name) or None, what was written) for module `m`'s ``weight``."""
    import gguf

    spec = m.qspec("weight") if hasattr(m, "qspec") else None
    if spec and blockable(spec[2], spec[1]):
        q = m.quantized("weight")
        blocks, kind = encode(q)
        return blocks, gguf.GGMLQuantizationType[kind], (q, kind), kind
    w = (m.quantized("weight").dequantize(torch.float32).to(spec[3]) if spec else m.weight).detach()
    arr, raw = _dense(w)
    what = raw.name if raw is not None else "F32" if arr.dtype == np.float32 else "F16"
    return arr, raw, None, (f"{spec[0]}-bit codes in groups of {spec[1]} de-quantized (not whole blocks of {BLOCK}) "
                            f"to {what}" if spec else what)


def error_lines(done: dict) -> tuple[list[str], list[str]]:
    """(report lines, warnings) per code width from ``{bits: [(QTensor, type name, blocks)]}``: the type written,
    and how far GGUF's values are from the library's (de-quantized with gguf's own reader)."""
    import gguf

    lines, warns = [], []
    for bits in sorted(done):
        items = done[bits]
        kind = items[0][1]
        worst = worst_steps = 0.0
        for q, _, blocks in items:
            rows, cols = q.shape
            ours = q.dequantize(torch.float32).numpy()
            theirs = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(rows, cols)
            err = np.abs(theirs - ours)
            step = np.repeat(q.scale.cpu().float().numpy().reshape(rows, -1), q.group_size, 1)[:, :cols]
            worst = max(worst, float(err.max()))
            worst_steps = max(worst_steps, float((err / np.maximum(step, 2**-24)).max()))
        n = len(items)
        if kind in ("Q4_1", "Q5_1"):
            lines.append(f"{bits}-bit: {n} tensors as {kind} (d = scale, m = -scale x zero in float16), codes and "
                         f"scales exact: max |error| {worst:.3g} ({worst_steps:.2g} of a scale step, from m's float16 "
                         "rounding)")
        elif worst == 0:
            lines.append(f"{bits}-bit: {n} tensors as Q8_0 (d = scale, q = code - zero): exact")
        else:
            lines.append(f"{bits}-bit: {n} tensors as Q8_0, blocks with |code - zero| > 127 at d = 2 scale (re-"
                         f"quantized): max |error| {worst:.3g} ({worst_steps:.2g} of a scale step)")
            warns.append(lines[-1])
    return lines, warns


def write(model, out, tmp, tokenizer=None) -> dict:
    """Write ``model.gguf`` (and ``adapter.gguf`` where a layer has a correction) into `tmp`; returns the report."""
    import gguf

    from .peft import qlr_modules

    qlr = qlr_modules(model, "export: format='gguf'")
    _check_model(model, qlr)
    cfg = model.config
    tables, tied = _tables(model)
    fields, tok_lines = tokenizer_fields(model, tokenizer, model.get_input_embeddings().weight.shape[0])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)

    def gguf_name(key: str) -> str:
        got = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if got is None:
            raise ValueError(f"export: format='gguf': {key} has no llama.cpp tensor name; allowed: a plain Llama")
        return got

    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads

    def rows_of(key: str, n: int):
        return qk_rows(n, heads) if ".attn_q." in key else qk_rows(n, kv_heads) if ".attn_k." in key else None

    tensors, done, lines = {}, {}, []
    for name, m in {**tables, **qlr}.items():
        if name in tables and name != next(iter(tables)) and tied:
            continue  # a tied head: llama.cpp reads token_embd
        key = gguf_name(f"{name}.weight")
        arr, raw, q, what = _quantized_or_dense(m)
        r = rows_of(key, arr.shape[0])
        tensors[key] = (arr if r is None else arr[r.numpy()], raw)
        if q is not None:
            done.setdefault(q[0].bits, []).append((q[0], q[1], arr))  # compared in the library's row order
        if name in tables:
            lines.append(f"{key}: {what}")
        if getattr(m, "bias", None) is not None:
            b = m.bias.detach()
            r = rows_of(key, b.shape[0])
            tensors[gguf_name(f"{name}.bias")] = _dense(b if r is None else b[r])
    for key, t in model.state_dict().items():
        owner = key.rpartition(".")[0]
        if owner in qlr or owner in tables:
            continue
        g = gguf_name(key)
        r = rows_of(g, t.shape[0])
        tensors[g] = _dense(t if r is None else t[r])
    err_lines, warns = error_lines(done)
    for w in warns:
        warnings.warn(f"export: {w}", stacklevel=4)
    kinds = [k for bits, items in done.items() for _, k, _ in items]
    main = max(set(kinds), key=kinds.count) if kinds else None
    path = tmp / FILES["model"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(os.path.basename(str(getattr(cfg, "_name_or_path", "") or getattr(model, "name_or_path", "")) or "model"))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    theta, factor = _rope(cfg)
    w.add_rope_freq_base(theta)
    if factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(factor))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(len(fields["tokens"]))
    ftype = {"Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
             "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    w.add_file_type(ftype[main] if main else gguf.LlamaFileType.ALL_F32)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(fields["pre"])
    w.add_token_list(fields["tokens"])
    w.add_token_types(fields["types"])
    w.add_token_merges(fields["merges"])
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id),
                     ("pad", w.add_pad_token_id)):
        if fields["ids"][key] is not None:
            add(int(fields["ids"][key]))
    w.add_add_bos_token(fields["add_bos"])
    w.add_add_eos_token(fields["add_eos"])
    if isinstance(fields["chat_template"], str):
        w.add_chat_template(fields["chat_template"])
    for key, (arr, raw) in tensors.items():
        w.add_tensor(key, np.ascontiguousarray(arr), raw_dtype=raw)
    _finish(w)
    lines = err_lines + lines + tok_lines
    lines.append(f"{FILES['model']}: {len(tensors)} tensors, {path.stat().st_size:,} bytes"
                 + (" (head tied: token_embd)" if tied else ""))
    adapter = write_adapter(qlr, tmp / FILES["adapter"], rows_of, gguf_name)
    lines.append(adapter or "correction: none (every qlr layer has rank 0): no adapter")
    return {"base": str(out / FILES["model"]), "adapter": str(out / FILES["adapter"]) if adapter else None,
            "report": lines}


def write_adapter(qlr: dict, path, rows_of, gguf_name) -> str | None:
    """Write the corrections as a GGUF LoRA adapter at `path` (alpha 0: scale 1 at every rank); its report line, or
    None (nothing written) where every rank is 0."""
    import gguf

    ranks = {n: m.rank for n, m in qlr.items() if m.rank}
    if not ranks:
        return None
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 0.0)  # llama.cpp: alpha 0 means scale 1 (else alpha / rank)
    for name in ranks:
        m = qlr[name]
        key = gguf_name(f"{name}.weight")
        b = m.lora_B.detach()
        r = rows_of(key, b.shape[0])
        w.add_tensor(f"{key}.lora_a", *_dense_pair(m.lora_A.detach()))
        w.add_tensor(f"{key}.lora_b", *_dense_pair(b if r is None else b[r]))
    _finish(w)
    return (f"correction: {FILES['adapter']}, a GGUF LoRA adapter on {len(ranks)} linears (ranks {min(ranks.values())}-"
            f"{max(ranks.values())}, alpha 0: scale 1)")


def _dense_pair(t: torch.Tensor):
    arr, raw = _dense(t)
    return np.ascontiguousarray(arr), None, raw


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
