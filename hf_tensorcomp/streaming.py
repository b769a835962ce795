"""Streaming compression of a checkpoint larger than memory: one decoder layer at a time from its shards.

`compress_checkpoint(src, out, cfg)` builds the model on the meta device (buffers real), reads the final
norm (and the input embedding's rows the calibration tokens use, `StreamedEmbedding`; the head is never
read) from the source safetensors, and runs the ordinary pipeline
(`hf_tensorcomp.pipeline.compress_model`) with a `LayerStream`: each decoder layer is read from the
shards (plain file reads at the header's offsets, tensor by tensor, never the whole state dict) just
before the pipeline reaches it, and once the pipeline has passed it, it is written to its own output
shard and put back on the meta device. Only the calibration hidden states span layers. The output is a sharded safetensors checkpoint
with an index that ``from_pretrained`` reloads like any compressed one, written into a temporary
sibling folder and moved into place at the end (a killed run leaves no readable output).

Healing (``heal={"mode": "layerwise"}``) is done while streaming: each decoder layer is trained toward
its dense outputs while it is in memory (`hf_tensorcomp.healing.StreamHealer`), as in-memory compression
followed by layer-wise healing does it.

What streaming cannot do, refused up front: steps that need the whole dense model at once (Fisher
weighting, a Fisher-weighted or data-free global allocation, weight gradients, end-to-end healing) and
methods whose units span several layers (TRAWL's whole-model / segmented formulations).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import distributed
from .atomic import atomic_dir, refuse_overlap
from .config import TensorCompressionConfig
from .layer_stream import TABLE_BLOCK_BYTES, LayerStream, StreamedEmbedding
from .memory import PeakRSS, return_large_frees
from .layout import find_decoder_layers
from .plan import plan
from .shards import ShardReader

_COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")


def _resolve(src) -> Path:
    name = str(src)
    if name in ("smollm2", "gemma3"):
        from .assets import model_path

        return Path(model_path(name))
    path = Path(name)
    if path.is_file() and path.suffix == ".gguf":
        raise ValueError(f"compress_checkpoint: src: {name}: a GGUF file; allowed: a checkpoint folder — convert it first, "
                         "tensor by tensor: hf_tensorcomp.convert_gguf(src, folder) (CLI: hf-tensorcomp convert-gguf)")
    if not path.is_dir():
        raise ValueError(f"compress_checkpoint: src: {name}: not a folder; allowed: a local checkpoint folder or "
                         "'smollm2' | 'gemma3' (download a Hub model with huggingface_hub.snapshot_download first)")
    return path


def compress_checkpoint(src, out, cfg: TensorCompressionConfig, max_memory: str | None = None, device: str = "cpu",
                        dtype: torch.dtype = torch.float32, overwrite: bool = False, states_dir=None) -> dict:
    """Compress the checkpoint in folder `src` into `out` (sharded safetensors + index), one decoder layer
    in memory at a time; returns a report (peak resident memory, seconds per layer, the stats).

    max_memory: accepted for the report only (the bound is structural: one layer, the non-layer tensors
    and the calibration states); device: "cpu" | "cuda" | "cuda:N": where each layer, its statistics,
    decompositions and calibration forwards, the calibration states and the table's blocks live while
    worked on (shards are read and written on the host; the bound counts host memory).
    states_dir: None (the calibration hidden states in memory) or an existing folder: they are written
    to a temporary folder in it, one file per calibration batch, read back one batch at a time, and
    removed at the end (memory then holds one batch of them; healing's states too).
    ``cfg.heal={"mode": "layerwise", ...}``: each layer healed while it is in memory (`StreamHealer`).
    The model card (README.md) is written beside the checkpoint. Under ``torchrun`` / ``accelerate launch``
    (`hf_tensorcomp.distributed`): the calibration batches and each layer's matrices are shared out over the
    ranks, every rank reads every layer, and rank 0 alone writes `out`.
    """
    from .pipeline import compress_model

    dev = _check_arguments(cfg, device, states_dir)
    src = _resolve(src)
    out = Path(out)
    refuse_overlap(out, [src], "compress_checkpoint: out")  # overwrite=True never reaches the source
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"compress_checkpoint: out: {out} exists and is not empty; allowed: a new or empty folder, "
                         "or overwrite=True")
    return_large_frees()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        model, work = _skeleton(src, cfg, dtype)
        prefix, layers = find_decoder_layers(model)
        reader = ShardReader(src)
        emb, emb_name, tied = _load_non_layer_tensors(model, reader, f"{prefix}.", dtype, dev)
        parent, _, attr = next(n for n, m in model.named_modules() if m is emb).rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        group = distributed.group()  # distributed: every rank streams every layer, rank 0 alone writes
        with (atomic_dir(out, overwrite=overwrite) if group is None or group.rank == 0 else contextlib.nullcontext()) \
                as tmp, contextlib.ExitStack() as scratch:
            stream = LayerStream(model, reader, tmp, dtype, peak, dev)
            if states_dir is not None:
                stream.states_dir = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="hf-tensorcomp-states-",
                                                                                          dir=states_dir)))
            streamed = StreamedEmbedding(emb, reader, emb_name, dtype)
            setattr(holder, attr, streamed)
            try:
                compress_model(model, cfg, work=work, stream=stream)
            finally:
                if getattr(holder, attr) is streamed:  # (with embedding_bits it is the quantized table by now)
                    setattr(holder, attr, emb)
            if tmp is not None:
                _write_rest(model, cfg, src, tmp, reader, stream, f"{prefix}.", tied, dtype)
        if group is not None:  # every rank returns once rank 0's folder is in place (or stops if it failed)
            group.barrier("writing the checkpoint")
    bound = _memory_bound(reader, prefix, len(layers), model, cfg, stream.largest_written, on_disk=states_dir is not None)
    report = {"src": str(src), "out": str(out), "layers": len(layers), "seconds": round(time.perf_counter() - t0, 1),
              "seconds_per_layer": stream.seconds, "peak_above_start_mb": round(peak.above_start / 2**20, 1),
              "setup_peak_above_start_mb": round(((peak.peak if peak.before_mark is None else peak.before_mark)
                                                  - peak.start) / 2**20, 1),
              "bound_mb": {k: round(v / 2**20, 1) for k, v in bound.items()},
              "within_bound": peak.above_start <= bound["bound"],
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
              "max_memory": max_memory, "stats": cfg.stats}
    return report


def _check_arguments(cfg: TensorCompressionConfig, device: str, states_dir) -> torch.device:
    """`compress_checkpoint`'s settings refused before any work (what streaming cannot do); returns the device."""
    from .validation import fail

    if not isinstance(cfg, TensorCompressionConfig):
        raise ValueError(f"compress_checkpoint: cfg: got {type(cfg).__name__}; allowed: a TensorCompressionConfig")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"compress_checkpoint.device: got {device!r}; allowed: 'cpu', or 'cuda' | 'cuda:N' where "
                         f"torch sees a CUDA device (here: {torch.cuda.device_count()})")
    if cfg.heal and cfg.heal["mode"] != "layerwise":
        fail("heal.mode", cfg.heal["mode"], "'layerwise' with compress_checkpoint (each layer healed while it is in "
             "memory; end-to-end healing needs the whole model: heal the compressed checkpoint afterwards with "
             "hf_tensorcomp.heal, or compress in memory)")
    if cfg.heal and cfg.embedding_bits:
        fail("embedding_bits", cfg.embedding_bits, "None with compress_checkpoint and heal= (streaming quantizes the "
             "table after the layers, which layer-wise healing would have to see first)")
    if cfg.embedding_bits == "auto":
        fail("embedding_bits", "auto", "8 | 4 | None with compress_checkpoint ('auto' weighs the table by the dense "
             "model's head error, a pass over the whole model)")
    if cfg.embedding_bits and cfg.calibration is not None and not cfg.propagate:
        fail("propagate", False, "True with compress_checkpoint and embedding_bits (the table's GPTQ reads the compressed "
             "model's final hidden states, which streaming gets by propagating the calibration text)")
    if states_dir is not None and not Path(states_dir).is_dir():
        raise ValueError(f"compress_checkpoint.states_dir: got {str(states_dir)!r}; allowed: None (states in memory) or an "
                         "existing folder")
    return dev


def _skeleton(src: Path, cfg: TensorCompressionConfig, dtype: torch.dtype):
    """(the model of checkpoint `src` on the meta device, its plan for `cfg`), refusing a compressed source and a
    unit that spans several decoder layers."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    if getattr(config, "quantization_config", None) is not None:
        raise ValueError(f"compress_checkpoint: src: {src} is compressed or quantized already (its config has a "
                         "quantization_config); allowed: a dense checkpoint (compress a compressed model again in "
                         "memory with hf_tensorcomp.compress)")
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.name_or_path = str(src)
    model.config._name_or_path = str(src)
    work = plan(model, cfg)
    if any(len({int(n.split(".")[0]) for n in names}) > 1 for _, names in work):
        raise ValueError("compress_checkpoint: a unit of this config spans several decoder layers (e.g. TRAWL "
                         "formulation='whole_model' | 'segmented'); allowed: methods compressed layer by layer")
    return model, work


def _load_non_layer_tensors(model, reader: ShardReader, layer_keys: str, dtype: torch.dtype, dev: torch.device):
    """Every tensor of the skeleton outside the decoder layers (names not starting with `layer_keys`) read from
    the source onto `dev`, but the embedding table and the head, which stay on the meta device (the table is
    read row by row, `StreamedEmbedding`; a tied head is the table). Returns (the input embedding, its weight's
    name, whether the head is tied)."""
    from accelerate.utils import set_module_tensor_to_device

    emb = model.get_input_embeddings()
    emb_name = next(n for n, p in model.named_parameters() if p is emb.weight)
    head = model.get_output_embeddings()
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    if tied and head is not None:  # the skeleton ties as a loaded model does: one table, the head's
        head.weight = emb.weight
    lazy = {emb_name} | ({next(n for n, p in model.named_parameters(remove_duplicate=False) if p is head.weight)}
                         if head is not None else set())  # read row by row / never read: stay on meta
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.startswith(layer_keys) or name in lazy:
            continue
        if t.device.type != "meta":  # a buffer the skeleton built itself (rotary frequencies, Gemma's scale)
            if t.device != dev:
                set_module_tensor_to_device(model, name, dev)
        elif name in reader.where:
            value = reader.get(name)
            set_module_tensor_to_device(model, name, dev, value=value.to(dtype) if value.is_floating_point() else value)
    missing = [n for n in sorted(lazy) if n not in reader.where and not (tied and n != emb_name)]
    missing += [n for n, t in model.named_parameters() if not n.startswith(layer_keys) and n not in lazy
                and t.device.type == "meta"]
    if missing:
        raise ValueError(f"compress_checkpoint: {missing[0]} is missing from the source checkpoint")
    return emb, emb_name, tied


def _write_rest(model, cfg: TensorCompressionConfig, src: Path, tmp: Path, reader: ShardReader, stream: LayerStream,
                layer_keys: str, tied: bool, dtype: torch.dtype) -> None:
    """Beside the layers the stream wrote: the tensors outside them (copied from the source when compression left
    them unchanged, else saved as the model holds them), the index, the config, the model card and the
    tokenizer's files."""
    rest = [k for k in model.state_dict() if not k.startswith(layer_keys)]
    if tied and "lm_head.weight" in rest:
        rest.remove("lm_head.weight")
    copied = [k for k in rest if k in reader.where and k not in stream.weight_map]  # unchanged by compression: copied from the source a chunk at a time
    reader.copy_to(copied, tmp / "model-rest.safetensors", dtype)
    weight_map = {**stream.weight_map, **{k: "model-rest.safetensors" for k in copied}}
    made = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
            if k in rest and k not in reader.where and v.device.type != "meta"}
    if made:  # persistent buffers the model builds itself
        save_file(made, str(tmp / "model-built.safetensors"), metadata={"format": "pt"})
        weight_map.update({k: "model-built.safetensors" for k in made})
    total = sum(os.path.getsize(tmp / f) for f in set(weight_map.values()))
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    model.config.quantization_config = cfg
    model.config.dtype = dtype
    model.config.save_pretrained(tmp)
    from .integration.hub import write_model_card

    write_model_card(model, tmp)  # how it was compressed (and healed), as in-memory saving writes it
    for name in _COPIED:
        if (src / name).exists():
            shutil.copy2(src / name, tmp / name)


def _memory_bound(reader: ShardReader, prefix: str, n_layers: int, model, cfg: TensorCompressionConfig,
                  largest_written: int, on_disk: bool = False) -> dict[str, int]:
    """The streaming run's memory bound, in bytes: 1.5 x (the largest decoder layer in float32 + the largest
    compressed layer held before writing + the calibration hidden states + that layer's statistics
    [+ layer-wise healing's states and training]).

    The states are counted four times (the runner's layer-0 inputs, the current layer's inputs and
    outputs, the dense stream that propagation pairs with them); the statistics as one float64 input
    Gram per matrix (in x in, what whitening and GPTQ read) and three more of the largest (the working
    copies of its decomposition), plus the largest matrix's whitened SVD in float64 (W S, its factors
    and LAPACK's workspace). States on disk (``on_disk``): four copies of one calibration batch's."""
    layer_bytes = stats_bytes = 0
    for li in range(n_layers):
        head = f"{prefix}.{li}."
        sizes = [reader.info(k) for k in reader.where if k.startswith(head)]
        layer_bytes = max(layer_bytes, sum((e - b) // d.itemsize * 4 for d, _, b, e in sizes))
    calibrated = cfg.calibration is not None
    if calibrated:
        shapes = [shape for name in reader.where if name.startswith(f"{prefix}.0.") and name.endswith(".weight")
                  for _, shape, _, _ in [reader.info(name)] if len(shape) == 2]
        grams = [s[-1] ** 2 * 8 for s in shapes]
        stats_bytes = sum(grams) + 3 * max(grams, default=0)  # and the largest one's damped copy, Cholesky factor, inverse
        # the largest matrix's whitened SVD in float64: W S, its factors and LAPACK's workspace (~5 min(out, in)^2)
        stats_bytes += max((8 * (2 * o * i + 5 * min(o, i) ** 2) for o, i in shapes), default=0)
    cal = cfg.stats.get("calibration", {})
    hidden = model.config.get_text_config().hidden_size
    tokens = cal.get("tokens", 0)
    if on_disk and cal.get("samples"):  # one batch of samples
        tokens = tokens // cal["samples"] * min(cal["samples"], cfg.calibration_batch_size)
    states = 4 * tokens * hidden * 4 if calibrated else 0
    parts = {"layer_fp32": layer_bytes, "compressed_layer": largest_written, "calibration_states": states,
             "layer_statistics": stats_bytes}
    heal = cfg.stats.get("heal")
    if heal:  # layer-wise healing: its two streams (as the calibration's), the trained layer's parameters, gradients,
        # Adam's two moments and best copy, and one batch's activations through the layer, forward and backward
        windows = min(heal["windows"], cfg.heal["batch_size"]) if on_disk else heal["windows"]
        inner = max(hidden, getattr(model.config.get_text_config(), "intermediate_size", 0) or 0)
        parts["heal"] = (4 * windows * heal["length"] * hidden * 4 + 5 * largest_written
                         + 16 * cfg.heal["batch_size"] * heal["length"] * inner * 4)
    if cfg.embedding_bits:  # a block of the table's rows: read, GPTQ's float64 copies, codes, de-quantized check
        parts["table_block"] = 4 * TABLE_BLOCK_BYTES
    parts["bound"] = int(1.5 * sum(parts.values()))
    return parts

