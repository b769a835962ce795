"""Real English text: paragraphs read out of the ``evals`` wheel, split into calib / eval."""

from __future__ import annotations

import functools
import json
import zipfile

from .pypi import download_wheel

_EVALS_WHEEL = "evals==3.0.1.post1"
_TEXT_MEMBERS = {
    "wikipedia": "evals/registry/data/schelling_point/wikipedia_5.jsonl",
    "owt": "evals/registry/data/schelling_point/owt_5.jsonl",
}
TEXT_SOURCES = tuple(_TEXT_MEMBERS)
TEXT_SPLITS = ("eval", "calib", "all")
_CALIB_FRACTION = 0.8


@functools.lru_cache(maxsize=None)
def _paragraphs(source: str) -> tuple[str, ...]:
    wheel = download_wheel(_EVALS_WHEEL)
    with zipfile.ZipFile(wheel) as zf:
        lines = zf.read(_TEXT_MEMBERS[source]).decode("utf-8").splitlines()
    paras = []
    for line in lines:
        if line.strip():
            p = json.loads(line)["0"].strip()
            if p:
                paras.append(p)
    return tuple(paras)


def load_text(source: str = "wikipedia", split: str = "eval") -> list[str]:
    """Paragraphs of real English text (a fresh list; each paragraph stripped).

    ``source``: ``"wikipedia"`` (schelling_point/wikipedia_5.jsonl) or ``"owt"``
    (OpenWebText, schelling_point/owt_5.jsonl), 1000 paragraphs each, from the
    ``evals==3.0.1.post1`` wheel (read from the zip, not installed).
    ``split``: ``"calib"`` = first 80% of the paragraphs in file order (800),
    ``"eval"`` = the last 20% (200), ``"all"`` = everything. calib and eval are disjoint.
    """
    if source not in _TEXT_MEMBERS:
        raise ValueError(f"unknown text source={source!r}; allowed: {', '.join(TEXT_SOURCES)}")
    if split not in TEXT_SPLITS:
        raise ValueError(f"unknown text split={split!r}; allowed: {', '.join(TEXT_SPLITS)}")
    paras = _paragraphs(source)
    n_calib = int(len(paras) * _CALIB_FRACTION)
    if split == "calib":
        return list(paras[:n_calib])
    if split == "eval":
        return list(paras[n_calib:])
    return list(paras)
