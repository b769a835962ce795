"""Writes are atomic: a save killed mid-way or two saves racing leave a whole folder (the old or one new)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_tensorcomp import TensorCompressionConfig
from hf_tensorcomp.atomic import TAG, atomic_dir

ROOT = Path(__file__).resolve().parents[1]

# Runs in a child process: compress SRC at RANK, save into OUT (or run the CLI); with PAUSE set, announce and
# sleep as the weights file is about to be written (config.json is already in the folder being written)
CHILD = r"""
import sys, time, transformers.modeling_utils as mu
if "{pause}":
    real = mu.safe_save_file
    def slow(*a, **k):
        print("WRITING", flush=True); time.sleep(120); real(*a, **k)
    mu.safe_save_file = slow
import hf_tensorcomp, transformers
if "{cli}":
    from hf_tensorcomp.cli import main
    sys.exit(main({argv!r}))
m = transformers.AutoModelForCausalLM.from_pretrained("{src}", quantization_config=hf_tensorcomp.TensorCompressionConfig(
    rank={rank}, targets=["mlp.*"], progress=False))
m.save_pretrained("{out}")
"""


def child(src="", out="", rank=4, pause=False, argv=None):
    code = CHILD.format(src=src, out=out, rank=rank, pause="1" if pause else "", cli="1" if argv else "", argv=argv or [])
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def kill_when_writing(p):
    for line in p.stdout:
        if line.startswith("WRITING"):
            break
    else:
        raise AssertionError(p.stderr.read())
    p.send_signal(signal.SIGKILL)
    p.wait()


def hidden(parent: Path):
    return [p.name for p in parent.iterdir() if TAG in p.name]


def ranks(folder):
    specs = json.loads((folder / "config.json").read_text())["quantization_config"]["compressed_modules"]
    return {s["rank"] for s in specs.values()}


def test_save_killed_mid_way_leaves_the_old_checkpoint(tiny_dirs, tmp_path, ids):
    out = tmp_path / "ckpt"
    m = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(
        rank=4, targets=["mlp.*"], progress=False))
    m.save_pretrained(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    kill_when_writing(child(tiny_dirs["llama"], out, rank=8, pause=True))
    # before: config.json (rank 8) was already over the old one, next to the rank-4 weights
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert torch.equal(AutoModelForCausalLM.from_pretrained(out)(ids).logits, m(ids).logits)
    assert hidden(tmp_path)  # the killed writer's temporary folder ...
    m.save_pretrained(out)
    assert not hidden(tmp_path)  # ... is removed by the next save beside it


def test_save_into_existing_folder_keeps_other_files(tiny_dirs, tmp_path):
    out = tmp_path / "ckpt"
    cfg = dict(targets=["mlp.*"], progress=False)
    AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(rank=4, **cfg)).save_pretrained(out)
    (out / "tokenizer.json").write_text("{}")
    m8 = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(rank=8, **cfg))
    m8.save_pretrained(out)
    assert (out / "tokenizer.json").read_text() == "{}" and ranks(out) == {8}
    assert not hidden(tmp_path)


def test_atomic_dir_refuses_to_replace_without_overwrite(tmp_path):
    out = tmp_path / "o"
    with atomic_dir(out, overwrite=False) as t:
        (t / "a").write_text("first")
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        with atomic_dir(out, overwrite=False) as t:
            (t / "a").write_text("second")
    assert (out / "a").read_text() == "first" and not hidden(tmp_path)
    with pytest.raises(RuntimeError):
        with atomic_dir(out) as t:
            (t / "a").write_text("third")
            raise RuntimeError("fails mid-way")
    assert (out / "a").read_text() == "first" and not hidden(tmp_path)




def cli_argv(src, out, rank, *extra):
    return ["compress", str(src), "--rank", str(rank), "--targets", "mlp.*", "--out", str(out), "--no-eval", "--quiet", *extra]


def test_concurrent_cli_runs_into_one_out(tiny_with_tokenizer, tmp_path):
    out = tmp_path / "out"
    procs = [child(argv=cli_argv(tiny_with_tokenizer, out, r)) for r in (4, 8)]
    codes = [p.wait(timeout=300) for p in procs]
    errs = [p.stderr.read() for p in procs]
    # without --overwrite exactly one succeeds; the other says so and writes nothing
    assert sorted(codes) == [0, 2], errs
    assert "--out" in errs[codes.index(2)]
    assert ranks(out) == {(4, 8)[codes.index(0)]}
    AutoModelForCausalLM.from_pretrained(out)
    assert not hidden(tmp_path)
    # with --overwrite both succeed and the folder is one run's whole output
    procs = [child(argv=cli_argv(tiny_with_tokenizer, out, r, "--overwrite")) for r in (4, 8)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0], [p.stderr.read() for p in procs]
    assert len(ranks(out)) == 1 and json.loads((out / "compression_report.json").read_text())
    AutoModelForCausalLM.from_pretrained(out)
    assert not hidden(tmp_path)


def test_cli_overwrite_killed_mid_way_keeps_the_old_output(tiny_with_tokenizer, tmp_path):
    out = tmp_path / "out"
    p = child(argv=cli_argv(tiny_with_tokenizer, out, 4))
    assert p.wait(timeout=300) == 0, p.stderr.read()
    before = {q.name: q.read_bytes() for q in out.iterdir()}
    kill_when_writing(child(argv=cli_argv(tiny_with_tokenizer, out, 8, "--overwrite"), pause=True))
    assert {q.name: q.read_bytes() for q in out.iterdir()} == before
