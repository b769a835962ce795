"""Atomic folder writes: a checkpoint folder is either the old one or the complete new one, never a mix.

`atomic_dir` hands out a temporary sibling folder (``.NAME.hf_tensorcomp-tmp-PID-XXXX``), and when
the block completes swaps it into place under an exclusive lock on the parent folder: on Linux by
one ``renameat2(RENAME_EXCHANGE)``, elsewhere by two renames. A save killed before the swap leaves
the old folder untouched; its temporary folder is removed by the next write beside it (its process
is gone). Two writers racing into one folder each produce a whole folder; with ``overwrite=False``
the second one fails instead of replacing the first.

`make_save_atomic` routes a model's ``save_pretrained`` through `atomic_dir` (the quantizer does it
for every model it compresses or reloads).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import types
from pathlib import Path

TAG = ".hf_tensorcomp-tmp-"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
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


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the call is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the file system cannot; fall back
        return False
    raise OSError(err, os.strerror(err), str(b))


def _is_weight_file(name: str) -> bool:
    return name in _REWRITTEN or (name.startswith(("model", "pytorch_model")) and name.endswith((".safetensors", ".bin")))


@contextlib.contextmanager
def atomic_dir(target, overwrite: bool = True, keep_existing: bool = False):
    """Yield a temporary folder; on success it replaces `target` as a whole.

    overwrite: if False and `target` exists and is not empty at the swap, raise FileExistsError
        (checked under the lock, so of two racing writers exactly one succeeds).
    keep_existing: start the temporary folder with copies of the files already in `target` other
        than weights and configs (what ``save_pretrained`` into an existing folder keeps: a
        tokenizer, a README).
    """
    target = Path(target).absolute()
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale(parent, target.name)
    tmp = parent / f".{target.name}{TAG}{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        if keep_existing and target.is_dir():
            for p in target.iterdir():
                if p.is_file() and not _is_weight_file(p.name):
                    shutil.copy2(p, tmp / p.name)
                elif p.is_dir() and not p.name.startswith("."):
                    shutil.copytree(p, tmp / p.name)
        yield tmp
        with _locked(parent):
            if target.exists() and not target.is_dir():
                raise FileExistsError(f"{target}: exists and is not a folder")
            if target.is_dir() and any(target.iterdir()):
                if not overwrite:
                    raise FileExistsError(f"{target}: exists and is not empty (another writer may have finished first); "
                                          "allowed: a new or empty folder, or overwrite")
                if not _exchange(tmp, target):
                    old = parent / f".{target.name}{TAG}{os.getpid()}-old-{secrets.token_hex(4)}"
                    os.rename(target, old)
                    os.rename(tmp, target)
                    tmp = old
                shutil.rmtree(tmp, ignore_errors=True)  # now the old folder
                return
            if target.is_dir():
                target.rmdir()
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_pretrained(self, save_directory, *args, **kwargs):
    """``save_pretrained`` written to a temporary sibling folder and swapped into place (see `atomic_dir`)."""
    save = type(self).save_pretrained
    if os.path.isfile(save_directory):
        return save(self, save_directory, *args, **kwargs)  # transformers' own error
    with atomic_dir(save_directory, overwrite=True, keep_existing=True) as tmp:
        return save(self, tmp, *args, **kwargs)


def make_save_atomic(model) -> None:
    """Route ``model.save_pretrained`` through `atomic_dir` (a bound method: survives deepcopy and pickle)."""
    model.save_pretrained = types.MethodType(save_pretrained, model)
