import json

import pytest
from transformers import AutoConfig
from transformers.quantizers.auto import AutoQuantizationConfig

from hf_tensorcomp import TensorCompressionConfig


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"method": "svd"}, "method"),
        ({"rank": 0}, "rank"),
        ({"rank": -3}, "rank"),
        ({"rank": 1.5}, "rank"),
        ({"rank": 0.0}, "rank"),
        ({"rank": "half"}, "rank"),
        ({"rank": True}, "rank"),
        ({"targets": []}, "targets"),
        ({"targets": [3]}, "targets"),
        ({"layers": []}, "layers"),
        ({"layers": ["last"]}, "layers"),
        ({"layers": 1.0}, "layers"),
        ({"mode": "sparse"}, "mode"),
        ({"progress": "yes"}, "progress"),
        ({"entries": []}, "entries"),
        ({"entries": [{"rank": 3}]}, "entries[0]"),
        ({"quant_method": "gptq"}, "quant_method"),
        ({"format_version": 99}, "format_version"),
        ({"compressed_modules": [1]}, "compressed_modules"),
        ({"foo": 1}, "foo"),
    ],
)
def test_bad_field_names_field_and_allowed_values(kwargs, field):
    with pytest.raises(ValueError) as e:
        TensorCompressionConfig(**kwargs)
    msg = str(e.value)
    assert field in msg
    assert "allowed" in msg


def test_entries_and_single_fields_are_exclusive():
    with pytest.raises(ValueError, match="either"):
        TensorCompressionConfig(method="laser", entries=[{"method": "laser"}])


def test_defaults_and_single_entry_view():
    c = TensorCompressionConfig(method="laser", rank=0.25, targets="mlp.*", layers=-1)
    assert c.method == "laser" and c.rank == 0.25 and c.mode == "factorized"
    assert c.entries[0].targets == ["mlp.*"] and c.entries[0].layers == [-1]


def test_calibration_windows_default_to_the_methods_and_the_config_records_the_count():
    """32 windows unless a method asks for more (qlr: 128); a config of several entries takes the largest; a
    count given (or read back from a saved config, where the resolved count is written) is kept."""
    assert TensorCompressionConfig(method="laser", rank=8).calibration_samples == 32
    assert TensorCompressionConfig(method="qlr", target_bytes=0.27).calibration_samples == 128
    both = TensorCompressionConfig(entries=[{"method": "laser", "rank": 8}, {"method": "qlr", "bits": 4, "rank": 0}])
    assert both.calibration_samples == 128
    c = TensorCompressionConfig(method="qlr", bits=4, rank=0, calibration_samples=32)
    assert c.calibration_samples == 32
    assert TensorCompressionConfig.from_dict(json.loads(c.to_json_string())).calibration_samples == 32


def test_round_trip_through_dict_json_and_config_json(tmp_path, tiny_dirs):
    c = TensorCompressionConfig(entries=[
        {"method": "laser", "rank": 8, "targets": ["self_attn.*"], "layers": [0]},
        {"method": "laser", "rank": 0.5, "targets": ["mlp.*"], "layers": [-1], "mode": "dense"},
    ])
    d = json.loads(c.to_json_string())
    assert d["quant_method"] == "tensorcomp"
    again = AutoQuantizationConfig.from_dict(d)  # transformers' own dispatch by quant_method
    assert isinstance(again, TensorCompressionConfig) and again == c
    cfg = AutoConfig.from_pretrained(tiny_dirs["llama"])
    cfg.quantization_config = c
    cfg.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert TensorCompressionConfig.from_dict(loaded.quantization_config) == c
