"""The settings of `hf_tensorcomp.heal` (``TensorCompressionConfig(heal=...)``): their defaults and their
validation, apart from the trainer so that the config checks them without importing it (no torch here)."""

from __future__ import annotations

from .validation import fail, is_int, is_number

HEAL_DEFAULTS = {"mode": "e2e", "steps": 100, "layer_steps": 50, "lr": 1e-3, "relative": True, "batch_size": 4,
                 "train": "auto", "lm_weight": 0.0, "held_out": 0.125, "eval_every": 25, "seed": 0, "samples": 256,
                 "length": 256, "gradient_checkpointing": False, "precision": "auto", "generated": 0, "generated_prompt": None,
                 "every": 1}
#: what each ``train`` setting trains (`hf_tensorcomp.healing.trainable`)
TRAIN_PARTS = {"auto": {"factors", "norms"}, "factors": {"factors"}, "norms": {"norms"}, "scales": {"scales"},
               "all": {"factors", "norms", "scales"}, "full": {"factors", "norms", "scales", "dense"}}
TRAIN = tuple(TRAIN_PARTS)
MODES = ("e2e", "layerwise", "both")
#: the ``precision`` settings (`hf_tensorcomp.training.resolve_precision`)
PRECISIONS = ("auto", "float32", "bfloat16")


def validate_heal(value):
    """The config's ``heal``: False / None (no healing), True (the defaults) or a dict of `HEAL_DEFAULTS` keys."""

    if value is None or value is False:
        return None
    if value is True:
        return dict(HEAL_DEFAULTS)
    if not isinstance(value, dict):
        fail("heal", value, f"False | True | a dict with keys {sorted(HEAL_DEFAULTS)}")
    unknown = sorted(set(value) - set(HEAL_DEFAULTS))
    if unknown:
        fail("heal", value, f"a dict with keys among {sorted(HEAL_DEFAULTS)} (unknown: {unknown})")
    o = {**HEAL_DEFAULTS, **value}
    if o["mode"] not in MODES:
        fail("heal.mode", o["mode"], " | ".join(map(repr, MODES)) + " (end to end on the logits, layer by layer on "
             "each decoder layer's output, or layer-wise then end to end)")
    for key, lo in (("steps", 1), ("layer_steps", 1), ("batch_size", 1), ("eval_every", 1), ("samples", 2), ("length", 2),
                    ("generated", 0), ("every", 1)):
        if not is_int(o[key], lo):
            fail(f"heal.{key}", o[key], f"an int >= {lo}")
    if not is_int(o["seed"]):
        fail("heal.seed", o["seed"], "an int")
    for key, lo, hi in (("lr", 0, 1), ("lm_weight", 0, 100), ("held_out", 0, 0.5)):
        if not is_number(o[key]) or not lo <= o[key] <= hi or (key == "held_out" and o[key] == 0):
            fail(f"heal.{key}", o[key], f"a number in {'(' if key == 'held_out' else '['}{lo}, {hi}]")
    gp = o["generated_prompt"]
    if gp is not None and not (is_int(gp, 0) and gp < o["length"]):  # up front: teacher_windows checks it only late
        fail("heal.generated_prompt", gp, f"None (each sample continues the first length // 8 tokens of a calibration "
             f"window) | an int in [0, {o['length'] - 1}] (that many; 0: from the teacher's start-of-text token alone)")
    if o["generated"] and o["mode"] == "layerwise":
        fail("heal.generated", o["generated"], "0 with mode='layerwise' (windows sampled from the teacher feed the "
             "end-to-end step: mode='e2e' or 'both')")
    if o["train"] not in TRAIN:
        fail("heal.train", o["train"], " | ".join(map(repr, TRAIN)))
    if o["precision"] not in PRECISIONS:
        fail("heal.precision", o["precision"], "'auto' (bfloat16 where the device multiplies it natively) | 'float32' | "
             "'bfloat16' (the training forwards under bfloat16 autocast; parameters, optimizer and held-out scoring stay "
             "float32)")
    for key in ("gradient_checkpointing", "relative"):
        if not isinstance(o[key], bool):
            fail(f"heal.{key}", o[key], "True | False")
    return o
