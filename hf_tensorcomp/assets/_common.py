"""The cache folder and the small helpers every asset module uses."""

from __future__ import annotations

import logging
import os
import sys
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
    from ..atomic import atomic_file

    with atomic_file(path) as tmp:
        tmp.write_bytes(data)
