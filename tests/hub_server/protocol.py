"""Protocol constants, errors and the in-memory repository record of the local Hub server."""

from __future__ import annotations

import hashlib
import re
from datetime import datetime, timezone


DEFAULT_TOKEN = "hf_local_test_token"
DEFAULT_USER = "user"

_TYPE_BY_API = {"models": "model", "datasets": "dataset", "spaces": "space", "kernels": "kernel"}
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/", "kernel": "kernels/"}
_PREFIX_TO_TYPE = {"datasets": "dataset", "spaces": "space", "kernels": "kernel"}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

DEFAULT_LFS_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".onnx", ".msgpack",
    ".npy", ".npz", ".pkl", ".pickle", ".zip", ".gz", ".tar", ".tflite", ".model", ".arrow",
    ".parquet",
)

GITATTRIBUTES = "".join(
    f"*{suffix} filter=lfs diff=lfs merge=lfs -text\n" for suffix in DEFAULT_LFS_SUFFIXES
).encode()


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


class HubError(Exception):
    """Raised by route handlers; rendered as a JSON error with X-Error-Code."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None,
                 extra: dict | None = None):
        super().__init__(message)
        self.extra = extra or {}
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}


class _Repo:
    def __init__(self, repo_type: str, repo_id: str, private: bool):
        self.repo_type = repo_type
        self.repo_id = repo_id
        self.private = private
        self.created_at = _now()
        self.branches: dict[str, str] = {}
        self.tags: dict[str, str] = {}
        self.commits: dict[str, dict] = {}  # oid -> {parent, tree, title, message, date}
        self.pr_count = 0
