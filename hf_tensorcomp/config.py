"""`TensorCompressionConfig`: what to compress, how, and (after compression) what was built.

The config is a transformers quantization config (``quant_method="tensorcomp"``), so it rides in
``config.json`` like any other and is handed back to the quantizer on reload.

One config holds one or more *entries*. An entry is one method applied to one group of modules::

    TensorCompressionConfig(method="laser", rank=0.25, targets=["mlp.*"], layers=[-1])
    TensorCompressionConfig(entries=[
        {"method": "tensorllm", "ranks": (64, 32, 3), "layers": [-2]},
        {"method": "laser", "rank": 0.2, "targets": ["mlp.*"], "layers": [-2]},
    ])

Everything is validated at construction; each error names the field and the allowed values.
After compression, ``compressed_modules`` records the factor layout of every replaced module, so a
saved checkpoint can be rebuilt (on the meta device) before its weights load.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from .methods import METHODS, get_method
from .calibration.data import DEFAULT as DEFAULT_CALIBRATION, describe, validate_calibration
from .heal_settings import validate_heal
from .validation import fail, is_int, is_path

logger = logging.getLogger(__name__)

QUANT_METHOD = "tensorcomp"
FORMAT_VERSION = 1
MODES = ("factorized", "dense")
FACTOR_BITS = (None, 8, 4)
DEFAULT_GROUP_SIZE = 128
ENTRY_FIELDS = ("method", "rank", "target", "targets", "layers", "mode")
# the calibration settings a saved config records (calibration_samples: None resolves to the methods' count)
CALIBRATION_DEFAULTS = {"calibration_samples": 32, "calibration_length": 256, "calibration_batch_size": 8,
                        "calibration_seed": 0, "propagate": True}


class Entry:
    """One method applied to one group of modules. Built and validated by `TensorCompressionConfig`."""

    def __init__(self, method: str, rank=None, targets=None, layers=None, mode="factorized", target=None, **options):
        m = get_method(method)  # raises on unknown method
        self.method = method
        self.mode = mode
        if mode not in MODES:
            fail("mode", mode, " | ".join(repr(x) for x in MODES))
        self.factor_bits = options.pop("factor_bits", None)
        self.group_size = options.pop("group_size", DEFAULT_GROUP_SIZE)
        if self.factor_bits not in FACTOR_BITS or type(self.factor_bits) not in (int, type(None)):  # not True, not 8.0
            fail("factor_bits", self.factor_bits, "None (factors kept in the model's dtype) | 8 | 4 (integer codes with a "
                 "float16 scale and an integer zero point per group of group_size values)")
        if self.factor_bits is not None and (m.structural or mode == "dense"):
            fail("factor_bits", self.factor_bits, f"None with method {method!r} and mode {mode!r} (no factors are kept)")
        if not is_int(self.group_size, 16) or self.group_size > 8192:
            fail("group_size", self.group_size, "an int in [16, 8192] (values sharing one scale and zero point; "
                 "claims in this project are made at >= 64)")
        options = m.validate_options(options)
        if targets is None:
            targets = list(m.targets_for(options))
        if isinstance(targets, str):
            targets = [targets]
        if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) and t for t in targets):
            fail("targets", targets, "a non-empty list of module-name patterns such as ['mlp.*', 'self_attn.q_proj']")
        self.targets = list(targets)
        if layers is not None:
            if isinstance(layers, int) and not isinstance(layers, bool):
                layers = [layers]
            if (
                not isinstance(layers, (list, tuple))
                or not layers
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
            ):
                fail("layers", layers, "None (all layers) or a non-empty list of ints (negatives count from the end)")
            layers = list(layers)
        self.layers = layers
        if target is None and rank is None:
            target = m.default_target
        if target is not None:
            if rank is not None:
                fail("target", target, "either rank= (per matrix) or target= (a budget for all the targeted modules), not both")
            target = m.validate_target(target, options)
        self.target = target
        if rank is not None and m.byte_budget and options.get("target_bytes") is not None:  # the default one too
            fail("rank", rank, "None with target_bytes= (bits and ranks are allocated)")
        if target is None:
            self.rank = m.validate_rank(m.default_rank if rank is None else rank, options) if m.uses_rank else rank
        else:
            self.rank = None
        self.options = options

    def to_dict(self) -> dict:
        d = {"method": self.method, "rank": self.rank, "targets": self.targets, "layers": self.layers, "mode": self.mode}
        if self.target is not None:
            d["target"] = self.target
        if self.factor_bits is not None:
            d["factor_bits"] = self.factor_bits
        if self.factor_bits is not None or get_method(self.method).uses_group_size:
            d["group_size"] = self.group_size
        d.update(copy.deepcopy(self.options))
        return d


def table_entry(entries, embedding_bits) -> int | None:
    """The entry whose byte budget holds the embedding table: with `embedding_bits`, the first entry whose
    method allocates a byte budget (``qlr`` with ``target_bytes``); else None."""
    if not embedding_bits:
        return None
    return next((k for k, e in enumerate(entries) if get_method(e.method).byte_budget and get_method(e.method).allocates(e)),
                None)


class TensorCompressionConfig(QuantizationConfigMixin):
    """Compression config passed as ``quantization_config=`` (or ``compression_config=``) to ``from_pretrained``.

    Args:
        method: ``"laser"`` (more methods register themselves in ``hf_tensorcomp.methods``).
        rank: int >= 1 (rank) or float in (0, 1] (fraction of each matrix's full rank).
        targets: module-name patterns (fnmatch) relative to a decoder layer, e.g. ``["mlp.*"]``,
            ``["self_attn.q_proj", "self_attn.k_proj"]``; the method's default if omitted.
        layers: decoder-layer indices (negatives count from the end); all layers if omitted.
        mode: ``"factorized"`` keeps the factors and runs a factored forward; ``"dense"`` writes the
            approximation back into ordinary ``nn.Linear`` weights.
        entries: instead of the fields above, a list of dicts (or `Entry` objects), one per module group.
        progress: show tqdm progress bars while compressing.
        calibration: the text the calibrated methods and options fit to (README: Calibration); when they
            need some and none is given, ``"wikipedia+owt"`` (both bundled corpora, paragraphs alternating).
        calibration_samples: windows of ``calibration_length`` tokens drawn from it; None (default): the
            methods' own count, 32, or 128 for ``qlr`` (the largest of a config's entries); the count used is saved.
        heal: False (default), True or a dict of `hf_tensorcomp.heal_settings.HEAL_DEFAULTS` settings: after
            compression, distil the model toward the dense one on the calibration text (`hf_tensorcomp.heal`).
        embedding_bits: None (default: the input embedding and the head stay as they are) | 8 | 4: store
            them as integer codes (round to nearest, a float16 scale and an integer zero point per group of
            ``embedding_group_size`` values along each token's row); a tied head stays tied, reading the
            embedding's codes (`hf_tensorcomp.layers.QuantizedEmbedding` / `QuantizedHead`). With a byte
            budget (``method="qlr", target_bytes=``) the table is inside it: ``target_bytes`` is then a
            fraction of the bf16 bytes of the targeted matrices *and* the table (an untied head counted
            too), the table's bytes coming off first; ``"auto"``: that budget chooses 4 or 8 bits for the
            table, weighing its error in the output head against the linears' by the entry's ``allocation`` rule.
        **options: method-specific options (each method lists and validates its own).
    """

    def __init__(
        self,
        method: str | None = None,
        rank: int | float | None = None,
        target: float | None = None,
        targets: list[str] | str | None = None,
        layers: list[int] | int | None = None,
        mode: str = "factorized",
        entries: list | None = None,
        progress: bool = True,
        calibration=None,
        calibration_samples: int | None = None,
        calibration_length: int = 256,
        calibration_batch_size: int = 8,
        calibration_seed: int = 0,
        propagate: bool = True,
        calibration_tokenizer=None,
        heal=False,
        embedding_bits: int | None = None,
        embedding_group_size: int = DEFAULT_GROUP_SIZE,
        compressed_modules: dict | None = None,
        stats: dict | None = None,
        format_version: int = FORMAT_VERSION,
        quant_method: str = QUANT_METHOD,
        **options,
    ):
        self.quant_method = QUANT_METHOD
        if quant_method != QUANT_METHOD:
            fail("quant_method", quant_method, repr(QUANT_METHOD))
        if format_version != FORMAT_VERSION:
            fail("format_version", format_version, f"{FORMAT_VERSION} (this hf_tensorcomp release)")
        if entries is not None:
            if method is not None or rank is not None or target is not None or targets is not None or layers is not None or options:
                raise ValueError(
                    "TensorCompressionConfig: pass either `entries=[...]` or the single-entry fields "
                    "(method, rank, targets, layers, options), not both"
                )
            if not isinstance(entries, (list, tuple)) or not entries:
                fail("entries", entries, "a non-empty list of dicts, each with a 'method' key")
            built = []
            for i, e in enumerate(entries):
                if isinstance(e, Entry):
                    built.append(e)
                    continue
                if not isinstance(e, dict) or "method" not in e:
                    fail(f"entries[{i}]", e, "a dict with a 'method' key")
                e = dict(e)
                e.setdefault("mode", mode)
                if compressed_modules and e["method"] in METHODS:  # a saved checkpoint's entry
                    e = {**METHODS[e["method"]].saved_defaults, **e}
                built.append(Entry(**e))
            self.entries = built
        else:
            self.entries = [Entry(method or "laser", rank=rank, target=target, targets=targets, layers=layers, mode=mode, **options)]
        if not isinstance(progress, bool):
            fail("progress", progress, "True | False")
        self.progress = progress
        self.calibration = validate_calibration(calibration)
        if calibration_samples is None:  # the methods' own count: 32 windows, 128 for qlr
            calibration_samples = max(get_method(e.method).calibration_samples for e in self.entries)
        for field, value, lo in (("calibration_samples", calibration_samples, 1), ("calibration_length", calibration_length, 2),
                                 ("calibration_batch_size", calibration_batch_size, 1)):
            if not is_int(value, lo):
                fail(field, value, f"an int >= {lo}" + (" (or None: the method's count)" if field == "calibration_samples" else ""))
        if not is_int(calibration_seed):
            fail("calibration_seed", calibration_seed, "an int")
        if not isinstance(propagate, bool):
            fail("propagate", propagate, "True | False")
        self.calibration_samples, self.calibration_length = calibration_samples, calibration_length
        self.calibration_batch_size, self.calibration_seed, self.propagate = calibration_batch_size, calibration_seed, propagate
        if calibration_tokenizer is not None and not is_path(calibration_tokenizer) and not callable(calibration_tokenizer):
            fail("calibration_tokenizer", type(calibration_tokenizer).__name__, "None (the model's own), a path, or a tokenizer")
        self.calibration_tokenizer = calibration_tokenizer  # not saved: only needed while compressing
        self.heal = validate_heal(heal)
        if (embedding_bits not in FACTOR_BITS and embedding_bits != "auto") or type(embedding_bits) not in (int, str, type(None)):
            fail("embedding_bits", embedding_bits, "None (embedding and head as they are) | 8 | 4 (integer codes per group "
                 "of embedding_group_size values) | 'auto' (4 or 8, chosen by a target_bytes budget)")
        if embedding_bits == "auto" and not compressed_modules and table_entry(self.entries, embedding_bits) is None:
            fail("embedding_bits", embedding_bits, "8 | 4, or 'auto' with a byte budget that allocates it (method='qlr' "
                 "with target_bytes=)")
        if not is_int(embedding_group_size, 16) or embedding_group_size > 8192:
            fail("embedding_group_size", embedding_group_size, "an int in [16, 8192]")
        self.embedding_bits, self.embedding_group_size = embedding_bits, embedding_group_size
        if not propagate and any(e.options.get("correct") for e in self.entries):
            fail("correct", True, "False with propagate=False (error correction fits the dense outputs from the inputs "
                 "a partly compressed model gives, which only propagation computes), or propagate=True")
        needing = [e.method for e in self.entries if get_method(e.method).needs(e)] + ["heal"] * (self.heal is not None)
        if needing and self.calibration is None and not compressed_modules:
            # both bundled corpora, so that a compression is not tuned to one kind of text (a calibration fitted to
            # Wikipedia alone costs several times more perplexity on web text than on Wikipedia)
            self.calibration = DEFAULT_CALIBRATION
            logger.info("hf_tensorcomp: %s need calibration text and none was given: calibration=%r (both bundled "
                        "corpora)", sorted(set(needing)), DEFAULT_CALIBRATION)
        if compressed_modules is not None and not isinstance(compressed_modules, dict):
            fail("compressed_modules", compressed_modules, "a dict {module name: layer spec} written by hf_tensorcomp")
        self.compressed_modules = dict(compressed_modules or {})
        self.stats = dict(stats or {})
        self.format_version = FORMAT_VERSION

    # -- the single-entry view, so `cfg.method`, `cfg.rank` read naturally --------------------------
    @property
    def method(self) -> str:
        return self.entries[0].method if len(self.entries) == 1 else "+".join(e.method for e in self.entries)

    @property
    def mode(self) -> str:
        return self.entries[0].mode

    @property
    def rank(self):
        return self.entries[0].rank

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": self.quant_method,
            "format_version": self.format_version,
            "entries": [e.to_dict() for e in self.entries],
            "progress": self.progress,
            "calibration": describe(self.calibration),
            **{k: getattr(self, k) for k in CALIBRATION_DEFAULTS},
            **({"heal": copy.deepcopy(self.heal)} if self.heal else {}),
            **({"embedding_bits": self.embedding_bits, "embedding_group_size": self.embedding_group_size}
               if self.embedding_bits else {}),
            "compressed_modules": copy.deepcopy(self.compressed_modules),
            "stats": copy.deepcopy(self.stats),
        }

    def __iter__(self):
        yield from self.to_dict().items()

    def __eq__(self, other):
        return isinstance(other, TensorCompressionConfig) and self.to_dict() == other.to_dict()

    def get_loading_attributes(self) -> dict:
        return {}
