"""Calibration input: turn what the user named into a (samples x length) tensor of token ids.

Accepted (``TensorCompressionConfig.calibration``):

- a bundled text name, ``"wikipedia"`` or ``"owt"``: the *calibration* split of the package's
  paragraphs (`hf_tensorcomp.assets.load_text(name, "calib")`), disjoint from the ``"eval"`` split
  every evaluation in this project reads;
- a list of strings (your own text);
- a ``datasets.Dataset`` with a ``"text"`` column;
- token ids: a 2-D ``torch.Tensor`` / nested list of ints (used as given, one row per sample).

Texts are joined with blank lines, tokenized once, cut into windows of ``length`` tokens (the
tokenizer's BOS in front when it adds one itself, as evaluation does), and ``samples`` windows are
drawn without replacement with a seeded generator, so the same seed gives the same batch.
"""

from __future__ import annotations

from typing import Any

import torch

from ..validation import fail, is_path

BUNDLED = ("wikipedia", "owt", "wikipedia+owt")
DEFAULT = "wikipedia+owt"  # what a config that needs calibration text and names none draws from: both kinds of text
ALLOWED = ("a bundled text name ('wikipedia' | 'owt' | 'wikipedia+owt': both, paragraphs alternating), a list of strings, a datasets.Dataset with a 'text' column, "
           "or token ids (a 2-D LongTensor or list of lists of ints)")


def validate_calibration(value: Any) -> Any:
    """Check the *form* of a calibration spec at config construction (nothing is loaded)."""
    if value is None or isinstance(value, dict) and set(value) == {"described"}:
        return value  # None, or the description a saved config keeps of data it no longer has
    if isinstance(value, str):
        if value not in BUNDLED:
            fail("calibration", value, ALLOWED)
        return value
    if isinstance(value, torch.Tensor):
        if value.ndim != 2 or value.dtype not in (torch.int64, torch.int32) or value.numel() == 0:
            fail("calibration", f"tensor {tuple(value.shape)} {value.dtype}", "a non-empty 2-D int tensor of token ids")
        return value
    if isinstance(value, (list, tuple)):
        if not value:
            fail("calibration", value, ALLOWED)
        if all(isinstance(t, str) for t in value):
            if not any(t.strip() for t in value):
                fail("calibration", value, "texts with some non-blank content")
            return list(value)
        if all(isinstance(r, (list, tuple)) and r and all(isinstance(i, int) and not isinstance(i, bool) for i in r)
               for r in value):
            return [list(r) for r in value]
        fail("calibration", f"list of {type(value[0]).__name__}", ALLOWED)
    if hasattr(value, "column_names") and hasattr(value, "__getitem__"):  # a datasets.Dataset
        if "text" not in value.column_names:
            fail("calibration", f"Dataset with columns {value.column_names}", "a datasets.Dataset with a 'text' column")
        return value
    fail("calibration", type(value).__name__, ALLOWED)


def describe(value: Any) -> Any:
    """What config.json keeps of the calibration data (a name, or a short description, never the data)."""
    if value is None or isinstance(value, str) or isinstance(value, dict):
        return value
    if isinstance(value, torch.Tensor):
        return {"described": f"token ids {tuple(value.shape)}"}
    if hasattr(value, "column_names"):
        return {"described": f"datasets.Dataset, {len(value)} rows"}
    kind = "texts" if value and isinstance(value[0], str) else "token-id rows"
    return {"described": f"{len(value)} {kind}"}


def is_token_ids(value: Any) -> bool:
    """Token ids (a tensor or lists of ints) need no tokenizer; names, texts and datasets do."""
    return isinstance(value, torch.Tensor) or (isinstance(value, list) and bool(value) and isinstance(value[0], list))


def calibration_ids(value: Any, tokenizer, samples: int, length: int, seed: int) -> torch.Tensor:
    """The calibration batch: LongTensor (n, length [+1 for BOS]) with n = min(samples, windows available)."""
    if isinstance(value, dict):
        raise ValueError(
            f"TensorCompressionConfig.calibration: this config only records {value['described']!r} (the data itself is "
            "not saved); pass the calibration data again to compress")
    if is_token_ids(value):
        rows = torch.as_tensor(value, dtype=torch.long) if not isinstance(value, torch.Tensor) else value.long()
        g = torch.Generator().manual_seed(seed)
        pick = torch.randperm(rows.shape[0], generator=g)[:samples].sort().values
        return rows[pick]
    if tokenizer is None:
        raise ValueError("TensorCompressionConfig.calibration: texts need a tokenizer; none was found beside the model "
                         "(pass calibration_tokenizer=<path or tokenizer>) or pass token ids instead")
    if isinstance(value, str):
        from ..assets import load_text

        parts = [load_text(name, "calib") for name in value.split("+")]
        texts = [t for group in zip(*parts) for t in group]  # alternating: windows come from both kinds of text
    elif isinstance(value, list):
        texts = value
    else:
        texts = list(value["text"])
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise ValueError(f"TensorCompressionConfig.calibration: row {bad} of the Dataset's 'text' column is "
                             f"{type(texts[bad]).__name__}; allowed: a string in every row (filter the empty ones out)")
    from ..eval.perplexity import bos_prefix

    ids = tokenizer("\n\n".join(t for t in texts if t.strip()), add_special_tokens=False, verbose=False)["input_ids"]
    n_windows = len(ids) // length
    if n_windows < 1:
        raise ValueError(f"TensorCompressionConfig.calibration: the text gives {len(ids)} tokens, fewer than "
                         f"calibration_length={length}; allowed: more text or a smaller calibration_length")
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(n_windows, generator=g)[:samples].sort().values.tolist()
    bos = bos_prefix(tokenizer, None)
    return torch.tensor([bos + ids[i * length:(i + 1) * length] for i in pick], dtype=torch.long)


def check_vocabulary(ids: torch.Tensor, model) -> torch.Tensor:
    """`ids` if every id lies in `model`'s vocabulary (its input embeddings), else the one-line error compression and
    healing both give."""
    vocab = model.get_input_embeddings().num_embeddings
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.numel():
        raise ValueError(f"TensorCompressionConfig.calibration: token id {int(bad[0])} is outside the model's vocabulary "
                         f"of {vocab} ({bad.numel()} such ids); allowed: ids in [0, {vocab}), or texts")
    return ids


def calibration_tokenizer(model, calibration, tokenizer=None):
    """The tokenizer for calibration texts: `tokenizer` (object or path), else the model's own folder's;
    None for token ids."""
    if tokenizer is not None and not is_path(tokenizer):
        return tokenizer
    if is_token_ids(calibration):
        return None
    from transformers import AutoTokenizer

    src = tokenizer or getattr(model, "name_or_path", None)
    try:
        return AutoTokenizer.from_pretrained(src)
    except Exception as e:  # noqa: BLE001 - any failure means: tell the user how to pass one
        raise ValueError(f"TensorCompressionConfig.calibration_tokenizer: no tokenizer could be loaded from {src!r} ({e}); "
                         "allowed: a tokenizer object or path, or token ids as calibration") from None
