"""End-to-end tests of the local Hub server (tests/hub_server/) with the real,
unpatched huggingface_hub / transformers client code.

transformers-level pushes and pulls run in subprocesses configured by ``hub_env``
(endpoint, token and cache are import-time constants); plain HfApi calls run
in-process against ``HfApi(endpoint=server.url)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hub_server import DEFAULT_TOKEN, HubServer, hub_env, patch_in_process, run_python

huggingface_hub = pytest.importorskip("huggingface_hub")
from huggingface_hub import hf_hub_download, snapshot_download  # noqa: E402
from huggingface_hub.errors import (  # noqa: E402
    EntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)


@pytest.fixture(scope="module")
def hub():
    with HubServer() as server:
        yield server


@pytest.fixture
def api(hub, monkeypatch):
    return patch_in_process(monkeypatch, hub)


def _lfs_puts(hub: HubServer) -> list[str]:
    return [path for method, path, status in hub.requests if method == "PUT" and path.startswith("/_lfs/upload/")]


PUSH_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    repo_id, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()

    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(124)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>")

    model_commit = model.push_to_hub(repo_id)
    tok_commit = tokenizer.push_to_hub(repo_id)

    ids = tokenizer("w1 w5 w7 w42 w99 w3 zzz", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    torch.save({"ids": ids, "logits": logits}, out + "/ref.pt")
    print(json.dumps({"model_commit": model_commit.oid, "tok_commit": tok_commit.oid}))
    """
)

PULL_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch
    from huggingface_hub import ModelCard, constants
    from transformers import AutoModelForCausalLM, AutoTokenizer

    repo_id, out = sys.argv[1], sys.argv[2]
    assert not os.path.exists(os.path.join(constants.HF_HUB_CACHE, "models--" + repo_id.replace("/", "--")))
    model = AutoModelForCausalLM.from_pretrained(repo_id).eval()
    tokenizer = AutoTokenizer.from_pretrained(repo_id)
    ref = torch.load(out + "/ref.pt")
    ids = tokenizer("w1 w5 w7 w42 w99 w3 zzz", return_tensors="pt")["input_ids"]
    assert torch.equal(ids, ref["ids"]), (ids, ref["ids"])
    with torch.no_grad():
        logits = model(ids).logits
    card = ModelCard.load(repo_id)
    cached = sorted(os.listdir(os.path.join(constants.HF_HUB_CACHE, "models--" + repo_id.replace("/", "--"),
                                            "snapshots")))
    print(json.dumps({
        "model_class": type(model).__name__,
        "identical": bool(torch.equal(logits, ref["logits"])),
        "max_abs_diff": float((logits - ref["logits"]).abs().max()),
        "library_name": card.data.library_name,
        "snapshots": cached,
    }))
    """
)


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_push_to_hub_then_from_pretrained_in_fresh_process(hub, tmp_path):
    repo_id = "user/tiny-llama"
    push = run_python(PUSH_SCRIPT, hub_env(hub, tmp_path / "push"), args=[repo_id, str(tmp_path)])
    commits = _last_json(push.stdout)

    files = hub.repo_files(repo_id)
    for name in ("config.json", "generation_config.json", "model.safetensors", "README.md",
                 "tokenizer.json", "tokenizer_config.json", ".gitattributes"):
        assert name in files, sorted(files)
    # weights went through the LFS batch API + basic PUT, JSON files inline in the commit
    assert files["model.safetensors"]["lfs"] is True
    assert f"/_lfs/upload/{files['model.safetensors']['sha256']}" in _lfs_puts(hub)
    assert files["config.json"]["lfs"] is False
    assert json.loads(hub.read_file(repo_id, "config.json"))["model_type"] == "llama"
    head = hub.repo_files(repo_id, revision=commits["tok_commit"])
    assert "tokenizer.json" in head

    pull = run_python(PULL_SCRIPT, hub_env(hub, tmp_path / "pull"), args=[repo_id, str(tmp_path)])
    result = _last_json(pull.stdout)
    assert result["model_class"] == "LlamaForCausalLM"
    assert result["identical"], result
    assert result["library_name"] == "transformers"
    assert result["snapshots"] == [commits["tok_commit"]]


def test_large_file_upload_uses_lfs_and_downloads_back(hub, api, tmp_path):
    repo_id = api.create_repo("big-file").repo_id
    assert repo_id == f"{hub.user}/big-file"
    data = os.urandom(11 * 1024 * 1024)  # > 10 MB threshold, neutral suffix
    sha = hashlib.sha256(data).hexdigest()
    local = tmp_path / "blob.dat"
    local.write_bytes(data)
    api.upload_file(path_or_fileobj=str(local), path_in_repo="data/blob.dat", repo_id=repo_id)

    assert f"/_lfs/upload/{sha}" in _lfs_puts(hub)
    entry = hub.repo_files(repo_id)["data/blob.dat"]
    assert entry["lfs"] and entry["sha256"] == sha and entry["size"] == len(data)

    info = api.model_info(repo_id, files_metadata=True)
    sibling = {s.rfilename: s for s in info.siblings}["data/blob.dat"]
    assert sibling.lfs is not None and sibling.lfs.sha256 == sha and sibling.size == len(data)

    meta = huggingface_hub.get_hf_file_metadata(
        huggingface_hub.hf_hub_url(repo_id, "data/blob.dat", endpoint=hub.url), token=DEFAULT_TOKEN
    )
    assert meta.etag == sha and meta.size == len(data) and meta.commit_hash == info.sha

    path = hf_hub_download(repo_id, "data/blob.dat", endpoint=hub.url, token=DEFAULT_TOKEN,
                           cache_dir=tmp_path / "cache")
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() == sha

    # same content again: LFS object already present upstream, commit is a no-op
    puts_before = len(_lfs_puts(hub))
    commit = api.upload_file(path_or_fileobj=str(local), path_in_repo="data/blob.dat", repo_id=repo_id)
    assert commit.oid == info.sha
    assert len(_lfs_puts(hub)) == puts_before


def test_missing_repo_raises_repository_not_found(hub, api, tmp_path):
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("user/does-not-exist")
    with pytest.raises(RepositoryNotFoundError):
        api.list_repo_files("user/does-not-exist")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("user/does-not-exist", "config.json", endpoint=hub.url, token=DEFAULT_TOKEN,
                        cache_dir=tmp_path)
    with pytest.raises(RepositoryNotFoundError):
        api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id="user/does-not-exist")
    assert api.repo_exists("user/does-not-exist") is False

    # private repos are invisible without a token
    repo_id = api.create_repo("secret", private=True).repo_id
    assert api.model_info(repo_id).private is True
    anonymous = huggingface_hub.HfApi(endpoint=hub.url, token=False)
    with pytest.raises(RepositoryNotFoundError):
        anonymous.model_info(repo_id)

    # repo exists but file / revision do not
    repo_id = api.create_repo("exists").repo_id
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(repo_id, "missing.json", endpoint=hub.url, token=DEFAULT_TOKEN, cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(repo_id, ".gitattributes", revision="no-such-branch", endpoint=hub.url,
                        token=DEFAULT_TOKEN, cache_dir=tmp_path)


def test_model_card_roundtrip(hub, api, tmp_path):
    repo_id = api.create_repo("with-card").repo_id
    card = "---\nlicense: apache-2.0\nlibrary_name: transformers\ntags:\n- tiny\n---\n\n# Tiny model\n\nHello.\n"
    api.upload_file(path_or_fileobj=card.encode(), path_in_repo="README.md", repo_id=repo_id)
    path = hf_hub_download(repo_id, "README.md", endpoint=hub.url, token=DEFAULT_TOKEN, cache_dir=tmp_path)
    assert open(path, encoding="utf-8").read() == card
    assert hub.repo_files(repo_id)["README.md"]["lfs"] is False
    parsed = huggingface_hub.ModelCard(open(path, encoding="utf-8").read())
    assert parsed.data.license == "apache-2.0" and parsed.data.tags == ["tiny"]


def test_upload_folder_listing_snapshot_and_history(hub, api, tmp_path):
    repo_id = api.create_repo("folder").repo_id
    src = tmp_path / "src"
    (src / "sub" / "deep").mkdir(parents=True)
    contents = {
        "a.txt": b"alpha",
        "sub/b.json": b'{"b": 1}',
        "sub/deep/c.safetensors": b"\x00" * 1000,
        "empty.txt": b"",
    }
    for rel, data in contents.items():
        (src / rel).write_bytes(data)
    first = api.upload_folder(folder_path=str(src), repo_id=repo_id, commit_message="add folder")

    assert sorted(api.list_repo_files(repo_id)) == sorted([".gitattributes", *contents])
    top = {e.path: type(e).__name__ for e in api.list_repo_tree(repo_id)}
    assert top == {".gitattributes": "RepoFile", "a.txt": "RepoFile", "empty.txt": "RepoFile", "sub": "RepoFolder"}
    expanded = list(api.list_repo_tree(repo_id, path_in_repo="sub", recursive=True, expand=True))
    assert {e.path for e in expanded} == {"sub/b.json", "sub/deep", "sub/deep/c.safetensors"}
    assert all(e.last_commit.oid == first.oid for e in expanded if type(e).__name__ == "RepoFile")
    assert hub.repo_files(repo_id)["sub/deep/c.safetensors"]["lfs"] is True

    snap = snapshot_download(repo_id, endpoint=hub.url, token=DEFAULT_TOKEN, cache_dir=tmp_path / "cache")
    for rel, data in contents.items():
        assert open(os.path.join(snap, rel), "rb").read() == data
    assert os.path.basename(snap) == first.oid

    # second commit deletes a file and changes another; old revision stays readable
    (src / "a.txt").write_bytes(b"alpha v2")
    second = api.upload_folder(folder_path=str(src), repo_id=repo_id, delete_patterns=["*.json"],
                               allow_patterns=["a.txt"])
    files = api.list_repo_files(repo_id)
    assert "sub/b.json" not in files and "a.txt" in files
    assert [c.commit_id for c in api.list_repo_commits(repo_id)][:2] == [second.oid, first.oid]
    old = hf_hub_download(repo_id, "a.txt", revision=first.oid, endpoint=hub.url, token=DEFAULT_TOKEN,
                          cache_dir=tmp_path / "cache")
    new = hf_hub_download(repo_id, "a.txt", endpoint=hub.url, token=DEFAULT_TOKEN, cache_dir=tmp_path / "cache")
    assert open(old, "rb").read() == b"alpha" and open(new, "rb").read() == b"alpha v2"

    # branches and pull requests
    api.create_branch(repo_id, branch="dev")
    api.create_branch(repo_id, branch="dev", exist_ok=True)
    pr = api.upload_file(path_or_fileobj=b"pr", path_in_repo="pr.txt", repo_id=repo_id, create_pr=True)
    assert pr.pr_revision == "refs/pr/1"
    assert api.file_exists(repo_id, "pr.txt", revision="refs/pr/1")
    assert not api.file_exists(repo_id, "pr.txt")
    assert {b.name for b in api.list_repo_refs(repo_id).branches} == {"main", "dev"}
    api.create_tag(repo_id, tag="v1", revision=first.oid)
    tagged = hf_hub_download(repo_id, "a.txt", revision="v1", endpoint=hub.url, token=DEFAULT_TOKEN,
                             cache_dir=tmp_path / "cache")
    assert open(tagged, "rb").read() == b"alpha"


def test_all_regular_mode_works_with_xet_enabled_client(tmp_path, monkeypatch):
    """With LFS disabled server-side, even a client with hf_xet enabled can upload (inline base64)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with HubServer(lfs_threshold=None, lfs_suffixes=()) as server:
        api = huggingface_hub.HfApi(endpoint=server.url, token=DEFAULT_TOKEN)
        repo_id = api.create_repo("regular").repo_id
        data = os.urandom(2 * 1024 * 1024)
        (tmp_path / "w.safetensors").write_bytes(data)
        api.upload_file(path_or_fileobj=str(tmp_path / "w.safetensors"), path_in_repo="w.safetensors",
                        repo_id=repo_id)
        assert server.repo_files(repo_id)["w.safetensors"]["lfs"] is False
        assert server.read_file(repo_id, "w.safetensors") == data
        assert not any("lfs" in path or "xet" in path for _, path, _ in server.requests)
