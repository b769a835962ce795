"""The local Hub server: repository and blob storage, and its lifecycle in a background thread."""

from __future__ import annotations

import copy
import hashlib
import os
import re
import shutil
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

from .protocol import DEFAULT_USER, DEFAULT_LFS_SUFFIXES, _now, _git_blob_oid, _lfs_pointer, HubError, _Repo
from .handler import Handler


class HubServer:
    """Local Hub server, run in a daemon thread.

    Args:
        root: directory for blob storage (a temp dir, removed on stop, if None).
        host, port: bind address (port 0 = pick a free one).
        user: namespace used when ``create_repo`` gets no organization.
        token: if set, only this bearer token is accepted; if None, any token is.
        lfs_threshold: files at least this big are asked to go through LFS
            (None: size never forces LFS).
        lfs_suffixes: path suffixes always asked to go through LFS.

    Attributes:
        url: base URL, e.g. ``http://127.0.0.1:PORT`` (set by ``start()``).
        requests: list of ``(method, path, status)`` of every request served.
    """

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        user: str = DEFAULT_USER,
        token: str | None = None,
        lfs_threshold: int | None = 10 * 1024 * 1024,
        lfs_suffixes: tuple[str, ...] = DEFAULT_LFS_SUFFIXES,
    ):
        self._own_root = root is None
        self.root = Path(root) if root is not None else None
        self.host = host
        self.port = port
        self.user = user
        self.token = token
        self.lfs_threshold = lfs_threshold
        self.lfs_suffixes = tuple(lfs_suffixes)
        self.url: str | None = None
        self.requests: list[tuple[str, str, int]] = []
        self._repos: dict[tuple[str, str], _Repo] = {}
        self._lock = threading.RLock()
        self._counter = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "HubServer":
        if self._httpd is not None:
            return self
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="hub_server_"))
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        handler = type("_BoundHandler", (Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer((self.host, self.port), handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://{self.host}:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._own_root and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ helpers for tests
    def repo_files(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> dict[str, dict]:
        """Server-side view of a repo tree: ``{path: {"size", "sha256", "lfs", ...}}``."""
        with self._lock:
            repo = self._get_repo(repo_type, repo_id, authed=True)
            return copy.deepcopy(self._resolve(repo, revision)[1]["tree"])

    def read_file(self, repo_id: str, path: str, revision: str = "main", repo_type: str = "model") -> bytes:
        entry = self.repo_files(repo_id, revision, repo_type)[path]
        return self._blob_path(entry["sha256"]).read_bytes()

    # ------------------------------------------------------------------ storage
    def _blob_path(self, sha256: str) -> Path:
        assert self.root is not None
        return self.root / "blobs" / sha256

    def _store_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = self._blob_path(sha)
        if not path.exists():
            tmp = path.with_name(f"{sha}.{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return sha

    def _new_oid(self, seed: str) -> str:
        with self._lock:
            self._counter += 1
            return hashlib.sha1(f"{seed}:{self._counter}:{time.time_ns()}".encode()).hexdigest()

    def _get_repo(self, repo_type: str, repo_id: str, authed: bool) -> _Repo:
        repo = self._repos.get((repo_type, repo_id))
        if repo is None or (repo.private and not authed):
            raise HubError(404, f"Repository Not Found for {repo_type} '{repo_id}'.", "RepoNotFound")
        return repo

    def _resolve(self, repo: _Repo, revision: str) -> tuple[str, dict]:
        oid = repo.branches.get(revision) or repo.tags.get(revision)
        if oid is None and re.fullmatch(r"[0-9a-f]{7,40}", revision):
            matches = [c for c in repo.commits if c.startswith(revision)]
            if len(matches) == 1:
                oid = matches[0]
        if oid is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return oid, repo.commits[oid]

    def _commit(self, repo: _Repo, branch: str, tree: dict, title: str, message: str, parent: str | None) -> str:
        oid = self._new_oid(f"{repo.repo_type}/{repo.repo_id}")
        date = _now()
        for entry in tree.values():
            if entry.get("_new"):
                entry.pop("_new")
                entry["last_commit"] = oid
        repo.commits[oid] = {"parent": parent, "tree": tree, "title": title, "message": message, "date": date}
        repo.branches[branch] = oid
        return oid

    def _entry_for(self, sha256: str, size: int, lfs: bool) -> dict:
        if lfs:
            pointer = _lfs_pointer(sha256, size)
            git_oid = _git_blob_oid(pointer)
            return {"sha256": sha256, "size": size, "lfs": True, "oid": git_oid,
                    "pointer_size": len(pointer), "_new": True}
        data = self._blob_path(sha256).read_bytes()
        return {"sha256": sha256, "size": size, "lfs": False, "oid": _git_blob_oid(data), "_new": True}

    def _wants_lfs(self, path: str, size: int) -> bool:
        if size == 0:
            return False
        if self.lfs_threshold is not None and size >= self.lfs_threshold:
            return True
        return path.lower().endswith(self.lfs_suffixes)
