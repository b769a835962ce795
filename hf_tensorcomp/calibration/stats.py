"""Per-module statistics of the inputs a linear layer sees on calibration text.

A method declares the *kinds* it needs (`Method.needs`); only those are gathered:

- ``"gram"``: XᵀX summed over every calibration token (float64, in x in) and the token count ``n``;
- ``"abs_mean"``: mean |x| per input channel (ASVD's scale);
- ``"inputs"``: the input rows themselves (float32, tokens x in) for methods that train on them;
- ``"cross"``: X_denseᵀ X, the inputs the *dense* model gives this module against the inputs it gets
  in the partly compressed model (same tokens), so a method can fit the dense outputs from the
  inputs it will really see (error correction; needs ``propagate=True``, else it equals the Gram);
- ``"fisher"``: the mean squared loss gradient of the module's *outputs* (`sensitivity.output_fisher`,
  one backward pass of the dense model; only for budget allocation);
- ``"attention"``: the calls of the module's *parent* (the attention block of a q/k/v projection):
  per calibration batch, its positional and keyword arguments (hidden states, position embeddings,
  mask) and its output, so a method can re-run the block with replaced projections and fit what
  follows them to the block's original output (rotor's ``retrain_o``). Siblings share one list;
- ``"calls"``: the same record of the module's *own* calls (a whole attention block that a method
  replaces and trains on its real inputs and outputs: ``linearize``); its input rows are not gathered;
- ``"sequences"``: the module's input hidden states with their (batch, sequence, features) shape
  kept (float32), for a method that re-runs a sequence operation (state reduction's short conv);
- ``"weight_grad"``: the gradient of the language-modelling loss summed over the calibration text
  for each of the module's parameters (`sensitivity.weight_gradients`, one backward pass of the
  dense model before anything changes; state reduction's Grad scorer).

A module may be called with its input as a keyword (``hidden_states=``, e.g. the Gated DeltaNet
mixers); the hooks read it from there.

Modules that read the same tensor (q/k/v, gate/up) share one Gram product per batch.
"""

from __future__ import annotations

import torch

from ..decompositions.svd import gram_of
from ..layout import first_output

KINDS = ("gram", "abs_mean", "inputs", "fisher", "cross", "attention", "calls", "sequences", "weight_grad")
#: kinds filled by a pass of their own rather than by the per-layer hooks
PASS_KINDS = frozenset({"fisher", "weight_grad"})
#: the kinds read from a module's input rows (a hook on the module itself)
ROW_KINDS = frozenset({"gram", "abs_mean", "inputs", "cross", "attention", "sequences"})


class ModuleStats:
    def __init__(self, kinds):
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown calibration statistic(s) {sorted(unknown)}; allowed: {KINDS}")
        self.kinds = frozenset(kinds)
        self.n = 0
        self.gram: torch.Tensor | None = None
        self.cross: torch.Tensor | None = None
        self._abs_sum: torch.Tensor | None = None
        self._inputs: list[torch.Tensor] = []
        self.fisher: torch.Tensor | None = None  # per output channel, set by the pipeline
        self.weight_grad: dict[str, torch.Tensor] | None = None  # {parameter name: dL/dW}, set by the pipeline
        self._sequences: list[torch.Tensor] = []
        #: ``"attention"``: [(args, kwargs, output), ...] of the parent block's calls, one per batch
        self.attention: list[tuple[tuple, dict, torch.Tensor]] = []
        #: ``"calls"``: the same for the module's own calls
        self.calls: list[tuple[tuple, dict, torch.Tensor]] = []

    def add(self, x: torch.Tensor, gram: torch.Tensor | None = None, dense_x: torch.Tensor | None = None) -> None:
        """x: (tokens, in) float32 rows; gram: its XᵀX if already computed for a sibling module;
        dense_x: the dense model's inputs on the same tokens (for ``"cross"``; None: x itself)."""
        self.n += x.shape[0]
        if "cross" in self.kinds:
            c = (x.T @ x if dense_x is None else dense_x.T @ x).double().cpu()
            self.cross = c if self.cross is None else self.cross.add_(c)
        if "gram" in self.kinds:
            g = (x.T @ x if gram is None else gram).double().cpu()
            self.gram = g if self.gram is None else self.gram.add_(g)
        if "abs_mean" in self.kinds:
            s = x.abs().sum(0, dtype=torch.float64).cpu()
            self._abs_sum = s if self._abs_sum is None else self._abs_sum.add_(s)
        if "inputs" in self.kinds:
            self._inputs.append(x.detach().cpu().clone())

    def to(self, device) -> "ModuleStats":
        """The summed statistics (Gram, cross, |x| sums, Fisher, weight gradients) moved to `device`, the layer's:
        they are gathered on the host (float64, the device's memory kept for the layer), and used beside its
        weights. The input rows and sequences stay on the host (the methods that train on them move batches)."""
        for name in ("gram", "cross", "_abs_sum", "fisher"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        if self.weight_grad is not None:
            self.weight_grad = {k: v.to(device) for k, v in self.weight_grad.items()}
        return self

    def add_sequences(self, x: torch.Tensor) -> None:
        self._sequences.append(x.detach().float().cpu().clone())

    @property
    def sequences(self) -> list[torch.Tensor]:
        """The inputs, one (batch, sequence, features) tensor per calibration batch."""
        return self._sequences

    @property
    def abs_mean(self) -> torch.Tensor:
        return self._abs_sum / max(self.n, 1)

    @property
    def inputs(self) -> torch.Tensor:
        if len(self._inputs) > 1:
            self._inputs = [torch.cat(self._inputs)]
        return self._inputs[0]


class StatsHooks:
    """Forward hooks filling `ModuleStats` for named submodules of one decoder layer."""

    def __init__(self, layer: torch.nn.Module, wanted: dict[str, frozenset], layer_prefix: str,
                 dense_inputs: dict[str, list[torch.Tensor]] | None = None):
        self.stats = {name: ModuleStats(kinds) for name, kinds in wanted.items()}
        self._dense = dense_inputs  # {name: [rows of batch 0, batch 1, ...]} from the dense stream
        self._batch = {name: 0 for name in wanted}
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, its gram): shared by siblings
        self._handles = [
            layer.get_submodule(name[len(layer_prefix):]).register_forward_hook(self._hook(name), with_kwargs=True)
            for name, kinds in wanted.items() if kinds & ROW_KINDS or not kinds
        ]
        for name, st in self.stats.items():
            if "calls" in st.kinds:
                self._handles.append(layer.get_submodule(name[len(layer_prefix):]).register_forward_hook(
                    _recorder(st.calls), with_kwargs=True))
        calls_of: dict[str, list] = {}  # parent block -> its recorded calls, shared by its children's stats
        for name, st in self.stats.items():
            if "attention" in st.kinds:
                parent = name[len(layer_prefix):].rpartition(".")[0]
                if parent not in calls_of:
                    calls_of[parent] = []
                    self._handles.append(layer.get_submodule(parent).register_forward_hook(
                        _recorder(calls_of[parent]), with_kwargs=True))
                st.attention = calls_of[parent]

    def _hook(self, name):
        st = self.stats[name]

        def hook(module, args, kwargs, output):
            x = args[0] if args else kwargs["hidden_states"]
            if "sequences" in st.kinds:
                st.add_sequences(x)
            x2 = x.detach().reshape(-1, x.shape[-1]).float()
            gram = None
            if "gram" in st.kinds:
                if self._last is not None and self._last[0] is x:
                    gram = self._last[1]
                else:
                    gram = gram_of(x2)
                    self._last = (x, gram)
            dense_x = None
            if self._dense is not None and name in self._dense:
                dense_x = self._dense[name][self._batch[name]]
            self._batch[name] += 1
            st.add(x2, gram, dense_x)

        return hook

    def close(self) -> dict[str, ModuleStats]:
        for h in self._handles:
            h.remove()
        self._last = None
        return self.stats


def _detached(v):
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, (tuple, list)):
        return type(v)(_detached(t) for t in v)
    return v


def _recorder(calls: list):
    """A forward hook (``with_kwargs=True``) appending (args, kwargs, first output) to `calls`."""
    def hook(module, args, kwargs, output):
        calls.append((_detached(args), {k: _detached(v) for k, v in kwargs.items()}, first_output(output).detach()))
    return hook


class InputCapture:
    """Forward hooks keeping the input rows (float32) of named submodules, batch by batch."""

    def __init__(self, layer: torch.nn.Module, names, layer_prefix: str):
        self.rows: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        self._handles = [layer.get_submodule(n[len(layer_prefix):]).register_forward_hook(self._hook(n)) for n in names]

    def _hook(self, name):
        def hook(module, args, output):
            x = args[0]
            self.rows[name].append(x.detach().reshape(-1, x.shape[-1]).float())
        return hook

    def close(self) -> dict[str, list[torch.Tensor]]:
        for h in self._handles:
            h.remove()
        return self.rows
