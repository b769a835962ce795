"""A small Hugging Face Hub-compatible HTTP server for tests (stdlib only).

It speaks the subset of the Hub protocol that the *unpatched* ``huggingface_hub``
client (v1/v2, checked against 2.4) and ``transformers`` use to push and pull
models, so that ``model.push_to_hub``, ``HfApi`` methods, ``hf_hub_download``,
``snapshot_download`` and ``from_pretrained("user/repo")`` run end to end on
localhost, without network access and without mocks.

Protocol subset (``{t}`` is ``models``/``datasets``/``spaces``/``kernels``,
``{p}`` the matching URL prefix: empty for models, ``datasets/`` ...)::

    GET    /api/whoami-v2
    POST   /api/validate-yaml                         (always valid)
    POST   /api/repos/create     DELETE /api/repos/delete
    GET    /api/{t}/{ns}/{name}[/revision/{rev}]      (model_info / repo_info)
    GET    /api/{t}/{ns}/{name}/tree/{rev}[/{path}]   (?recursive=&expand=)
    POST   /api/{t}/{ns}/{name}/paths-info/{rev}
    GET    /api/{t}/{ns}/{name}/refs
    GET    /api/{t}/{ns}/{name}/commits/{rev}
    POST   /api/{t}/{ns}/{name}/preupload/{rev}
    POST   /api/{t}/{ns}/{name}/commit/{rev}          (NDJSON; ?create_pr=1)
    POST/DELETE /api/{t}/{ns}/{name}/branch/{branch}
    POST   /api/{t}/{ns}/{name}/tag/{rev}   DELETE /api/{t}/{ns}/{name}/tag/{tag}
    POST   /{p}{ns}/{name}.git/info/lfs/objects/batch (LFS "basic" transfer)
    PUT    /_lfs/upload/{sha256}   POST /_lfs/verify/{sha256}
    HEAD/GET /{p}{ns}/{name}/resolve/{rev}/{path}     (Range supported)

Errors carry the ``X-Error-Code`` header the client maps to exceptions
(``RepoNotFound`` -> ``RepositoryNotFoundError``, ``RevisionNotFound``,
``EntryNotFound`` -> ``RemoteEntryNotFoundError``).  Resolve responses carry
``ETag`` (git blob sha1 for regular files, sha256 for LFS files),
``X-Repo-Commit``, ``Content-Length`` and, for LFS files, ``X-Linked-Etag`` /
``X-Linked-Size``.  Files are served directly (no CDN redirect).

Upload path
-----------
``preupload`` answers ``uploadMode: "lfs"`` for files of ``lfs_threshold``
bytes or more (default 10 MiB, as on the Hub) and for the usual binary
suffixes (``.safetensors``, ``.bin``, ...), ``"regular"`` otherwise; regular
files then travel base64-encoded inside the commit NDJSON.  For LFS files,
``huggingface_hub`` decides *on the client side* between Xet and classic LFS:
it uses Xet whenever the ``hf_xet`` package is importable, unless
``HF_HUB_DISABLE_XET=1`` (read into ``huggingface_hub.constants`` at import,
checked at call time by ``is_xet_available()``).  This server implements the
classic LFS batch API with the single-PUT "basic" transfer only, so clients
must run with ``HF_HUB_DISABLE_XET=1`` (``hub_env`` sets it; in-process code
can set ``huggingface_hub.constants.HF_HUB_DISABLE_XET = True``).  A client
that still tries Xet gets a clear 501 from the ``xet-write-token`` route.
``HubServer(lfs_threshold=None, lfs_suffixes=())`` makes every file
"regular", which works even with Xet enabled.

Endpoint / environment
----------------------
``huggingface_hub`` reads ``HF_ENDPOINT``, ``HF_HOME``, ``HF_TOKEN``,
``HF_HUB_OFFLINE`` ... into module constants *at import time*, and
``transformers`` builds on them (``push_to_hub`` / ``from_pretrained`` have no
``endpoint=`` argument).  Setting them inside an already-running pytest
process is unreliable, so the robust pattern is:

* start one ``HubServer`` in a background thread (session fixture), and
* run the transformers / hf_tensorcomp code in a **subprocess** whose
  environment is ``hub_env(server, tmp_path)``, e.g. via
  ``run_python(code, env)``.

Plain ``HfApi`` calls may run in-process with explicit arguments:
``HfApi(endpoint=server.url, token=server.token)`` and
``hf_hub_download(..., endpoint=server.url, token=server.token,
cache_dir=...)``, after setting ``constants.HF_HUB_DISABLE_XET = True`` (see
``patch_in_process``).

Standalone: ``python tests/hub_server.py --port 8080`` then
``HF_ENDPOINT=http://127.0.0.1:8080 HF_TOKEN=x HF_HUB_DISABLE_XET=1 ...``.
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["HubServer", "hub_env", "run_python", "patch_in_process", "DEFAULT_TOKEN"]

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
        handler = type("_BoundHandler", (_Handler,), {"hub": self})
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


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer  # set on the bound subclass
    protocol_version = "HTTP/1.1"
    server_version = "LocalHub/1.0"

    # silence default stderr logging
    def log_message(self, format, *args):  # noqa: A002
        pass

    # ------------------------------------------------------------------ plumbing
    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        self._status = 0
        self._body_consumed = False
        split = urlsplit(self.path)
        self.query = {k: v for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        self.segs = [unquote(s) for s in split.path.split("/")[1:]]
        if self.segs and self.segs[-1] == "" and len(self.segs) > 1:
            self.segs = self.segs[:-1]
        try:
            self._route(method)
        except HubError as err:
            self._drain()
            headers = dict(err.headers)
            if err.code:
                headers["X-Error-Code"] = err.code
            headers["X-Error-Message"] = err.message.replace("\n", " ")[:500]
            self._send(err.status, {"error": err.message, **err.extra}, headers, head=(method == "HEAD"))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # pragma: no cover - debugging aid
            self._drain()
            msg = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            self._send(500, {"error": msg}, head=(method == "HEAD"))
        finally:
            with self.hub._lock:
                self.hub.requests.append((method, self.path, self._status))

    def _send(self, status: int, body=None, headers: dict | None = None, head: bool = False,
              content_type: str | None = None) -> None:
        if isinstance(body, (dict, list)):
            data = json.dumps(body).encode()
            content_type = content_type or "application/json"
        elif body is None:
            data = b""
        else:
            data = body
        self._status = status
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        for key, value in (headers or {}).items():
            self.send_header(key, str(value))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head and data:
            self.wfile.write(data)

    def _iter_body(self, chunk_size: int = 1 << 20):
        """Yield the request body (Content-Length or chunked transfer encoding)."""
        self._body_consumed = True
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                line = self.rfile.readline().strip()
                size = int(line.split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline().strip():  # trailers
                        pass
                    return
                yield from self._read_exactly(size, chunk_size)
                self.rfile.readline()  # CRLF after chunk
        else:
            yield from self._read_exactly(int(self.headers.get("Content-Length") or 0), chunk_size)

    def _read_exactly(self, remaining: int, chunk_size: int):
        while remaining:
            chunk = self.rfile.read(min(remaining, chunk_size))
            if not chunk:
                raise ConnectionResetError("truncated request body")
            remaining -= len(chunk)
            yield chunk

    def _read_body(self) -> bytes:
        return b"".join(self._iter_body())

    def _drain(self) -> None:
        if not self._body_consumed:
            try:
                for _ in self._iter_body():
                    pass
            except Exception:
                self.close_connection = True

    def _json_body(self) -> dict:
        raw = self._read_body()
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise HubError(400, f"Invalid JSON body: {exc}") from exc

    def _authed(self, required: bool = False) -> bool:
        auth = self.headers.get("Authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if token:
            if self.hub.token is not None and token != self.hub.token:
                raise HubError(401, "Invalid credentials in Authorization header")
            return True
        if required:
            raise HubError(401, "You must be authenticated to access this endpoint (send a Bearer token).")
        return False

    def _param_true(self, name: str) -> bool:
        values = self.query.get(name)
        return bool(values) and values[-1].lower() in ("1", "true", "yes")

    def _repo_url(self, repo: _Repo) -> str:
        return f"{self.hub.url}/{_URL_PREFIX[repo.repo_type]}{repo.repo_id}"

    # ------------------------------------------------------------------ routing
    def _route(self, method: str) -> None:
        s = self.segs
        hub = self.hub
        if s[:1] == ["api"]:
            rest = s[1:]
            if rest == ["whoami-v2"] and method == "GET":
                return self._whoami()
            if rest == ["validate-yaml"] and method == "POST":
                self._read_body()
                return self._send(200, {"errors": [], "warnings": []})
            if rest == ["repos", "create"] and method == "POST":
                return self._create_repo()
            if rest == ["repos", "delete"] and method == "DELETE":
                return self._delete_repo()
            if len(rest) >= 3 and rest[0] in _TYPE_BY_API:
                repo_type = _TYPE_BY_API[rest[0]]
                repo_id = f"{rest[1]}/{rest[2]}"
                return self._repo_api(method, repo_type, repo_id, rest[3:])
            raise HubError(404, f"Unknown API route {method} {self.path}")

        if s[:2] == ["_lfs", "upload"] and len(s) == 3 and method == "PUT":
            return self._lfs_put(s[2])
        if s[:2] == ["_lfs", "verify"] and len(s) == 3 and method == "POST":
            return self._lfs_verify(s[2])

        # repo-scoped non-API routes: [prefix] ns name(.git) ...
        repo_type = "model"
        rest = s
        if rest and rest[0] in _PREFIX_TO_TYPE:
            repo_type = _PREFIX_TO_TYPE[rest[0]]
            rest = rest[1:]
        if len(rest) >= 6 and rest[1].endswith(".git") and rest[2:] == ["info", "lfs", "objects", "batch"]:
            if method != "POST":
                raise HubError(405, "Method not allowed")
            return self._lfs_batch(repo_type, f"{rest[0]}/{rest[1][:-4]}")
        if len(rest) >= 5 and rest[2] == "resolve" and method in ("GET", "HEAD"):
            return self._resolve_file(method, repo_type, f"{rest[0]}/{rest[1]}", rest[3], "/".join(rest[4:]))
        raise HubError(404, f"Unknown route {method} {self.path}")

    def _repo_api(self, method: str, repo_type: str, repo_id: str, rest: list[str]) -> None:
        if not rest and method == "GET":
            return self._repo_info(repo_type, repo_id, "main")
        if len(rest) == 2 and rest[0] == "revision" and method == "GET":
            return self._repo_info(repo_type, repo_id, rest[1])
        if len(rest) >= 2 and rest[0] == "tree" and method == "GET":
            return self._tree(repo_type, repo_id, rest[1], "/".join(rest[2:]))
        if len(rest) == 2 and rest[0] == "paths-info" and method == "POST":
            return self._paths_info(repo_type, repo_id, rest[1])
        if rest == ["refs"] and method == "GET":
            return self._refs(repo_type, repo_id)
        if len(rest) == 2 and rest[0] == "commits" and method == "GET":
            return self._commits(repo_type, repo_id, rest[1])
        if len(rest) == 2 and rest[0] == "preupload" and method == "POST":
            return self._preupload(repo_type, repo_id, rest[1])
        if len(rest) == 2 and rest[0] == "commit" and method == "POST":
            return self._commit_api(repo_type, repo_id, rest[1])
        if len(rest) == 2 and rest[0] == "branch" and method in ("POST", "DELETE"):
            return self._branch(method, repo_type, repo_id, rest[1])
        if len(rest) == 2 and rest[0] == "tag" and method in ("POST", "DELETE"):
            return self._tag(method, repo_type, repo_id, rest[1])
        if len(rest) >= 1 and rest[0] in ("xet-write-token", "xet-read-token"):
            raise HubError(
                501,
                "This local test Hub does not implement Xet storage: run the client with HF_HUB_DISABLE_XET=1 "
                "(classic LFS 'basic' transfer is supported).",
            )
        raise HubError(404, f"Unknown API route {method} {self.path}")

    # ------------------------------------------------------------------ API handlers
    def _whoami(self) -> None:
        self._authed(required=True)
        user = self.hub.user
        self._send(200, {
            "type": "user", "id": hashlib.sha1(user.encode()).hexdigest()[:24], "name": user,
            "fullname": user, "email": None, "emailVerified": False, "isPro": False, "orgs": [],
            "auth": {"type": "access_token", "accessToken": {"displayName": "local-test", "role": "write"}},
        })

    def _create_repo(self) -> None:
        hub = self.hub
        body = self._json_body()
        self._authed(required=True)
        name = body.get("name") or ""
        namespace = body.get("organization") or hub.user
        repo_type = body.get("type") or "model"
        if repo_type not in _URL_PREFIX:
            raise HubError(400, f"Invalid repo type '{repo_type}'")
        if not _NAME_RE.match(name) or not _NAME_RE.match(namespace) or "--" in name or name.endswith(".git"):
            raise HubError(400, f"Invalid repo name '{namespace}/{name}'")
        private = body.get("visibility") == "private" or bool(body.get("private"))
        repo_id = f"{namespace}/{name}"
        with hub._lock:
            existing = hub._repos.get((repo_type, repo_id))
            if existing is not None:
                raise HubError(409, f"You already created this {repo_type} repo: {repo_id}",
                               extra={"url": self._repo_url(existing)})
            repo = _Repo(repo_type, repo_id, private)
            sha = hub._store_bytes(GITATTRIBUTES)
            tree = {".gitattributes": hub._entry_for(sha, len(GITATTRIBUTES), lfs=False)}
            hub._commit(repo, "main", tree, "initial commit", "", None)
            hub._repos[(repo_type, repo_id)] = repo
        self._send(200, {"url": self._repo_url(repo), "name": repo_id, "id": repo_id})

    def _delete_repo(self) -> None:
        body = self._json_body()
        self._authed(required=True)
        repo_id = f"{body.get('organization') or self.hub.user}/{body.get('name')}"
        repo_type = body.get("type") or "model"
        with self.hub._lock:
            self.hub._get_repo(repo_type, repo_id, authed=True)
            del self.hub._repos[(repo_type, repo_id)]
        self._send(200, {})

    def _file_json(self, repo: _Repo, path: str, entry: dict, expand: bool) -> dict:
        item = {"type": "file", "oid": entry["oid"], "size": entry["size"], "path": path}
        if entry["lfs"]:
            item["lfs"] = {"oid": entry["sha256"], "size": entry["size"], "pointerSize": entry["pointer_size"]}
        if expand:
            commit = repo.commits.get(entry.get("last_commit", ""))
            if commit is not None:
                item["lastCommit"] = {"id": entry["last_commit"], "title": commit["title"], "date": commit["date"]}
            item["securityFileStatus"] = {"status": "safe", "avScan": {"virusFound": False},
                                          "pickleImportScan": None}
        return item

    def _folder_json(self, tree: dict, path: str) -> dict:
        inner = sorted((p, e["oid"]) for p, e in tree.items() if p.startswith(path + "/"))
        return {"type": "directory", "oid": hashlib.sha1(json.dumps(inner).encode()).hexdigest(), "path": path}

    def _repo_info(self, repo_type: str, repo_id: str, revision: str) -> None:
        authed = self._authed()
        with self.hub._lock:
            repo = self.hub._get_repo(repo_type, repo_id, authed)
            oid, commit = self.hub._resolve(repo, revision)
            tree = commit["tree"]
            siblings = []
            for path in sorted(tree):
                entry = tree[path]
                sib = {"rfilename": path, "size": entry["size"], "blobId": entry["oid"]}
                if entry["lfs"]:
                    sib["lfs"] = {"size": entry["size"], "sha256": entry["sha256"],
                                  "pointerSize": entry["pointer_size"]}
                siblings.append(sib)
            namespace = repo_id.split("/")[0]
            info = {
                "_id": hashlib.sha1(f"{repo_type}/{repo_id}".encode()).hexdigest()[:24],
                "id": repo_id, "author": namespace, "sha": oid, "lastModified": commit["date"],
                "createdAt": repo.created_at, "private": repo.private, "gated": False, "disabled": False,
                "downloads": 0, "likes": 0, "tags": [], "siblings": siblings,
                "usedStorage": sum(e["size"] for e in tree.values()),
            }
            if repo_type == "model":
                info["modelId"] = repo_id
                info["spaces"] = []
                cfg = tree.get("config.json")
                if cfg is not None and cfg["size"] < 1 << 20:
                    try:
                        config = json.loads(self.hub._blob_path(cfg["sha256"]).read_bytes())
                        info["config"] = {k: config[k] for k in ("architectures", "model_type") if k in config}
                    except ValueError:
                        pass
            elif repo_type == "space":
                info["sdk"] = "static"
        self._send(200, info)

    def _tree(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        authed = self._authed()
        recursive = self._param_true("recursive")
        expand = self._param_true("expand")
        path = path.strip("/")
        with self.hub._lock:
            repo = self.hub._get_repo(repo_type, repo_id, authed)
            _, commit = self.hub._resolve(repo, revision)
            tree = commit["tree"]
            prefix = path + "/" if path else ""
            if path and not any(p.startswith(prefix) for p in tree):
                raise HubError(404, f"Entry not found: '{path}' is not a folder", "EntryNotFound")
            files, folders = [], set()
            for p in sorted(tree):
                if not p.startswith(prefix):
                    continue
                rel_parts = p[len(prefix):].split("/")
                for depth in range(1, len(rel_parts)):
                    if recursive or depth == 1:
                        folders.add(prefix + "/".join(rel_parts[:depth]))
                if recursive or len(rel_parts) == 1:
                    files.append(self._file_json(repo, p, tree[p], expand))
            items = [self._folder_json(tree, f) for f in sorted(folders)] + files
        self._send(200, items)

    def _paths_info(self, repo_type: str, repo_id: str, revision: str) -> None:
        raw = self._read_body().decode()
        ctype = self.headers.get("Content-Type", "")
        if "json" in ctype:
            body = json.loads(raw or "{}")
            paths, expand = body.get("paths", []), bool(body.get("expand"))
        else:
            form = parse_qs(raw, keep_blank_values=True)
            paths = form.get("paths", [])
            expand = (form.get("expand") or ["false"])[-1].lower() in ("1", "true")
        authed = self._authed()
        with self.hub._lock:
            repo = self.hub._get_repo(repo_type, repo_id, authed)
            _, commit = self.hub._resolve(repo, revision)
            tree = commit["tree"]
            items = []
            for path in paths:
                path = path.strip("/")
                if path in tree:
                    items.append(self._file_json(repo, path, tree[path], expand))
                elif any(p.startswith(path + "/") for p in tree):
                    items.append(self._folder_json(tree, path))
        self._send(200, items)

    def _refs(self, repo_type: str, repo_id: str) -> None:
        authed = self._authed()
        with self.hub._lock:
            repo = self.hub._get_repo(repo_type, repo_id, authed)
            branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": oid}
                        for b, oid in sorted(repo.branches.items()) if not b.startswith("refs/pr/")]
            prs = [{"name": b, "ref": b, "targetCommit": oid}
                   for b, oid in sorted(repo.branches.items()) if b.startswith("refs/pr/")]
            tags = [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": oid} for t, oid in sorted(repo.tags.items())]
        body = {"branches": branches, "converts": [], "tags": tags}
        if self._param_true("include_prs"):
            body["pullRequests"] = prs
        self._send(200, body)

    def _commits(self, repo_type: str, repo_id: str, revision: str) -> None:
        authed = self._authed()
        with self.hub._lock:
            repo = self.hub._get_repo(repo_type, repo_id, authed)
            oid, _ = self.hub._resolve(repo, revision)
            items = []
            while oid is not None:
                commit = repo.commits[oid]
                items.append({"id": oid, "authors": [{"user": self.hub.user}], "date": commit["date"],
                              "title": commit["title"], "message": commit["message"]})
                oid = commit["parent"]
        self._send(200, items)

    def _preupload(self, repo_type: str, repo_id: str, revision: str) -> None:
        body = self._json_body()
        authed = self._authed(required=True)
        with self.hub._lock:
            repo = self.hub._get_repo(repo_type, repo_id, authed)
            try:
                tree = self.hub._resolve(repo, revision)[1]["tree"]
            except HubError:
                if self._param_true("create_pr"):
                    tree = {}
                else:
                    raise
            out = []
            for item in body.get("files", []):
                path, size = item["path"], int(item.get("size", 0))
                mode = "lfs" if self.hub._wants_lfs(path, size) else "regular"
                existing = tree.get(path)
                oid = None
                if existing is not None:
                    oid = existing["sha256"] if existing["lfs"] else existing["oid"]
                out.append({"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        self._send(200, {"files": out, "commitOid": None})

    def _commit_api(self, repo_type: str, repo_id: str, revision: str) -> None:
        hub = self.hub
        raw = self._read_body()
        authed = self._authed(required=True)
        lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "Commit payload must start with a 'header' line")
        header = lines[0]["value"]
        title = header.get("summary") or ""
        if not title:
            raise HubError(400, "Commit summary is required")
        create_pr = self._param_true("create_pr")
        with hub._lock:
            repo = hub._get_repo(repo_type, repo_id, authed)
            base_oid, base_commit = hub._resolve(repo, revision)
            if not create_pr and revision not in repo.branches:
                raise HubError(400, f"Cannot commit to '{revision}': not a branch")
            parent = header.get("parentCommit")
            if parent and parent != base_oid:
                raise HubError(412, f"A commit has happened since parentCommit {parent} (head is {base_oid})")
            tree = {p: dict(e) for p, e in base_commit["tree"].items()}
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value", {})
                path = str(value.get("path", "")).strip("/")
                if key in ("file", "lfsFile") and (not path or ".." in path.split("/")):
                    raise HubError(400, f"Invalid path '{path}'")
                if key == "file":
                    if value.get("encoding", "base64") != "base64":
                        data = str(value.get("content", "")).encode()
                    else:
                        data = base64.b64decode(value.get("content", ""))
                    sha = hub._store_bytes(data)
                    tree[path] = hub._entry_for(sha, len(data), lfs=False)
                elif key == "lfsFile":
                    oid = value.get("oid", "")
                    blob = hub._blob_path(oid) if _SHA256_RE.match(oid) else None
                    if blob is None or not blob.exists():
                        raise HubError(422, f"LFS object {oid} for '{path}' was not uploaded")
                    size = blob.stat().st_size
                    if value.get("size") is not None and int(value["size"]) != size:
                        raise HubError(422, f"LFS object {oid}: size mismatch")
                    tree[path] = hub._entry_for(oid, size, lfs=True)
                elif key == "deletedFile":
                    if path not in tree:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                    del tree[path]
                elif key == "deletedFolder":
                    victims = [p for p in tree if p.startswith(path + "/")]
                    if not victims:
                        raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                    for p in victims:
                        del tree[p]
                else:
                    raise HubError(400, f"Unknown commit operation key '{key}'")
            if create_pr:
                repo.pr_count += 1
                branch = f"refs/pr/{repo.pr_count}"
            else:
                branch = revision
            new_oid = hub._commit(repo, branch, tree, title, header.get("description") or "", base_oid)
            body = {"commitUrl": f"{self._repo_url(repo)}/commit/{new_oid}", "commitOid": new_oid,
                    "success": True}
            if create_pr:
                body["pullRequestUrl"] = f"{self._repo_url(repo)}/discussions/{repo.pr_count}"
        self._send(200, body)

    def _branch(self, method: str, repo_type: str, repo_id: str, branch: str) -> None:
        body = self._json_body()
        authed = self._authed(required=True)
        with self.hub._lock:
            repo = self.hub._get_repo(repo_type, repo_id, authed)
            if method == "DELETE":
                if branch not in repo.branches:
                    raise HubError(404, f"Branch {branch} not found", "RevisionNotFound")
                if branch == "main":
                    raise HubError(403, "Cannot delete the main branch")
                del repo.branches[branch]
                return self._send(200, {})
            if branch in repo.branches:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            oid, _ = self.hub._resolve(repo, body.get("startingPoint") or "main")
            repo.branches[branch] = oid
        self._send(200, {})

    def _tag(self, method: str, repo_type: str, repo_id: str, name: str) -> None:
        body = self._json_body()
        authed = self._authed(required=True)
        with self.hub._lock:
            repo = self.hub._get_repo(repo_type, repo_id, authed)
            if method == "DELETE":
                if repo.tags.pop(name, None) is None:
                    raise HubError(404, f"Tag {name} not found", "RevisionNotFound")
                return self._send(200, {})
            tag = body.get("tag") or ""
            if not tag:
                raise HubError(400, "Missing 'tag'")
            if tag in repo.tags:
                raise HubError(409, f"Tag {tag} already exists")
            repo.tags[tag] = self.hub._resolve(repo, name)[0]  # here `name` is the revision to tag
        self._send(200, {})

    # ------------------------------------------------------------------ LFS
    def _lfs_batch(self, repo_type: str, repo_id: str) -> None:
        body = self._json_body()
        authed = self._authed(required=True)
        with self.hub._lock:
            self.hub._get_repo(repo_type, repo_id, authed)
        if body.get("operation") != "upload":
            raise HubError(400, "Only the 'upload' LFS operation is supported")
        transfers = body.get("transfers") or ["basic"]
        if "basic" not in transfers:
            raise HubError(400, f"Unsupported LFS transfers {transfers}: only 'basic' is implemented")
        objects = []
        for obj in body.get("objects", []):
            oid, size = str(obj.get("oid", "")), int(obj.get("size", 0))
            item = {"oid": oid, "size": size, "authenticated": True}
            if not _SHA256_RE.match(oid):
                item["error"] = {"code": 422, "message": f"Invalid sha256 oid '{oid}'"}
            elif not self.hub._blob_path(oid).exists():
                item["actions"] = {
                    "upload": {"href": f"{self.hub.url}/_lfs/upload/{oid}", "header": {}},
                    "verify": {"href": f"{self.hub.url}/_lfs/verify/{oid}", "header": {}},
                }
            objects.append(item)
        self._send(200, {"transfer": "basic", "objects": objects}, content_type="application/vnd.git-lfs+json")

    def _lfs_put(self, oid: str) -> None:
        if not _SHA256_RE.match(oid):
            raise HubError(400, f"Invalid sha256 oid '{oid}'")
        final = self.hub._blob_path(oid)
        tmp = final.with_name(f"{oid}.{threading.get_ident()}.upload")
        digest = hashlib.sha256()
        try:
            with open(tmp, "wb") as fh:
                for chunk in self._iter_body():
                    digest.update(chunk)
                    fh.write(chunk)
            if digest.hexdigest() != oid:
                raise HubError(400, f"Uploaded content does not match sha256 {oid}")
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                tmp.unlink()
        self._send(200, None, {"ETag": f'"{oid}"'})

    def _lfs_verify(self, oid: str) -> None:
        body = self._json_body()
        blob = self.hub._blob_path(oid)
        if not _SHA256_RE.match(oid) or not blob.exists():
            raise HubError(404, f"LFS object {oid} not found")
        if body.get("size") is not None and int(body["size"]) != blob.stat().st_size:
            raise HubError(422, f"LFS object {oid}: size mismatch")
        self._send(200, {"message": "ok"})

    # ------------------------------------------------------------------ file download
    def _resolve_file(self, method: str, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        authed = self._authed()
        with self.hub._lock:
            repo = self.hub._get_repo(repo_type, repo_id, authed)
            oid, commit = self.hub._resolve(repo, revision)
            entry = commit["tree"].get(path)
            if entry is None:
                raise HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": oid})
            entry = dict(entry)
        blob = self.hub._blob_path(entry["sha256"])
        size = entry["size"]
        etag = entry["sha256"] if entry["lfs"] else entry["oid"]
        headers = {"X-Repo-Commit": oid, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if entry["lfs"]:
            headers["X-Linked-Etag"] = f'"{entry["sha256"]}"'
            headers["X-Linked-Size"] = str(size)
        start, end, status = 0, size - 1, 200
        rng = self.headers.get("Range")
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip()) if rng else None
        if m and (m.group(1) or m.group(2)):
            if m.group(1):
                start = int(m.group(1))
                end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            else:  # suffix range
                start = max(size - int(m.group(2)), 0)
            if start >= size or start > end:
                headers["Content-Range"] = f"bytes */{size}"
                self._status = 416
                self.send_response(416)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        length = max(end - start + 1, 0)
        self._status = status
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if method == "HEAD" or length == 0:
            return
        with open(blob, "rb") as fh:
            fh.seek(start)
            remaining = length
            while remaining:
                chunk = fh.read(min(remaining, 1 << 20))
                if not chunk:
                    break
                self.wfile.write(chunk)
                remaining -= len(chunk)


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Local Hugging Face Hub-compatible test server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--root", default=None, help="storage directory (default: temp dir)")
    parser.add_argument("--user", default=DEFAULT_USER)
    parser.add_argument("--token", default=None, help="only accept this token (default: any)")
    parser.add_argument("--lfs-threshold", type=int, default=10 * 1024 * 1024)
    opts = parser.parse_args(argv)
    server = HubServer(root=opts.root, host=opts.host, port=opts.port, user=opts.user, token=opts.token,
                       lfs_threshold=opts.lfs_threshold)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so `finally` removes the temp storage
    server.start()
    print(f"Local Hub serving at {server.url} (storage: {server.root}); "
          f"use HF_ENDPOINT={server.url} HF_HUB_DISABLE_XET=1 HF_TOKEN=<anything>", flush=True)
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
