"""Per-module statistics of the inputs a linear layer sees on calibration text.

A method declares the *kinds* it needs (`Method.needs`); only those are gathered:

- ``"gram"``: XᵀX summed over every calibration token (float64, in x in) and the token count ``n``;
- ``"abs_mean"``: mean |x| per input channel (ASVD's scale);
- ``"inputs"``: the input rows themselves (float32, tokens x in) for methods that train on them;
- ``"fisher"``: the mean squared loss gradient of the module's *outputs* (`sensitivity.output_fisher`,
  one backward pass of the dense model; only for budget allocation).

Modules that read the same tensor (q/k/v, gate/up) share one Gram product per batch.
"""

from __future__ import annotations

import torch

KINDS = ("gram", "abs_mean", "inputs", "fisher")


class ModuleStats:
    def __init__(self, kinds):
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown calibration statistic(s) {sorted(unknown)}; allowed: {KINDS}")
        self.kinds = frozenset(kinds)
        self.n = 0
        self.gram: torch.Tensor | None = None
        self._abs_sum: torch.Tensor | None = None
        self._inputs: list[torch.Tensor] = []
        self.fisher: torch.Tensor | None = None  # per output channel, set by the pipeline

    def add(self, x: torch.Tensor, gram: torch.Tensor | None = None) -> None:
        """x: (tokens, in) float32 rows; gram: its XᵀX if already computed for a sibling module."""
        self.n += x.shape[0]
        if "gram" in self.kinds:
            g = (x.T @ x if gram is None else gram).double().cpu()
            self.gram = g if self.gram is None else self.gram.add_(g)
        if "abs_mean" in self.kinds:
            s = x.abs().sum(0, dtype=torch.float64).cpu()
            self._abs_sum = s if self._abs_sum is None else self._abs_sum.add_(s)
        if "inputs" in self.kinds:
            self._inputs.append(x.detach().cpu().clone())

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

    def __init__(self, layer: torch.nn.Module, wanted: dict[str, frozenset], layer_prefix: str):
        self.stats = {name: ModuleStats(kinds) for name, kinds in wanted.items()}
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, its gram): shared by siblings
        self._handles = [
            layer.get_submodule(name[len(layer_prefix):]).register_forward_hook(self._hook(name)) for name in wanted
        ]

    def _hook(self, name):
        st = self.stats[name]

        def hook(module, args, output):
            x = args[0]
            x2 = x.detach().reshape(-1, x.shape[-1]).float()
            gram = None
            if "gram" in st.kinds:
                if self._last is not None and self._last[0] is x:
                    gram = self._last[1]
                else:
                    gram = x2.T @ x2
                    self._last = (x, gram)
            st.add(x2, gram)

        return hook

    def close(self) -> dict[str, ModuleStats]:
        for h in self._handles:
            h.remove()
        self._last = None
        return self.stats
