"""The cache folder and the small helpers every asset module uses."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger("hf_tensorcomp.assets")

CACHE_ENV = "HF_TENSORCOMP_CACHE"


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
