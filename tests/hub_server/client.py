"""Helpers for tests that talk to the local Hub server: a subprocess environment, running code in it, in-process HfApi."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .protocol import DEFAULT_TOKEN
from .server import HubServer


# ---------------------------------------------------------------------- test helpers
def hub_env(server: HubServer, tmp_path: str | os.PathLike, base: dict | None = None) -> dict[str, str]:
    """Environment for a subprocess that talks to ``server`` with a fresh, private cache.

    Returns a full copy of ``base`` (default ``os.environ``) with: ``HF_ENDPOINT``,
    ``HF_TOKEN``, ``HF_HOME`` / ``HF_HUB_CACHE`` / ``HF_XET_CACHE`` / ``HF_TOKEN_PATH``
    under ``tmp_path/hf_home``, online mode, Xet disabled (classic LFS), no telemetry,
    update checks or progress bars, and ``NO_PROXY`` covering localhost.  Use a different
    ``tmp_path`` to get a cold cache (e.g. for the "pull in a fresh process" side).
    """
    env = dict(os.environ if base is None else base)
    for key in ("HUGGINGFACE_HUB_CACHE", "HUGGINGFACE_ASSETS_CACHE", "TRANSFORMERS_CACHE", "HF_DATASETS_CACHE",
                "HUGGINGFACE_CO_STAGING", "HF_HUB_DISABLE_IMPLICIT_TOKEN", "HUGGING_FACE_HUB_TOKEN",
                "HF_HUB_ENABLE_HF_TRANSFER", "HF_XET_HIGH_PERFORMANCE"):
        env.pop(key, None)
    home = Path(tmp_path) / "hf_home"
    home.mkdir(parents=True, exist_ok=True)
    no_proxy = ",".join(x for x in ("127.0.0.1", "localhost", env.get("NO_PROXY", "")) if x)
    env.update({
        "HF_ENDPOINT": str(server.url),
        "HF_TOKEN": server.token or DEFAULT_TOKEN,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_ASSETS_CACHE": str(home / "assets"),
        "HF_XET_CACHE": str(home / "xet"),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_HUB_OFFLINE": "0",
        "TRANSFORMERS_OFFLINE": "0",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_SYMLINKS_WARNING": "1",
        "HF_HUB_ETAG_TIMEOUT": "30",
        "HF_HUB_DOWNLOAD_TIMEOUT": "60",
        "NO_PROXY": no_proxy,
        "no_proxy": no_proxy,
        "TOKENIZERS_PARALLELISM": "false",
    })
    return env


def run_python(code: str, env: dict[str, str], timeout: float = 300, cwd: str | os.PathLike | None = None,
               args: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -c code`` with ``env``; raise AssertionError with its output if it fails."""
    proc = subprocess.run([sys.executable, "-c", code, *(args or [])], env=env, cwd=cwd, timeout=timeout,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(
            f"subprocess failed (rc={proc.returncode})\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        )
    return proc


def patch_in_process(monkeypatch, server: HubServer):
    """For in-process ``HfApi`` use: return ``HfApi(endpoint=server.url, token=...)``.

    Uses ``monkeypatch`` (pytest's fixture) to force classic LFS uploads
    (``constants.HF_HUB_DISABLE_XET = True``) and online mode (``constants.HF_HUB_OFFLINE =
    False``); both are read at call time.  Only ``HfApi`` methods and functions given
    ``endpoint=`` explicitly reach ``server``; ``transformers`` APIs keep the import-time
    endpoint, so run them in a subprocess with ``hub_env``.
    """
    from huggingface_hub import HfApi, constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return HfApi(endpoint=server.url, token=server.token or DEFAULT_TOKEN)
