"""The shape every method has: find targets → compress one unit of layers → replacement modules.

A *unit* is the set of decoder layers decomposed together: one layer for most methods, several for
TRAWL's segmented / whole-model formulations. Module names passed to and returned by a method are
relative to the decoder-layer list (``"3.mlp.up_proj"``); a returned name that does not exist yet
(a container of shared factors) is added to the model.

Reload does not come through here: replaced modules describe themselves (`FactorizedModule.spec`)
and are rebuilt from the saved config by `hf_tensorcomp.surgery.build_skeleton`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..validation import fail, is_int, is_number, validate_rank

METHODS: dict[str, "Method"] = {}


def register_method(cls):
    METHODS[cls.name] = cls()
    return cls


#: TRAWL's and TensorLLM's layouts for grouped-query attention: every weight once, or K and V per query head
GQA_LAYOUTS = ("group", "repeat")


def check_stacked_options(o: dict, mode: str) -> None:
    """The options TRAWL and TensorLLM share: the iterative solver's (tensorly CP-ALS / HOOI), whitening `mode`
    (and its damping), the grouped-query layout and the slices' weights (`slice_scales`)."""
    if not is_int(o["n_iter_max"], 1):
        fail("n_iter_max", o["n_iter_max"], "an int >= 1")
    if not is_number(o["tol"]) or not o["tol"] > 0:
        fail("tol", o["tol"], "a number > 0")
    if o["init"] not in ("svd", "random"):
        fail("init", o["init"], "'svd' | 'random'")
    if not is_int(o["seed"]):
        fail("seed", o["seed"], "an int")
    if not isinstance(o["whiten"], bool):
        fail("whiten", o["whiten"], f"False | True (whiten {mode} by the Cholesky factor of XᵀX)")
    if not is_number(o["damping"]) or not 0 <= o["damping"] <= 10:
        fail("damping", o["damping"], "a number in [0, 10]")
    if o["gqa"] not in GQA_LAYOUTS:
        fail("gqa", o["gqa"], " | ".join(map(repr, GQA_LAYOUTS))
             + " (every weight once, K and V beside their group's query heads; or K and V repeated per query head)")
    w = o["slice_weight"]
    if w is not None and w != "balanced" and not (isinstance(w, dict) and w and all(
            isinstance(k, str) and is_number(v) and 0 < v < float("inf") for k, v in w.items())):
        fail("slice_weight", w, "None (every matrix weighs 1), 'balanced' (each matrix's slices scaled to the same "
             "norm: the sum of relative errors) or a dict {matrix name: weight > 0}, e.g. {'k_proj': 0.3}")


def check_slice_names(o: dict, names) -> None:
    """Every name of a ``slice_weight`` dict is one of the group's matrices (`names`: their last name part)."""
    unknown = sorted(set(o["slice_weight"] if isinstance(o["slice_weight"], dict) else ()) - set(names))
    if unknown:
        fail("slice_weight", o["slice_weight"], f"names of this group's matrices ({sorted(set(names))}); "
             f"{unknown} matches none")


def check_schedule_options(o: dict) -> None:
    """The training-schedule options trained methods share (rotor, linearize): warm-up fraction, seed."""
    if not is_number(o["warmup"]) or not 0 <= o["warmup"] < 1:
        fail("warmup", o["warmup"], "a fraction of the steps in [0, 1)")
    if not is_int(o["seed"]):
        fail("seed", o["seed"], "an int")


def spec_fail(name: str, field: str, got: Any, want: Any, entry) -> None:
    """The error for a saved spec that disagrees with the entry that (supposedly) wrote it."""
    raise ValueError(f"compressed_modules[{name!r}].{field}: got {got!r}; allowed: {want!r} (what method {entry.method!r} "
                     "writes for this config entry); the checkpoint's config.json is corrupt or edited")


def attach(model: nn.Module) -> None:
    """Every method's `Method.attach` on `model` (after compression and after a load): the glue names no method."""
    for method in METHODS.values():
        method.attach(model)


def get_method(name: Any) -> "Method":
    if name not in METHODS:
        raise ValueError(f"TensorCompressionConfig.method: got {name!r}; allowed: {' | '.join(map(repr, sorted(METHODS)))}")
    return METHODS[name]


@dataclass
class Allocation:
    """One config entry's global budget: made by `Method.start_allocation` (``budget``, ``measured``), every other
    field written by the budget room alone (`hf_tensorcomp.budget`, from the `Ladder`s the method returns); the
    method reads ``share`` while it prices, and ``rungs`` / ``settings`` when it compresses (``ctx.allocation``)."""

    #: the fraction of the targeted modules' parameters to spend (``ladder`` costs' unit: parameters, or bf16
    #: parameters' worth of bytes for a byte budget)
    budget: float
    #: the ladders' losses are to be replaced by measured ones (`hf_tensorcomp.calibration.sensitivity.measured_kl`,
    #: on the weights `probes` give)
    measured: bool = False
    #: the fraction of their own size the targeted modules may spend: `budget`, or less once the embedding table
    #: (in a byte budget) took its bytes, at its widest width
    share: float | None = None
    #: {module name: what each rung of its ladder stands for}, where the rung's index is not enough (qlr: (bits, rank))
    settings: dict[str, list] = field(default_factory=dict)
    #: {module name: a callable giving its weight at its cheapest rung}, kept by `ladder` when `measured`
    probes: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    #: {module name: {a setting every module may take (qlr: a width, rank 0): the rung that stands for it}}: the
    #: plain settings the allocation must not lose to (`decompositions.allocation.allocate`'s ``seed``)
    uniform: dict[str, dict] = field(default_factory=dict)
    #: {module name: the index of the rung chosen}, once allocated
    rungs: dict[str, int] = field(default_factory=dict)
    #: what the allocation reports (``config.stats["allocation"]``)
    report: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.share is None:
            self.share = self.budget


@dataclass
class Ladder:
    """One module's rungs for a global budget, as `Method.ladder` prices them (see
    `hf_tensorcomp.decompositions.allocation`): costs increasing, losses decreasing; what the budget room records."""

    costs: list[float]
    losses: list[float]
    #: what each rung stands for, where its index is not enough (qlr: (bits, rank); latent_kv: ranks per group)
    settings: list | None = None
    #: {a plain setting every module may take: the rung that stands for it} (`Allocation.uniform`)
    uniform: dict | None = None
    #: a callable giving the module's weight at its cheapest rung (kept for a measured allocation)
    probe: Callable[[], torch.Tensor] | None = None


@dataclass
class Context:
    """What a method may need to know about the model besides the modules it compresses."""

    config: Any  # the model's (text) config
    prefix: str  # full name of the decoder-layer list, e.g. "model.layers"
    n_layers: int
    #: calibration statistics of the unit's modules ({name: ModuleStats}), when the method `needs` any
    stats: dict | None = None
    #: the entry's global budget: while its ladders are priced (``share``), and once allocated (``allocation.rungs``:
    #: {name: rung of the method's `ladder`}); else None
    allocation: Allocation | None = None
    #: the decoder-layer list itself, while pricing and compressing (for a method that re-runs a block, e.g. the
    #: attention around the projections it replaced); None while planning on the meta model
    layers: Any = None
    #: a list the budget room hands the ladders of one decoder layer, in turn: what a module's ladder made that the
    #: next one may reuse (qlr: q / k / v read one input, so one whitening factor and one GPTQ plan); None elsewhere
    scratch: list | None = None


class Method:
    name: str = ""
    default_targets: tuple[str, ...] = ()
    default_rank: Any = None
    #: calibration windows drawn when the config names none (``calibration_samples=None``); a config with several
    #: entries takes the largest of theirs
    calibration_samples: int = 32
    #: the budget used when neither rank nor target is given (methods whose natural unit is a budget)
    default_target: Any = None
    uses_rank: bool = True
    #: method-specific options and their defaults; `validate_options` rejects anything else
    option_defaults: dict[str, Any] = {}
    #: options added with a default other than what earlier releases did: the value a *saved* entry that
    #: lacks the option was written with (a checkpoint keeps loading as it was made)
    saved_defaults: dict[str, Any] = {}
    #: what to try when a result is refused (non-finite, or no better than zeros): ends the error message
    remedy: str = "another rank"
    #: module types this method can replace (leaf modules matched by `targets`)
    target_types: tuple[type, ...] = (nn.Linear,)
    #: `FactorizedModule.layer_type`s this method puts in place of a target (not counting shared-factor containers)
    layer_types: tuple[str, ...] = ()

    #: True when `compress` treats each module of a unit on its own (compressing them one by one gives the same
    #: modules): a distributed run then deals a layer's matrices out over the ranks, not whole units
    per_matrix: bool = False

    #: True when the method leaves ordinary transformers modules (a smaller config, no factored
    #: module): a model compressed only by such methods is saved as a plain transformers checkpoint
    structural: bool = False
    #: the error `plan.plan` raises when no module of the model is a target (None: the generic one)
    no_target_error: str | None = None

    def is_target(self, module: nn.Module) -> bool:
        """Whether a module matched by `targets` is one this method compresses."""
        return isinstance(module, self.target_types)

    def finish(self, model: nn.Module, entry, ctx: "Context", runner) -> dict | None:
        """A whole-model step after every unit is compressed (calibration `runner` or None); its
        returned stats (if any) go into ``config.stats``."""
        return None

    def validate_options(self, options: dict) -> dict:
        unknown = sorted(set(options) - set(self.option_defaults))
        if unknown:
            allowed = sorted(self.option_defaults) or "none"
            raise ValueError(f"TensorCompressionConfig: unknown option(s) {unknown} for method {self.name!r}; allowed: {allowed}")
        out = dict(self.option_defaults)
        out.update(options)
        return out

    def validate_rank(self, rank, options: dict):
        return validate_rank(rank)

    def validate_target(self, target, options: dict):
        """``target``: the fraction of the targeted modules' parameters (or bytes) kept, in (0, 1)."""
        if not self.supports_target:
            fail("target", target, f"None: method {self.name!r} takes no global budget (use its rank options)")
        if not is_number(target) or not 0 < target < 1:
            fail("target", target, "a float in (0, 1): the fraction of the targeted modules' parameters kept")
        return float(target)

    #: whether the entry's ``group_size`` is the method's own (quantizing methods); saved with it
    uses_group_size: bool = False

    #: whether `target=` (a budget over all targeted modules) is accepted
    supports_target: bool = False

    #: whether the global budget counts bytes (``target_bytes``): with ``embedding_bits`` it holds the table too
    byte_budget: bool = False

    def settle(self, entry, calibrated: bool, streaming: bool) -> None:
        """Fix the options whose best value depends on the run (``"auto"``), in ``entry.options``, before any
        work: `calibrated`, whether the config has calibration text; `streaming`, whether the model is streamed
        (`compress_checkpoint`), so no backward pass of the whole model. The saved config records what ran."""

    def needs(self, entry) -> frozenset:
        """Calibration statistics (`hf_tensorcomp.calibration.KINDS`) each targeted module must come with."""
        return frozenset()

    def allocates(self, entry) -> bool:
        """True when `entry.target` is to be met by a global allocation over `ladder` rungs."""
        return False

    def start_allocation(self, entry) -> Allocation:
        """The state of an allocation of `entry`'s budget (`allocates`): its budget (default ``entry.target``), and
        whether its losses are measured."""
        return Allocation(budget=entry.target)

    def budget_hint(self, entry, alloc: Allocation) -> str:
        """What else, besides a larger budget, lets an allocation this entry's budget cannot meet go through
        (appended to the error's "allowed:"; empty when nothing)."""
        return ""

    def ladder_needs(self, entry) -> frozenset:
        """Statistics the `target` allocation reads (gathered in a first pass over the dense model)."""
        return frozenset()

    def ladder(self, name: str, module: nn.Module, stats, entry, ctx: Context) -> Ladder:
        """The rungs a `target` allocation may choose from for one module (`Ladder`), priced on its statistics;
        ``ctx``: the model's config, the decoder layers and the allocation so far (``ctx.allocation.share``). Rung
        ``j`` is what `compress` finds in ``ctx.allocation.rungs``."""
        raise NotImplementedError

    def table_ladder(self, name: str, head: nn.Module, stats, entry, ctx: Context, bits, group_size: int,
                     copies: int) -> Ladder:
        """The embedding table's rungs in a byte budget (``embedding_bits="auto"``): one per width of `bits`, in
        groups of `group_size`, its loss that of the output `head` it is read as; `copies`: 2 for an untied head
        stored beside it. Only methods with a byte budget (`byte_budget`) hold the table."""
        raise NotImplementedError

    def attach(self, model: nn.Module) -> None:
        """Wire up what this method's modules need at run time beyond their weights (called after compression and
        after every load, on any model: a no-op where none of its modules are)."""

    def targets_for(self, options: dict) -> tuple[str, ...]:
        return self.default_targets

    def units(self, entry, layers: list[int], n_layers: int) -> list[list[int]]:
        """Group the chosen layers into units decomposed together (default: one layer each)."""
        return [[i] for i in layers]

    def check_unit(self, modules: dict[str, nn.Module], entry, ctx: Context) -> None:
        """Raise ValueError if `entry` cannot be applied (called on the meta model, before any weight loads)."""

    def check_spec(self, name: str, spec: dict, entry, unit: dict[str, nn.Module], ctx: Context) -> str | None:
        """Raise ValueError if a saved `spec` for module `name` is not what this method writes for `entry`.

        `unit`: {full name: the dense module it replaces (on meta)} for the modules compressed together
        with `name` (one unit of `plan.plan`), in compression order.

        Returns the full name of the shared-factors container the module reads, or None.
        """
        return None

    def compress(self, modules: dict[str, nn.Module], entry, ctx: Context) -> dict[str, tuple[nn.Module, dict]]:
        """Compress one unit. Returns, per name, the new module and a stats dict (at least ``rel_error``)."""
        raise NotImplementedError
