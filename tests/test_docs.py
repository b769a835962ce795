"""Every code block of README.md and docs/*.md runs, on tiny random models standing in for the bundled ones.

How: the blocks of one page run in order in one namespace, in a fresh working folder, with
`hf_tensorcomp.assets.model_path` (any bundled name) pointed at a tiny random checkpoint of the same
architecture family (Llama for "smollm2", Gemma-3 for "gemma3") with a word-level tokenizer, and
`hf_tensorcomp.hybrid.linearized_path` at a tiny linearized hybrid. Nothing else is substituted: the blocks
run as written (the calibration text is the bundled corpora, which the test suite fetches anyway).
```python blocks are executed; ```bash blocks are `hf-tensorcomp` command lines, run in-process through
`hf_tensorcomp.cli.main`. A block that cannot run here (the real models, the network, an install, a long run)
carries `<!-- no-run: reason -->` on the line before its fence and is listed in NO_RUN below: the marked set
must equal the list, so an unmarked block that does not run fails.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^(?:<!-- no-run: (?P<reason>[^\n]+?) -->\n)?```(?P<lang>[\w-]*)\n(?P<body>.*?)^```[ \t]*$",
                   re.M | re.S)
LANGS = ("python", "bash")

#: (page, first line of the block without its trailing comment) of every block that does not run here, and why
NO_RUN = {
    ("docs/serving.md", "vllm serve out/smollm2-ct/base --enable-lora --lora-modules correction=out/smollm2-ct/adapter --max-lora-rank 64"):
        "vLLM needs a GPU",
    ("docs/serving.md", "import hf_tensorcomp"): "the docs' stand-in model has a word-level tokenizer; GGUF holds BPE",
    ("docs/serving.md", 'llama-cli -m out/smollm2-gguf/model.gguf --lora out/smollm2-gguf/adapter.gguf -p "The capital of '
                        'France is" -n 32'): "llama.cpp is not installed here",
    ("README.md", 'python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e ".[quanto]" && '
                  ".venv/bin/hf-tensorcomp compress --recipe recipes/qlr_smollm2.json --out out/smollm2-qlr"):
        "installs packages and compresses the real SmolLM2",
    ("README.md", 'python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e ".[dev]" && '
                  ".venv/bin/python -m pytest -q"): "the test suite itself",
    ("docs/benchmarks.md", "python benchmarks/quantized.py --recipe benchmarks/recipes/quantized/quantized_qlr021_mix.json"):
        "benchmark runs on the real models",
    ("docs/cli.md", "hf-tensorcomp compress --recipe recipes/qlr_smollm2.json --out DIR"):
        "real models, BIG-bench, a GGUF file, the Hub",
    ("docs/distributed.md", "torchrun --standalone --nproc-per-node 2 -m hf_tensorcomp.cli compress smollm2 --method qlr "
                            "--rank 8 --stream --out out/qlr"): "starts two processes through torchrun",
    ("docs/distributed.md", "accelerate launch --num_processes 2 -m hf_tensorcomp.cli compress smollm2 --method qlr "
                            "--rank 8 --stream --out out/qlr"): "starts two processes through accelerate launch",
    ("docs/hub.md", 'hf_tensorcomp.push_to_hub(again, "user/smollm2-laser", tokenizer=tok, results={"perplexity": 30.1})'):
        "uploads to the Hugging Face Hub",
    ("docs/linearize.md", "hf-tensorcomp linearize --recipe recipes/linearize_smollm2.json --out out/smollm2-gdn"):
        "builds the real SmolLM2 hybrid",
    ("docs/streaming.md", 'gguf = hf_tensorcomp.assets.gguf_path("smollm2")'): "reads the real SmolLM2 GGUF file",
    ("docs/tensorllm.md", "hf-tensorcomp sweep --recipe recipes/tensorllm_layer_sweep.json --out tensorllm_sweep.json"):
        "a sweep of the real SmolLM2",
    ("docs/trawl.md", "hf-tensorcomp sweep --recipe recipes/trawl_fc_cp_sweep.json --out results/trawl_sweep.json"):
        "a sweep of the real SmolLM2",
}

#: the line CI parses from the README to run the tests
TEST_COMMAND = 'python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e ".[dev]" && .venv/bin/python -m pytest -q'


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def blocks(page: Path) -> list[dict]:
    """The fenced blocks of `page` in order: {lang, body, first, reason (None unless marked no-run)}."""
    out = []
    for m in BLOCK.finditer(page.read_text()):
        body = m["body"]
        first = re.sub(r"\s+#.*$", "", next((line for line in body.splitlines() if line.strip()), ""))
        out.append({"lang": m["lang"], "body": body, "first": first, "reason": m["reason"]})
    return out


def _runnable(page: Path) -> list[dict]:
    return [b for b in blocks(page) if b["reason"] is None]


def test_pages_hold_only_python_and_bash_blocks_at_the_margin():
    for page in PAGES:
        text = page.read_text()
        assert not re.search(r"^[ \t]+```", text, re.M), f"{_name(page)}: an indented fence (write blocks at the margin)"
        assert text.count("\n```") % 2 == 0 or text.startswith("```"), f"{_name(page)}: an unclosed fence"
        for b in blocks(page):
            assert b["lang"] in LANGS, f"{_name(page)}: a ```{b['lang']} block; allowed: {LANGS}"


def test_no_run_blocks_are_exactly_the_listed_ones():
    marked = {(_name(p), b["first"]) for p in PAGES for b in blocks(p) if b["reason"] is not None}
    assert marked == set(NO_RUN), (f"marked but not listed: {marked - set(NO_RUN)}; "
                                   f"listed but not marked: {set(NO_RUN) - marked}")


def test_readme_is_a_landing_page_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert TEST_COMMAND in text.splitlines()  # verbatim, on a line of its own: CI parses it
    assert "hf-tensorcomp compress --recipe recipes/qlr_smollm2.json --out out/smollm2-qlr" in text
    first = next(b for b in blocks(ROOT / "README.md") if b["lang"] == "python")["body"]
    assert 'method="qlr", target_bytes=' in first  # the quickstart's first config is the setting to keep


def test_links_and_recipe_paths_resolve():
    """Every relative link of the README and the docs points at a file (and a heading where it names one), and every
    recipe path they name exists."""
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            assert dest.exists(), f"{_name(page)}: link to {target}: no such file"
            if anchor and dest.suffix == ".md" and "benchmarks" not in dest.parts:
                assert anchor in _anchors(dest), f"{_name(page)}: link to {target}: no such heading"
        for recipe in re.findall(r"(?<![\w/.])((?:benchmarks/)?recipes/[\w./-]+?\.json)", text):
            assert (ROOT / recipe).is_file(), f"{_name(page)}: names {recipe}, which does not exist"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of the headings of `page`."""
    out = set()
    for h in re.findall(r"^#+ (.+)$", page.read_text(), re.M):
        out.add(re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-"))
    return out


def test_every_page_is_listed_in_the_index():
    index = (ROOT / "docs" / "index.md").read_text()
    for page in PAGES[1:]:
        if page.name != "index.md":
            assert f"]({page.name})" in index, f"docs/index.md does not list {page.name}"


# ---- running the blocks ------------------------------------------------------------------------------------


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)} | {"[UNK]": 100}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[UNK]").save_pretrained(folder)


def _tiny(kind: str, folder: Path) -> Path:
    """A tiny random checkpoint with a tokenizer: widths of 128 so that `qlr`'s groups of 128 fit the rows; each decoder
    matrix keeps its random singular vectors and norm with singular values falling as 1 / i."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=101, hidden_size=128, intermediate_size=256, num_hidden_layers=2, max_position_embeddings=512)
    if kind == "llama":  # SmolLM2's family: grouped-query attention, tied embeddings
        model = LlamaForCausalLM(LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2,
                                             tie_word_embeddings=True))
    else:  # Gemma-3's: a sliding and a global layer, one KV head
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                                   sliding_window=16, layer_types=["sliding_attention", "full_attention"]))
    with torch.no_grad():  # a trained model's decaying spectra, so that a low-rank budget has something to keep
        for name, p in model.named_parameters():
            if p.dim() == 2 and ".layers." in name:
                u, _, vh = torch.linalg.svd(p, full_matrices=False)
                s = torch.arange(1, u.shape[1] + 1, dtype=p.dtype) ** -1.0
                p.copy_(u @ torch.diag(s * p.norm() / s.norm()) @ vh)
    model.save_pretrained(folder)
    _tokenizer(folder)
    return folder


def make_stand_ins(mktemp) -> dict:
    """{"smollm2": tiny Llama folder, "gemma3": tiny Gemma-3 folder, "hybrid": a function giving the tiny Llama with
    layer 1 linearized (built on first use)}; `mktemp(name)` gives a new folder."""
    out = {"smollm2": _tiny("llama", mktemp("smollm2")), "gemma3": _tiny("gemma3", mktemp("gemma3"))}
    built = []

    def hybrid(*args, **kwargs):
        if not built:
            from transformers import AutoModelForCausalLM

            from hf_tensorcomp import TensorCompressionConfig

            ids = torch.randint(0, 100, (16, 64), generator=torch.Generator().manual_seed(0))
            cfg = TensorCompressionConfig(method="linearize", layers=[1], epochs=8, lr=3e-3, calibration=ids, progress=False)
            model = AutoModelForCausalLM.from_pretrained(out["smollm2"], quantization_config=cfg)
            built.append(mktemp("hybrid"))
            model.save_pretrained(built[0])
            _tokenizer(built[0])
        return built[0]

    out["hybrid"] = hybrid
    return out


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    return make_stand_ins(tmp_path_factory.mktemp)


def _run_bash(body: str) -> None:
    from hf_tensorcomp.cli import main

    for line in body.splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        assert argv[0] == "hf-tensorcomp", f"a bash line that is not an hf-tensorcomp command: {line!r} (mark it no-run)"
        assert main(argv[1:]) == 0, line


@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)], ids=_name)
def test_code_blocks_run(page, stand_ins, tmp_path, monkeypatch):
    import hf_tensorcomp
    import hf_tensorcomp.assets.models

    def model_path(name="smollm2"):
        return stand_ins["gemma3" if "gemma" in name else "smollm2"]

    monkeypatch.setattr(hf_tensorcomp.assets, "model_path", model_path)
    monkeypatch.setattr(hf_tensorcomp.assets.models, "model_path", model_path)
    monkeypatch.setattr(hf_tensorcomp.hybrid, "linearized_path", stand_ins["hybrid"])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread buys nothing, and spins on a busy machine
    try:
        _run_page(page)
    finally:
        torch.set_num_threads(threads)


def _run_page(page: Path) -> None:
    namespace = {"__name__": "__docs__"}
    for i, b in enumerate(_runnable(page)):
        where = f"{_name(page)}, block {i + 1} ({b['first'][:60]!r})"
        try:
            if b["lang"] == "python":
                exec(compile(b["body"], where, "exec"), namespace)
            else:
                _run_bash(b["body"])
        except Exception as e:
            raise AssertionError(f"{where} failed: {type(e).__name__}: {e}") from e


def test_changelog_says_what_changed_release_by_release():
    """CHANGELOG.md: [Unreleased] first, then released versions as sections (Keep a Changelog), at most 300 lines,
    no measurement tables (those live in benchmarks/README.md and benchmarks/results/)."""
    text = (ROOT / "CHANGELOG.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 300, f"CHANGELOG.md: {len(lines)} lines; allowed: at most 300"
    assert not [line for line in lines if line.lstrip().startswith("|")], "a table in CHANGELOG.md: measurements go to benchmarks/"
    versions = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert versions and versions[0] == "Unreleased", versions
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", v) for v in versions[1:]) and len(versions) > 1, versions
    import hf_tensorcomp

    def key(v):
        return tuple(map(int, v.split(".")))

    assert key(versions[1]) <= key(hf_tensorcomp.__version__), "the latest release is newer than the package's version"
    assert versions[1:] == sorted(versions[1:], key=key, reverse=True), "released versions newest first"


def test_the_version_is_written_once():
    """pyproject.toml reads the version from ``hf_tensorcomp.__version__``; no other file writes it."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = {attr = "hf_tensorcomp.__version__"}' in pyproject
    assert not re.search(r'^version\s*=\s*"', pyproject, re.M)
