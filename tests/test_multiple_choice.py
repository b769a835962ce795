"""Tests for hf_tensorcomp.eval.multiple_choice and the BIG-bench loader in hf_tensorcomp.assets.

Fast tests use tiny random models, a character tokenizer and a small fake ``bigbench`` sdist
built in a temporary cache. Tests marked ``slow`` read the real ``bigbench==1.0.0`` sdist
(342 MiB, downloaded from PyPI on first use) and run the real SmolLM2 checkpoint.
"""

import io
import json
import subprocess
import tarfile

import pytest
import torch
import torch.nn.functional as F

from hf_tensorcomp import assets
from hf_tensorcomp.eval import multiple_choice_accuracy
from tiny import _tiny, tiny_llama

# --------------------------------------------------------------------------- helpers


class MergingTokenizer:
    """Stand-in for a BPE tokenizer: one token per character, except that a space followed by
    a non-space character is a single token (like " Buy"), so ``"is "`` ends in a lone space
    token while ``"is Buy"`` does not: context and continuation merge at the boundary."""

    def __init__(self, bos_token_id=None, vocab_size=64):
        self.bos_token_id = bos_token_id
        self.pad_token_id = 0
        self.vocab_size = vocab_size

    def tokens(self, text):
        out, i = [], 0
        while i < len(text):
            if text[i] == " " and i + 1 < len(text) and text[i + 1] != " ":
                out.append(" " + text[i + 1])
                i += 2
            else:
                out.append(text[i])
                i += 1
        return out

    def _id(self, tok):
        if len(tok) == 2:  # merged " x"
            return 33 + ord(tok[1]) % 30
        return 3 + ord(tok) % 30

    def __call__(self, text, add_special_tokens=True, verbose=True):
        ids = [self._id(t) for t in self.tokens(text)]
        if add_special_tokens and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return {"input_ids": ids}




@torch.no_grad()
def hf_loss_score(model, ids, n_cont):
    """log P(last n_cont tokens | the rest) from the model's own shifted loss (labels=-100)."""
    inp = torch.tensor([ids])
    labels = inp.clone()
    labels[:, : len(ids) - n_cont] = -100
    return -float(model(inp, labels=labels).loss) * n_cont


@torch.no_grad()
def explicit_scores(model, tok, example, bos=None):
    """Per choice (sum log-prob, n tokens), by an explicit loop: one forward per choice, the
    continuation = the tokens of input+choice after those shared with the input alone."""
    ctx = tok(example["input"], add_special_tokens=False)["input_ids"]
    out = []
    for choice in example["choices"]:
        full = tok(example["input"] + choice, add_special_tokens=False)["input_ids"]
        k = 0
        while k < min(len(ctx), len(full)) and ctx[k] == full[k]:
            k += 1
        ids = ([bos] if bos is not None else []) + full
        start = len(ids) - (len(full) - k)
        logp = F.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        out.append((sum(float(logp[p - 1, ids[p]]) for p in range(start, len(ids))), len(ids) - start))
    return out


def make_examples(n, seed=0, ctx_space=True):
    """Random lowercase examples; inputs end with a space (boundary merge) if ctx_space."""
    g = torch.Generator().manual_seed(seed)

    def word(lo, hi):
        n_chars = int(torch.randint(lo, hi, (1,), generator=g))
        return "".join(chr(97 + int(c)) for c in torch.randint(0, 26, (n_chars,), generator=g))

    out = []
    for _ in range(n):
        inp = " ".join(word(2, 6) for _ in range(3)) + (" " if ctx_space else "")
        k = int(torch.randint(2, 5, (1,), generator=g))
        choices = [word(1, 9) if ctx_space else " " + word(1, 9) for _ in range(k)]
        out.append({"input": inp, "choices": choices, "target": 0})
    return out


def argmax(values):
    return max(range(len(values)), key=lambda i: (values[i], -i))


# --------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("bos", [None, 1])
def test_scores_match_explicit_loop_and_choice_is_argmax(bos):
    model, tok = tiny_llama(), MergingTokenizer(bos_token_id=bos)
    examples = make_examples(12)
    ref = [explicit_scores(model, tok, ex, bos) for ex in examples]
    r = multiple_choice_accuracy(model, tok, examples, normalize="none", batch_size=5,
                                 progress=False, return_scores=True)
    assert r["add_bos"] is (bos is not None)
    for got, want in zip(r["scores"], ref):
        assert [n for _, n in got] == [n for _, n in want]
        assert [s for s, _ in got] == pytest.approx([s for s, _ in want], abs=1e-4)
    # with the targets set to what the hand-computed log-likelihoods prefer, accuracy is 1
    by_sum = [dict(ex, target=argmax([s for s, _ in sc])) for ex, sc in zip(examples, ref)]
    by_mean = [dict(ex, target=argmax([s / n for s, n in sc])) for ex, sc in zip(examples, ref)]
    assert any(a["target"] != b["target"] for a, b in zip(by_sum, by_mean))  # the test can tell them apart
    r_none = multiple_choice_accuracy(model, tok, by_sum, normalize="none", progress=False)
    r_len = multiple_choice_accuracy(model, tok, by_mean, normalize="length", progress=False)
    assert r_none["accuracy"] == 1.0 and r_none["predictions"] == [e["target"] for e in by_sum]
    assert r_len["accuracy"] == 1.0 and r_len["predictions"] == [e["target"] for e in by_mean]
    assert r_none["accuracy_by_normalize"]["length"] < 1.0
    assert r_len["accuracy_by_normalize"]["none"] < 1.0


def test_boundary_merge_scores_the_merged_token():
    # "ab " + "cd": the input alone ends in a lone " " token, "ab cd" has " c": the scored
    # tokens are [" c", "d"] predicted from ["a", "b"] - not the input's space token
    model, tok = tiny_llama(), MergingTokenizer()
    assert tok.tokens("ab ") == ["a", "b", " "] and tok.tokens("ab cd") == ["a", "b", " c", "d"]
    ex = {"input": "ab ", "choices": ["cd", "c"], "target": 0}
    r = multiple_choice_accuracy(model, tok, [ex], normalize="none", progress=False, return_scores=True)
    ids = tok("ab cd")["input_ids"]
    assert r["scores"][0][0][1] == 2
    assert r["scores"][0][0][0] == pytest.approx(hf_loss_score(model, ids, 2), abs=1e-4)
    assert r["scores"][0][1][1] == 1


def test_no_merge_scores_equal_hf_loss_and_delimiter():
    model, tok = tiny_llama(), MergingTokenizer()
    ex = {"input": "abc", "choices": [" de", " f"], "target": 1}
    r = multiple_choice_accuracy(model, tok, [ex], normalize="none", progress=False, return_scores=True)
    for (score, n), choice in zip(r["scores"][0], ex["choices"]):
        assert n == len(tok.tokens(choice))
        assert score == pytest.approx(hf_loss_score(model, tok("abc" + choice)["input_ids"], n), abs=1e-4)
    # the default delimiter " " goes between an input not ending in whitespace and a choice
    # not starting with one; delimiter="" concatenates
    bare = {"input": "abc", "choices": ["de", "f"], "target": 1}
    spaced = multiple_choice_accuracy(model, tok, [bare], normalize="none", progress=False, return_scores=True)
    assert spaced["scores"] == r["scores"]  # the same text, token for token
    glued = multiple_choice_accuracy(model, tok, [bare], delimiter="", normalize="none", progress=False,
                                     return_scores=True)
    assert glued["scores"][0][0][0] == pytest.approx(hf_loss_score(model, tok("abcde")["input_ids"], 2), abs=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batching_and_determinism(arch):
    torch.manual_seed(0)
    model = _tiny(arch).eval()
    tok = MergingTokenizer(bos_token_id=2 if arch == "gemma3" else None)
    examples = make_examples(9, seed=3)
    r1 = multiple_choice_accuracy(model, tok, examples, batch_size=1, progress=False, return_scores=True)
    r4 = multiple_choice_accuracy(model, tok, examples, batch_size=4, progress=False, return_scores=True)
    r64 = multiple_choice_accuracy(model, tok, examples, batch_size=64, progress=False, return_scores=True)
    for r in (r4, r64):
        assert r["predictions"] == r1["predictions"]
        for a, b in zip(r["scores"], r1["scores"]):
            assert [s for s, _ in a] == pytest.approx([s for s, _ in b], abs=1e-4)
    again = multiple_choice_accuracy(model, tok, examples, batch_size=4, progress=False, return_scores=True)
    assert again["scores"] == r4["scores"]  # bit-identical on a re-run
    assert r1["n_sequences"] == sum(len(e["choices"]) for e in examples)


def test_accuracy_chance_targets_subtasks_max_examples():
    model, tok = tiny_llama(), MergingTokenizer()
    examples = make_examples(6, seed=5)
    ref = [explicit_scores(model, tok, ex) for ex in examples]
    preds = [argmax([s / n for s, n in sc]) for sc in ref]
    examples[0]["target"] = preds[0]
    examples[1]["target"] = (preds[1] + 1) % len(examples[1]["choices"])  # wrong ...
    examples[1]["targets"] = [examples[1]["target"], preds[1]]  # ... but also accepted
    for i in range(2, 6):
        examples[i]["target"] = (preds[i] + 1) % len(examples[i]["choices"])  # wrong
    for i, ex in enumerate(examples):
        ex["subtask"] = "a" if i < 3 else "b"
    r = multiple_choice_accuracy(model, tok, examples, progress=False)
    assert r["n"] == 6 and r["predictions"] == preds
    assert r["accuracy"] == pytest.approx(2 / 6)
    chance = [len(ex.get("targets", [0])) / len(ex["choices"]) for ex in examples]
    assert r["chance"] == pytest.approx(sum(chance) / 6)
    assert r["by_subtask"]["a"]["n"] == 3 and r["by_subtask"]["a"]["accuracy"] == pytest.approx(2 / 3)
    assert r["by_subtask"]["b"]["accuracy"] == 0.0
    assert r["by_subtask"]["b"]["chance"] == pytest.approx(sum(chance[3:]) / 3)
    r2 = multiple_choice_accuracy(model, tok, examples, max_examples=2, progress=False)
    assert r2["n"] == 2 and r2["accuracy"] == 1.0 and r2["predictions"] == preds[:2]


def test_mode_restored_and_bad_arguments():
    model, tok = tiny_llama(), MergingTokenizer()
    ex = [{"input": "ab", "choices": [" c", " d"], "target": 0}]
    model.train()
    multiple_choice_accuracy(model, tok, ex, progress=False)
    assert model.training
    with pytest.raises(ValueError, match="normalize"):
        multiple_choice_accuracy(model, tok, ex, normalize="mean", progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        multiple_choice_accuracy(model, tok, ex, batch_size=0, progress=False)
    with pytest.raises(ValueError, match="max_examples"):
        multiple_choice_accuracy(model, tok, ex, max_examples=0, progress=False)
    with pytest.raises(ValueError, match="empty"):
        multiple_choice_accuracy(model, tok, [], progress=False)
    with pytest.raises(ValueError, match="target"):
        multiple_choice_accuracy(model, tok, [dict(ex[0], target=2)], progress=False)
    with pytest.raises(ValueError, match="choices"):
        multiple_choice_accuracy(model, tok, [dict(ex[0], choices=[])], progress=False)
    with pytest.raises(ValueError, match="adds no tokens"):
        multiple_choice_accuracy(model, tok, [dict(ex[0], choices=["", " c"])], delimiter="", progress=False)
    # an empty input has nothing to predict the first choice token from without a BOS token
    empty = [{"input": "", "choices": ["c", "d"], "target": 0}]
    with pytest.raises(ValueError, match="BOS"):
        multiple_choice_accuracy(model, tok, empty, progress=False)
    r = multiple_choice_accuracy(model, MergingTokenizer(bos_token_id=1), empty, progress=False)
    assert r["add_bos"] and r["n"] == 1


# --------------------------------------------------------------------------- BIG-bench loader (fake sdist)

ROOT = "bigbench-1.0.0/bigbench/benchmark_tasks/"
FAKE_TASKS = {
    "toy/task.json": {
        "name": "toy", "task_prefix": "T: ", "example_input_prefix": "", "example_output_prefix": " A:",
        "examples": [
            {"input": "x", "target_scores": {"no": 0, "yes": 1}},
            {"input": "gen", "target": "only generative"},
            {"input": "tie", "target_scores": {"a": 1, "b": 1, "c": 0.5}},
        ],
    },
    "multi/task.json": {"name": "multi", "description": "parent, no examples"},
    "multi/sub_b/task.json": {
        "name": "sub_b",
        "examples": [{"input": f"b{i}", "target_scores": {"p": 0, "q": 1, "r": 0}} for i in range(3)],
    },
    "multi/sub_a/task.json": {"name": "sub_a", "examples": [{"input": "a0", "target_scores": {"u": 1, "v": 0}}]},
    "gen/task.json": {"name": "gen", "examples": [{"input": "g", "target": "h"}]},
}


def _add(tf, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


@pytest.fixture
def fake_bigbench(monkeypatch, tmp_path):
    """A small bigbench-1.0.0.tar.gz with the real layout in an empty cache; pip is disabled."""
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path))
    (tmp_path / "sdists").mkdir()
    sdist = tmp_path / "sdists" / "bigbench-1.0.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        _add(tf, "bigbench-1.0.0/PKG-INFO", b"Name: bigbench\n")
        _add(tf, "bigbench-1.0.0/bigbench/api/json_task.py", b"# not a task\n")
        _add(tf, ROOT + "README.md", b"tasks\n")
        for rel, task in FAKE_TASKS.items():
            _add(tf, ROOT + rel, json.dumps(task).encode())
        _add(tf, ROOT + "prog/task.py", b"# programmatic\n")
        _add(tf, ROOT + "prog/README.md", b"\n")

    def no_pip(*a, **k):
        raise AssertionError("pip must not run for a cached pinned sdist")

    monkeypatch.setattr(assets.pypi.subprocess, "run", no_pip)
    return tmp_path


def test_download_sdist_uses_cache(fake_bigbench):
    assert assets.download_sdist("bigbench==1.0.0") == fake_bigbench / "sdists" / "bigbench-1.0.0.tar.gz"
    assert assets.download_sdist("BigBench==1.0.0").name == "bigbench-1.0.0.tar.gz"


def test_download_sdist_index_fallback(monkeypatch, tmp_path):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path))
    calls = []

    def pip_refuses(cmd, **k):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Distributions from PyPI cannot declare "
                                                        "direct URL dependencies.\nfoo depends on bar @ file://x")

    def from_index(req, dest):
        out = dest / "foo-2.0.tar.gz"
        out.write_bytes(b"archive")
        return out

    monkeypatch.setattr(assets.pypi.subprocess, "run", pip_refuses)
    monkeypatch.setattr(assets.pypi, "_download_sdist_from_index", from_index)
    got = assets.download_sdist("foo==2.0")
    assert got == tmp_path / "sdists" / "foo-2.0.tar.gz" and got.read_bytes() == b"archive"
    assert "--no-binary=:all:" in calls[0] and "--no-deps" in calls[0]
    assert [p.name for p in (tmp_path / "sdists").iterdir()] == ["foo-2.0.tar.gz"]  # temp dir gone

    # any other pip failure is reported as such, without the fallback
    monkeypatch.setattr(assets.pypi.subprocess, "run",
                        lambda cmd, **k: subprocess.CompletedProcess(cmd, 1, "", "ERROR: no such package"))
    with pytest.raises(RuntimeError, match="pip download of 'bar==1.0' failed"):
        assets.download_sdist("bar==1.0")


def test_load_bigbench_fake_task_prefixes_and_targets(fake_bigbench):
    ex = assets.load_bigbench_task("toy")
    assert ex == [
        {"input": "T: x A:", "choices": ["no", "yes"], "target": 1, "target_scores": [0.0, 1.0]},
        {"input": "T: tie A:", "choices": ["a", "b", "c"], "target": 0, "target_scores": [1.0, 1.0, 0.5],
         "targets": [0, 1]},
    ]
    bb = assets.load_bigbench_task("toy", prompt="bigbench")  # explicit fields kept, choices listed
    assert bb[0]["input"] == "T: x\n  choice: no\n  choice: yes A:"
    a0 = assets.load_bigbench_task("multi", "sub_a", prompt="bigbench")[0]  # all BIG-bench defaults
    assert a0["input"] == "\nQ: a0\n  choice: u\n  choice: v\nA: "
    with pytest.raises(ValueError, match="prompt"):
        assets.load_bigbench_task("toy", prompt="chat")


def test_load_bigbench_fake_subtasks(fake_bigbench):
    ex = assets.load_bigbench_task("multi")
    assert [(e["subtask"], e["input"]) for e in ex] == [("sub_a", "a0"), ("sub_b", "b0"), ("sub_b", "b1"),
                                                        ("sub_b", "b2")]  # round-robin, sorted subtasks
    assert assets.load_bigbench_task("multi/sub_b") == assets.load_bigbench_task("multi", "sub_b") == ex[1:]
    assert all(e["target"] == 1 and e["choices"] == ["p", "q", "r"] for e in ex[1:])


def test_load_bigbench_fake_errors(fake_bigbench):
    with pytest.raises(ValueError, match=r"name='nope'.*allowed.*gen, multi, toy$"):
        assets.load_bigbench_task("nope")
    with pytest.raises(ValueError, match=r"name='prog' is a programmatic task"):
        assets.load_bigbench_task("prog")
    with pytest.raises(ValueError, match="no multiple-choice examples"):
        assets.load_bigbench_task("gen")
    with pytest.raises(ValueError, match=r"subtask='sub_c'.*allowed: sub_a, sub_b"):
        assets.load_bigbench_task("multi", "sub_c")
    with pytest.raises(ValueError, match=r"subtask='x'.*no subtasks"):
        assets.load_bigbench_task("toy/x")
    for bad in ("", "..", "a/b/c", None, 3):
        with pytest.raises(ValueError, match="name"):
            assets.load_bigbench_task(bad)


def test_load_bigbench_caches_task_files(fake_bigbench, monkeypatch):
    first = assets.load_bigbench_task("toy")
    cache = fake_bigbench / "bigbench"
    assert (cache / "toy" / "task.json").is_file() and (cache / "index.json").is_file()
    assert not (cache / "multi").exists()  # only the requested task is copied out
    index = json.loads((cache / "index.json").read_text())
    assert index["tasks"]["multi"]["subtasks"] == ["sub_a", "sub_b"] and index["tasks"]["prog"]["programmatic"]

    opened = []
    real_open = tarfile.open
    monkeypatch.setattr(tarfile, "open", lambda *a, **k: opened.append(a) or real_open(*a, **k))
    assert assets.load_bigbench_task("toy") == first  # from the cache: the sdist is not opened
    with pytest.raises(ValueError, match="nope"):  # unknown names are answered by the index
        assets.load_bigbench_task("nope")
    assert opened == []
    assert len(assets.load_bigbench_task("multi")) == 4  # a new task: one more pass
    assert len(opened) == 1 and (cache / "multi" / "sub_b" / "task.json").is_file()
    assets.load_bigbench_task("multi", "sub_a")
    assert len(opened) == 1
    assert not [p for p in cache.rglob("*") if p.name.startswith(".")]  # no temp files left


# --------------------------------------------------------------------------- slow tests (PyPI)


@pytest.mark.slow
def test_real_bigbench_tasks_load(real_bigbench):
    ex = assets.load_bigbench_task("goal_step_wikihow")
    assert len(ex) == 1703 + 2250 + 3100
    counts = {s: sum(e["subtask"] == s for e in ex) for s in ("goal_inference", "step_inference", "step_ordering")}
    assert counts == {"goal_inference": 1703, "step_inference": 2250, "step_ordering": 3100}
    assert [e["subtask"] for e in ex[:3]] == ["goal_inference", "step_inference", "step_ordering"]
    assert ex[0]["input"] == "The most reasonable goal of 'Have the butcher make them' is "
    assert ex[0]["choices"][ex[0]["target"]] == "Buy Burger Patties" and len(ex[0]["choices"]) == 4
    fever = assets.load_bigbench_task("fact_checker/fever")
    assert len(fever) == 6612 and all(e["choices"] == ["true", "false"] for e in fever)
    assert fever[0]["input"].endswith("\nQ: Was this claim true or false?")
    with pytest.raises(ValueError, match="goal_step_wikihow"):
        assets.load_bigbench_task("goal_step_wikihw")


@pytest.mark.slow
def test_smollm2_goal_step_wikihow_above_chance(smollm2, real_bigbench):
    model, tok = smollm2
    examples = assets.load_bigbench_task("goal_step_wikihow")
    r = multiple_choice_accuracy(model, tok, examples, max_examples=200, batch_size=16, progress=False)
    assert r["n"] == 200 and not r["add_bos"]
    assert 0.33 < r["chance"] < 0.34  # 67 x 4 choices, 67 x 4, 66 x 2 (interleaved subtasks)
    assert r["accuracy_by_normalize"]["length"] > r["chance"] + 0.1, r
    assert r["accuracy_by_normalize"]["none"] > r["chance"] + 0.1, r
