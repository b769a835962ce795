"""The hf-tensorcomp CLI: report, atomic output, clear errors that leave nothing behind."""

import json

import pytest

from hf_tensorcomp.cli import main


def test_bad_config_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["compress", str(tmp_path), "--rank", "0", "--out", str(out)]) == 2
    assert "rank" in capsys.readouterr().err and not out.exists()


def test_refuses_non_empty_out(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("precious")
    assert main(["compress", "smollm2", "--out", str(tmp_path), "--no-eval"]) == 2
    assert "--out" in capsys.readouterr().err and (tmp_path / "keep.txt").read_text() == "precious"


@pytest.mark.slow
def test_compress_recipe_on_bundled_model(tmp_path, capsys):
    out = tmp_path / "smol"
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"method": "laser", "rank": 16, "targets": ["mlp.down_proj"], "layers": [-1]}))
    assert main(["compress", "--recipe", str(recipe), "--out", str(out), "--max-eval-tokens", "512", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "parameters" in text and "perplexity" in text and "size on disk" in text
    report = json.loads((out / "compression_report.json").read_text())
    assert report["params_before"] - report["params_after"] == 1536 * 576 - 16 * (1536 + 576)
    assert report["bytes"] < report["dense_bytes"]
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".smol")]  # no temp folder left


@pytest.mark.slow
def test_sweep_recipe_writes_table(tmp_path, capsys):
    recipe = tmp_path / "s.json"
    recipe.write_text(json.dumps({"method": "trawl", "option": {"decomposition": "tucker"}, "groups": ["fc"],
                                  "layers": [-1], "ranks": [1.0, 8], "max_eval_tokens": 256, "context_length": 128,
                                  "stride": 128, "mc_examples": 8}))
    out = tmp_path / "t.json"
    assert main(["sweep", "--recipe", str(recipe), "--out", str(out), "--quiet"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["rank"] for r in rows] == [None, 1.0, 8] and rows[1]["layer"] == 29
    assert abs(rows[1]["ppl"] - rows[0]["ppl"]) < 1e-3 * rows[0]["ppl"]  # full-rank Tucker is exact
    assert rows[2]["ppl"] > rows[0]["ppl"] and "mc_accuracy" in rows[2]


@pytest.mark.slow
def test_sweep_over_tensorllm_ratios(tmp_path):
    out = tmp_path / "t.json"
    assert main(["sweep", "--method", "tensorllm", "--layers", "-1", "--ratios", "2", "50", "--max-eval-tokens", "256",
                 "--context-length", "128", "--stride", "128", "--out", str(out), "--quiet"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r.get("ratio") for r in rows] == [None, 2.0, 50.0]
    assert rows[1]["mean_rel_error"] < rows[2]["mean_rel_error"] and rows[2]["ppl"] > rows[0]["ppl"]
    assert rows[2]["dense_params"] >= 50 * rows[2]["factored_params"]
    assert main(["sweep", "--method", "tensorllm", "--layers", "-1", "--ratios", "2", "--ranks", "4", "--out", str(out)]) == 2
