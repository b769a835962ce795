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
import copy
import gc
import json
import math
import os
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn
from safetensors.torch import save_file

from . import distributed
from .config import TensorCompressionConfig
from .integration.io import atomic_dir, refuse_overlap
from .plan import find_decoder_layers, plan

_COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
           "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_NAMES = {v: k for k, v in _DTYPES.items()}


HEADER_MAX_BYTES = 100 << 20  # safetensors' own bound on a header's length


def _header(path: Path, who: str = "compress_checkpoint", any_dtype: bool = False) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data starts, checked
    before anything is sized by it: the header's length within the file (and safetensors' 100 MB), each
    entry's dtype known (`any_dtype`: any, for a reader that is not this one), its shape non-negative integers,
    its byte span that shape's size and inside the file. A damaged shard is refused in one line naming it
    (ValueError, starting with `who`), never read past its end."""

    def bad(why: str) -> ValueError:
        return ValueError(f"{who}: {path}: {why}; allowed: a whole safetensors file (copy or download the file "
                          "again)")

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(8)
        if len(first) < 8:
            raise bad(f"the file is truncated ({size} bytes, shorter than a header)")
        n = int.from_bytes(first, "little")
        if n > min(size - 8, HEADER_MAX_BYTES):
            raise bad(f"the header says it is {n} bytes long, but the file holds {size - 8} after the length"
                      + (" (truncated or corrupted)" if n <= HEADER_MAX_BYTES else f" (at most {HEADER_MAX_BYTES})"))
        text = f.read(n)
    try:
        head = json.loads(text)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"the header is not valid JSON ({e})") from None
    if not isinstance(head, dict):
        raise bad(f"the header is a JSON {type(head).__name__}, not an object")
    head.pop("__metadata__", None)
    data = size - 8 - n
    for name, t in head.items():
        if not (isinstance(t, dict) and isinstance(t.get("shape"), list) and isinstance(t.get("data_offsets"), list)
                and len(t["data_offsets"]) == 2):
            raise bad(f"the header's entry {name!r} is not {{dtype, shape, data_offsets: [begin, end]}}")
        if t.get("dtype") not in _DTYPES and not any_dtype:
            raise bad(f"tensor {name!r} has dtype {t.get('dtype')!r}, which this reader does not know (it reads "
                      f"{', '.join(_DTYPES)})")
        numbers = [*t["shape"], *t["data_offsets"]]
        if not all(type(v) is int and v >= 0 for v in numbers):
            raise bad(f"tensor {name!r} has shape {t['shape']} and data_offsets {t['data_offsets']}; allowed: "
                      "non-negative integers")
        begin, end = t["data_offsets"]
        if end < begin or t["dtype"] in _DTYPES and end - begin != math.prod(t["shape"]) * _DTYPES[t["dtype"]].itemsize:
            raise bad(f"tensor {name!r}: data_offsets {t['data_offsets']} span {end - begin} bytes, but "
                      f"{t['dtype']} x {t['shape']} takes {math.prod(t['shape']) * _DTYPES[t['dtype']].itemsize}")
        if end > data:
            raise bad(f"tensor {name!r} ends at byte {8 + n + end}, past the end of the file ({size} bytes): the file "
                      "is truncated")
    return head, 8 + n


def _write_header(f, header: dict) -> int:
    """Write a safetensors header (its length, then the JSON padded to 8 bytes) at the start of the open file
    `f`; returns where the data begins. The tensors' bytes follow at their ``data_offsets``."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write(len(text).to_bytes(8, "little") + text)
    return 8 + len(text)


class PeakRSS:
    """Peak resident memory of this process above its value at the start, sampled every 2 ms from
    ``/proc/self/statm`` (elsewhere: the process's lifetime maximum, an upper bound)."""

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = _rss()
        self.before_mark = None  # the peak up to `mark`, once marked
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    def mark(self) -> None:
        """Track the peak from here on separately: the peak so far is kept in ``before_mark``."""
        self.before_mark, self.peak = self.peak, _rss()

    @property
    def above_start(self) -> int:
        """The peak since the start (or since `mark`, when marked) above the start."""
        return self.peak - self.start


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _libc():
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
            _LIBC.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


def _return_large_frees() -> None:
    """Serve allocations of 1 MB and more by their own mappings, handed back to the system when freed (glibc
    ``mallopt(M_MMAP_THRESHOLD)``, for the rest of the process). glibc's default raises that threshold with
    every large free, after which freed layers and decomposition workspaces stay in its heap: the resident
    memory of a streaming run then grows by tens of MB per layer although nothing is held."""
    libc = _libc()
    if libc:
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def _trim() -> None:
    """Hand freed heap memory back to the system (glibc ``malloc_trim``)."""
    libc = _libc()
    if libc:
        libc.malloc_trim(0)


_LIBC = None


class ShardReader:
    """Tensors of a safetensors checkpoint (one file or an index of shards), read one at a time."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        self._headers: dict[Path, tuple[dict, int]] = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"compress_checkpoint: {index}: not a safetensors index ({type(e).__name__}: {e}); "
                                 "allowed: a JSON object whose \"weight_map\" maps tensor names to shard files") from None
            bad = [(k, f) for k, f in (weight_map.items() if isinstance(weight_map, dict) else [("weight_map", weight_map)])
                   if not (isinstance(k, str) and isinstance(f, str) and f and Path(f).name == f and f not in (".", ".."))]
            if bad:
                raise ValueError(f"compress_checkpoint: {index}: entry {bad[0][0]!r} -> {bad[0][1]!r}; allowed: tensor "
                                 "names mapped to file names in the checkpoint's folder")
            self.where = {k: folder / f for k, f in weight_map.items()}
            for path in sorted(set(self.where.values())):  # every shard's header checked before any work
                if not path.is_file():
                    raise ValueError(f"compress_checkpoint: {path}: the index names this shard, but it is missing; "
                                     "allowed: a checkpoint folder with all its shards")
                self._headers[path] = _header(path)
        elif (folder / "model.safetensors").exists():
            path = folder / "model.safetensors"
            self._headers[path] = _header(path)
            self.where = {k: path for k in self._headers[path][0]}
        else:
            raise ValueError(f"compress_checkpoint: src: {folder} holds no safetensors checkpoint (model.safetensors or "
                             "model.safetensors.index.json); allowed: a folder written by save_pretrained")

    def get(self, name: str) -> torch.Tensor:
        """One stored tensor, read from its file into a new tensor. Plain reads, not safetensors' ``safe_open``:
        that maps the whole shard, so a process under an address-space limit smaller than a shard could not
        open it (and the mapping's pages count as resident while they are touched)."""
        shape = self.info(name)[1]
        return self.block(name, 0, shape[0]) if shape else self.block(name, 0, 1).reshape(())

    def info(self, name: str) -> tuple[torch.dtype, list[int], int, int]:
        """(dtype, shape, first byte, end byte) of a stored tensor in its file."""
        path = self.where[name]
        if path not in self._headers:
            self._headers[path] = _header(path)
        head, start = self._headers[path]
        if name not in head:
            raise ValueError(f"compress_checkpoint: {path}: the index places tensor {name!r} in this shard, but its header "
                             "does not hold it; allowed: an index and shards written together")
        t = head[name]
        return _DTYPES[t["dtype"]], t["shape"], start + t["data_offsets"][0], start + t["data_offsets"][1]

    def rows(self, name: str, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` of a stored 2-D tensor, read from its file one row at a time (an embedding's rows
        the calibration text uses; nothing else of the tensor is read)."""
        stored, shape, begin, _ = self.info(name)
        if len(shape) != 2 or (len(index) and not 0 <= int(index.min()) <= int(index.max()) < shape[0]):
            raise ValueError(f"compress_checkpoint: {self.where[name]}: tensor {name!r} has shape {shape}; rows "
                             f"{int(index.min()) if len(index) else 0}..{int(index.max()) if len(index) else 0} were asked "
                             "for (the stored table does not match the model's config)")
        width = shape[1] * stored.itemsize
        out = torch.empty(len(index), shape[1], dtype=stored)
        view = out.view(torch.uint8).numpy()
        with open(self.where[name], "rb") as f:
            for i, r in enumerate(index.tolist()):
                f.seek(begin + r * width)
                data = f.read(width)
                if len(data) != width:
                    raise ValueError(f"compress_checkpoint: {self.where[name]} ends inside tensor {name!r}; the shard "
                                     "is truncated")
                view[i] = memoryview(data)
        return out.to(dtype)

    def block(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of a stored tensor (one contiguous read; a 0-d tensor is one row)."""
        stored, shape, begin, _ = self.info(name)
        if not 0 <= start <= stop <= (shape[0] if shape else 1):
            raise ValueError(f"compress_checkpoint: {self.where[name]}: rows {start}:{stop} of tensor {name!r} of shape "
                             f"{shape} were asked for")
        width = math.prod(shape[1:]) * stored.itemsize
        out = torch.empty(stop - start, *shape[1:], dtype=stored)
        with open(self.where[name], "rb") as f:
            f.seek(begin + start * width)
            if f.readinto(out.reshape(-1).view(torch.uint8).numpy()) != (stop - start) * width:
                raise ValueError(f"compress_checkpoint: {self.where[name]} ends inside tensor {name!r}; the shard is "
                                 "truncated")
        return out

    def copy_to(self, names: list[str], path: Path, dtype: torch.dtype, chunk: int = 1 << 24) -> None:
        """Write the stored tensors `names` (floating ones as `dtype`) into a new safetensors file at `path`,
        a chunk at a time: never a whole tensor in memory (safetensors' writer takes whole tensors)."""
        plan, offset = [], 0
        for name in names:
            src_dtype, shape, begin, end = self.info(name)
            out_dtype = dtype if src_dtype.is_floating_point else src_dtype
            size = (end - begin) // src_dtype.itemsize * out_dtype.itemsize
            plan.append((name, src_dtype, out_dtype, shape, begin, end, offset))
            offset += size
        head = {"__metadata__": {"format": "pt"}}
        head.update({n: {"dtype": _NAMES[o], "shape": shape, "data_offsets": [off, off + (e - b) // sd.itemsize * o.itemsize]}
                     for n, sd, o, shape, b, e, off in plan})
        step = chunk - chunk % 8
        with open(path, "wb") as out:
            _write_header(out, head)
            for name, sd, od, _, begin, end, _ in plan:
                with open(self.where[name], "rb") as f:
                    f.seek(begin)
                    left = end - begin
                    while left:
                        data = f.read(min(step, left))
                        if not data:  # the file shrank since its header was read: never loop on an empty read
                            raise ValueError(f"compress_checkpoint: {self.where[name]} ends inside tensor {name!r}; the "
                                             "shard is truncated")
                        left -= len(data)
                        if sd != od:
                            data = torch.frombuffer(bytearray(data), dtype=sd).to(od).view(torch.uint8).numpy().tobytes()
                        out.write(data)


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
            _trim()
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
        _trim()

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
            base = _write_header(f, header)
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
    _return_large_frees()
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

