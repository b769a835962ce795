"""Repository endpoints of the local Hub server (the mixin the request handler inherits)."""

from __future__ import annotations

import hashlib
import json
from urllib.parse import parse_qs

from .protocol import _URL_PREFIX, _NAME_RE, GITATTRIBUTES, HubError, _Repo


class RepoRoutes:
    """Repository endpoints: who-am-i, create/delete, info, tree, paths-info, refs, commits, branches, tags."""

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
