"""Atomic folder writes: a checkpoint folder is either the old one or the complete new one, never a mix.

`atomic_dir` hands out a temporary sibling folder (``.NAME.hf_tensorcomp-tmp-PID-XXXX``), and when
the block completes puts it in place under an exclusive lock on the parent folder: a new folder in one
rename; into an existing one, only the files the save wrote, each in one rename (weights, then the
index, then configs), so that a ``.git`` or a user's files beside a checkpoint are never touched. A
save killed before that step leaves the old folder untouched; its temporary folder is removed by the
next write beside it (its process is gone). Two writers racing into one folder each produce a whole folder; with ``overwrite=False``
the second one fails instead of replacing the first.

An output path that is a symbolic link (to a folder, an empty one, or to nothing yet) is written where the link
points, atomically as any other, and the link is left as it is: the path is resolved before the temporary
sibling is made, so the sibling lies beside the link's target and the rename replaces no link.

`hf_tensorcomp.integration.saving.make_save_atomic` routes a model's ``save_pretrained`` through `atomic_dir` (the
quantizer does it for every model it compresses or reloads). This module needs nothing of the package: the writers
on every floor (the assets, the methods' side files, the CLI) use it.

Readers are not protected during a rewrite: a reader may see the old config beside new weights. A
compressed checkpoint whose files change between its header check and the end of its load is refused
(`hf_tensorcomp.checks.check_unchanged`), never returned half old, half new: load it again once the
writer is done.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from pathlib import Path

TAG = ".hf_tensorcomp-tmp-"
#: files `save_pretrained` writes or deletes itself; the others in an existing folder are kept
_REWRITTEN = ("config.json", "generation_config.json", "model.safetensors.index.json")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(parent: Path, name: str) -> None:
    """Delete temporary folders of `name` left by writers that were killed (their process is gone)."""
    for p in parent.glob(f".{name}{TAG}*"):
        pid = p.name[len(f".{name}{TAG}"):].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def _locked(folder: Path):
    """An exclusive advisory lock on `folder` itself (nothing is created for it)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock; the swap below is still whole-folder
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _is_weight_file(name: str) -> bool:
    return name in _REWRITTEN or (name.startswith(("model", "pytorch_model")) and name.endswith((".safetensors", ".bin")))


def _write_order(name: str) -> tuple[int, str]:
    """Weights first, then the weight index, then configs: a reader that finds the new config finds its weights."""
    return (2 if name.endswith(".json") and "config" in name else 1 if name.endswith(".index.json") else 0, name)


def _merge_into(tmp: Path, target: Path) -> None:
    """Move what `tmp` holds into the existing folder `target`, entry by entry (each an atomic rename);
    remove the weight files of an earlier save that this one did not write; leave everything else."""
    written = {p.name for p in tmp.iterdir()}
    for name in sorted(written, key=_write_order):
        src, dst = tmp / name, target / name
        if src.is_dir() and dst.is_dir():
            shutil.rmtree(dst)
        os.replace(src, dst)
    for p in target.iterdir():
        if p.is_file() and _is_weight_file(p.name) and p.name not in written:
            p.unlink()  # a stale shard of an earlier save (save_pretrained removes these itself)


@contextlib.contextmanager
def atomic_dir(target, overwrite: bool = True):
    """Yield a temporary folder; on success its content is put in place at `target`.

    A new or empty `target` becomes the temporary folder in one rename: whole or absent. Into an
    existing folder (with ``overwrite``) only the entries the block wrote are replaced, each in one
    rename, weights before configs, under the lock; the rest of the folder (a ``.git``, a user's
    files) is not touched, and weight files of an earlier save that this one did not write are removed.

    overwrite: if False and `target` exists and is not empty at the swap, raise FileExistsError
        (checked under the lock, so of two racing writers exactly one succeeds).
    """
    target = Path(os.path.realpath(target))  # "." and "..", and a link: written where it points (`resolve`)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target}: exists and is not a folder; allowed: a new, empty or model folder")
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale(parent, target.name)
    tmp = parent / f".{target.name}{TAG}{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        with _locked(parent):
            if target.exists() and not target.is_dir():
                raise FileExistsError(f"{target}: exists and is not a folder")
            if target.is_dir() and any(target.iterdir()):
                if not overwrite:
                    raise FileExistsError(f"{target}: exists and is not empty (another writer may have finished first); "
                                          "allowed: a new or empty folder, or overwrite")
                _merge_into(tmp, target)
                shutil.rmtree(tmp, ignore_errors=True)
                return
            if target.is_dir():
                target.rmdir()
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def final_path(path) -> str:
    """`path` with each temporary sibling of `atomic_dir` / `atomic_file` (``.NAME.hf_tensorcomp-tmp-PID-XXXX``) named
    as what it is renamed to (NAME): where an output being written will be, for messages."""
    return re.sub(rf"(^|/)\.([^/]+?){re.escape(TAG)}\d+-[0-9a-f]+(?=/|$)", r"\1\2", str(path))


def refuse_overlap(out, inputs, who: str, what: str = "the input") -> None:
    """The writers' rule, checked before any work: an output never is, lies inside or holds one of its inputs
    (symbolic links followed). Raises ValueError naming `who` (e.g. ``"compress_checkpoint: out"``) and `what` the
    input is."""
    o = Path(os.path.realpath(out))
    for src in inputs:
        if src is None:
            continue
        s = Path(os.path.realpath(src))
        said = "is" if o == s else "lies inside" if s in o.parents else "holds" if o in s.parents else None
        if said:
            raise ValueError(f"{who}: {out} {said} {what} {src}; allowed: a folder apart from it (nothing was touched)")


@contextlib.contextmanager
def atomic_file(path, overwrite: bool = True):
    """Yield a temporary sibling path of the file `path` (``.NAME.hf_tensorcomp-tmp-PID-XXXX``, not created); when
    the block completes, what was written there replaces `path` in one rename, else it is removed.

    overwrite: if False and `path` exists, raise FileExistsError (before the block runs, and again at the rename).
    """
    path = Path(os.path.realpath(path))  # a link: the file it points to is replaced, the link kept
    if path.is_dir():
        raise IsADirectoryError(f"{path}: a folder; allowed: a file path")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path}: exists; allowed: a new file, or overwrite")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}{TAG}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        yield tmp
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path}: exists (another writer may have finished first); allowed: a new file, or "
                                  "overwrite")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
