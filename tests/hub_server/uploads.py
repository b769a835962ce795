"""Upload endpoints of the local Hub server: preupload, commit, classic LFS (the mixin the handler inherits)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading

from .protocol import _SHA256_RE, HubError


class UploadRoutes:
    """Upload endpoints: preupload, the NDJSON commit, and the classic LFS batch / PUT / verify."""

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
