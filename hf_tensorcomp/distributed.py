"""Compression and healing on several processes: the process group ``torchrun`` / ``accelerate launch`` set up.

There is no launcher of our own. A run is distributed when `torch.distributed` has a default process group of
more than one process, or when the launcher's environment says so (``WORLD_SIZE`` > 1 with ``RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``): then the first entry point that asks (`compress_model`, `compress_checkpoint`,
`heal`, the CLI) joins it with ``init_process_group`` (gloo; gloo for CPU tensors and NCCL for CUDA ones where CUDA
is present). ``HF_TENSORCOMP_DISTRIBUTED=0`` keeps every process on its own (each runs the whole job).

What is shared, and how (the call sites hold one line each; the glue is here):

- calibration: the calibration batches are dealt out by index (batch ``i`` to rank ``i % world``); each rank runs
  only its batches through the layers, and each layer's statistics are summed over the ranks (`reduce_stats`:
  Grams, cross products, |x| sums and token counts all-reduced; input rows, sequences and recorded calls gathered
  back into the batches' order), so every rank holds what one process would;
- the per-matrix work of a layer (decompositions, GPTQ, a budget's rungs): dealt out round robin (`spread`), each
  result sent to every rank; layers advance in lockstep (every layer ends in a collective);
- healing: each step's global batch is split across the ranks and the gradients summed (`all_reduce_grads`);
  the held-out windows likewise, their losses summed;
- writing: rank 0 alone (`is_main`), atomically as always.

Same output as one process: the same codes for round to nearest and for data-free methods (no statistic is
summed); where statistics are summed the order of the float64 sums differs (bit-identical with one calibration
batch per rank), which moves GPTQ within its rounding path.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from typing import Any, Callable

import torch


class DistributedError(RuntimeError):
    """A rank stopped, or the ranks disagree (versions, settings): every rank stops, nothing is written."""


class Group:
    """The default process group as the pipeline uses it: this process's `rank` of `world`."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self._next = 0  # `spread`'s round robin, carried from one call to the next

    # -------------------------------------------------------------- collectives, with one clear error
    def _call(self, what: str, fn: Callable, *args):
        try:
            return fn(*args)
        except RuntimeError as e:  # gloo / NCCL: a peer's connection closed or reset, a timeout
            first = (str(e).strip().splitlines() or [""])[0]
            first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0][:200]  # gloo: "[file:line] Read error: why"
            raise DistributedError(f"hf_tensorcomp distributed: another rank stopped during {what} (rank {self.rank} "
                                   f"of {self.world} saw: {first}); this run stops here and writes nothing") from None

    def gather(self, obj: Any, what: str) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        import torch.distributed as dist

        out = [None] * self.world
        self._call(what, dist.all_gather_object, out, obj)
        return out

    def sum_(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """`t` summed over the ranks, in place (a CPU tensor through a CUDA-only backend goes by the current device)."""
        import torch.distributed as dist

        if t.device.type == "cpu" and dist.get_backend() == "nccl":
            moved = t.cuda()
            self._call(what, dist.all_reduce, moved)
            return t.copy_(moved.cpu())
        self._call(what, dist.all_reduce, t)
        return t

    def barrier(self, what: str) -> None:
        self.gather(None, what)

    # -------------------------------------------------------------- sharing work
    def deal(self, items) -> list:
        """This rank's share of `items` (e.g. batches), dealt out by index: item ``i`` to rank ``i % world``."""
        return list(items[self.rank::self.world])

    def mine(self, n: int, what: str, hint: str) -> list[int]:
        """The indices of `n` items (`what`: e.g. calibration batches) this rank takes: ``i % world == rank``. Fewer
        items than ranks would leave a rank idle: refused, on every rank alike (`n` is the same everywhere), with
        `hint` (what to change)."""
        if n < self.world:
            raise ValueError(f"hf_tensorcomp distributed: {what}: {n} for {self.world} processes; allowed: at least "
                             f"one per process ({hint}; or fewer processes)")
        return self.deal(range(n))

    def spread(self, tasks: list[Callable[[], Any]], what: str) -> list:
        """Run `tasks` (the same list on every rank) dealt out round robin; every rank gets every result, in order.
        A task that raises on its rank raises the same error on every rank (the first in task order)."""
        owners = [(self._next + i) % self.world for i in range(len(tasks))]
        self._next = (self._next + len(tasks)) % self.world
        done = {}
        for i, task in enumerate(tasks):
            if owners[i] == self.rank:
                try:
                    done[i] = ("ok", task())
                except Exception as e:  # sent to the other ranks: they stop with the same error
                    done[i] = ("error", _portable(e))
                    break
        results: dict[int, tuple] = {}
        for part in self.gather(done, what):
            results.update(part)
        errors = [results[i][1] for i in sorted(results) if results[i][0] == "error"]
        if errors:
            raise errors[0]
        return [results[i][1] for i in range(len(tasks))]


def _portable(e: Exception) -> Exception:
    """`e`, or where it cannot be pickled (sent to the other ranks) a RuntimeError with its message."""
    try:
        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001 - whatever pickling raises
        return RuntimeError(f"{type(e).__name__}: {e}")


_STATE: dict[str, Any] = {}


def _launched() -> bool:
    env = os.environ
    return int(env.get("WORLD_SIZE", "1") or 1) > 1 and all(k in env for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"))


def group() -> Group | None:
    """The process group of this run (joined from the launcher's environment if need be), or None on one process."""
    if os.environ.get("HF_TENSORCOMP_DISTRIBUTED", "1") == "0":
        return None
    import torch.distributed as dist

    if not dist.is_available():
        return None
    if not dist.is_initialized():
        if not _launched():
            return None
        _join()
    world = dist.get_world_size()
    if world < 2:
        return None
    key = (id(dist.group.WORLD), dist.get_rank(), world)
    if _STATE.get("key") != key:  # a new group (a test may start several): a fresh round robin
        _STATE.update(key=key, group=Group(dist.get_rank(), world))
    return _STATE["group"]


def _join() -> None:
    """Join the launcher's process group (``env://``), waiting at most ``HF_TENSORCOMP_JOIN_TIMEOUT`` seconds (default
    300) for every rank to arrive: a rank that never comes (it was launched with ``HF_TENSORCOMP_DISTRIBUTED=0``, or
    died before) stops the others with a `DistributedError` naming it, instead of a wait without end."""
    import datetime

    import torch.distributed as dist

    seconds = float(os.environ.get("HF_TENSORCOMP_JOIN_TIMEOUT", "300"))
    timeout = datetime.timedelta(seconds=seconds)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    key = "hf_tensorcomp/joined/{}".format
    store = None
    try:
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        store.set(key(rank), "1")
        store.wait([key(r) for r in range(world)], timeout)
    except RuntimeError as e:  # the store's timeout (DistStoreError), or its host never came
        if store is not None:
            missing = ", ".join(str(r) for r in range(world) if not store.check([key(r)]))
        else:
            missing = "0 (the store's host)" if rank else "some of 1.." + str(world - 1)
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DistributedError(
            f"hf_tensorcomp distributed: rank(s) {missing} of {world} never joined the process group within {seconds:g} "
            f"s (HF_TENSORCOMP_JOIN_TIMEOUT; rank {rank} saw: {first}); allowed: every rank launched alike, "
            "HF_TENSORCOMP_DISTRIBUTED=0 on all of them or on none; nothing was done") from None
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo", store=store, rank=rank,
                            world_size=world)


def is_main() -> bool:
    """Whether this process writes: rank 0 of a distributed run, or the only process."""
    g = group()
    return g is None or g.rank == 0


def versions() -> dict[str, str]:
    import sys

    import transformers

    mine = sys.modules[__package__].__version__  # (the package is imported: this module is part of it)
    return {"hf_tensorcomp": mine, "torch": torch.__version__, "transformers": transformers.__version__}


def fingerprint(obj: Any) -> str:
    """A short digest of `obj` (JSON, what is not JSON by its ``str``), or of a tensor's values."""
    if isinstance(obj, torch.Tensor):
        data = obj.detach().cpu().contiguous().numpy().tobytes() + str((obj.dtype, tuple(obj.shape))).encode()
    else:
        data = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def fields(name: str, obj: Any) -> dict[str, str]:
    """`obj` as facts for `agree`, one a field (``name.key``, ``name[i].key`` through dicts and lists of dicts): each
    value as JSON where short, else its `fingerprint`, so that ranks that differ are told which field differs."""
    if isinstance(obj, dict) and obj:
        return {k: v for key, value in obj.items() for k, v in fields(f"{name}.{key}", value).items()}
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(x, dict) for x in obj):
        out = {f"{name} (count)": str(len(obj))}
        for i, x in enumerate(obj):
            out.update(fields(f"{name}[{i}]", x))
        return out
    text = None if isinstance(obj, torch.Tensor) else json.dumps(obj, sort_keys=True, default=str)
    return {name: text if text is not None and len(text) <= 60 else fingerprint(obj)}


def agree(g: Group | None, what: str, **facts) -> None:
    """Before any work: every rank runs the same library versions and `facts` (digests of the settings, the data);
    else a `DistributedError` on every rank naming what differs, rank by rank."""
    if g is None:
        return
    mine = {**versions(), **facts}
    every = g.gather(mine, f"{what} (checking that the ranks agree)")
    differ = sorted(k for k in mine if len({repr(e.get(k)) for e in every}) > 1)
    if differ:
        said = "; ".join(f"{k}: " + ", ".join(f"rank {r} {e.get(k)}" for r, e in enumerate(every)) for k in differ)
        raise DistributedError(f"hf_tensorcomp distributed: {what}: the ranks differ ({said}); allowed: the same "
                               "library versions and the same settings and data on every rank; nothing was done")


def on_device(result: dict, layer) -> dict:
    """A unit's result ({name: (module, stats)}) as another rank sent it, on the device of `layer` (CPU: a no-op)."""
    device = next((p.device for p in layer.parameters() if p.device.type != "meta"), torch.device("cpu"))
    return {n: (mod.to(device) if any(t.device != device for t in mod.state_dict().values()) else mod, st)
            for n, (mod, st) in result.items()}


# ------------------------------------------------------------------ calibration statistics
_SUMMED = ("gram", "cross", "_abs_sum")
_LISTED = ("_inputs", "_sequences", "attention", "calls")


def _interleave(parts: list[list], world: int, n_batches: int) -> list:
    """Rank-ordered lists of per-batch records (rank r held batches r, r + world, ...) back in the batches' order."""
    counts = [len(range(r, n_batches, world)) for r in range(world)]
    per = {len(p) // c for p, c in zip(parts, counts) if c} or {1}
    if len(per) != 1 or any(len(p) != c * next(iter(per)) for p, c in zip(parts, counts)):
        return [x for p in parts for x in p]  # records not one set per batch: in rank order
    k = next(iter(per))
    return [x for i in range(n_batches) for x in parts[i % world][(i // world) * k:(i // world + 1) * k]]


def reduce_stats(g: Group | None, stats: dict, n_batches: int, where: str) -> None:
    """`ModuleStats` gathered at `where` (e.g. one decoder layer) summed over the ranks, in place (``n_batches``: the
    calibration batches in all)."""
    if g is None:
        return
    what = f"calibration statistics of {where}"
    shapes = {n: {a: None if getattr(st, a) is None else (tuple(getattr(st, a).shape), getattr(st, a).dtype)
                  for a in _SUMMED} | {"listed": any(getattr(st, a) for a in _LISTED)} for n, st in stats.items()}
    every = g.gather(shapes, what)
    merged_lists: set[int] = set()  # siblings share their parent's recorded calls: merged once
    for n, st in stats.items():
        for a in _SUMMED:
            known = next((e[n][a] for e in every if e[n][a] is not None), None)
            if known is None:
                continue
            t = getattr(st, a)
            setattr(st, a, g.sum_(torch.zeros(known[0], dtype=known[1]) if t is None else t, what))
        if any(e[n]["listed"] for e in every):
            fields = [a for a in _LISTED if id(getattr(st, a)) not in merged_lists]
            parts = g.gather({a: getattr(st, a) for a in fields}, what)
            for a in fields:
                records = getattr(st, a)
                records[:] = _interleave([p[a] for p in parts], g.world, n_batches)
                merged_lists.add(id(records))
    counts = torch.tensor([st.n for st in stats.values()], dtype=torch.int64)
    if len(counts):
        g.sum_(counts, what)
        for st, c in zip(stats.values(), counts.tolist()):
            st.n = c


# ------------------------------------------------------------------ training
def all_reduce_grads(g: Group | None, params: list) -> None:
    """The gradients of `params` summed over the ranks (a flat buffer per dtype and device; a missing one as zeros)."""
    if g is None:
        return
    groups: dict = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    for ps in groups.values():
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
        g.sum_(flat, "healing (summing the gradients)")
        at = 0
        for p in ps:
            p.grad = flat[at:at + p.numel()].view_as(p).clone()
            at += p.numel()


def sum_floats(g: Group | None, values: list[float], what: str) -> list[float]:
    """Python floats summed over the ranks (float64)."""
    if g is None:
        return values
    t = g.sum_(torch.tensor(values, dtype=torch.float64), what)
    return t.tolist()


def share(g: Group | None, n: int) -> slice:
    """The rows ``[start, stop)`` of `n` that this rank takes (contiguous, as even as can be; `n` >= world)."""
    if g is None:
        return slice(0, n)
    base, extra = divmod(n, g.world)
    start = g.rank * base + min(g.rank, extra)
    return slice(start, start + base + (g.rank < extra))
