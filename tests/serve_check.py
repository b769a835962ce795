"""Load an ``hf_tensorcomp.export(..., format="compressed-tensors")`` folder the way a user without
hf_tensorcomp does, and print its logits' largest difference from the library's own (as JSON).

Run in an environment holding only torch, transformers, peft, compressed-tensors and safetensors:
``python serve_check.py OUT REF.pt``. The base loads through transformers' compressed-tensors
integration (the default path: each module's scheme from its config group, the codes decompressed on the
first forward). transformers does not apply a checkpoint's ``transform_config``; where there is one, its
online transforms are applied with compressed-tensors' own `apply_transform_config` (the inverse half,
``weight_input``, is in the codes already) and their stored matrices loaded, as vLLM does.
"""

import json
import sys
from pathlib import Path

import torch


def load(out: Path, transforms: bool = True):
    """The exported model; ``transforms=False`` leaves the checkpoint's transforms out (a control)."""
    from transformers import AutoModelForCausalLM

    from safetensors.torch import load_file

    stored = load_file(out / "base" / "model.safetensors")
    # compressed-tensors 0.20.1 gives a module it compresses on the meta device an unpacked zero point
    # (out x groups) where its own checkpoints (and vLLM) hold it packed along the output dim; transformers then
    # drops the stored one as a size mismatch. It is put back as stored: decompression unpacks it.
    model = AutoModelForCausalLM.from_pretrained(out / "base", ignore_mismatched_sizes=True).eval()
    for key, t in stored.items():
        if key.endswith(".weight_zero_point"):
            owner, _, leaf = key.rpartition(".")
            model.get_submodule(owner).get_parameter(leaf).data = t
    tconfig = json.loads((out / "base" / "config.json").read_text())["quantization_config"].get("transform_config")
    if tconfig and transforms:
        from compressed_tensors.transform import TransformConfig, apply_transform_config

        online = {name: {**scheme, "apply": [a for a in scheme["apply"] if a["location"] in ("input", "output")]}
                  for name, scheme in tconfig["config_groups"].items()}
        apply_transform_config(model, TransformConfig.model_validate({"config_groups": online}))
        for key, matrix in stored.items():
            if key.endswith("_input.weight") and "rotation_" in key:
                with torch.no_grad():  # one parameter per scheme, shared by its modules
                    model.get_parameter(key).copy_(matrix)
    model.hf_quantizer.compressor.decompress_model(model)  # else on the first forward; PEFT needs the weights
    if (out / "adapter").is_dir():
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, out / "adapter").eval()
    return model


if __name__ == "__main__":
    import importlib.util

    out, ref = Path(sys.argv[1]), sys.argv[2]
    ids, expected = torch.load(ref)
    model = load(out)
    with torch.no_grad():
        logits = model(ids).logits
    print(json.dumps({"max_abs_diff": (logits.float() - expected.float()).abs().max().item(),
                      "scale": expected.float().abs().max().item(),
                      "hf_tensorcomp_importable": importlib.util.find_spec("hf_tensorcomp") is not None,
                      "modules": {n: type(m).__name__ for n, m in model.named_modules() if n.endswith("q_proj")}}))
