"""HTTP plumbing of the local Hub server: parse, route, answer, record errors the way the Hub does."""

from __future__ import annotations

import json
import traceback
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, unquote, urlsplit

from .protocol import _TYPE_BY_API, _URL_PREFIX, _PREFIX_TO_TYPE, HubError, _Repo
from .files import FileRoutes
from .repos import RepoRoutes
from .uploads import UploadRoutes


class Handler(RepoRoutes, UploadRoutes, FileRoutes, BaseHTTPRequestHandler):
    """Request plumbing and routing; the endpoints live in the mixins, one module per concern."""
    hub = None  # the HubServer, set on the subclass it binds
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
