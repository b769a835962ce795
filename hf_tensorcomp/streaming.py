"""Streaming compression of a checkpoint larger than memory: one decoder layer at a time from its shards.

`compress_checkpoint(src, out, cfg)` builds the model on the meta device (buffers real), reads the
embeddings, final norm and head from the source safetensors, and runs the ordinary pipeline
(`hf_tensorcomp.pipeline.compress_model`) with a `LayerStream`: each decoder layer is read from the
shards (memory-mapped ``safe_open``, never the whole state dict) just before the pipeline reaches it,
and once the pipeline has passed it, it is written to its own output shard and put back on the meta
device. Only the calibration hidden states span layers. The output is a sharded safetensors checkpoint
with an index that ``from_pretrained`` reloads like any compressed one, written into a temporary
sibling folder and moved into place at the end (a killed run leaves no readable output).

What streaming cannot do, refused up front: steps that need the whole dense model at once (Fisher
weighting, a Fisher-weighted or data-free global allocation, weight gradients, healing) and methods
whose units span several layers (TRAWL's whole-model / segmented formulations).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import TensorCompressionConfig
from .integration.io import atomic_dir
from .plan import find_decoder_layers, plan

_COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")


class ShardReader:
    """Tensors of a safetensors checkpoint (one file or an index of shards), read one at a time."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.exists():
            self.where = {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif (folder / "model.safetensors").exists():
            with safe_open(str(folder / "model.safetensors"), "pt") as f:
                self.where = {k: folder / "model.safetensors" for k in f.keys()}
        else:
            raise ValueError(f"compress_checkpoint: src: {folder} holds no safetensors checkpoint (model.safetensors or "
                             "model.safetensors.index.json); allowed: a folder written by save_pretrained")

    def get(self, name: str) -> torch.Tensor:
        with safe_open(str(self.where[name]), "pt") as f:
            return f.get_tensor(name)


class LayerStream:
    """Loads decoder layer ``li`` when the pipeline reaches it; writes out and releases the layers before it."""

    def __init__(self, model, reader: ShardReader, out: Path | None, dtype: torch.dtype):
        self.model, self.shards, self.out, self.dtype = model, reader, out, dtype
        self.prefix, self.layers = find_decoder_layers(model)
        self.loaded: set[int] = set()
        self.released = 0
        self.weight_map: dict[str, str] = {}
        self.seconds: list[float] = []
        self._t = time.perf_counter()

    def _load(self, li: int) -> None:
        from accelerate.utils import set_module_tensor_to_device

        head = f"{self.prefix}.{li}."
        for name, t in [*self.layers[li].named_parameters(), *self.layers[li].named_buffers()]:
            if t.device.type != "meta":
                continue
            full = head + name
            if full not in self.shards.where:
                raise ValueError(f"compress_checkpoint: {full} is missing from the source checkpoint")
            value = self.shards.get(full)
            set_module_tensor_to_device(self.model, full, "cpu", value=value.to(self.dtype) if value.is_floating_point() else value)
        self.loaded.add(li)

    def _release(self, li: int, write: bool) -> None:
        layer = self.layers[li]
        if write:
            head = f"{self.prefix}.{li}."
            tensors = {head + k: v.detach().contiguous() for k, v in layer.state_dict().items()}
            shard = f"layer-{li:05d}.safetensors"
            save_file(tensors, str(self.out / shard), metadata={"format": "pt"})
            self.weight_map.update({k: shard for k in tensors})
            self.seconds.append(round(time.perf_counter() - self._t, 2))
            self._t = time.perf_counter()
        layer.to_empty(device="meta")
        self.loaded.discard(li)

    def upto(self, li: int, release_last: bool = False) -> None:
        """Layer ``li`` loaded (and every earlier one written and released); with `release_last`, ``li`` too."""
        while self.released < li:
            if self.released not in self.loaded:
                self._load(self.released)  # a layer the pipeline did not need: copied through
            self._release(self.released, write=self.out is not None)
            self.released += 1
        if li not in self.loaded and self.released == li:
            self._load(li)
        if release_last and self.released == li:
            self._release(li, write=self.out is not None)
            self.released += 1

    def reader(self) -> "LayerStream":
        """A stream for a read-only pass over the dense layers (the allocation's statistics); `close` it after."""
        return _ReadOnly(self)


class _ReadOnly(LayerStream):
    def __init__(self, parent: LayerStream):
        super().__init__(parent.model, parent.shards, None, parent.dtype)

    def upto(self, li: int, release_last: bool = False) -> None:
        for j in sorted(self.loaded):
            if j < li:
                self._release(j, write=False)
        if li not in self.loaded:
            self._load(li)
        if release_last:
            self._release(li, write=False)

    def close(self) -> None:
        for j in sorted(self.loaded):
            self._release(j, write=False)


def _resolve(src) -> Path:
    name = str(src)
    if name in ("smollm2", "gemma3"):
        from .assets import model_path

        return Path(model_path(name))
    path = Path(name)
    if not path.is_dir():
        raise ValueError(f"compress_checkpoint: src: {name}: not a folder; allowed: a local checkpoint folder or "
                         "'smollm2' | 'gemma3' (download a Hub model with huggingface_hub.snapshot_download first)")
    return path


def compress_checkpoint(src, out, cfg: TensorCompressionConfig, max_memory: str | None = None, device: str = "cpu",
                        dtype: torch.dtype = torch.float32, overwrite: bool = False) -> dict:
    """Compress the checkpoint in folder `src` into `out` (sharded safetensors + index), one decoder layer
    in memory at a time; returns a report (peak resident memory, seconds per layer, the stats).

    max_memory: accepted for the report only (the bound is structural: one layer, the non-layer tensors
    and the calibration states); device: "cpu" (an accelerator is not used by the streaming path yet).
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from .pipeline import compress_model
    from .validation import fail

    if not isinstance(cfg, TensorCompressionConfig):
        raise ValueError(f"compress_checkpoint: cfg: got {type(cfg).__name__}; allowed: a TensorCompressionConfig")
    if device != "cpu":
        fail("device", device, "'cpu' (the streaming path runs on the CPU; compress in memory to use an accelerator)")
    if cfg.heal:
        fail("heal", cfg.heal, "False with compress_checkpoint (end-to-end healing needs the whole model; heal the "
             "compressed checkpoint afterwards with hf_tensorcomp.heal)")
    src = _resolve(src)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"compress_checkpoint: out: {out} exists and is not empty; allowed: a new or empty folder, "
                         "or overwrite=True")
    t0 = time.perf_counter()
    config = AutoConfig.from_pretrained(src)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.name_or_path = str(src)
    model.config._name_or_path = str(src)
    prefix, layers = find_decoder_layers(model)
    work = plan(model, cfg)
    if any(len({int(n.split(".")[0]) for n in names}) > 1 for _, names in work):
        raise ValueError("compress_checkpoint: a unit of this config spans several decoder layers (e.g. TRAWL "
                         "formulation='whole_model' | 'segmented'); allowed: methods compressed layer by layer")
    reader = ShardReader(src)
    from accelerate.utils import set_module_tensor_to_device

    layer_keys = f"{prefix}."
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.startswith(layer_keys) or t.device.type != "meta":
            continue
        if name in reader.where:
            value = reader.get(name)
            set_module_tensor_to_device(model, name, "cpu", value=value.to(dtype) if value.is_floating_point() else value)
    model.tie_weights()
    missing = [n for n, t in model.named_parameters() if not n.startswith(layer_keys) and t.device.type == "meta"]
    if missing:
        raise ValueError(f"compress_checkpoint: {missing[0]} is missing from the source checkpoint")
    with atomic_dir(out, overwrite=overwrite) as tmp:
        stream = LayerStream(model, reader, tmp, dtype)
        compress_model(model, cfg, work=work, stream=stream)
        rest = {k: v.detach().contiguous() for k, v in model.state_dict().items()
                if not k.startswith(layer_keys) and v.device.type != "meta"}
        if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
            rest.pop("lm_head.weight", None)
        save_file(rest, str(tmp / "model-rest.safetensors"), metadata={"format": "pt"})
        weight_map = {**stream.weight_map, **{k: "model-rest.safetensors" for k in rest}}
        total = sum(os.path.getsize(tmp / f) for f in set(weight_map.values()))
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
        model.config.quantization_config = cfg
        model.config.dtype = dtype
        model.config.save_pretrained(tmp)
        for name in _COPIED:
            if (src / name).exists():
                shutil.copy2(src / name, tmp / name)
    report = {"src": str(src), "out": str(out), "layers": len(layers), "seconds": round(time.perf_counter() - t0, 1),
              "seconds_per_layer": stream.seconds,
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
              "max_memory": max_memory, "stats": cfg.stats}
    return report
