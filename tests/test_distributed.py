"""Compression and healing on two processes (CPU, gloo), against one process: `hf_tensorcomp.distributed`.

The two-process runs are started once per group of checks (`dist_jobs.launch`: ``torch.multiprocessing``, a file
rendezvous, each process joining the group as under ``torchrun``; one test goes through ``torchrun`` itself) and
compared with the same jobs run here, on one process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dist_jobs
from hf_tensorcomp.cli import main as cli
from tiny import VOCAB

ROOT = Path(__file__).resolve().parents[1]


def _ids(n, seed, length=16):
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def _jobs(src, tmp):
    ids4, ids2 = _ids(8, 2), _ids(4, 2)  # 4 and 2 calibration batches of 2: two batches a rank, one a rank
    return [
        ("compress", dict(src=src, config=dict(method="laser", rank=4), save=str(tmp / "saved"))),  # data-free
        ("compress", dict(src=src, config=dict(method="qlr", rank=4, quantizer="rtn", whiten=False))),  # round to nearest
        ("compress", dict(src=src, config=dict(method="qlr", rank=4, calibration=ids4, calibration_batch_size=2))),  # GPTQ
        ("compress", dict(src=src, config=dict(method="qlr", target_bytes=0.3, calibration=ids2,
                                               calibration_batch_size=2))),  # a byte budget: rungs priced over the ranks
        ("compress", dict(src=src, config=dict(method="trawl", rank=4, calibration=ids2, calibration_batch_size=2))),  # whole units
        ("stream", dict(src=src, out=str(tmp / "streamed"), config=dict(method="qlr", rank=4, calibration=ids4,
                                                                         calibration_batch_size=2, embedding_bits=8))),
        ("heal", dict(src=src, config=dict(method="laser", rank=1), ids=_ids(9, 3),
                      settings=dict(steps=4, batch_size=4, eval_every=2, lr=0.01, relative=False))),
        ("compress", dict(src=src, config=dict(method="qlr", target_bytes=0.3, allocation="fisher", calibration=ids2,
                                               calibration_batch_size=2))),  # a Fisher-weighted budget
        ("compress", dict(src=src, config=dict(method="qlr", target_bytes=0.3, allocation="measured", calibration=ids2,
                                               calibration_batch_size=2))),  # a measured budget
        ("compress", dict(src=src, config=dict(method="rotor", structure="lr4", layers=[0], calibration=_ids(16, 0),
                                               calibration_batch_size=8, epochs=10, batch_size=16, retrain_o=True,
                                               o_epochs=20, o_lr=0.01))),  # input rows and the block's calls, gathered
        ("compress", dict(src=src, config=dict(method="laser", rank=4, whiten="asvd", calibration=ids4,
                                               calibration_batch_size=2))),  # |x| sums
        ("compress", dict(src=src, config=dict(method="laser", rank=12, targets=["mlp.*"], whiten="cholesky", correct=True,
                                               calibration=ids2, calibration_batch_size=2))),  # cross products
    ]


@pytest.fixture(scope="module")
def runs(tiny_dirs, tmp_path_factory):
    """[(two processes' results, one process's result)] per job of `_jobs`."""
    src = str(tiny_dirs["llama"])

    def here():  # while the two processes start and run
        before = torch.get_num_threads()
        torch.set_num_threads(1)  # as the two processes run (the forwards' float sums depend on the thread count)
        try:
            return dist_jobs.run_here(_jobs(src, tmp_path_factory.mktemp("one")))
        finally:
            torch.set_num_threads(before)

    two, one = dist_jobs.launch(_jobs(src, tmp_path_factory.mktemp("two")), timeout=240, meanwhile=here)
    for row in two:
        for r in row:
            assert "error" not in r, r.get("traceback")
    return list(zip(two, one))


def _same_state(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def _timeless(modules: dict) -> dict:
    """Per-module stats without their timings."""
    return {n: {k: v for k, v in st.items() if not k.endswith("seconds")} for n, st in modules.items()}


def _spread_over_both(two, one):
    """Each rank compressed some of the matrices itself, none twice, all of them between the two."""
    done = [set(r["done"]) for r in two]
    assert done[0] and done[1] and not done[0] & done[1]
    assert done[0] | done[1] == set(one["done"])


@pytest.mark.parametrize("job", [0, 1], ids=["laser-data-free", "qlr-round-to-nearest"])
def test_data_free_and_round_to_nearest_codes_equal_one_process(runs, job):
    two, one = runs[job]
    for r in two:
        assert _same_state(r["state"], one["state"]) == []
        assert _timeless(r["modules"]) == _timeless(one["modules"])
    _spread_over_both(two, one)


def test_rank_0_alone_saves(runs):
    two, one = runs[0]
    saved = Path(two[0]["saved"])
    assert saved.name == "saved-0" and (saved / "config.json").is_file()
    assert not (saved.parent / "saved-1").exists()  # rank 1's save_pretrained wrote nothing
    assert not [p for p in saved.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_calibration_batches_split_and_statistics_summed(runs):
    """Four calibration batches: two a rank; summed Grams give GPTQ the one-process codes (the float64 sums differ
    in their order only, bit-identical here); both ranks hold the same model; the record counts every batch."""
    two, one = runs[2]
    assert one["batches"] == [4] and [r["batches"] for r in two] == [[2], [2]]
    assert _same_state(two[0]["state"], two[1]["state"]) == []
    codes = [k for k in one["state"] if one["state"][k].dtype == torch.uint8]
    assert codes
    for k in codes:  # codes: the same but for float64 rounding ties, which these tiny sums do not meet
        assert (two[0]["state"][k] != one["state"][k]).float().mean() <= 1e-3, k
    for k in one["state"]:
        if one["state"][k].is_floating_point():
            torch.testing.assert_close(two[0]["state"][k], one["state"][k], rtol=1e-4, atol=1e-6)
    assert two[0]["calibration"] == one["calibration"]  # 8 samples, 128 tokens: every rank's
    _spread_over_both(two, one)


def test_byte_budget_rungs_priced_over_the_ranks_allocate_as_one_process(runs):
    """One calibration batch a rank (the Gram sums bit-identical): the same rungs, the same codes, bit for bit."""
    two, one = runs[3]
    assert one["batches"] == [2] and [r["batches"] for r in two] == [[1], [1]]  # one runner: allocation, compression
    for r in two:
        assert _same_state(r["state"], one["state"]) == []
        assert _timeless(r["modules"]) == _timeless(one["modules"])


@pytest.mark.parametrize("job", [7, 8], ids=["fisher", "measured"])
def test_fisher_pass_split_and_summed(runs, job):
    """The dense model's backward pass (a byte budget weighted by Fisher, or measured: its KL on the first batch,
    which rank 0 holds, sent to the others): one batch a rank, the squared gradients summed: the same rungs and codes
    as one process, bit for bit."""
    two, one = runs[job]
    assert one["backward"] == [2] and [r["backward"] for r in two] == [[1], [1]]
    for r in two:
        assert _same_state(r["state"], one["state"]) == []
        assert _timeless(r["modules"]) == _timeless(one["modules"])


@pytest.mark.parametrize("job", [9, 10, 11], ids=["rotor-inputs-and-calls", "laser-asvd", "laser-correct"])
def test_every_kind_of_statistic_gathered_as_one_process(runs, job):
    """Input rows and the attention block's recorded calls (gathered back in the batches' order: rotor trains on
    them), |x| sums (two batches a rank) and the dense / compressed cross products: the same modules, bit for bit."""
    two, one = runs[job]
    assert [len(r["batches"]) for r in two] == [1, 1] and two[0]["batches"][0] * 2 == one["batches"][0]
    for r in two:
        assert _same_state(r["state"], one["state"]) == []
        assert _timeless(r["modules"]) == _timeless(one["modules"])


def test_whole_units_dealt_out_for_a_stacked_method(runs):
    """TRAWL stacks a layer's matrices: whole layers go to one rank or the other, the same factors come back."""
    two, one = runs[4]
    for r in two:
        assert _same_state(r["state"], one["state"]) == []
    done = [set(r["done"]) for r in two]
    assert done[0] and done[1] and not done[0] & done[1]
    layers = [{n.split(".")[0] for n in d} for d in done]
    assert not layers[0] & layers[1]


def test_streaming_rank_0_writes_the_one_process_checkpoint(runs):
    """With the embedding table quantized too (GPTQ on the head's inputs: the final states of every rank's batches)."""
    two, one = runs[5]
    out_two, out_one = Path(two[0]["out"]), Path(one["out"])
    assert two[0]["exists"] and two[1]["exists"]  # every rank returns once rank 0's folder is in place
    files = sorted(p.name for p in out_one.iterdir())
    assert sorted(p.name for p in out_two.iterdir()) == files
    for name in files:
        if name.endswith(".safetensors"):
            a, b = load_file(out_two / name), load_file(out_one / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert json.loads((out_two / "config.json").read_text())["quantization_config"]["compressed_modules"] == \
        json.loads((out_one / "config.json").read_text())["quantization_config"]["compressed_modules"]
    assert _timeless(two[0]["modules"]) == _timeless(one["modules"])


def test_heal_data_parallel_follows_one_process(runs):
    """The same global batch and seed: the loss curve and held-out scores of one process within float tolerance,
    the same kept iterate; both ranks end with the same weights, near one process's."""
    two, one = runs[6]
    assert one["report"]["improved"]
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one["losses"]), rtol=5e-3, atol=0)
    assert two[0]["losses"] == two[1]["losses"]
    assert [s[0] for s in two[0]["report"]["held_out_steps"]] == [s[0] for s in one["report"]["held_out_steps"]]
    torch.testing.assert_close(torch.tensor([s[1:] for s in two[0]["report"]["held_out_steps"]]),
                               torch.tensor([s[1:] for s in one["report"]["held_out_steps"]]), rtol=5e-3, atol=1e-7)
    assert two[0]["report"]["best_step"] == one["report"]["best_step"]
    assert _same_state(two[0]["state"], two[1]["state"]) == []
    start, mine, theirs = one["start"], two[0]["state"], one["state"]
    moved = [k for k in start if start[k].is_floating_point() and not torch.equal(start[k], theirs[k])]
    assert moved
    for k in moved:  # the two runs took the same steps: their difference is small beside the step itself
        assert (mine[k] - theirs[k]).norm() <= 0.05 * (theirs[k] - start[k]).norm(), k


# ------------------------------------------------------------------ bad input and faults
def test_too_few_batches_a_rank_that_dies_and_nothing_half_written(tiny_dirs, tmp_path):
    """Fewer calibration batches (or healing windows a step) than processes: one line, on every rank, before any
    work. Rank 1 dying mid-way through a streamed compression: rank 0 stops with a clear error, nothing is
    written (no output folder, no temporary one)."""
    src = str(tiny_dirs["llama"])
    cfg = dict(method="qlr", rank=4, calibration=_ids(4, 2), calibration_batch_size=2)
    jobs = [("compress", dict(src=src, config={**cfg, "calibration": _ids(2, 2)})),  # one batch for two processes
            ("heal", dict(src=src, config=dict(method="laser", rank=2, targets=["mlp.*"]), ids=_ids(9, 3),
                          settings=dict(steps=2, batch_size=1))),
            ("dies", dict(src=src, out=str(tmp_path / "out"), config=cfg))]
    few, heal_few, dies = dist_jobs.launch(jobs, timeout=120)
    for r in few:
        assert ("calibration batches: 1 for 2 processes; allowed: at least one per process (2 samples in batches of 2: "
                "more calibration_samples or a smaller calibration_batch_size; or fewer processes)") in r["error"]
    for r in heal_few:
        assert "heal: batch_size=1" in r["error"] and "batch_size >= 2" in r["error"]
    assert dies[1]["exitcode"] == 17 and "error" not in dies[1]
    assert dies[0]["error"].startswith("DistributedError: hf_tensorcomp distributed: another rank stopped during")
    assert "writes nothing" in dies[0]["error"]
    assert list(tmp_path.iterdir()) == []


def test_mismatched_library_versions_refused_on_every_rank_before_any_work(tiny_dirs, tmp_path):
    src = str(tiny_dirs["llama"])
    jobs = [("stream", dict(src=src, out=str(tmp_path / "out"), config=dict(method="laser", rank=4))),
            ("heal", dict(src=src, config=dict(method="laser", rank=2, targets=["mlp.*"]), ids=_ids(9, 3),
                          settings=dict(steps=2, batch_size=2)))]
    stream, heal = dist_jobs.launch(jobs, env={1: {"HF_TENSORCOMP_TEST_VERSION": "0.0.9"}}, timeout=120)
    for r in stream + heal:
        assert "the ranks differ (hf_tensorcomp: rank 0 0.1.0, rank 1 0.0.9)" in r["error"], r
    assert list(tmp_path.iterdir()) == []


def test_cli_under_torchrun_writes_what_one_process_writes(tiny_with_tokenizer, tmp_path):
    """``torchrun --nproc-per-node 2 -m hf_tensorcomp.cli compress``: the processes join the group from the launcher's
    environment, split the calibration text (two batches: one a process) and rank 0 alone reports and writes the
    checkpoint one process writes (GPTQ codes and all)."""
    args = ["compress", str(tiny_with_tokenizer), "--method", "qlr", "--rank", "4", "--calibration-samples", "16",
            "--calibration-length", "16", "--no-eval", "--quiet"]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    two = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "-m", "hf_tensorcomp.cli", *args, "--out", str(tmp_path / "two")], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # one process, here, meanwhile: as each of the two runs
    try:
        assert cli([*args, "--out", str(tmp_path / "one")]) == 0
    finally:
        torch.set_num_threads(before)
    out, err = two.communicate(timeout=120)
    assert two.returncode == 0, err
    assert out.count("compression time (s)") == 1  # rank 0 alone reports
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())
    assert (tmp_path / "two" / "model.safetensors").read_bytes() == (tmp_path / "one" / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # no temporary folder left
