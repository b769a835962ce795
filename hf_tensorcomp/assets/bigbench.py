"""BIG-bench multiple-choice tasks read out of the ``bigbench`` sdist (never installed)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ._common import _atomic_write_bytes, _note, cache_dir
from .pypi import download_sdist

_BIGBENCH_SDIST = "bigbench==1.0.0"
_BIGBENCH_ROOT = "bigbench/benchmark_tasks/"  # inside the sdist's top folder (bigbench-1.0.0/)
_BIGBENCH_INDEX_VERSION = 1
BIGBENCH_PROMPTS = ("plain", "bigbench")
# defaults of BIG-bench's JsonTask for fields a task.json leaves out (used by prompt="bigbench")
_BIGBENCH_DEFAULTS = {
    "task_prefix": "",
    "example_input_prefix": "\nQ: ",
    "example_output_prefix": "\nA: ",
    "choice_prefix": "\n  choice: ",
    "append_choices_to_input": True,
}
_SAFE_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def _bigbench_dir() -> Path:
    return cache_dir() / "bigbench"


def _bigbench_member(name: str) -> tuple[str, ...] | None:
    """Path parts below ``benchmark_tasks/`` of an sdist member, or None if outside it."""
    top, sep, rest = name.partition("/")
    if not sep or not rest.startswith(_BIGBENCH_ROOT):
        return None
    parts = tuple(rest[len(_BIGBENCH_ROOT):].split("/"))
    if not all(p and p not in (".", "..") and set(p) <= _SAFE_NAME_CHARS for p in parts):
        return None
    return parts


def _read_bigbench_index() -> dict | None:
    path = _bigbench_dir() / "index.json"
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return index if index.get("version") == _BIGBENCH_INDEX_VERSION else None


def _bigbench_task_files(task: str, index: dict | None) -> list[str]:
    """Cached paths (relative to the bigbench cache folder) that ``task`` needs, per the index."""
    info = index["tasks"][task]
    files = [f"{task}/task.json"] if info["json"] else []
    return files + [f"{task}/{s}/task.json" for s in info["subtasks"]]


def _scan_bigbench_sdist(task: str, index: dict | None) -> dict:
    """One streaming pass over the sdist: writes ``task``'s task.json file(s) into the cache and,
    if there is no index yet, builds and writes ``index.json`` (every task and subtask).

    With an index the pass stops as soon as the task's files are written.
    """
    import tarfile

    sdist = download_sdist(_BIGBENCH_SDIST)
    out = _bigbench_dir()
    need = None if index is None else set(_bigbench_task_files(task, index))
    tasks: dict[str, dict] = {}
    _note(f"reading BIG-bench task {task!r} from {sdist.name} (one pass over the archive) ...")
    t0 = time.perf_counter()
    with tarfile.open(sdist, mode="r|gz") as tf:
        for member in tf:
            parts = _bigbench_member(member.name)
            if parts is None or not member.isfile():
                continue
            if len(parts) in (2, 3) and parts[-1] in ("task.json", "task.py"):
                info = tasks.setdefault(parts[0], {"json": False, "subtasks": [], "programmatic": False})
                if parts[-1] == "task.py":
                    info["programmatic"] = True
                elif len(parts) == 2:
                    info["json"] = True
                else:
                    info["subtasks"].append(parts[1])
                if parts[0] == task and parts[-1] == "task.json":
                    rel = "/".join(parts)
                    _atomic_write_bytes(out / rel, tf.extractfile(member).read())
                    if need is not None:
                        need.discard(rel)
                        if not need:
                            break
    if index is None:
        for info in tasks.values():
            info["subtasks"].sort()
        index = {
            "version": _BIGBENCH_INDEX_VERSION,
            "sdist": sdist.name,
            "tasks": dict(sorted(tasks.items())),
        }
        _atomic_write_bytes(out / "index.json", (json.dumps(index, indent=1) + "\n").encode())
    elif need:
        raise RuntimeError(f"{sdist.name} lacks {sorted(need)} although the BIG-bench index lists them")
    _note(f"  done in {time.perf_counter() - t0:.1f}s")
    return index


def _bigbench_examples(path: Path, subtask: str | None, prompt: str) -> list[dict]:
    task = json.loads(path.read_text(encoding="utf-8"))
    if prompt == "bigbench":
        field = {k: task.get(k, default) for k, default in _BIGBENCH_DEFAULTS.items()}
    else:  # "plain": only what the task sets itself, never the choice list
        explicit = ("task_prefix", "example_input_prefix", "example_output_prefix")
        field = {k: task.get(k, "") for k in explicit}
        field["append_choices_to_input"] = False
    prefix = str(field["task_prefix"]) + str(field["example_input_prefix"])
    suffix = str(field["example_output_prefix"])
    out = []
    for ex in task.get("examples", []):
        scores = ex.get("target_scores")
        if not isinstance(scores, dict) or not scores:
            continue  # generative example (only "target"): not multiple choice
        choices = [str(c) for c in scores]
        values = [float(v) for v in scores.values()]
        best = max(values)
        correct = [i for i, v in enumerate(values) if v == best]
        listing = ""
        if field["append_choices_to_input"]:
            listing = str(field["choice_prefix"]) + str(field["choice_prefix"]).join(choices)
        item = {
            "input": prefix + str(ex["input"]) + listing + suffix,
            "choices": choices,
            "target": correct[0],
            "target_scores": values,
        }
        if len(correct) > 1:
            item["targets"] = correct
        if subtask is not None:
            item["subtask"] = subtask
        out.append(item)
    return out


def load_bigbench_task(
    name: str = "goal_step_wikihow", subtask: str | None = None, prompt: str = "plain"
) -> list[dict]:
    """Multiple-choice examples of a BIG-bench JSON task, read from the ``bigbench==1.0.0`` sdist.

    The sdist (342 MiB ``.tar.gz``, no wheel on PyPI) is fetched with :func:`download_sdist`
    and never installed or unpacked: the first call streams through it once (~10 s), copies
    the task's ``task.json`` file(s) to ``<cache>/bigbench/<task>[/<subtask>]/task.json`` and
    writes ``<cache>/bigbench/index.json`` (all tasks and subtasks in the archive); both are
    written atomically, and later calls only read these small files. A new task needs one
    more pass over the archive (stopping once its files are read).

    Args:
        name: a task folder of ``bigbench/benchmark_tasks/`` with a ``task.json``, e.g.
            ``"goal_step_wikihow"``, ``"fact_checker"``, ``"hyperbaton"``; ``"task/subtask"``
            is accepted as a shorthand for ``subtask=``. Programmatic tasks (``task.py``) are
            not supported.
        subtask: for tasks split into subtask folders (``fact_checker``: ``covid19_scientific``,
            ``fever``, ``politifact``; ``goal_step_wikihow``: ``goal_inference``,
            ``step_inference``, ``step_ordering``). None: for a task without subtasks its
            examples; for a task with subtasks the examples of all of them, **interleaved
            round-robin** in sorted subtask order (so any prefix ``examples[:n]`` covers the
            subtasks evenly until the smaller ones run out), each with a ``"subtask"`` key.

        prompt: how ``"input"`` is built from the task-level fields of the (sub)task's JSON
            file; the choices are always scored as the continuation of it (zero-shot).

            * ``"plain"`` (default): ``task_prefix + example_input_prefix + example["input"]
              + example_output_prefix``, each field only if the file sets it, else "". So
              goal_step_wikihow and fact_checker inputs are the raw ``input`` strings.
              ``choice_prefix`` / ``append_choices_to_input`` are ignored (choices are never
              listed in the input). Tasks that rely on BIG-bench's implicit separators get
              none (e.g. navigate: ``"...starting point?Take 1 step..."``).
            * ``"bigbench"``: the zero-shot prompt of BIG-bench's own ``JsonTask``, with its
              defaults for absent fields (``example_input_prefix="\\nQ: "``,
              ``example_output_prefix="\\nA: "``, ``choice_prefix="\\n  choice: "``,
              ``append_choices_to_input=True``): ``task_prefix + example_input_prefix + input
              [+ choice_prefix + choice_prefix.join(choices)] + example_output_prefix``. One
              difference: the choices are listed in file order, not in BIG-bench's seeded
              permutation of the sorted choices.

            Inputs keep their own whitespace (goal_step_wikihow inputs end with a space;
            ``multiple_choice_accuracy`` handles the token boundary).

    Returns:
        a fresh list (file order; interleaved as above for several subtasks) of dicts with
        ``"input"`` (str), ``"choices"`` (list of str, the keys of BIG-bench's
        ``target_scores`` in file order), ``"target"`` (index of the highest-scoring choice,
        the first one on ties) and ``"target_scores"`` (the scores as floats). Examples whose
        best score is shared by several choices also carry ``"targets"`` (all their indices;
        ``multiple_choice_accuracy`` accepts any of them).
        Examples without ``target_scores`` (generative ones) are skipped.

    Raises:
        ValueError: unknown ``name`` / ``subtask`` (the message lists the allowed values), a
            programmatic-only task, or a task without multiple-choice examples.
    """
    if isinstance(name, str) and subtask is None and name.count("/") == 1:
        name, subtask = name.split("/")
    if not isinstance(name, str) or not name or not set(name) <= _SAFE_NAME_CHARS or name in (".", ".."):
        raise ValueError(f"invalid BIG-bench task name={name!r}: expected a task folder name such as "
                         "'goal_step_wikihow' (or 'task/subtask')")
    if prompt not in BIGBENCH_PROMPTS:
        raise ValueError(f"unknown prompt={prompt!r}; allowed: {', '.join(BIGBENCH_PROMPTS)}")
    if subtask is not None and not isinstance(subtask, str):
        raise ValueError(f"subtask must be None or a str, got {subtask!r}")

    info = _bigbench_task_info(name, subtask)
    root = _bigbench_dir() / name
    if subtask is not None:
        examples = _bigbench_examples(root / subtask / "task.json", subtask, prompt)
    elif info["subtasks"]:
        parts = [_bigbench_examples(root / s / "task.json", s, prompt) for s in info["subtasks"]]
        examples = [ex for row in _round_robin(parts) for ex in row]
    else:
        examples = _bigbench_examples(root / "task.json", None, prompt)
    if not examples:
        where = name if subtask is None else f"{name}/{subtask}"
        raise ValueError(f"BIG-bench task {where!r} has no multiple-choice examples (target_scores)")
    return examples


def _bigbench_task_info(name: str, subtask: str | None) -> dict:
    """The index entry of JSON task `name` (its files fetched from the sdist if not cached yet), refusing an
    unknown or programmatic task and an unknown subtask."""
    index = _read_bigbench_index()
    if index is None or (name in index["tasks"] and not all(
        (_bigbench_dir() / f).is_file() for f in _bigbench_task_files(name, index)
    )):
        index = _scan_bigbench_sdist(name, index)  # builds the index too if there is none
    tasks = index["tasks"]
    json_tasks = [t for t, i in tasks.items() if i["json"] or i["subtasks"]]
    if name not in tasks:
        raise ValueError(
            f"unknown BIG-bench task name={name!r}; allowed (JSON tasks of {_BIGBENCH_SDIST}): "
            + ", ".join(json_tasks)
        )
    info = tasks[name]
    if name not in json_tasks:
        raise ValueError(
            f"BIG-bench task name={name!r} is a programmatic task (task.py), not supported; "
            f"allowed (JSON tasks): " + ", ".join(json_tasks)
        )
    if subtask is not None and subtask not in info["subtasks"]:
        allowed = ", ".join(info["subtasks"]) if info["subtasks"] else f"none ({name!r} has no subtasks)"
        raise ValueError(f"unknown subtask={subtask!r} of BIG-bench task {name!r}; allowed: {allowed}")
    return info


def _round_robin(lists: list[list]) -> list[list]:
    """Rows of the round-robin interleaving: row i holds the i-th item of each list that has one."""
    longest = max((len(x) for x in lists), default=0)
    return [[x[i] for x in lists if i < len(x)] for i in range(longest)]
