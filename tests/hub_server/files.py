"""File download endpoint of the local Hub server (the mixin the request handler inherits)."""

from __future__ import annotations

import re

from .protocol import HubError


class FileRoutes:
    """File download: HEAD/GET /resolve with ranges and the Hub's ETag headers."""

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
