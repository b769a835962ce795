"""The layer stream of a streaming compression (`hf_tensorcomp.streaming.compress_checkpoint`): the pipeline's
view of a checkpoint on disk. `LayerStream` loads each decoder layer from the shards just before the
pipeline reaches it and writes it to its own output shard once passed (and quantizes the embedding table a
block of rows at a time); `StreamedEmbedding` stands in for the input embedding, reading only the rows it
is asked for."""

from __future__ import annotations

import copy
import gc
import math
import os
import time
from pathlib import Path

import torch
from torch import nn
from safetensors.torch import save_file

from .layout import find_decoder_layers
from .memory import PeakRSS, trim
from .shards import ShardReader, write_header


class StreamedEmbedding(nn.Module):
    """Stands in for the input embedding while a checkpoint streams: each call reads only the rows of the ids
    it is given (`ShardReader.rows`) and runs the original module's own forward on them (Gemma's scaling
    included). The original, on the meta device, stays the model's for saving."""

    def __init__(self, original: nn.Module, reader: ShardReader, name: str, dtype: torch.dtype):
        super().__init__()
        self.__dict__["original"] = original  # not a submodule: nothing of it in this module's state
        self.reader, self.name, self.dtype = reader, name, dtype
        self.num_embeddings, self.embedding_dim = original.weight.shape
        if name in reader.where and list(reader.info(name)[1]) != list(original.weight.shape):
            raise ValueError(f"compress_checkpoint: {reader.where[name]}: tensor {name!r} has shape {reader.info(name)[1]}; "
                             f"the config says {list(original.weight.shape)} (the config and the weights do not belong "
                             "together)")

    @property
    def weight(self) -> torch.Tensor:
        """The original's table (on the meta device: its shape, and the identity a tied head shares)."""
        return self.original.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        used, local = torch.unique(ids, return_inverse=True)
        small = copy.copy(self.original)
        rows = self.reader.rows(self.name, used.cpu(), self.dtype).to(ids.device)
        small._parameters = {**self.original._parameters, "weight": nn.Parameter(rows, requires_grad=False)}
        return small(local)


TABLE_BLOCK_BYTES = 8 << 20  # rows of an embedding table quantized at once: this many bytes of them in float64


class LayerStream:
    """Loads decoder layer ``li`` when the pipeline reaches it; writes out and releases the layers before it."""

    def __init__(self, model, reader: ShardReader, out: Path | None, dtype: torch.dtype, peak: PeakRSS | None = None,
                 device: torch.device = torch.device("cpu")):
        self.model, self.shards, self.out, self.dtype, self.peak, self.device = model, reader, out, dtype, peak, device
        self.prefix, self.layers = find_decoder_layers(model)
        self.loaded: set[int] = set()
        self.released = 0
        self.weight_map: dict[str, str] = {}
        self.seconds: list[float] = []
        self.largest_written = 0  # bytes of the largest compressed layer held before writing
        self.states_dir: Path | None = None  # where the calibration runner keeps its hidden states (None: memory)
        self._t = time.perf_counter()

    def _load(self, li: int) -> None:
        from accelerate.utils import set_module_tensor_to_device

        if self.peak is not None and self.peak.before_mark is None:  # the layers' phase begins: first hand back
            gc.collect()  # what the steps before left freed (the calibration tokenizer: ~300 MB for Gemma-3's)
            trim()
            self.peak.mark()
        head = f"{self.prefix}.{li}."
        for name, t in [*self.layers[li].named_parameters(), *self.layers[li].named_buffers()]:
            full = head + name
            if t.device.type != "meta":  # a buffer the skeleton built itself (e.g. rotary frequencies)
                if t.device != self.device:
                    set_module_tensor_to_device(self.model, full, self.device)
                continue
            if full not in self.shards.where:
                raise ValueError(f"compress_checkpoint: {full} is missing from the source checkpoint")
            value = self.shards.get(full)
            set_module_tensor_to_device(self.model, full, self.device,
                                        value=value.to(self.dtype) if value.is_floating_point() else value)
        self.loaded.add(li)

    def _release(self, li: int, write: bool) -> None:
        layer = self.layers[li]
        if write:
            head = f"{self.prefix}.{li}."
            tensors = {head + k: v.detach().cpu().contiguous() for k, v in layer.state_dict().items()}
            self.largest_written = max(self.largest_written, sum(t.numel() * t.element_size() for t in tensors.values()))
            shard = f"layer-{li:05d}.safetensors"
            save_file(tensors, str(self.out / shard), metadata={"format": "pt"})
            self.weight_map.update({k: shard for k in tensors})
            self.seconds.append(round(time.perf_counter() - self._t, 2))
            self._t = time.perf_counter()
        layer.to_empty(device="meta")
        self.loaded.discard(li)
        trim()

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

    def quantize_table(self, bits: int, group_size: int, gram: torch.Tensor | None) -> dict:
        """``embedding_bits`` while streaming: the input embedding (and an untied head) quantized as
        `hf_tensorcomp.embedding_tables.quantize_embeddings` does in memory — GPTQ (activation order) on the head
        inputs' `gram` for the table the head multiplies by, round to nearest for an untied embedding or
        without calibration — but read from the source, quantized and written to their own shard a block of
        rows at a time (GPTQ and round to nearest treat each row on its own, so the blocks give the whole
        table's codes). The skeleton's modules become the quantized ones, on the meta device. Returns their
        stats."""
        from .decompositions.quantize import code_bytes, n_groups, pack, quantize_gptq, quantize_rtn
        from .layout import embedding_names
        from .embedding_tables import install_tables, table_plan, table_stats

        emb_name, head_name = embedding_names(self.model)
        emb = self.model.get_submodule(emb_name)
        emb = getattr(emb, "original", emb)
        head = self.model.get_submodule(head_name) if head_name else None
        tied = head is not None and head.weight is emb.weight
        gptq = "gptq" if gram is not None else "rtn"
        plan = table_plan(gram.to(self.device)) if gram is not None else None  # once, for every block
        tables = [(emb_name, gptq if tied else "rtn")] + ([(head_name, gptq)] if head is not None and not tied else [])
        layout, offset = [], 0  # (module, quantizer, rows, cols, offsets of codes / scales / zeros in the data)
        header = {"__metadata__": {"format": "pt"}}
        for name, quantizer in tables:
            rows, cols = self.shards.info(f"{name}.weight")[1]
            sizes = {"": (code_bytes(rows * cols, bits), "U8"), "_scale": (n_groups((rows, cols), group_size) * 2, "F16"),
                     "_zero": (n_groups((rows, cols), group_size), "U8")}
            starts = {}
            for suffix, (size, dtype) in sizes.items():
                header[f"{name}.weight{suffix}"] = {"dtype": dtype, "shape": [size // (2 if dtype == "F16" else 1)],
                                                    "data_offsets": [offset, offset + size]}
                starts[suffix] = offset
                offset += size
            layout.append((name, quantizer, rows, cols, starts))
        shard, out = "model-table.safetensors", {}
        with open(self.out / shard if self.out is not None else os.devnull, "wb") as f:  # (a rank that does not write)
            base = write_header(f, header)
            for name, quantizer, rows, cols, starts in layout:
                step = max(8, TABLE_BLOCK_BYTES // (8 * cols) // 8 * 8)  # whole bytes of codes per block
                per_row = n_groups((1, cols), group_size)
                err = ref = 0.0
                for r0 in range(0, rows, step):
                    w = self.shards.block(f"{name}.weight", r0, min(r0 + step, rows)).to(self.device, self.dtype)
                    q = quantize_gptq(w.float(), None, bits, group_size, plan=plan) if quantizer == "gptq" else \
                        quantize_rtn(w, bits, group_size)
                    for suffix, data, at in (("", pack(q.codes[: w.numel()], bits), r0 * cols * bits // 8),
                                             ("_scale", q.scale.view(torch.uint8), r0 * per_row * 2),
                                             ("_zero", q.zero, r0 * per_row)):
                        f.seek(base + starts[suffix] + at)
                        f.write(data.cpu().contiguous().numpy().tobytes())
                    err += float((w.double() - q.dequantize(torch.float64)).square().sum())  # (float64: on CPU or CUDA)
                    ref += float(w.double().square().sum())
                    del w, q
                rel = round(math.sqrt(err / max(ref, 1e-60)), 6)
                out[name] = table_stats(bits, group_size, quantizer, rel, tied if name == emb_name else None)
        self.weight_map.update({k: shard for k in header if k != "__metadata__"})
        install_tables(self.model, emb, head, bits, group_size)  # on the meta device: the saved shapes
        return out

    def reader(self) -> "LayerStream":
        """A stream for a read-only pass over the dense layers (the allocation's statistics); `close` it after."""
        return _ReadOnly(self)


class _ReadOnly(LayerStream):
    def __init__(self, parent: LayerStream):
        super().__init__(parent.model, parent.shards, None, parent.dtype, parent.peak, parent.device)

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
