"""Streaming GGUF → sharded safetensors conversion: tensor by tensor, never the whole model.

`convert_gguf(src, out)` turns a GGUF file (llama.cpp's format; quantized or not) into an ordinary
Hugging Face checkpoint folder — ``config.json``, the tokenizer, safetensors shards and their index —
that ``from_pretrained`` and `hf_tensorcomp.compress_checkpoint` read like any other. Transformers'
own GGUF loading (``from_pretrained(..., gguf_file=...)``) de-quantizes every tensor into one state
dict in memory first (a 7B model: 28 GB in float32); here each tensor is read from the file with a
plain file read at its offset, de-quantized by the ``gguf`` package, given the same per-architecture
treatment and name as transformers gives it (its tensor processors and name map, reused, not
re-implemented), cast to ``dtype`` and written into the shard it belongs to; a shard is written as
soon as it is full. Memory: one shard (``max_shard_size``) plus a few float32 copies of the tensor at
hand. The folder is written atomically (a temporary sibling moved into place at the end).
"""

from __future__ import annotations

import gc
import json
import time
from typing import NamedTuple
from pathlib import Path

import numpy as np
import torch

from .memory import PeakRSS, return_large_frees, trim

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _size(value, field: str) -> int:
    """Bytes from an int or a string such as ``"2GB"`` / ``"500MiB"``."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        text = value.strip().upper().replace(" ", "")
        for unit in sorted(_UNITS, key=len, reverse=True):
            if text.endswith(unit):
                try:
                    n = float(text[: -len(unit)])
                except ValueError:
                    break
                if n > 0:
                    return int(n * _UNITS[unit])
                break
    raise ValueError(f"convert_gguf.{field}: got {value!r}; allowed: a positive int (bytes) or a size such as '2GB', "
                     "'500MB', '1GiB'")


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if value in DTYPES:
        return DTYPES[value]
    raise ValueError(f"convert_gguf.dtype: got {value!r}; allowed: " + " | ".join(DTYPES) + " (or the torch dtype)")


class _Info(NamedTuple):
    """What the conversion needs of a tensor in the GGUF header."""
    name: str
    tensor_type: int
    shape: tuple  # the raw block, as gguf's reader maps it (quantized: rows x bytes a row)
    dtype: np.dtype
    n_elements: int
    offset: int  # of its data in the file


def _dequantized(f, tensor, chunk: int = 1 << 24) -> np.ndarray:
    """One tensor de-quantized to float32, read from the open file at its offset in blocks of rows of about
    `chunk` bytes (plain reads: no page of the mapped file stays resident, and `gguf.dequantize`'s
    temporaries stay the size of a block, not of the tensor)."""
    from gguf import dequantize

    shape, dt = tensor.shape, tensor.dtype  # the raw block's shape as the reader maps it
    n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    step = max(1, chunk // (shape[-1] * np.dtype(dt).itemsize))  # rows a block
    f.seek(tensor.offset)
    out = None
    for start in range(0, n_rows, step):
        buf = np.empty((min(step, n_rows - start), shape[-1]), dtype=dt)
        if f.readinto(memoryview(buf).cast("B")) != buf.nbytes:
            raise ValueError(f"convert_gguf: {tensor.name}: the file ends inside this tensor (a truncated or partial GGUF)")
        block = dequantize(buf, tensor.tensor_type)
        if out is None:
            out = np.empty((n_rows, block.shape[-1]), dtype=np.float32)
        out[start:start + len(buf)] = block
    return out.reshape(*shape[:-1], out.shape[-1])


def _skeleton(folder: Path, name: str):
    """The model's config (from the GGUF's metadata, as transformers parses it) and the model on the meta
    device (for the GGUF → transformers name map)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    return config, model


def convert_gguf(src, out, dtype="bfloat16", max_shard_size="2GB", overwrite: bool = False, tokenizer: bool = True,
                 progress: bool = False) -> dict:
    """Convert the GGUF file `src` into the checkpoint folder `out`, one tensor at a time.

    dtype: "bfloat16" (default) | "float32" | "float16" (or the torch dtype) of the written tensors;
    max_shard_size: bytes per shard (an int, or "2GB", "500MB", ...); overwrite: replace a non-empty
    `out`; tokenizer: also write the tokenizer transformers builds from the GGUF's vocabulary.
    Returns a report: tensors, shards, bytes written, seconds, peak resident memory (MB).
    """
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from .atomic import atomic_dir, refuse_overlap

    src, out = Path(src), Path(out)
    if not src.is_file():
        raise ValueError(f"convert_gguf: src: {src}: not a file; allowed: a local .gguf file")
    dtype, shard_bytes = _dtype(dtype), _size(max_shard_size, "max_shard_size")
    refuse_overlap(out, [src], "convert_gguf: out")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ValueError(f"convert_gguf: out: {out} exists and is not empty; allowed: a new or empty folder, or overwrite=True")
    return_large_frees()
    t0 = time.perf_counter()
    with PeakRSS() as peak:
        # the header: each tensor's name, type, raw shape and offset (the data are not read); the reader's
        # parsed fields (a Python object per vocabulary entry: ~160 MB for a 49k vocabulary) are let go
        try:
            reader = GGUFReader(src)
        except (ValueError, IndexError, OSError) as e:  # gguf's reader maps every tensor: a cut file fails here
            raise ValueError(f"convert_gguf: src: {src}: not a readable GGUF file ({e}); allowed: a whole .gguf file "
                             "(a truncated or partial download fails like this)") from None
        arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
        infos = [_Info(t.name, t.tensor_type, t.data.shape, t.data.dtype, int(t.n_elements), int(t.data_offset))
                 for t in reader.tensors]
        del reader
        gc.collect()
        trim()
        config, skeleton = _skeleton(src.parent, src.name)
        processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
        names = get_gguf_hf_weights_map(skeleton, processor)
        item = torch.empty((), dtype=dtype).element_size()
        # shards of at most `shard_bytes` (each tensor's element count at `dtype`, from the header), in file order
        plan, size = [[]], 0
        for t in infos:
            nbytes = int(t.n_elements) * item
            if plan[-1] and size + nbytes > shard_bytes:
                plan.append([])
                size = 0
            plan[-1].append(t)
            size += nbytes
        # `parsed`: what transformers' processors read and write
        shards, skipped, total, parsed = [], [], 0, {"tensors": {}, "config": config.to_dict()}
        with atomic_dir(out, overwrite=overwrite) as tmp, open(src, "rb") as f:
            for shard in plan:
                tensors = {}
                for t in shard:
                    w = _dequantized(f, t)
                    result = processor.process(weights=w, name=t.name, tensor_key_mapping=names, parsed_parameters=parsed)
                    if parsed["tensors"]:  # MoE processors merge several GGUF tensors into one parameter
                        raise ValueError(f"convert_gguf: src: {src.name}: architecture {arch!r} merges GGUF tensors into one "
                                         "parameter (MoE experts), which this tensor-by-tensor conversion does not do yet; "
                                         "allowed: a dense architecture (llama, qwen2, gemma3, ...), or transformers' "
                                         "from_pretrained(folder, gguf_file=...) with enough memory")
                    if result.name in names:
                        tensors[names[result.name]] = torch.from_numpy(np.ascontiguousarray(result.weights)).to(dtype)
                    else:
                        skipped.append(t.name)  # not a parameter of the transformers model (e.g. rope factors)
                    del w, result
                if tensors:
                    part = tmp / f".part-{len(shards):05d}"
                    save_file(tensors, str(part), metadata={"format": "pt"})
                    total += sum(v.numel() * v.element_size() for v in tensors.values())
                    shards.append((part, sorted(tensors)))
                    if progress:
                        print(f"convert_gguf: shard {len(shards)}: {len(tensors)} tensors", flush=True)
                del tensors
                trim()
            weight_map = {}
            for i, (part, keys) in enumerate(shards):  # the final names once the number of shards is known
                file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                part.rename(tmp / file)
                weight_map.update({k: file for k in keys})
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
            config.dtype, config.architectures = dtype, [type(skeleton).__name__]
            config.save_pretrained(tmp)
            if tokenizer:
                from transformers import AutoTokenizer

                AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).save_pretrained(tmp)
            (tmp / "hf_tensorcomp_source.json").write_text(json.dumps(
                {"gguf_file": src.name, "architecture": arch, "dtype": str(dtype).removeprefix("torch."),
                 "tensors": len(infos), "skipped": skipped}, indent=2) + "\n")
    return {"tensors": len(weight_map), "skipped": skipped, "shards": len(shards), "bytes": total,
            "seconds": round(time.perf_counter() - t0, 1), "peak_rss_mb": round(peak.peak / 2**20),
            "peak_above_start_mb": round(peak.above_start / 2**20)}
