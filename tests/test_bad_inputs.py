"""Bad inputs, faults and unusual sequences: what each one does, at a glance.

``GUARDED`` lists every case the project guards against, with the test that holds it; the first block
was found in the first reliability round, the second in the second, and so on to the fourth (their tests live
below, each written to reproduce the failure before it was fixed). ``test_every_guard_has_its_test`` keeps the table honest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_tensorcomp
from hf_tensorcomp import TensorCompressionConfig
from hf_tensorcomp.cli import main as cli
from tiny import VOCAB

HERE = Path(__file__).parent

# (what was tried, what happens now, "test file::test name")
GUARDED = [
    # first round
    ("a NaN/Inf dense weight", "one line naming the module and the count", "test_checks.py::test_non_finite_dense_weight_refused_naming_module"),
    ("a rank / ratio beyond what the tensor allows", "refused before any weight loads, with the bound", "test_checks.py::test_checks_run_before_weights_load"),
    ("a factor that comes out NaN or worse than zeros", "refused naming the module and what to try", "test_checks.py::test_check_outputs_refuses_nan_factor_and_error_above_one"),
    ("corrupt factor tensors in a checkpoint", "refused from the safetensors headers before loading", "test_checks.py::test_corrupt_factor_tensors_refused"),
    ("edited specs in config.json", "refused at reload, naming the spec", "test_checks.py::test_edited_specs_refused"),
    ("a pickle weights file", "never loaded", "test_checks.py::test_pickle_weights_never_loaded"),
    ("different thread counts", "bitwise identical factors", "test_checks.py::test_factors_bitwise_identical_across_thread_counts"),
    ("GPT-2, BERT, MoE experts", "refused before weights load", "test_checks.py::test_unsupported_models_refused_before_weights_load"),
    ("a save killed mid-way", "the old checkpoint stays whole", "test_atomic_save.py::test_save_killed_mid_way_leaves_the_old_checkpoint"),
    ("two CLI runs into one --out", "one succeeds, the other exits 2", "test_atomic_save.py::test_concurrent_cli_runs_into_one_out"),
    ("a bad config field", "the field, the value and the allowed values", "test_config.py::test_bad_field_names_field_and_allowed_values"),
    ("bad calibration settings", "the field named", "test_calibration.py::test_bad_calibration_settings_name_the_field"),
    ("bad EinSortCache settings", "the field named", "test_einsort_cache.py::test_bad_settings_name_the_field"),
    # second round
    ("save into a folder holding .git or other hidden / unrelated entries", "only the files the save writes are replaced", "test_bad_inputs.py::test_save_keeps_hidden_and_unrelated_entries"),
    ("CLI --overwrite into a folder with unrelated files; --out .", "unrelated files kept; --out . works", "test_bad_inputs.py::test_cli_overwrite_keeps_unrelated_files_and_out_dot_works"),
    ("compress twice with overlapping targets", "refused up front, naming the modules", "test_bad_inputs.py::test_compress_twice_overlapping_refused"),
    ("linearize, then LASER on *_proj", "refused before any work, naming the modules; LASER on the dense ones reloads", "test_bad_inputs.py::test_linearize_then_laser_refused_before_any_work"),
    ("LoRA merge that fails midway (lora_bias on a bias-less layer)", "the model is exactly as before", "test_bad_inputs.py::test_failed_lora_merge_leaves_the_model_as_before"),
    ("calibration with the model in train mode", "runs in eval mode, restores the mode", "test_bad_inputs.py::test_calibration_in_train_mode_is_deterministic"),
    ("Fisher weighting with all-zero gradients", "documented fallback (mean Fisher), reported in stats", "test_bad_inputs.py::test_zero_fisher_falls_back_and_says_so"),
    ("correct=True with propagate=False", "refused at construction", "test_bad_inputs.py::test_correct_without_propagate_refused"),
    ("a second compress on the same model", "stats and card describe the model as it is", "test_bad_inputs.py::test_second_compress_stats_describe_the_model"),
    ("save with an unmerged PEFT LoRA injected", "refused, with the fix in the message; nothing written", "test_bad_inputs.py::test_save_with_unmerged_lora_refused"),
    ("a NaN weight with target=", "the one-line error naming the module", "test_bad_inputs.py::test_nan_weight_with_target_names_the_module"),
    ("calibration producing non-finite activations", "names the decoder layer where values stopped being finite", "test_bad_inputs.py::test_non_finite_activations_name_the_layer"),
    ("calibration ids out of vocabulary; a Dataset with a wrong column or empty rows", "one line naming the argument", "test_bad_inputs.py::test_bad_calibration_data_names_the_argument"),
    ("whiten=1", "refused: a bool or a named mode", "test_bad_inputs.py::test_whiten_must_be_bool_or_mode"),
    ("state reduction with one calibration sample", "one line: how many samples it needs", "test_bad_inputs.py::test_state_reduction_one_sample"),
    ("CLI: malformed recipe, option as a list, missing recipe / model, --out a file", "one line each, exit 2, nothing written", "test_bad_inputs.py::test_cli_bad_invocations"),
    ("EinSortCache default", "holds fewer bytes than DynamicCache past the first segment", "test_einsort_cache.py::test_default_holds_fewer_bytes_than_dynamic_cache"),
    # found since
    ("reload with disk offload of shared factors, quantized codes or EinSort indices", "refused (TensorLLM gave wrong logits silently)", "test_streaming.py::test_offloading_shared_or_quantized_factors_is_refused"),
    ("quantization and healing settings out of range", "the field named", "test_quantized.py::test_bad_quantization_settings_name_the_field"),
    ("healing that does not help", "the model left bit-identical, with a warning", "test_heal.py::test_no_improvement_leaves_the_weights_bit_identical"),
    ("streaming a config that needs the whole model", "refused up front, nothing written", "test_streaming.py::test_what_needs_the_whole_model_is_refused_up_front"),
    # third round
    ("LASER factor_bits=8 (pivoted): decode 7x slower than the float factors, logits 7-14 % off on a tiny model", "codes grouped per channel along the rank, de-quantized once and kept (float factors' speed, their float bytes in memory beside the codes); tiny logits within 1 %", "test_quantized_factors.py::test_quantized_factors_are_dequantized_once_not_at_every_call"),
    ("LASER factor_bits=8, pivoted=False on whitened factors (SmolLM2 perplexity x5.36)", "factors balanced (U[:, i], V[i, :] equal norms), codes grouped per channel: tiny logits within 1 %, SmolLM2 within 0.5 % (slow test); old checkpoints load as before", "test_quantized_factors.py::test_8_bit_factors_stay_within_1_percent_of_the_float_factors"),
    ("streaming a source whose head shard is truncated (API, CLI --stream)", "one line naming the shard and that it is truncated, exit 2, no temporary folder (was: a hang for ever)", "test_bad_inputs.py::test_truncated_shard_streams_to_one_line_not_a_hang"),
    ("a shard with corrupted header bytes / JSON, offsets past its end, a span unlike its shape, a bad index", "one line naming the file, before anything is sized by it; CLI exit 2", "test_bad_inputs.py::test_corrupted_shard_names_the_shard"),
    ("a pivoted LASER checkpoint with repeated or out-of-range pivots", "refused on load naming the buffer (was: silently wrong / IndexError at the first forward)", "test_bad_inputs.py::test_corrupt_pivots_refused_on_load"),
    ("loading a folder while another process rewrites it", "a file changed between the header check and the end of the load: refused, load again", "test_bad_inputs.py::test_folder_rewritten_while_loading_is_refused"),
    ("a qlr checkpoint whose config.json sets quant group_size 2**20 / 10**12 / 8, bits 16 or rank 10**12", "refused on load naming the field, before anything is sized by it (was: ~1.2 GB at the first forward; 10**12: a 384 TB allocation); a group longer than a row never pads it", "test_bad_inputs.py::test_qlr_checkpoint_config_fields_bounded_before_any_allocation"),
    ("qlr bits=4.0, bit_choices=[4.0, 3.0], CLI --option bits=4.0", "refused when the config is built; CLI exit 2", "test_bad_inputs.py::test_qlr_float_bits_refused_when_the_config_is_built"),
    ("qlr rank above every matrix's full rank", "refused before weights load, with the bound; above some: a warning naming them and the bytes", "test_bad_inputs.py::test_qlr_rank_above_every_matrix_refused"),
    ("qlr with an explicit rank (the default 32 too) and target_bytes", "refused", "test_bad_inputs.py::test_qlr_any_explicit_rank_with_target_bytes_refused"),
    ("compress_checkpoint / CLI --out (--stream or not) that is, lies inside or holds the source, with overwrite", "refused up front naming both, nothing touched (was: the dense source's shards deleted)", "test_bad_inputs.py::test_compressing_into_or_around_the_source_is_refused_up_front"),
    ("a writer's output over its input or over a folder / file it did not create (save_pretrained over the dense source, export_qlr, build_hybrid, sweep --out)", "refused before any work unless overwrite; written to a temporary sibling renamed into place", "test_bad_inputs.py::test_writers_never_touch_their_input_nor_what_they_did_not_create"),
    ("EinSortCache(segment=1, residual=8) (any network, sort, error_bits)", "works: lossless at full rank, greedy and beams (was: a reshape error at the first compressed segment)", "test_einsort_cache.py::test_one_token_segments_work"),
    ("CLI --out in a read-only folder or under a file, a shard missing, Ctrl-C mid-run (--stream or not), in a child process", "one line, exit 2 (Ctrl-C: 130, the shell's SIGINT code), nothing left behind (was: a traceback, exit 1)", "test_bad_inputs.py::test_cli_expected_failures_are_one_line_exit_2"),
    ("a recipe with \"out\" and no --out (compress, sweep)", "the recipe's out is used; --out wins when given too (was: argparse's 'required: --out')", "test_bad_inputs.py::test_recipe_out_is_honoured_and_the_flag_wins"),
    ("SIGINT / any exception during heal (qlr train='all', LASER pivoted, layer-wise), in a child process", "the model exactly as it came, bit for bit (was: partly trained, saved as if never healed)", "test_heal.py::test_an_interrupted_heal_leaves_the_model_exactly_as_it_came"),
    ("heal on an uncompressed model with teacher=None", "refused: it would be its own teacher; the model untouched (was: improved=True for KL 0.0 -> -0.0, norms changed)", "test_heal.py::test_healing_an_uncompressed_model_without_a_teacher_is_refused"),
    ("heal whose held-out loss falls by float rounding only", "improved=False, the model bit-identical", "test_heal.py::test_an_improvement_within_numerical_noise_is_not_one"),
    ("heal with calibration windows of 1 token", "one line: windows need at least 2 tokens (was: ZeroDivisionError)", "test_heal.py::test_one_token_windows_are_refused_in_one_line"),
    ("heal with calibration ids >= the vocabulary", "compression's one-line message, before any work (was: IndexError)", "test_heal.py::test_calibration_ids_outside_the_vocabulary_get_compressions_message"),
    ("heal with a teacher of another vocabulary (folder or model); layer-wise, of other decoder layers", "refused from its config before any work (was: a shape error in the KL after loading and scoring)", "test_heal.py::test_a_teacher_of_another_vocabulary_or_shape_is_refused_before_any_work"),
    ("heal(teacher='/no/such/dir')", "'heal: teacher: /no/such/dir: no such folder' (was: a repo id syntax error)", "test_heal.py::test_a_teacher_folder_that_does_not_exist_is_named"),
    # several processes (torchrun / accelerate launch)
    ("a world size larger than the calibration batches, or than a healing step's windows", "one line on every rank before any work, with what to change (a world size that does not divide the batches is fine)", "test_distributed.py::test_too_few_batches_a_rank_that_dies_and_nothing_half_written"),
    ("a rank that dies mid-way through a streamed compression", "the others stop with DistributedError naming the step; no output folder, no temporary one", "test_distributed.py::test_too_few_batches_a_rank_that_dies_and_nothing_half_written"),
    ("ranks running different hf_tensorcomp versions (compress_checkpoint, heal)", "one line on every rank naming each rank's version, before any work; nothing written", "test_distributed.py::test_mismatched_library_versions_refused_on_every_rank_before_any_work"),
    ("latent_kv settings out of range (kv_bytes, bits, key_bits, grid, group, window, rank, head_groups; rank with kv_bytes)", "the field named, when the config is built", "test_latent_kv.py::test_bad_settings_name_the_field"),
    ("latent_kv rank above a group's rows, head_groups not dividing the KV heads, k_proj without v_proj, kv_bytes below rank 1", "refused before weights load, naming the field and the bound", "test_latent_kv.py::test_bad_settings_for_the_model_refused_before_weights_load"),
    # fourth round
    ("assisted decoding, prompt lookup or crop on a latent_kv model (also as the assistant)", "the newest tokens' latents removed, exact at 16 bits; a crop reaching codes, or a positive one, one line (was: AttributeError: 'LatentKVLayer' has no 'crop')", "test_bad_inputs.py::test_assisted_decoding_crops_the_latent_cache_exactly"),
    ("a latent_kv checkpoint with 500 bytes cut off model.safetensors", "one line naming the file and that it is truncated (was: a raw SafetensorError naming no file)", "test_bad_inputs.py::test_a_truncated_compressed_checkpoint_names_the_file"),
    ("CLI compress (no --stream) of a sharded source with a truncated shard", "one line naming the shard, exit 2 (was: a 23-line traceback, exit 1)", "test_bad_inputs.py::test_cli_compress_of_a_truncated_shard_is_one_line"),
    ("a qlr checkpoint whose config sets quant.weight.bits to 4.0 (group_size to 64.0)", "refused naming quant.weight.bits and the allowed widths (was: a TypeError at load)", "test_bad_inputs.py::test_qlr_checkpoint_float_bits_refused_naming_the_field"),
    ("a module's entry deleted from compressed_modules (latent k_proj, v_proj, a qlr module)", "its tensors refused in one line before loading (was: loaded silently as another model, or transformers' size-mismatch table)", "test_bad_inputs.py::test_a_module_deleted_from_compressed_modules_is_refused"),
    ("save_pretrained, compress_checkpoint or CLI --out to a link (to an empty folder or to nothing), in a child process", "the link resolved first, the output written atomically where it points, the link kept (was: NotADirectoryError after all the work)", "test_bad_inputs.py::test_an_output_path_that_is_a_link_is_written_where_it_points"),
    ("torchrun --nproc-per-node 2 with HF_TENSORCOMP_DISTRIBUTED=0 on one rank only, in a child process", "the join bounded (HF_TENSORCOMP_JOIN_TIMEOUT): one line naming the rank that never came, exit 2 (was: a wait for ever)", "test_bad_inputs.py::test_a_rank_launched_without_distribution_does_not_hang_the_others"),
    ("generate / forward with a LatentKVCache built for another model (Gemma-3's for a Llama, the reverse, other ranks)", "refused in one line naming the first layer that differs (was: silently other outputs, or IndexError)", "test_bad_inputs.py::test_a_cache_built_for_another_model_is_refused"),
    ("latent_kv on some of Gemma-3's sliding layers (layers=[0])", "refused when the config meets the model, before any weight (was: saved, then generate failed)", "test_bad_inputs.py::test_latent_kv_on_some_sliding_layers_refused_before_any_weight"),
    ("CLI --stream --out on a full disk", "the message names the output being written, under its final name (was: the source file)", "test_bad_inputs.py::test_a_full_disk_names_the_output_being_written"),
    ("generate(cache_implementation='static' | 'offloaded' | 'quantized' ...) on a latent_kv model", "refused in one line: it would drop the KV compression (was: a dense cache, silently)", "test_bad_inputs.py::test_a_dense_cache_implementation_on_a_latent_model_is_refused"),
    ("torch.compile(m.forward) on a latent_kv model with 4-bit codes, in a child process", "the latent attention runs eagerly (a graph break a layer): the eager logits, in bounded time (was: not done in 120 s on 10 tokens)", "test_bad_inputs.py::test_torch_compile_of_a_latent_model_with_codes_runs_in_bounded_time"),
    # found beside the fourth round
    ("ranks whose configs or healing settings differ", "the field that differs named, with each rank's value (was: two fingerprints)", "test_bad_inputs.py::test_ranks_with_different_settings_are_told_the_field"),
    ("LatentKVCache(model, bits=1)", "'LatentKVCache.bits: got 1; allowed: ...' (was: prefixed TensorCompressionConfig.)", "test_bad_inputs.py::test_a_cache_built_for_another_model_is_refused"),
]


def test_every_guard_has_its_test():
    for _, _, ref in GUARDED:
        file, name = ref.split("::")
        assert f"def {name}(" in (HERE / file).read_text(), ref


def laser(**kw):
    return TensorCompressionConfig(method="laser", progress=False, **{"rank": 4, "targets": ["mlp.*"], **kw})


def calib(n=4, length=16, seed=2):
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def dense(tiny_dirs, arch="llama", **kw):
    return AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], **kw).eval()


# ---------------------------------------------------------------- writing outputs
def test_save_keeps_hidden_and_unrelated_entries(tiny_dirs, tmp_path, ids):
    out = tmp_path / "repo"
    (out / ".git" / "objects").mkdir(parents=True)
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (out / ".env").write_text("SECRET=1\n")
    (out / "notes").mkdir()
    (out / "notes" / "a.txt").write_text("mine")
    git_inode = (out / ".git").stat().st_ino
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=laser())
    model.save_pretrained(out)
    assert (out / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n"
    assert (out / ".git").stat().st_ino == git_inode  # not copied, not moved: untouched
    assert (out / ".env").read_text() == "SECRET=1\n" and (out / "notes" / "a.txt").read_text() == "mine"
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(out)(ids).logits, model(ids).logits)
    model.save_pretrained(out)  # again: the same
    assert (out / ".git").stat().st_ino == git_inode and (out / ".env").exists()
    assert not [p for p in tmp_path.iterdir() if p.name != "repo"]  # no temporary folder left


def test_cli_overwrite_keeps_unrelated_files_and_out_dot_works(tiny_with_tokenizer, tmp_path, monkeypatch):
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    (out / "data" / "table.csv").write_text("a,b\n")
    (out / "keep.txt").write_text("keep")
    argv = ["compress", str(tiny_with_tokenizer), "--rank", "4", "--targets", "mlp.*", "--no-eval", "--quiet"]
    assert cli(argv + ["--out", str(out), "--overwrite"]) == 0
    assert (out / "keep.txt").read_text() == "keep" and (out / "data" / "table.csv").read_text() == "a,b\n"
    AutoModelForCausalLM.from_pretrained(out)
    here = tmp_path / "here"
    here.mkdir()
    (here / "mine.txt").write_text("x")
    monkeypatch.chdir(here)
    assert cli(argv + ["--out", ".", "--overwrite"]) == 0
    assert (here / "mine.txt").read_text() == "x" and (here / "config.json").exists()
    AutoModelForCausalLM.from_pretrained(here)


def test_save_with_unmerged_lora_refused(tiny_dirs, tmp_path):
    from peft import get_peft_model

    from hf_tensorcomp.integration.peft import lora_config

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=laser())
    peft_model = get_peft_model(model, lora_config(r=2, target_modules=["up_proj"]))
    with pytest.raises(ValueError, match=r"unmerged LoRA.*merge_and_unload\(\).*peft_model\.save_pretrained"):
        peft_model.base_model.model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    peft_model.save_pretrained(tmp_path / "adapter")  # the PEFT way still works
    assert (tmp_path / "adapter" / "adapter_config.json").exists()


# ---------------------------------------------------------------- sequences of calls
def test_compress_twice_overlapping_refused(tiny_dirs, ids):
    model = hf_tensorcomp.compress(dense(tiny_dirs), laser())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"already compressed by hf_tensorcomp.*model\.layers\.0\.mlp\.up_proj"):
        hf_tensorcomp.compress(model, laser(rank=2, targets=["mlp.up_proj"]))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_second_compress_stats_describe_the_model(tiny_dirs, tmp_path):
    model = hf_tensorcomp.compress(dense(tiny_dirs), laser())
    hf_tensorcomp.compress(model, laser(targets=["self_attn.q_proj"]))
    st = model.config.quantization_config.stats
    assert st["params_after"] == sum(p.numel() for p in model.parameters())
    assert st["params_before"] == sum(p.numel() for p in dense(tiny_dirs).parameters())
    assert "model.layers.0.mlp.up_proj" in st["modules"] and "model.layers.0.self_attn.q_proj" in st["modules"]
    model.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text() if (tmp_path / "README.md").exists() else None
    hf_tensorcomp.write_model_card(model, tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert f"{st['params_after']:,}" in card


def test_linearize_then_laser_refused_before_any_work(tiny_dirs, tmp_path, ids):
    lin = TensorCompressionConfig(method="linearize", layers=[1], calibration=calib(8, 24, 3), epochs=2, progress=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=lin).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"already compressed by hf_tensorcomp.*model\.layers\.1\.self_attn\.gdn"):
        hf_tensorcomp.compress(model, laser(targets=["*_proj"]))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    hf_tensorcomp.compress(model, laser(targets=["mlp.*"]))  # the dense modules beside it: compressed, saved, reloaded
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.allclose(again(ids).logits, ref, rtol=0, atol=1e-5)


def test_failed_lora_merge_leaves_the_model_as_before(tiny_dirs, ids):
    from peft import get_peft_model

    from hf_tensorcomp.integration.peft import lora_config

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=laser(targets=["self_attn.o_proj"]))
    peft_model = get_peft_model(model, lora_config(r=2, target_modules=["o_proj"], lora_bias=True))
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p)
    with torch.no_grad():
        ref = peft_model(ids).logits
    ranks = [m.rank for m in model.modules() if type(m).__name__ == "LowRankLinear"]
    with pytest.raises(RuntimeError, match="bias"):
        peft_model.merge_adapter()
    assert [m.rank for m in model.modules() if type(m).__name__ == "LowRankLinear"] == ranks
    with torch.no_grad():
        assert torch.equal(peft_model(ids).logits, ref)


# ---------------------------------------------------------------- calibration
def test_calibration_in_train_mode_is_deterministic(tiny_dirs):
    def run():
        model = dense(tiny_dirs, attention_dropout=0.5).train()
        hf_tensorcomp.compress(model, laser(whiten=True, calibration=calib()))
        assert model.training  # the mode is restored
        return model.model.layers[1].mlp.up_proj.weight.clone()

    torch.manual_seed(0)
    a = run()
    torch.manual_seed(1)
    assert torch.equal(a, run())


def test_zero_fisher_falls_back_and_says_so(tiny_dirs):
    model = dense(tiny_dirs)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()  # v_proj of layer 0 no longer reaches the loss
    cfg = TensorCompressionConfig(method="laser", target=0.8, whiten=True, weighting="fisher", calibration=calib(),
                                  targets=["self_attn.v_proj", "mlp.up_proj"], progress=False)
    with pytest.warns(UserWarning, match=r"Fisher.*model\.layers\.0\.self_attn\.v_proj"):
        hf_tensorcomp.compress(model, cfg)
    st = model.config.quantization_config.stats
    assert st["calibration"]["fisher_fallback"] == ["model.layers.0.self_attn.v_proj"]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_correct_without_propagate_refused():
    with pytest.raises(ValueError, match=r"correct.*propagate"):
        TensorCompressionConfig(method="laser", rank=4, whiten=True, correct=True, propagate=False, calibration="wikipedia")


def test_nan_weight_with_target_names_the_module(tiny_dirs):
    model = dense(tiny_dirs)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight: the dense weight holds 1 NaN/Inf"):
        hf_tensorcomp.compress(model, laser(rank=None, target=0.8, whiten=True, calibration=calib()))


def test_non_finite_activations_name_the_layer(tiny_dirs):
    model = dense(tiny_dirs)
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight.fill_(1e38)  # not a target: finite, but overflows
    with pytest.raises(ValueError, match=r"decoder layer 1 \(model\.layers\.1\).*not finite"):
        hf_tensorcomp.compress(model, laser(whiten=True, calibration=calib()))


@pytest.mark.parametrize("on_disk", [False, True])
def test_non_finite_embeddings_are_named(tiny_dirs, tmp_path, on_disk):
    """Checked batch by batch as the first layer's inputs are captured (with ``states_dir``, before they are written)."""
    from hf_tensorcomp.calibration.pipeline import LayerwiseRunner
    from hf_tensorcomp.plan import find_decoder_layers

    model = dense(tiny_dirs)
    ids = calib()
    with torch.no_grad():
        model.get_input_embeddings().weight[int(ids.reshape(-1)[-1])] = float("inf")  # a token of the last batch
    with pytest.raises(ValueError, match=r"embeddings of the calibration tokens are not finite"):
        LayerwiseRunner(model, *find_decoder_layers(model), ids, batch_size=2, states_dir=tmp_path if on_disk else None)


def test_bad_calibration_data_names_the_argument(tiny_dirs, tiny_with_tokenizer):
    from datasets import Dataset

    with pytest.raises(ValueError, match=r"calibration: token id 500.*vocabulary of 101"):
        hf_tensorcomp.compress(dense(tiny_dirs), laser(whiten=True, calibration=[[1, 2, 500]]))
    with pytest.raises(ValueError, match=r"calibration: .*'text' column"):
        laser(whiten=True, calibration=Dataset.from_dict({"content": ["w1 w2"]}))
    rows = Dataset.from_dict({"text": [None, "", "w1 w2 w3"]})
    model = AutoModelForCausalLM.from_pretrained(tiny_with_tokenizer)
    with pytest.raises(ValueError, match=r"calibration: row 0 of the Dataset's 'text' column is NoneType"):
        hf_tensorcomp.compress(model, laser(whiten=True, calibration=rows))


@pytest.mark.parametrize("method, kw", [("laser", {"rank": 4}), ("trawl", {"rank": 4}), ("tensorllm", {"ratio": 2.0})])
@pytest.mark.parametrize("value", [1, 0, "yes"])
def test_whiten_must_be_bool_or_mode(method, kw, value):
    with pytest.raises(ValueError, match=r"whiten: got"):
        TensorCompressionConfig(method=method, whiten=value, calibration="wikipedia", **kw)


def test_state_reduction_one_sample():
    """One DRRQR sample (the ``samples`` option: tokens sampled per head) gives 2 rows of [Q; K], fewer
    than the 4 channels to keep: a raw RuntimeError from the triangular solve before."""
    from test_state_reduction import tiny

    cfg = TensorCompressionConfig(method="state_reduction", keep=0.5, samples=1, calibration=calib(2, 24), progress=False)
    with pytest.raises(ValueError, match=r"samples: got 1; allowed: at least 2"):
        hf_tensorcomp.compress(tiny("qwen3_5"), cfg)
    cfg = TensorCompressionConfig(method="state_reduction", keep=0.5, calibration=calib(1, 1), progress=False)
    with pytest.raises(ValueError, match=r"calibration: got '2 tokens'; allowed: at least 2|calibration"):
        hf_tensorcomp.compress(tiny("qwen3_5"), cfg)


# ---------------------------------------------------------------- the CLI
@pytest.mark.parametrize("case", ["malformed", "option_list", "missing_recipe", "missing_model", "out_is_file",
                                  "states_dir_without_stream"])
def test_cli_bad_invocations(case, tiny_with_tokenizer, tmp_path, capsys):
    recipe = tmp_path / "r.json"
    out = tmp_path / "out"
    argv = ["compress", str(tiny_with_tokenizer), "--rank", "4", "--no-eval", "--quiet", "--out", str(out)]
    if case == "malformed":
        recipe.write_text('{"rank": 4,')
        argv += ["--recipe", str(recipe)]
    elif case == "option_list":
        recipe.write_text(json.dumps({"option": ["whiten", True]}))
        argv += ["--recipe", str(recipe)]
    elif case == "missing_recipe":
        argv += ["--recipe", str(tmp_path / "nope.json")]
    elif case == "missing_model":
        argv[1] = str(tmp_path / "no-such-model")
    elif case == "states_dir_without_stream":
        argv += ["--states-dir", str(tmp_path)]
    else:
        out.write_text("a file")
    before = sorted(os.listdir(tmp_path))
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-tensorcomp: error:") and "\n" not in err and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == before
    if case == "out_is_file":
        assert out.read_text() == "a file"


# ---------------------------------------------------------------- third round: damaged shards, bad pivots, qlr options
def _untied_sharded(tiny_with_tokenizer, folder):
    """The tiny Qwen3 (untied head) in many small shards, with a tokenizer: what the issue's row 2 streams."""
    from tiny import _tiny

    torch.manual_seed(0)
    _tiny("qwen3").save_pretrained(folder, max_shard_size="20KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(tiny_with_tokenizer) / name).exists():
            (folder / name).write_bytes((Path(tiny_with_tokenizer) / name).read_bytes())
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    return folder / weight_map["lm_head.weight"]


def test_truncated_shard_streams_to_one_line_not_a_hang(tiny_with_tokenizer, tmp_path):
    """Row 2: 100 bytes cut off the shard holding the head; the reader's copy loop spun for ever on empty reads."""
    import subprocess
    import sys

    src = tmp_path / "src"
    shard = _untied_sharded(tiny_with_tokenizer, src)
    shard.write_bytes(shard.read_bytes()[:-100])
    work = tmp_path / "work"
    work.mkdir()
    code = ("import sys; from hf_tensorcomp.cli import main; sys.exit(main(sys.argv[1:]))")
    for argv in (["compress", str(src), "--stream", "--rank", "4", "--targets", "mlp.*", "--quiet", "--out",
                  str(work / "out")],):
        try:
            run = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=240,
                                 cwd=work)
        except subprocess.TimeoutExpired:
            pytest.fail("streaming a truncated shard did not return within 240 s")
        err = run.stderr.strip().splitlines()
        assert run.returncode == 2, run.stderr[-2000:]
        assert err[-1].startswith("hf-tensorcomp: error:") and shard.name in err[-1] and "truncated" in err[-1], err[-1]
        assert "Traceback" not in run.stderr
        assert os.listdir(work) == []  # no output, no temporary folder
    with pytest.raises(ValueError, match=rf"{shard.name}.*truncated"):
        hf_tensorcomp.compress_checkpoint(src, work / "api", laser())
    assert os.listdir(work) == []


@pytest.mark.parametrize("damage", ["header_length", "header_json", "header_not_object", "offsets_past_end",
                                    "span_not_shape", "unknown_dtype", "tiny_file", "index_json", "index_escape",
                                    "config_vocab"])
def test_corrupted_shard_names_the_shard(tiny_with_tokenizer, tmp_path, capsys, damage):
    """Row 3 (and item 4 for the streaming reader): a damaged header is refused in one line naming the file, before
    anything is sized by it; the CLI exits 2 and leaves nothing behind."""
    src = tmp_path / "src"
    shard = _untied_sharded(tiny_with_tokenizer, src)
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    head = json.loads(data[8:8 + n])
    bad = shard
    if damage == "header_length":
        shard.write_bytes(b"\xff" * 8 + data[8:])
    elif damage == "header_json":
        shard.write_bytes(data[:8] + b"{garbage" + data[16:])
    elif damage == "tiny_file":
        shard.write_bytes(data[:5])
    elif damage == "index_json":
        bad = src / "model.safetensors.index.json"
        bad.write_text('{"weight_map": ')
    elif damage == "config_vocab":  # the config's table smaller than the stored one
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, "vocab_size": 90}))
        bad = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]["model.embed_tokens.weight"]
    elif damage == "index_escape":
        bad = src / "model.safetensors.index.json"
        index = json.loads(bad.read_text())
        index["weight_map"]["lm_head.weight"] = "../../etc/passwd"
        bad.write_text(json.dumps(index))
    else:
        t = head["lm_head.weight"]
        if damage == "header_not_object":
            head = [1, 2]
        elif damage == "offsets_past_end":
            t["data_offsets"] = [t["data_offsets"][0], 10**15]
            t["shape"] = [10**15 // 4 // 48 + 1, 48]  # what the span would need: a 2e14-element allocation
        elif damage == "span_not_shape":
            t["shape"] = [t["shape"][0] * 1000, t["shape"][1]]
        else:
            t["dtype"] = "F8_E4M3"
        text = json.dumps(head).encode()
        text += b" " * (-len(text) % 8)
        shard.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    with pytest.raises(ValueError, match=rf"compress_checkpoint: .*{bad.name}"):
        hf_tensorcomp.compress_checkpoint(src, tmp_path / "out", laser())
    assert sorted(os.listdir(tmp_path)) == ["src"]
    argv = ["compress", str(src), "--stream", "--rank", "4", "--targets", "mlp.*", "--quiet", "--out", str(tmp_path / "o")]
    capsys.readouterr()
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-tensorcomp: error:") and "\n" not in err and bad.name in err, err
    assert sorted(os.listdir(tmp_path)) == ["src"]


def _pivoted(tiny_dirs, tmp_path):
    from safetensors.torch import load_file

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=laser(pivoted=True))
    model.save_pretrained(tmp_path)
    return model, load_file(tmp_path / "model.safetensors")


@pytest.mark.parametrize("damage", ["repeated", "out_of_range", "negative"])
def test_corrupt_pivots_refused_on_load(tiny_dirs, tmp_path, damage):
    """Row 5: a repeated pivot loaded and ran silently wrong; one out of range loaded, then IndexError at the first
    forward."""
    from safetensors.torch import save_file

    _, tensors = _pivoted(tiny_dirs, tmp_path)
    key = "model.layers.1.mlp.up_proj.pivots"
    p = tensors[key].clone()
    if damage == "repeated":
        p[1] = p[0]
    else:
        p[0] = 10_000 if damage == "out_of_range" else -1
    save_file({**tensors, key: p}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.pivots: .*checkpoint is corrupt"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_folder_rewritten_while_loading_is_refused(tiny_dirs, tmp_path, monkeypatch, ids):
    """Row 6: the headers checked and the tensors loaded came from different saves when another process rewrote the
    folder in between (a load that succeeded, then crashed or ran wrong). Here the rewrite lands right after the
    header check: another model of the same shapes (another dense model's factors)."""
    from hf_tensorcomp import checks
    from tiny import _tiny

    model, _ = _pivoted(tiny_dirs, tmp_path)
    torch.manual_seed(5)
    other_dense = tmp_path.parent / f"{tmp_path.name}-other"
    _tiny("llama").save_pretrained(other_dense)
    other = AutoModelForCausalLM.from_pretrained(other_dense, quantization_config=laser(pivoted=True))
    check = checks.check_checkpoint_tensors

    def rewritten(*args, **kw):
        check(*args, **kw)
        other.save_pretrained(tmp_path)  # the other process's save lands now

    monkeypatch.setattr(checks, "check_checkpoint_tensors", rewritten)
    with pytest.raises(ValueError, match=r"model\.safetensors: changed while the checkpoint loaded"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    monkeypatch.setattr(checks, "check_checkpoint_tensors", check)
    with torch.no_grad():  # once the writer is done, the load gives the model written
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path).eval()(ids).logits, other.eval()(ids).logits)


@pytest.mark.parametrize("kw, field", [(dict(rank=4, bits=4.0), "bits"),
                                       (dict(target_bytes=0.4, bit_choices=[4.0, 3.0]), "bit_choices"),
                                       (dict(rank=4, bits=4.5), "bits"), (dict(rank=4, factor_bits=8.0), "factor_bits"),
                                       (dict(rank=4, embedding_bits=8.0), "embedding_bits")])
def test_qlr_float_bits_refused_when_the_config_is_built(kw, field, tiny_with_tokenizer, tmp_path, capsys):
    """Row 13: bits=4.0 (== 4) was accepted, calibration ran, then a raw TypeError in the quantizer; factor_bits=8.0 and
    embedding_bits=8.0 the same (found beside it)."""
    with pytest.raises(ValueError, match=rf"{field}: got"):
        TensorCompressionConfig(method="qlr", calibration="wikipedia", **kw)
    if field == "bits":
        argv = ["compress", str(tiny_with_tokenizer), "--method", "qlr", "--rank", "4", "--option", f"bits={kw['bits']}",
                "--no-eval", "--quiet", "--out", str(tmp_path / "out")]
        assert cli(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hf-tensorcomp: error:") and "bits: got" in err and "\n" not in err, err
        assert not (tmp_path / "out").exists()


def test_qlr_rank_above_every_matrix_refused(tiny_dirs):
    """Row 14: rank=1000 was cut silently to each matrix's full rank (more bytes than the dense model); refused as
    LASER refuses it, before any weight loads. A rank above some matrices' full rank only: cut there, with a warning
    naming them and the bytes."""
    cfg = TensorCompressionConfig(method="qlr", rank=1000, calibration=calib(), progress=False, group_size=16)
    with pytest.raises(ValueError, match=r"rank: got 1000 but the largest full rank .* is 48 .*allowed: an int in "
                                         r"\[0, 48\]"):
        AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg)
    cfg = TensorCompressionConfig(method="qlr", rank=32, calibration=calib(), progress=False, group_size=16,
                                  targets=["self_attn.*_proj"], layers=[0])
    with pytest.warns(UserWarning, match=r"qlr rank=32 is above the full rank of self_attn\.k_proj, self_attn\.v_proj "
                                         r"\(16, 16\): cut to it there; .* bytes"):
        AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=cfg)


@pytest.mark.parametrize("rank", [32, 8, 0])
def test_qlr_any_explicit_rank_with_target_bytes_refused(rank):
    """Row 15: rank=32 with target_bytes was ignored silently because 32 is the default (rank=8 was refused)."""
    with pytest.raises(ValueError, match=rf"rank: got {rank}; allowed: None with target_bytes="):
        TensorCompressionConfig(method="qlr", rank=rank, target_bytes=0.4, calibration="wikipedia")
    assert TensorCompressionConfig(method="qlr", target_bytes=0.4, calibration="wikipedia").rank is None


# ---------------------------------------------------------------- third round: no writer touches its own input
def _tree(folder):
    """Every path under `folder` with its bytes (files) or None (folders): what "nothing touched" compares."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(Path(folder).rglob("*"))}


@pytest.mark.parametrize("where", ["same", "inside", "holds"])
def test_compressing_into_or_around_the_source_is_refused_up_front(tiny_with_tokenizer, tmp_path, capsys, where):
    """Row 1: ``compress_checkpoint(S, S, ..., overwrite=True)`` deleted the dense source's shards and put the
    compressed ones in their place. An out that is the source, lies inside it or holds it is refused before any
    work, by the API, the CLI's --stream and the CLI's in-memory path; nothing is touched."""
    import shutil

    src = tmp_path / "parent" / "dense"
    shutil.copytree(tiny_with_tokenizer, src)
    out = {"same": src, "inside": src / "compressed", "holds": src.parent}[where]
    before = _tree(tmp_path)
    cfg = TensorCompressionConfig(method="qlr", rank=4, calibration=calib(), progress=False, group_size=16)
    said = {"same": "is", "inside": "lies inside", "holds": "holds"}[where]
    with pytest.raises(ValueError, match=rf"^compress_checkpoint: out: .* {said} the input .*; allowed: a folder apart "
                                         r"from it \(nothing was touched\)"):
        hf_tensorcomp.compress_checkpoint(src, out, cfg, overwrite=True)
    for stream in (["--stream"], []):
        argv = ["compress", str(src), "--method", "qlr", "--rank", "4", "--option", "group_size=16", "--calibration",
                "wikipedia", "--no-eval", "--quiet", "--out", str(out), "--overwrite", *stream]
        assert cli(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"hf-tensorcomp: error: --out: {out} {said} the input") and "\n" not in err, err
    assert _tree(tmp_path) == before


def test_writers_never_touch_their_input_nor_what_they_did_not_create(tiny_with_tokenizer, tmp_path, capsys):
    """Must-be-true 3: every writer of the library refuses, before any work, an output that is, lies inside or
    holds its input, and a non-empty output it did not create unless told to overwrite; what it writes goes to a
    temporary sibling renamed into place (no temporary file left)."""
    import shutil

    from hf_tensorcomp.hybrid import build_hybrid
    from hf_tensorcomp.integration.peft import export_qlr

    src = tmp_path / "dense"
    shutil.copytree(tiny_with_tokenizer, src)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    table = tmp_path / "table.json"
    table.write_text("{}")
    before = _tree(tmp_path)
    # a compressed model saved over the dense checkpoint it was made from (heal's default teacher)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=TensorCompressionConfig(
        method="qlr", rank=4, group_size=16, calibration=calib(), progress=False))
    with pytest.raises(ValueError, match=r"^save_pretrained: .* is the dense checkpoint this model was compressed from"):
        model.save_pretrained(src)
    # export_qlr: into a folder it did not create, the two outputs one folder, an output inside its input
    with pytest.raises(ValueError, match=r"^export_qlr: base_dir: .*mine exists and is not empty; allowed: .*overwrite=True"):
        export_qlr(model, mine, tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"^export_qlr: adapter_dir: .*out is the input"):
        export_qlr(model, tmp_path / "out", tmp_path / "out")
    # linearize into its own model folder; into a folder it did not create
    with pytest.raises(ValueError, match=r"^build_hybrid: out: .*dense is the input"):
        build_hybrid(str(src), src, overwrite=True)
    with pytest.raises(ValueError, match=r"^build_hybrid: out: .*mine exists and is not empty"):
        build_hybrid(str(src), mine)
    # the CLI's sweep table: an existing file is replaced only with --overwrite, checked before the sweep runs
    argv = ["sweep", str(src), "--layers", "0", "--ranks", "4", "--out", str(table)]
    capsys.readouterr()
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hf-tensorcomp: error: --out: {table} exists; allowed: a new file") and "\n" not in err, err
    assert _tree(tmp_path) == before
    # a writer's temporary sibling never stays: the model card, replaced in place
    hf_tensorcomp.write_model_card(model, mine)
    hf_tensorcomp.write_model_card(model, mine)
    assert sorted(p.name for p in mine.iterdir()) == ["README.md", "keep.txt"]


# ---------------------------------------------------------------- third round: what a checkpoint's config sizes
@pytest.mark.parametrize("field,value", [("group_size", 2**20), ("group_size", 10**12), ("group_size", 8),
                                         ("bits", 16), ("rank", 10**12)])
def test_qlr_checkpoint_config_fields_bounded_before_any_allocation(tiny_dirs, tmp_path, field, value):
    """Row 4: a qlr checkpoint whose config.json set a module's ``quant.weight.group_size`` to 2**20 passed every
    check (any group at least a row long gives one scale per row: the stored shapes still matched) and the first
    forward padded each row to 2**20 values (~1.2 GB for a 96 x 64 matrix; 10**12: a 384 TB allocation error).
    Every field is now bounded and checked against the stored tensors before anything is sized by it."""
    from hf_tensorcomp.decompositions.quantize import _groups

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(
        method="qlr", rank=4, group_size=64, calibration=calib(), progress=False, targets=["mlp.*"]))
    model.save_pretrained(tmp_path)  # up_proj: 96 x 48, one group per row
    cfg_file = tmp_path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    spec = cfg["quantization_config"]["compressed_modules"]["model.layers.0.mlp.up_proj"]
    if field == "rank":
        spec["rank"] = value
    else:
        spec["quant"]["weight"][field] = value
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"compressed_modules\['model\.layers\.0\.mlp\.up_proj'\]\.(quant|rank)"
                                         rf"|model\.layers\.0\.mlp\.up_proj\.lora_A: the checkpoint holds shape"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    # and the quantizer never pads a row beyond its own length: a group longer than a row is the row
    assert _groups(torch.ones(96, 48), 10**12).shape == (96, 48)


# ---------------------------------------------------------------- third round: the CLI's expected failures, recipes
_CHILD = "import sys; from hf_tensorcomp.cli import main; sys.exit(main(sys.argv[1:]))"
# the same CLI, interrupted (a real SIGINT to itself) once the first unit's factors are checked: a run mid-way
# (SIGINT's default handler set first: a job started in the background of a non-interactive shell, as CI may start the
# tests, inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it)
_INTERRUPTED = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                "from hf_tensorcomp import checks; real = checks.check_outputs\n"
                "def hit(*a, **k):\n    os.kill(os.getpid(), signal.SIGINT); return real(*a, **k)\n"
                "checks.check_outputs = hit\n" + _CHILD)


def _run_cli(code, argv, cwd):
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=env)


def test_cli_expected_failures_are_one_line_exit_2(tiny_with_tokenizer, tmp_path):
    """Row 17: --out in a read-only folder, --out under a file with --stream, a shard missing without --stream,
    a run interrupted with Ctrl-C: raw tracebacks, exit 1 (the CLI caught only ValueError). Now one line each;
    exit 2 for every expected failure, 130 (the shell's code for SIGINT) for an interrupt; nothing left behind.
    Run in a child process, as a user runs it."""
    import shutil

    src = tmp_path / "src"
    shard = _untied_sharded(tiny_with_tokenizer, src)
    (tmp_path / "afile").write_text("x")
    args = ["--rank", "4", "--targets", "mlp.*", "--quiet", "--no-eval"]
    cases = [(["compress", src, "--stream", "--rank", "4", "--targets", "mlp.*", "--quiet", "--out",
               tmp_path / "afile" / "out"], _CHILD, 2, r"afile"),
             (["compress", src, *args, "--out", tmp_path / "out"], _INTERRUPTED, 130, r"^hf-tensorcomp: interrupted"),
             (["compress", src, "--stream", "--rank", "4", "--targets", "mlp.*", "--quiet", "--out", tmp_path / "out"],
              _INTERRUPTED, 130, r"^hf-tensorcomp: interrupted")]
    if os.geteuid() != 0:  # root writes into a read-only folder anyway
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        cases.append((["compress", src, *args, "--out", ro / "out"], _CHILD, 2, r"ro"))
    missing = tmp_path / "missing"
    shutil.copytree(src, missing)
    (missing / shard.name).unlink()
    cases.append((["compress", missing, *args, "--out", tmp_path / "out"], _CHILD, 2, shard.name))
    before = _tree(tmp_path)
    for argv, code, rc, says in cases:
        r = _run_cli(code, argv, tmp_path)
        err = r.stderr.strip().splitlines()
        err = [line for line in err if "it/s]" not in line and line.strip()]  # progress bars of the loader
        assert r.returncode == rc and len(err) == 1 and "Traceback" not in r.stderr, (argv, r.returncode, r.stderr[-2000:])
        assert err[0].startswith("hf-tensorcomp: ") and __import__("re").search(says, err[0]), err
        assert _tree(tmp_path) == before, argv  # no --out, no temporary sibling


def test_recipe_out_is_honoured_and_the_flag_wins(tiny_with_tokenizer, tmp_path):
    """Row 18: a recipe with "out" and no --out: argparse printed its usage and "required: --out" though "out" is
    among the recipe's keys. The recipe's "out" is used; --out, when given too, wins."""
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"description": "x", "rank": 4, "targets": ["mlp.*"], "no_eval": True, "quiet": True,
                                  "out": str(tmp_path / "from_recipe")}))
    assert cli(["compress", str(tiny_with_tokenizer), "--recipe", str(recipe)]) == 0
    assert (tmp_path / "from_recipe" / "config.json").exists()
    assert cli(["compress", str(tiny_with_tokenizer), "--recipe", str(recipe), "--out", str(tmp_path / "flag")]) == 0
    assert (tmp_path / "flag" / "config.json").exists() and len(list((tmp_path / "from_recipe").iterdir())) > 0
    sweep = tmp_path / "sweep.json"  # sweep's "out" too
    sweep.write_text(json.dumps({"layers": [0], "ranks": [4], "out": str(tmp_path / "table.json"),
                                 "max_eval_tokens": 64, "context_length": 32, "stride": 32, "text": "wikipedia"}))
    assert cli(["sweep", str(tiny_with_tokenizer), "--recipe", str(sweep)]) == 0
    assert (tmp_path / "table.json").exists()


# ---------------------------------------------------------------- fourth round: the latent cache, checkpoints, links
def _latent(tiny_dirs, arch="llama", **kw):
    cfg = TensorCompressionConfig(method="latent_kv", **{"rank": 1.0, "bits": 16, "whiten": False, **kw})
    return AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], quantization_config=cfg).eval()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_assisted_decoding_crops_the_latent_cache_exactly(tiny_dirs, arch):
    """Row 1: assisted decoding, prompt lookup and ``crop`` raised AttributeError ('LatentKVLayer' has no 'crop').
    Now the newest tokens' latents are removed: at bits=16 what a DynamicCache gives; a crop reaching codes, or a
    positive crop (as transformers' own layers), one line."""
    from transformers import DynamicCache

    from hf_tensorcomp.methods.latent_kv import LatentKVCache

    m, d = _latent(tiny_dirs, arch, group=8), dense(tiny_dirs, arch)
    x = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = d.generate(x, **kw)
    assert torch.equal(m.generate(x, assistant_model=d, **kw), want)
    assert torch.equal(m.generate(x, prompt_lookup_num_tokens=3, **kw), want)
    assert torch.equal(d.generate(x, assistant_model=_latent(tiny_dirs, arch, group=8), **kw), want)  # as the assistant
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    logits = []
    for model, cache in ((m, LatentKVCache(m)), (d, DynamicCache(config=d.config))):
        cache.activate_past_recording()  # (transformers' sliding layers keep what a crop needs only when told)
        with torch.no_grad():
            model(ids[:, :14], past_key_values=cache, use_cache=True)
            cache.crop(-4)  # the last 4 of the 14 forgotten: the 6 new tokens follow the first 10
            assert cache.get_seq_length() == 10
            logits.append(model(ids[:, 14:], past_key_values=cache, use_cache=True).logits)
    assert (logits[0] - logits[1]).abs().max() < 1e-5
    with pytest.raises(ValueError, match=r"^LatentKVCache\.crop: got 5; allowed: a negative int"):
        LatentKVCache(m).crop(5)
    q = _latent(tiny_dirs, arch, bits=4, group=8, window=4, sink=0)
    cache = LatentKVCache(q)
    with torch.no_grad():
        q(ids, past_key_values=cache, use_cache=True)  # 20 tokens: 16 as codes, the newest 4 in 16 bits
    cache.crop(-2)
    with pytest.raises(ValueError, match=r"^LatentKVCache\.crop: removing 4 tokens reaches tokens already held as "
                                         r"codes \(the newest 2 are in 16 bits\)"):
        cache.crop(-4)
    assert cache.get_seq_length() == 18


def test_a_cache_built_for_another_model_is_refused(tiny_dirs):
    """Row 8: a Llama decoding through a cache built for Gemma-3 slid its full-attention layers at Gemma's window and
    changed its output silently (the reverse pairing: a raw IndexError). Refused in one line naming the layer."""
    from hf_tensorcomp.methods.latent_kv import LatentKVCache

    llama, gemma = _latent(tiny_dirs, "llama"), _latent(tiny_dirs, "gemma3")
    x = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    for model, other in ((llama, gemma), (gemma, llama), (llama, _latent(tiny_dirs, "llama", rank=4))):
        with pytest.raises(ValueError, match=r"^LatentKVCache: built for another model \(layer 0: .*; this model's: "
                                             r".*\); allowed: a cache made for the model it is used with"):
            model.generate(x, past_key_values=LatentKVCache(other), max_new_tokens=3, do_sample=False)
        with pytest.raises(ValueError, match=r"^LatentKVCache: built for another model"):
            model(x, past_key_values=LatentKVCache(other), use_cache=True)
    llama.generate(x, past_key_values=LatentKVCache(llama, bits=4), max_new_tokens=3, do_sample=False)  # its own: fine
    with pytest.raises(ValueError, match=r"^LatentKVCache\.bits: got 1; allowed"):  # not TensorCompressionConfig.bits
        LatentKVCache(llama, bits=1)


def test_latent_kv_on_some_sliding_layers_refused_before_any_weight(tiny_dirs, monkeypatch):
    """Row 9: latent_kv on one of Gemma-3's two sliding layers compressed and saved; generate then failed. Refused
    when the config meets the model, before any weight is touched; all of them, or none, still compress."""
    from hf_tensorcomp.methods.latent_kv.method import LatentKV

    def never(*a, **k):
        raise AssertionError("compress ran")

    with monkeypatch.context() as m:
        m.setattr(LatentKV, "compress", never)
        for layers in ([0], [1, 2]):
            with pytest.raises(ValueError, match=r"^TensorCompressionConfig\.layers: got \[.*\]; allowed: all of the "
                                                 r"model's sliding-window layers \[0, 1\] or none of them"):
                _latent(tiny_dirs, "gemma3", layers=layers)
    for layers in ([0, 1], [2]):
        model = _latent(tiny_dirs, "gemma3", layers=layers)
        model.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=3, do_sample=False)


@pytest.mark.parametrize("kind", ["static", "offloaded", "quantized", "offloaded_static"])
def test_a_dense_cache_implementation_on_a_latent_model_is_refused(tiny_dirs, kind):
    """Row 11: cache_implementation='static' gave a dense StaticCache, the KV compression dropped without a word."""
    m = _latent(tiny_dirs)
    x = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"^generate: cache_implementation={kind!r} would hold dense keys and values, "
                                         r"dropping latent_kv's KV compression; allowed: None or 'dynamic'"):
        m.generate(x, cache_implementation=kind, max_new_tokens=3, do_sample=False)
    m.generate(x, cache_implementation="dynamic", max_new_tokens=3, do_sample=False)


_COMPILED = """
import sys, torch
from transformers import AutoModelForCausalLM
from hf_tensorcomp import TensorCompressionConfig
from hf_tensorcomp.methods.latent_kv import LatentKVCache
cfg = TensorCompressionConfig(method="latent_kv", rank=1.0, bits=4, window=4, group=8, sink=0, whiten=False, progress=False)
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], quantization_config=cfg).eval()
x = torch.randint(0, 101, (1, 24), generator=torch.Generator().manual_seed(1))
out = []
with torch.no_grad():
    for forward in (m.forward, torch.compile(m.forward)):
        cache = LatentKVCache(m)
        logits = [forward(x[:, :10], past_key_values=cache, use_cache=True).logits]
        logits += [forward(x[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(10, 24)]
        out.append(torch.cat(logits, 1))
print("max difference", float((out[0] - out[1]).abs().max()))
"""


def test_torch_compile_of_a_latent_model_with_codes_runs_in_bounded_time(tiny_dirs, tmp_path):
    """Row 12: ``torch.compile(m.forward)`` with 4-bit codes was not done in 120 s on 10 tokens (bits=16: 18 s, dense:
    5 s). The latent attention now runs eagerly under compile (a graph break a layer; the rest compiles): the
    compiled forward gives the eager logits, prompt and decoding steps past the window (codes), in bounded time."""
    import subprocess
    import sys

    try:
        run = subprocess.run([sys.executable, "-c", _COMPILED, str(tiny_dirs["llama"])], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    except subprocess.TimeoutExpired:
        pytest.fail("torch.compile of a latent model with 4-bit codes did not finish within 300 s")
    assert run.returncode == 0, run.stderr[-3000:]
    assert float(run.stdout.split("max difference")[1]) < 1e-4, run.stdout


def test_a_truncated_compressed_checkpoint_names_the_file(tiny_dirs, tmp_path):
    """Row 2: 500 bytes cut off a latent_kv checkpoint's model.safetensors gave a raw SafetensorError ('incomplete
    metadata') from the header check, naming no file. Now one line naming it and that it is truncated."""
    _latent(tiny_dirs).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-500])
    with pytest.raises(ValueError, match=r"^from_pretrained: .*model\.safetensors: .*the file is truncated; allowed: a "
                                         r"whole safetensors file"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_cli_compress_of_a_truncated_shard_is_one_line(tiny_with_tokenizer, tmp_path, capsys):
    """Row 3: CLI compress (no --stream) of a sharded source whose shard is truncated: a 23-line traceback, exit 1
    (as the API: from_pretrained with a quantization_config). Now one line naming the shard, exit 2."""
    src = tmp_path / "src"
    shard = _untied_sharded(tiny_with_tokenizer, src)
    shard.write_bytes(shard.read_bytes()[:-100])
    before = _tree(tmp_path)
    argv = ["compress", str(src), "--rank", "4", "--targets", "mlp.*", "--no-eval", "--quiet", "--out", str(tmp_path / "out")]
    capsys.readouterr()
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-tensorcomp: error: from_pretrained: ") and "\n" not in err, err
    assert shard.name in err and "the file is truncated" in err, err
    assert _tree(tmp_path) == before


def test_qlr_checkpoint_float_bits_refused_naming_the_field(tiny_dirs, tmp_path):
    """Row 4: a qlr checkpoint whose config.json set a module's quant.weight.bits to 4.0 loaded until a raw TypeError
    ('empty(): argument size must be tuple of ints, not float'). Refused naming quant.weight.bits and the allowed
    widths (group_size 64.0 likewise names quant.weight.group_size)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(
        method="qlr", rank=4, group_size=16, calibration=calib(), progress=False, targets=["mlp.*"]))
    model.save_pretrained(tmp_path)
    saved = (tmp_path / "config.json").read_text()
    for field, value, allowed in (("bits", 4.0, r"2 \| 3 \| 4"), ("group_size", 64.0, r"an int in")):
        cfg = json.loads(saved)
        cfg["quantization_config"]["compressed_modules"]["model.layers.0.mlp.up_proj"]["quant"]["weight"][field] = value
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=rf"^compressed_modules\['model\.layers\.0\.mlp\.up_proj'\]\.quant\.weight\."
                                             rf"{field}: got {value}; allowed: {allowed}"):
            AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("method, module", [("latent_kv", "self_attn.k_proj"), ("latent_kv", "self_attn.v_proj"),
                                            ("qlr", "mlp.up_proj")])
def test_a_module_deleted_from_compressed_modules_is_refused(tiny_dirs, tmp_path, method, module):
    """Row 5: deleting k_proj's entry from compressed_modules loaded silently as another model (its factor tensors
    ignored, decoding off by 2.9e-3); v_proj's or a qlr entry: transformers' multi-line size-mismatch error. Tensors
    of the checkpoint that belong to no listed module are refused in one line before loading."""
    if method == "latent_kv":
        model = _latent(tiny_dirs)
    else:
        model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], quantization_config=TensorCompressionConfig(
            method="qlr", rank=4, group_size=16, calibration=calib(), progress=False, targets=["mlp.*"]))
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["quantization_config"]["compressed_modules"][f"model.layers.0.{module}"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"^model\.layers\.0\.{module}\.\w+ \[.*\]: in the checkpoint, but "
                                         rf"compressed_modules lists no 'model\.layers\.0\.{module}', which loads as a "
                                         r"dense Linear \(weight \[.*\]\); the config\.json and the weights do not belong"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


_THROUGH_LINKS = """
import sys
from pathlib import Path
from transformers import AutoModelForCausalLM
from hf_tensorcomp import TensorCompressionConfig, compress_checkpoint
src, tmp = sys.argv[1], Path(sys.argv[2])
cfg = lambda: TensorCompressionConfig(method="laser", rank=4, targets=["mlp.*"], progress=False)
for kind in ("empty", "missing"):
    for writer in ("save", "stream"):
        real, link = tmp / f"real-{kind}-{writer}", tmp / f"link-{kind}-{writer}"
        if kind == "empty":
            real.mkdir()
        link.symlink_to(real)
        if writer == "save":
            AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg()).save_pretrained(link)
        else:
            compress_checkpoint(src, link, cfg())
"""


def test_an_output_path_that_is_a_link_is_written_where_it_points(tiny_with_tokenizer, tmp_path):
    """Row 6: ``ln -s real link`` (real empty or missing), then save_pretrained("link"), compress_checkpoint(...,
    "link") or CLI --out link: NotADirectoryError once all the work was done (atomic_dir called rmdir / rename on the
    link). The link is resolved first: the output is written atomically into its target and the link kept. In a
    child process, as a user runs it."""
    import subprocess
    import sys

    work = tmp_path / "work"
    work.mkdir()
    try:
        run = subprocess.run([sys.executable, "-c", _THROUGH_LINKS, str(tiny_with_tokenizer), str(work)],
                             capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    except subprocess.TimeoutExpired:
        pytest.fail("writing through links did not finish within 300 s")
    assert run.returncode == 0, run.stderr[-3000:]
    for kind in ("empty", "missing"):
        real = work / f"real-cli-{kind}"
        if kind == "empty":
            real.mkdir()
        (work / f"link-cli-{kind}").symlink_to(real)
        r = _run_cli(_CHILD, ["compress", tiny_with_tokenizer, "--rank", "4", "--targets", "mlp.*", "--no-eval", "--quiet",
                              "--out", work / f"link-cli-{kind}"], work)
        assert r.returncode == 0, r.stderr[-3000:]
    links = sorted(p.name for p in work.iterdir() if p.name.startswith("link"))
    assert len(links) == 6 and all((work / n).is_symlink() for n in links)  # the links kept
    for name in links:
        real = work / name.replace("link", "real", 1)
        assert not real.is_symlink() and (real / "config.json").is_file(), name
        AutoModelForCausalLM.from_pretrained(work / name)
    assert not [p for p in work.iterdir() if ".hf_tensorcomp-tmp-" in p.name]  # no temporary sibling left


_ALONE = """
import os, sys
if os.environ["RANK"] == sys.argv[1]:
    os.environ["HF_TENSORCOMP_DISTRIBUTED"] = "0"  # this rank alone opts out
from hf_tensorcomp.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("alone", ["0", "1"])
def test_a_rank_launched_without_distribution_does_not_hang_the_others(tiny_with_tokenizer, tmp_path, alone):
    """Row 7: ``torchrun --nproc-per-node 2`` with HF_TENSORCOMP_DISTRIBUTED=0 on one rank only: that rank wrote
    alone, the other waited in the process-group join for ever. The join is bounded (HF_TENSORCOMP_JOIN_TIMEOUT):
    the rank that waits stops in one line naming the rank that never came, exit 2. In a child process."""
    import subprocess
    import sys

    script = tmp_path / "alone.py"
    script.write_text(_ALONE)
    argv = ["compress", str(tiny_with_tokenizer), "--rank", "4", "--targets", "mlp.*", "--no-eval", "--quiet", "--out",
            str(tmp_path / "out")]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(HERE.parent),
           "HF_TENSORCOMP_JOIN_TIMEOUT": "10"}
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            str(script), alone, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env, cwd=tmp_path, start_new_session=True)
    try:
        _, stderr = run.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, 9)  # the launcher and both ranks
        run.communicate()
        pytest.fail("a rank waited for one launched with HF_TENSORCOMP_DISTRIBUTED=0 for 240 s")
    waiting = "1" if alone == "0" else "0"
    said = [line for line in stderr.splitlines() if "never joined" in line]
    assert said and said[0].startswith(f"hf-tensorcomp: error: hf_tensorcomp distributed: rank(s) {alone} of 2 never "
                                       "joined the process group within 10 s"), stderr[-3000:]
    assert f"rank {waiting} saw" in said[0] and "HF_TENSORCOMP_DISTRIBUTED=0 on all of them or on none" in said[0]
    assert "Traceback" not in stderr.split("never joined")[0], stderr[-3000:]


# the CLI on a disk that fills up: every copy (os.sendfile, which shutil.copy2 uses) and every write into the output
# folder fails with ENOSPC, as on a full disk
_FULL_DISK = """
import errno, os, sys
def full(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
os.sendfile = full
""" + _CHILD


def test_a_full_disk_names_the_output_being_written(tiny_with_tokenizer, tmp_path):
    """Row 10: ``--stream --out`` on a full disk said "cli/src/generation_config.json: No space left on device": the
    source file (shutil's copy names both, the source first). Now the output being written, under its final name."""
    src = tmp_path / "src"
    src.mkdir()
    for p in Path(tiny_with_tokenizer).iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    r = _run_cli(_FULL_DISK, ["compress", src, "--stream", "--rank", "4", "--targets", "mlp.*", "--quiet", "--out",
                              tmp_path / "out"], tmp_path)
    err = [line for line in r.stderr.strip().splitlines() if line.strip() and "it/s]" not in line]
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert err[0].startswith(f"hf-tensorcomp: error: {tmp_path / 'out'}/") and ": No space left on device" in err[0], err
    assert str(src) not in err[0] and ".hf_tensorcomp-tmp-" not in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing left behind


def test_ranks_with_different_settings_are_told_the_field():
    """Found beside row 7: ranks whose configs differed were told only two fingerprints ("config: rank 0 3f2a...,
    rank 1 9bc1..."), not what differs. Each field is a fact of its own now, its value shown where short."""
    from hf_tensorcomp import distributed

    class TwoRanks:  # the other rank asked for rank=8
        rank, world = 0, 2

        def gather(self, mine, what):
            return [mine, {**mine, "config.entries[0].rank": "8"}]

    facts = distributed.fields("config.entries", [e.to_dict() for e in laser().entries])
    with pytest.raises(distributed.DistributedError, match=r"compress: the ranks differ \(config\.entries\[0\]\.rank: "
                                                           r"rank 0 4, rank 1 8\); allowed"):
        distributed.agree(TwoRanks(), "compress", **facts)
    assert distributed.fields("ids", torch.arange(3)) == {"ids": distributed.fingerprint(torch.arange(3))}
