"""The hf-tensorcomp CLI: report, atomic output, clear errors that leave nothing behind."""

import importlib.util
import json
import math

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
    assert "values stored" in text and "bytes on disk" in text and "OpenWebText" in text and "[{" not in text
    assert "method       laser" in text and "rank         16" in text and "mlp.down_proj in layers 29" in text
    report = json.loads((out / "compression_report.json").read_text())
    # the factors of rank 16 and the pivoted factor's column order (one int per input) replace the matrix
    assert report["dense_values"] - report["values"] == 1536 * 576 - 16 * (1536 + 576 - 16) - 1536
    assert set(report["ppl"]) == set(report["dense_ppl"]) == {"wikipedia", "owt"}
    assert report["bytes"] < report["dense_bytes"]
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".smol")]  # no temp folder left


@pytest.mark.slow
def test_sweep_recipe_writes_table(tmp_path, capsys, real_bigbench):
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


def test_script_entry_helps_without_importing_torch_then_runs_commands(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, hf_tensorcomp_cli\n"
            "try:\n    hf_tensorcomp_cli.main(['compress', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('HEAVY' if {'torch', 'transformers', 'hf_tensorcomp'} & set(sys.modules) else 'LIGHT')\n"
            "hf_tensorcomp_cli.main(['methods', 'laser'])  # a command: the package loads now\n")
    root = str(Path(__file__).parents[1])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={"PYTHONPATH": root, "PATH": "", "OMP_NUM_THREADS": "1"})
    assert "--method {einsort,laser,latent_kv,linearize,qlr,rotor,state_reduction,tensorllm,trawl}" in r.stdout and "\nLIGHT\n" in r.stdout, r.stdout + r.stderr
    assert "laser: LASER" in r.stdout and "default rank: 0.5" in r.stdout, r.stdout + r.stderr


def test_method_choices_match_the_registry_and_options_are_listed(capsys):
    from hf_tensorcomp import cli
    from hf_tensorcomp.methods import METHODS

    assert cli.METHODS == tuple(sorted(METHODS))
    with pytest.raises(SystemExit):
        main(["compress", "--method", "svd", "--out", "x"])
    assert "invalid choice: 'svd'" in capsys.readouterr().err
    assert main(["methods", "einsort"]) == 0
    out = capsys.readouterr().out
    assert "--option cache_weight=true" in out and "--option network=\"svd\"" in out and "default rank: None" in out and "--target: accepted (default 0.5)" in out


def test_eval_text_from_a_file_or_a_dataset(tmp_path, monkeypatch):
    import datasets

    from hf_tensorcomp.cli import _texts

    f = tmp_path / "mine.txt"
    f.write_text("My own text.\n\nA second paragraph.\n")
    assert _texts(str(f)) == ["My own text.\n\nA second paragraph.\n"]
    assert len(_texts("owt")) == 200  # the bundled held-out split
    calls = []

    def fake_load(name, subset=None, split=None):
        calls.append((name, subset, split))
        if name == "nowhere/nothing":
            raise ConnectionError("no network")
        return datasets.Dataset.from_dict({"text": ["a b c", "", "d e"]} if name != "no/text" else {"body": ["x"]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert _texts("wikitext:wikitext-2-raw-v1@validation") == ["a b c", "d e"]
    assert _texts("someone/corpus") == ["a b c", "d e"]
    assert calls == [("wikitext", "wikitext-2-raw-v1", "validation"), ("someone/corpus", None, "test")]
    with pytest.raises(ValueError, match=r"--text: got 'nowhere/nothing'.*ConnectionError.*allowed: wikipedia \| owt"):
        _texts("nowhere/nothing")
    with pytest.raises(ValueError, match="'text' column"):
        _texts("no/text")


def test_card_base_model_is_a_hub_id(tmp_path):
    from hf_tensorcomp.cli import _base_model

    assert _base_model("smollm2") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert _base_model("gemma3") == "google/gemma-3-270m"
    assert _base_model("user/repo") == "user/repo" and _base_model(str(tmp_path)) is None


@pytest.mark.slow
def test_peers_are_reported_beside_the_compressed_model(tmp_path, capsys):
    """``--peers``: optimum-quanto int8 and int4 weight-only on the same text, their bytes as held (packed
    codes and scales, not the float shadow) and perplexity, as a user would compare them."""
    # looked up, not imported: the library's own import of quanto must come first (it keeps setuptools off
    # its distutils override, whose assertion an earlier import here once failed in a full run)
    if importlib.util.find_spec("optimum") is None or importlib.util.find_spec("optimum.quanto") is None:
        pytest.skip("optimum-quanto is not installed")
    out = tmp_path / "smol"
    assert main(["compress", "smollm2", "--method", "laser", "--rank", "16", "--targets", "mlp.down_proj", "--layers", "-1",
                 "--peers", "--max-eval-tokens", "512", "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "quanto int4: in memory" in text and "\nquanto int4 " in text  # its bytes row and its perplexity row
    r = json.loads((out / "compression_report.json").read_text())
    int8, int4 = r["peers"]
    assert (int8["name"], int4["name"]) == ("quanto int8", "quanto int4")
    assert int4["memory_bytes"] < int8["memory_bytes"] < r["memory_bytes"] < r["dense_memory_bytes"]
    for t in ("wikipedia", "owt"):
        assert abs(int8["ppl"][t] / r["dense_ppl"][t] - 1) < 0.01 < int4["ppl"][t] / r["dense_ppl"][t] - 1
    assert main(["compress", "smollm2", "--rank", "4", "--peers", "--no-eval", "--out", str(tmp_path / "x")]) == 2
    assert "--peers" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_report_says_what_was_done_in_words_and_counts_quantized_codes(tiny_with_tokenizer, tmp_path, capsys):
    """The report's header is words (the method, where, its budget or rank, the bits it chose, the calibration),
    not a Python list of dicts; it scores both bundled corpora; and it counts every value stored: a 4-bit model
    stores a code for every weight (in buffers, which ``num_parameters()`` misses), so it stores no fewer values
    than the dense model, in fewer bytes."""
    from transformers import AutoModelForCausalLM

    from hf_tensorcomp.eval.peers import stored_values

    out = tmp_path / "out"
    assert main(["compress", str(tiny_with_tokenizer), "--method", "qlr", "--rank", "0", "--option", "quantizer=rtn",
                 "--option", "whiten=false", "--option", "rotate=false", "--option", "group_size=16", "--embedding-bits", "8",
                 "--max-eval-tokens", "128", "--context-length", "32", "--stride", "32", "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    header = text[text.index("hf_tensorcomp report"): text.index("\nsize")]
    assert "[{" not in text and "{'" not in text and "\nparameters" not in text
    assert "method       qlr (a quantized weight" in header and "rank         0" in header
    assert "4-bit x21 matrices" in header and "8-bit codes" in header and "calibration  none (data-free)" in header
    assert "Wikipedia" in text and "OpenWebText" in text and "vs bfloat16" in text
    r = json.loads((out / "compression_report.json").read_text())
    assert r["header"] == header.strip("\n").splitlines()[: len(r["header"])]
    assert set(r["ppl"]) == set(r["dense_ppl"]) == {"wikipedia", "owt"}
    m = AutoModelForCausalLM.from_pretrained(out)
    codes = sum(math.prod(q[2]) for mod in m.modules() for q in mod.__dict__.get("_qfactors", {}).values())
    assert codes >= 3 * 7 * 48 * 48  # every decoder linear and the table are codes now
    assert r["values"] == stored_values(m) > codes + sum(p.numel() for p in m.parameters())
    assert r["values"] >= r["dense_values"] == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(
        tiny_with_tokenizer).parameters())
    assert r["memory_bytes"] < r["dense_bf16_bytes"] < r["dense_memory_bytes"]
    assert "values stored (each weight" in (out / "README.md").read_text()  # the card counts them likewise


def test_quanto_weight_only_names_its_bits(tiny_dirs):
    from transformers import AutoModelForCausalLM

    from hf_tensorcomp.eval.peers import quanto_weight_only

    with pytest.raises(ValueError, match=r"quanto_weight_only: bits: got 3; allowed: 8 \| 4"):
        quanto_weight_only(AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]), 3)


def test_embedding_bits_flag_quantizes_the_table_and_the_saved_model_reloads(tiny_with_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_tensorcomp.layers import QuantizedEmbedding, QuantizedHead

    out = tmp_path / "out"
    assert main(["compress", str(tiny_with_tokenizer), "--rank", "4", "--targets", "mlp.*", "--embedding-bits", "8",
                 "--out", str(out), "--no-eval", "--quiet"]) == 0
    report = json.loads((out / "compression_report.json").read_text())
    assert report["embedding_bits"] == 8
    m = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(m.get_input_embeddings(), QuantizedEmbedding) and m.get_output_embeddings().tied
    assert isinstance(m.get_output_embeddings(), QuantizedHead)


def test_heal_flag_heals_after_compressing_and_bad_settings_name_the_field(tiny_with_tokenizer, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["compress", str(tiny_with_tokenizer), "--rank", "2", "--targets", "mlp.*", "--calibration", "wikipedia",
                 "--calibration-samples", "8", "--calibration-length", "32", "--heal",
                 '{"steps": 10, "samples": 8, "length": 32, "lr": 0.003, "precision": "bfloat16"}',
                 "--out", str(out), "--no-eval", "--quiet"]) == 0
    report = json.loads((out / "compression_report.json").read_text())
    assert set(report["heal"]) == {"held_out_kl_before", "held_out_kl_after", "improved", "seconds"}
    assert report["heal"]["held_out_kl_after"] <= report["heal"]["held_out_kl_before"]
    assert "healing: held-out KL" in capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert "heal" in card.lower()
    bad = tmp_path / "bad"
    assert main(["compress", str(tiny_with_tokenizer), "--rank", "2", "--calibration", "wikipedia", "--heal",
                 '{"precision": "fp8"}', "--out", str(bad), "--no-eval", "--quiet"]) == 2
    assert "heal.precision" in capsys.readouterr().err and not bad.exists()


def test_stream_flag_heals_layer_by_layer_and_prints_each_layers_error(tiny_with_tokenizer, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    assert main(["compress", str(tiny_with_tokenizer), "--rank", "2", "--targets", "mlp.*", "--calibration", "wikipedia",
                 "--calibration-samples", "8", "--calibration-length", "32", "--stream", "--heal",
                 '{"mode": "layerwise", "layer_steps": 4, "samples": 8, "length": 32, "batch_size": 2}',
                 "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    shown = json.loads(printed[printed.index("{"):])
    m = AutoModelForCausalLM.from_pretrained(out)
    heal = m.config.quantization_config.stats["heal"]
    assert heal["streamed"] and len(heal["layerwise"]["layers"]) == m.config.num_hidden_layers
    assert all(r["mse_after"] <= r["mse_before"] for r in heal["layerwise"]["layers"])
    assert shown["heal"]["layers"] == [[r["layer"], r["mse_before"], r["mse_after"]] for r in heal["layerwise"]["layers"]]
    assert main(["compress", str(tiny_with_tokenizer), "--rank", "2", "--calibration", "wikipedia", "--stream", "--heal",
                 "{}", "--out", str(tmp_path / "bad"), "--quiet"]) == 2
    assert "heal.mode: got 'e2e'" in capsys.readouterr().err and not (tmp_path / "bad").exists()
