"""Safetensors checkpoints read a tensor (or a block of rows) at a time: each shard's header checked before
anything is sized by it (`ShardReader`), and headers written for files filled a piece at a time
(`write_header`). Plain file reads at the header's offsets, never a mapping of the whole shard."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch


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


def write_header(f, header: dict) -> int:
    """Write a safetensors header (its length, then the JSON padded to 8 bytes) at the start of the open file
    `f`; returns where the data begins. The tensors' bytes follow at their ``data_offsets``."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write(len(text).to_bytes(8, "little") + text)
    return 8 + len(text)


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
            write_header(out, head)
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
