"""The jobs `test_distributed.py` runs on several processes (and on one, to compare): each takes plain arguments and
returns what the test compares. `launch` starts the processes (``torch.multiprocessing``, gloo, a file rendezvous),
each joining the group as ``torchrun`` would have it joined, and collects every rank's results."""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from pathlib import Path

import torch


def compress(src, config: dict, save=None, out=None) -> dict:
    """`from_pretrained(quantization_config=)`: the compressed state dict, the stats, and how much work this process
    did itself (matrices it compressed, calibration batches it ran, batches of its Fisher pass); `save`:
    ``save_pretrained`` into that folder (suffixed with the rank)."""
    from transformers import AutoModelForCausalLM

    from hf_tensorcomp import TensorCompressionConfig
    from hf_tensorcomp.calibration import LayerwiseRunner
    from hf_tensorcomp.methods import get_method

    from hf_tensorcomp.calibration import sensitivity

    cfg = TensorCompressionConfig(progress=False, **config)
    method = get_method(cfg.entries[0].method)
    done, batches, backward = [], [], []
    compress_, init, loss_backward = method.compress, LayerwiseRunner.__init__, sensitivity._loss_backward

    def counted(modules, entry, ctx):
        done.extend(modules)
        return compress_(modules, entry, ctx)

    def runner_init(self, *a, **kw):
        init(self, *a, **kw)
        batches.append(len(self.hidden))

    def counted_backward(model, ids, batch_size, *a, **kw):
        backward.append(len(ids.split(batch_size)))
        return loss_backward(model, ids, batch_size, *a, **kw)

    method.compress, LayerwiseRunner.__init__, sensitivity._loss_backward = counted, runner_init, counted_backward
    try:
        model = AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg)
    finally:
        method.compress, LayerwiseRunner.__init__, sensitivity._loss_backward = compress_, init, loss_backward
    if save is not None:  # every rank saves, each to its own folder: rank 0's alone is written
        import torch.distributed as dist

        save = f"{save}-{dist.get_rank() if dist.is_initialized() else 'one'}"
        model.save_pretrained(save)
    stats = model.config.quantization_config.stats
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "modules": stats["modules"],
            "calibration": stats.get("calibration"), "done": done, "batches": batches, "saved": save,
            "backward": backward}


def stream(src, out, config: dict) -> dict:
    """`compress_checkpoint` into `out`: the report's stats and whether `out` exists on return."""
    from hf_tensorcomp import TensorCompressionConfig, compress_checkpoint

    report = compress_checkpoint(src, out, TensorCompressionConfig(progress=False, **config))
    return {"modules": report["stats"]["modules"], "exists": Path(out).is_dir(), "out": str(out)}


def heal(src, config: dict, ids, settings: dict) -> dict:
    """Compress, then `hf_tensorcomp.heal` toward the dense model: the loss curve, the held-out scores, the weights."""
    import hf_tensorcomp
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=hf_tensorcomp.TensorCompressionConfig(
        progress=False, **config))
    losses, start = [], {k: v.clone() for k, v in model.state_dict().items()}
    from hf_tensorcomp import training

    distill = training.distill

    def recorded(*a, **kw):
        run = distill(*a, **kw)
        losses.extend(run["losses"])
        return run

    import hf_tensorcomp.healing as healing

    healing.distill = recorded
    try:
        report = hf_tensorcomp.heal(model, teacher=src, calibration=ids, progress=False, **settings)
    finally:
        healing.distill = distill
    return {"losses": losses, "report": report, "start": start,
            "state": {k: v.clone() for k, v in model.state_dict().items()}}


def dies(src, config: dict, out, layer: int = 1) -> dict:
    """Streaming compression where rank 1 dies (``os._exit``) when it reaches decoder layer `layer`."""
    import torch.distributed as dist

    from hf_tensorcomp import TensorCompressionConfig, compress_checkpoint
    from hf_tensorcomp.layer_stream import LayerStream

    upto = LayerStream.upto

    def dying(self, li, release_last=False):
        if dist.get_rank() == 1 and li == layer:
            os._exit(17)
        return upto(self, li, release_last)

    LayerStream.upto = dying
    compress_checkpoint(src, out, TensorCompressionConfig(progress=False, **config))
    return {}


JOBS = {"compress": compress, "stream": stream, "heal": heal, "dies": dies}


def _worker(rank: int, world: int, rendezvous: str, folder: str, jobs: list, env: dict) -> None:
    os.environ.update(env.get(rank, {}))  # {rank: {variable: value}}
    torch.set_num_threads(1)
    import torch.distributed as dist

    if "HF_TENSORCOMP_TEST_VERSION" in os.environ:  # a rank running another release
        import hf_tensorcomp

        hf_tensorcomp.__version__ = os.environ["HF_TENSORCOMP_TEST_VERSION"]
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        for i, (name, kwargs) in enumerate(jobs):
            t0 = time.perf_counter()
            try:
                result = JOBS[name](**kwargs)
            except Exception as e:  # noqa: BLE001 - what the test compares
                result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            result["seconds"] = time.perf_counter() - t0
            torch.save(result, Path(folder) / f"{i}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def launch(jobs: list, world: int = 2, env: dict | None = None, timeout: float = 120, meanwhile=None):
    """Run `jobs` ([(name, kwargs)], in order) on `world` processes (`env`: {rank: {variable: value}} set in that
    process); returns [job][rank] -> its result ({} where that rank left none, e.g. it died) with the process's exit
    code under the key ``"exitcode"``. `meanwhile()`: run here while the processes work; then returns (those
    results, what it returned)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="hf-tensorcomp-dist-") as folder:
        rendezvous = os.path.join(folder, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, world, rendezvous, folder, jobs, env or {})) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            here = meanwhile() if meanwhile is not None else None
        finally:
            for p in procs:
                p.join(max(1.0, deadline - time.monotonic()))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        results = []
        for i in range(len(jobs)):
            row = []
            for r in range(world):
                f = Path(folder) / f"{i}-{r}.pt"
                row.append({**(torch.load(f, weights_only=False) if f.exists() else {}), "exitcode": procs[r].exitcode})
            results.append(row)
        return results if meanwhile is None else (results, here)


def run_here(jobs: list) -> list[dict]:
    """The same jobs in this process, without a process group (the one-process reference)."""
    return [JOBS[name](**kwargs) for name, kwargs in jobs]
