"""`export`: a compressed model in a format a serving engine reads; one writer per format, one file each.

``hf_tensorcomp.export(model, "out", format="compressed-tensors")`` (`export_ct`: vLLM, transformers; the
base in ``out/base``, the correction as a PEFT LoRA adapter in ``out/adapter``);
``format="gguf"`` (`export_gguf`: llama.cpp; ``out/model.gguf``, the correction as the GGUF LoRA adapter
``out/adapter.gguf``). The library's write rule: the
folder is written as a temporary sibling and renamed into place; never over or inside the folder the model was
loaded from; a folder that exists and is not empty is refused unless ``overwrite=True``.
"""

from __future__ import annotations

import os
from pathlib import Path

FORMATS = ("compressed-tensors", "gguf")
OPTIONS = {"compressed-tensors": {"widths"}, "gguf": {"tokenizer"}}


def export(model, out, format: str = "compressed-tensors", overwrite: bool = False, **options) -> dict:
    """Write `model` (compressed with ``method="qlr"``) to the folder `out` in `format`.

    options (``format="compressed-tensors"``): ``widths="vllm"`` (default: every width at the nearest of 4 and
    8 bits at or above it, what vLLM's kernels serve) or ``"any"`` (each width as the budget chose it).
    options (``format="gguf"``): ``tokenizer`` (an HF tokenizer or its folder; default: the one saved with the
    model), written as llama.cpp's ``gpt2`` BPE.
    Returns ``{"base": folder (gguf: the file), "adapter": folder (gguf: the file) or None, "report": [lines]}``:
    per width what was written and what it cost (gguf: its largest error), the rotation, the correction.
    """
    from ..atomic import atomic_dir, refuse_overlap

    if format not in FORMATS:
        raise ValueError(f"export: format: got {format!r}; allowed: {' | '.join(map(repr, FORMATS))}")
    allowed = OPTIONS[format]
    for key in options:
        if key not in allowed:
            raise ValueError(f"export: {key}: not an option of format={format!r}; allowed: {', '.join(sorted(allowed))}")
    loaded_from = getattr(model, "name_or_path", None)
    refuse_overlap(out, [loaded_from if loaded_from and os.path.isdir(loaded_from) else None], "export: out")
    out = Path(os.path.abspath(out))
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ValueError(f"export: out: {out} exists and is not empty; allowed: a new or empty folder, or overwrite=True")
    from . import export_ct, export_gguf

    writer = {"compressed-tensors": export_ct, "gguf": export_gguf}[format]
    with atomic_dir(out, overwrite=overwrite) as tmp:
        report = writer.write(model, out, tmp, **options)
    return report
