"""push_to_hub and from_pretrained("user/repo") of a compressed model, against the local Hub server."""

import textwrap

import pytest
from huggingface_hub import hf_hub_download

from hub_server import HubServer, hub_env, patch_in_process, run_python

PUSH = textwrap.dedent("""
    import sys, torch, hf_tensorcomp
    from transformers import AutoModelForCausalLM
    src, repo, out = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = hf_tensorcomp.TensorCompressionConfig(method="laser", rank=4, targets=["mlp.*"], layers=[-1], progress=False)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg)
    ids = torch.arange(12).reshape(2, 6)
    torch.save(model(ids).logits.detach(), out)
    hf_tensorcomp.push_to_hub(model, repo, results={"perplexity": 12.5})
    model.push_to_hub(repo + "-plain")   # transformers' own push: factors + tags, generic card
""")

PULL = textwrap.dedent("""
    import sys, torch, hf_tensorcomp
    from transformers import AutoModelForCausalLM
    repo, ref = sys.argv[1], sys.argv[2]
    for r in (repo, repo + "-plain"):
        model = AutoModelForCausalLM.from_pretrained(r)
        assert type(model.model.layers[-1].mlp.up_proj).__name__ == "LowRankLinear"
        ids = torch.arange(12).reshape(2, 6)
        assert torch.equal(model(ids).logits, torch.load(ref)), r
    print("PULLED")
""")


@pytest.fixture(scope="module")
def hub():
    with HubServer() as server:
        yield server


def test_push_and_pull_compressed_model(hub, tiny_dirs, tmp_path, monkeypatch):
    ref = tmp_path / "logits.pt"
    run_python(PUSH, hub_env(hub, tmp_path / "push"), args=[str(tiny_dirs["llama"]), "user/tiny-laser", str(ref)])
    files = hub.repo_files("user/tiny-laser")
    assert {"config.json", "model.safetensors", "README.md"} <= set(files)
    api = patch_in_process(monkeypatch, hub)
    card = open(hf_hub_download("user/tiny-laser", "README.md", endpoint=hub.url, cache_dir=tmp_path / "c",
                                token=api.token)).read()
    assert "hf_tensorcomp" in card and "imported" in card
    assert "| 0 | laser | 4 | 4 ×3 | mlp.* | 2 | factorized |" in card and "| perplexity | 12.5 |" in card
    assert 'from_pretrained("user/tiny-laser")' in card  # the repo id, not a placeholder
    assert "parameters:" in card
    plain = hub.read_file("user/tiny-laser-plain", "README.md").decode()
    assert "tensorcomp-laser" in plain  # tags set at compression reach transformers' own card
    out = run_python(PULL, hub_env(hub, tmp_path / "pull"), args=["user/tiny-laser", str(ref)])
    assert "PULLED" in out.stdout
