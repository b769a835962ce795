"""Validation helpers shared by the config and the methods (no torch, no transformers).

Every error a user can get from a bad setting goes through `fail`, so they all read the same:
``TensorCompressionConfig.<field>: got <value>; allowed: <what would be right>``.
"""

from __future__ import annotations

import os
from typing import Any


def fail(field: str, got: Any, allowed: str, who: str = "TensorCompressionConfig") -> None:
    raise ValueError(f"{who}.{field}: got {got!r}; allowed: {allowed}")


def is_int(x: Any, lo: int | None = None) -> bool:
    """An int (not a bool), at least `lo` if given."""
    return isinstance(x, int) and not isinstance(x, bool) and (lo is None or x >= lo)


def is_path(x: Any) -> bool:
    """A path given as a string or as an os.PathLike (pathlib.Path)."""
    return isinstance(x, (str, os.PathLike))


def missing_folder(x: Any) -> bool:
    """A path meant as a local folder that is not one: an os.PathLike, or a string that cannot be a Hub repo id
    (absolute, starting with ``.`` or ``~``, more than one ``/``) or that names something other than a folder."""
    name = os.fspath(x)
    if os.path.isdir(name):
        return False
    return (not isinstance(x, str) or os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
            or os.path.exists(name))


def is_number(x: Any) -> bool:
    """A real number given as an int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def choices(allowed) -> str:
    """The "allowed" text of an error for a field that takes one of `allowed`."""
    return " | ".join(map(repr, allowed))


def validate_rank(rank: Any, field: str = "rank") -> int | float:
    """An int >= 1 (absolute rank) or a float in (0, 1] (fraction of the full rank)."""
    if isinstance(rank, bool):
        fail(field, rank, "an int >= 1 or a float in (0, 1]")
    if isinstance(rank, int):
        if rank < 1:
            fail(field, rank, "an int >= 1 or a float in (0, 1]")
        return rank
    if isinstance(rank, float):
        if not 0.0 < rank <= 1.0:
            fail(field, rank, "an int >= 1 or a float in (0, 1]")
        return rank
    fail(field, rank, "an int >= 1 or a float in (0, 1]")


def resolve_rank(rank: int | float, full: int) -> int:
    """Turn a validated rank (int, or fraction of `full`) into an int in [1, full]."""
    if isinstance(rank, float):
        return max(1, min(full, round(rank * full)))
    return rank
