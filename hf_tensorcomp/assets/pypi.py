"""Wheels and source distributions fetched from the package index into the cache (``pip download``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._common import _note, cache_dir


def _parse_dist_filename(filename: str, kind: str):
    """``(canonical name, Version)`` of a wheel (kind "wheel") or sdist (kind "sdist") file name,
    or None if the name does not parse as one."""
    from packaging.utils import (
        InvalidSdistFilename,
        InvalidWheelFilename,
        parse_sdist_filename,
        parse_wheel_filename,
    )

    try:
        if kind == "wheel":
            name, version, _, _ = parse_wheel_filename(filename)
        else:
            name, version = parse_sdist_filename(filename)
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None
    return name, version


# kind -> (cache sub-folder, file name patterns, pip option restricting the format)
_DIST_KINDS = {
    "wheel": ("wheels", ("*.whl",), "--only-binary=:all:"),
    "sdist": ("sdists", ("*.tar.gz", "*.zip"), "--no-binary=:all:"),
}


def _find_cached_dist(folder: Path, spec: str, kind: str) -> Path | None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    req = Requirement(spec)
    want = canonicalize_name(req.name)
    best = None
    for pattern in _DIST_KINDS[kind][1]:
        for f in folder.glob(pattern):
            parsed = _parse_dist_filename(f.name, kind)
            if parsed is None:
                continue
            name, version = parsed
            if name == want and req.specifier.contains(version, prereleases=True):
                if best is None or version > best[0]:
                    best = (version, f)
    return None if best is None else best[1]



def _download_dist(spec: str, kind: str) -> Path:
    """Shared body of :func:`download_wheel` / :func:`download_sdist` (``kind``: "wheel"/"sdist")."""
    from packaging.requirements import InvalidRequirement, Requirement

    func = f"download_{kind}"
    try:
        req = Requirement(spec)
    except InvalidRequirement as e:
        raise ValueError(f"{func}: invalid requirement spec {spec!r}: {e}") from None
    pinned = any(s.operator in ("==", "===") and "*" not in s.version for s in req.specifier)

    subdir, patterns, fmt_option = _DIST_KINDS[kind]
    folder = cache_dir() / subdir
    folder.mkdir(parents=True, exist_ok=True)
    if pinned:
        hit = _find_cached_dist(folder, spec, kind)
        if hit is not None:
            return hit

    _note(f"downloading {kind} {spec} from the package index (pip download) ...")
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=".pip-", dir=folder))
    try:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", fmt_option,
            "--disable-pip-version-check", "--quiet", "-d", str(tmp), spec,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
            error = RuntimeError(
                f"pip download of {spec!r} failed (exit code {proc.returncode}); "
                f"command: {' '.join(cmd)}\n{tail}"
            )
            if kind != "sdist" or "cannot declare direct URL dependencies" not in tail:
                raise error
            # pip prepares an sdist's metadata even with --no-deps, and recent pip (26.3 here)
            # refuses any sdist from PyPI that declares a direct-URL dependency (bigbench 1.0.0
            # does: "bleurt @ file://..."). The archive itself is fine: fetch it from the index.
            _note("  pip refused the sdist's metadata (direct-URL dependency); "
                  "downloading the archive from the index's simple API instead ...")
            try:
                _download_sdist_from_index(req, tmp)
            except Exception as e:
                raise error from e
        for pattern in patterns:
            for f in tmp.glob(pattern):
                os.replace(f, folder / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    hit = _find_cached_dist(folder, spec, kind)
    if hit is None:
        raise RuntimeError(f"pip download of {spec!r} succeeded but no matching {kind} is in {folder}")
    _note(f"  {hit.name}: {hit.stat().st_size / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f}s")
    return hit


def _download_sdist_from_index(req, dest: Path) -> Path:
    """Download the newest matching, non-yanked sdist of ``req`` into ``dest``, sha256-checked.

    Uses the index's PEP 691 JSON simple API (``$PIP_INDEX_URL``, else pip's own default index)
    and the sha256 the index lists for the file; only the archive is fetched, nothing is built.
    """
    import ssl
    import urllib.request

    from packaging.utils import canonicalize_name

    from pip._internal.models.index import PyPI  # pip's default index, as `pip download` would use

    index = (os.environ.get("PIP_INDEX_URL") or PyPI.simple_url).rstrip("/")
    cafile = os.environ.get("PIP_CERT") or None
    context = ssl.create_default_context(cafile=cafile if cafile and os.path.isfile(cafile) else None)
    url = f"{index}/{canonicalize_name(req.name)}/"
    request = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60, context=context) as r:
        listing = json.load(r)
    best = None
    for f in listing.get("files", []):
        parsed = _parse_dist_filename(f.get("filename", ""), "sdist")
        if parsed is None or f.get("yanked") or "sha256" not in f.get("hashes", {}):
            continue
        version = parsed[1]
        if req.specifier.contains(version, prereleases=True):
            key = (version, f["filename"].endswith(".tar.gz"))
            if best is None or key > best[0]:
                best = (key, f)
    if best is None:
        raise RuntimeError(f"no sdist matching {str(req)!r} is listed at {url}")
    info = best[1]
    out = dest / info["filename"]
    digest = hashlib.sha256()
    with urllib.request.urlopen(info["url"], timeout=180, context=context) as r, open(out, "wb") as dst:
        while block := r.read(1 << 22):
            digest.update(block)
            dst.write(block)
    if digest.hexdigest() != info["hashes"]["sha256"]:
        out.unlink(missing_ok=True)
        raise RuntimeError(
            f"sha256 mismatch for {info['filename']}: got {digest.hexdigest()}, "
            f"index says {info['hashes']['sha256']}"
        )
    return out


def download_wheel(spec: str) -> Path:
    """Return the path of the wheel for ``spec`` (e.g. ``"evals==3.0.1.post1"``) in the cache.

    Runs ``python -m pip download --no-deps --only-binary=:all: <spec>`` into
    ``<cache>/wheels`` unless an exactly pinned (``==``) wheel is already there. Unpinned
    specs always ask pip (which re-uses a file it already has). pip downloads into a
    temporary folder first and the wheel is then renamed into place, so an interrupted
    download never leaves a partial wheel. Raises ``RuntimeError`` if pip fails.
    """
    return _download_dist(spec, "wheel")


def download_sdist(spec: str) -> Path:
    """Return the path of the source distribution (``.tar.gz``/``.zip``) for ``spec`` in the cache.

    Like :func:`download_wheel` (same pinning, caching and atomicity rules) but runs
    ``python -m pip download --no-deps --no-binary=:all: <spec>`` into ``<cache>/sdists``.
    For packages that publish no wheel, e.g. ``"bigbench==1.0.0"``.

    pip prepares an sdist's metadata (unpacks it and runs its build backend) even with
    ``--no-deps``. Recent pip (seen with 26.3) then rejects a PyPI sdist that declares a
    direct-URL dependency, as bigbench 1.0.0 does (``bleurt @ file://...``); in exactly that
    case the archive is fetched from the index's JSON simple API (``$PIP_INDEX_URL``, else
    PyPI) instead and its sha256 checked against the index. Nothing is installed either way.
    """
    return _download_dist(spec, "sdist")

