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

Standalone: ``cd tests && python -m hub_server --port 8080`` then
``HF_ENDPOINT=http://127.0.0.1:8080 HF_TOKEN=x HF_HUB_DISABLE_XET=1 ...``.

Layout: ``protocol`` (constants, errors), ``server`` (storage and lifecycle), ``handler``
(plumbing and routing) with one mixin per concern: ``repos``, ``uploads``, ``files``;
``client`` (helpers for tests).
"""

from .client import hub_env, patch_in_process, run_python
from .protocol import DEFAULT_TOKEN
from .server import HubServer

__all__ = ["HubServer", "hub_env", "run_python", "patch_in_process", "DEFAULT_TOKEN"]
