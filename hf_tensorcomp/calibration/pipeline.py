"""The sequential, layer-by-layer calibration pipeline (the way GPTQ's and llm-compressor's work).

1. The inputs of the first decoder layer are captured once, together with the keyword arguments
   *every* layer is called with (attention masks and position embeddings: Gemma3's sliding and
   global layers get different ones), by running the base model with each layer's forward swapped
   for a recorder that passes its input through (no layer computes; the LM head never runs).
2. For each layer in turn: hooks gather the statistics the layer's methods asked for while the layer
   runs over the calibration batches; a callback compresses the layer from them; the layer's outputs
   are recomputed with the compressed layer and become the next layer's inputs (``propagate=True``:
   later layers see, and their statistics correct for, earlier errors), or the dense outputs are used
   (``propagate=False``). When a method asks for ``"cross"`` statistics, the dense model's hidden
   states are carried along as a second stream, so each module's dense inputs can be paired with the
   inputs it gets in the partly compressed model.

Peak memory: the model, one layer's statistics and two copies of the hidden states of the
calibration batch (samples x length x hidden, float of the model's dtype).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from .stats import PASS_KINDS, InputCapture, ModuleStats, StatsHooks


class _Stop(Exception):
    pass


class LayerwiseRunner:
    """Holds the captured layer inputs and runs the calibration batches through one layer at a time."""

    def __init__(self, model: nn.Module, prefix: str, layers: nn.ModuleList, ids: torch.Tensor, batch_size: int = 8):
        self.model, self.prefix, self.layers, self.ids = model, prefix, layers, ids
        #: {module name: per-output-channel Fisher} from `sensitivity.output_fisher`, attached to every
        #: statistic of that module the runner hands out (computed once, on the dense model)
        self.fisher: dict[str, torch.Tensor] = {}
        self.fisher_fallback: list[str] = []  # modules whose Fisher is the fallback (see `output_fisher`)
        #: {module name: the loss gradient of its weight} from `sensitivity.weight_gradients`, likewise
        self.weight_grad: dict[str, torch.Tensor] = {}
        base = model.get_submodule(prefix.rpartition(".")[0])  # the decoder stack: embeddings, layers, norm
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))  # streamed: some on meta
        self.hidden: list[torch.Tensor] = []
        self.kwargs: list[list[dict]] = []  # [batch][layer] -> kwargs of that layer's call
        for batch in ids.split(batch_size):
            calls: list[dict] = []

            def recorder(li):
                def forward(hidden_states, *args, **kwargs):
                    if args:
                        raise RuntimeError(f"hf_tensorcomp calibration: decoder layer {li} got positional arguments "
                                           "beyond the hidden states; this architecture is not supported")
                    if li == 0:
                        self.hidden.append(hidden_states.detach())
                    calls.append(kwargs)
                    return hidden_states

                return forward

            for li, layer in enumerate(layers):
                layer.forward = recorder(li)
            try:
                with torch.no_grad():
                    base(input_ids=batch.to(device), use_cache=False)
            finally:
                for layer in layers:
                    del layer.forward
            if len(calls) != len(layers):
                raise RuntimeError(f"hf_tensorcomp calibration: {len(calls)} of {len(layers)} decoder layers were called")
            self.kwargs.append(calls)
        if not all(bool(torch.isfinite(h).all()) for h in self.hidden):
            raise ValueError("hf_tensorcomp calibration: the embeddings of the calibration tokens are not finite (Inf/NaN); "
                             "check the model's input embedding weights")

    @property
    def n_tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)

    def _forward(self, li: int, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
        layer = self.layers[li]
        with torch.no_grad():
            out = [layer(h, **kw[li]) for h, kw in zip(hidden, self.kwargs)]
        return [o[0] if isinstance(o, tuple) else o for o in out]

    def _check_finite(self, li: int, out: list[torch.Tensor], when: str) -> None:
        """Stop at the first decoder layer whose outputs are not finite (its inputs were), naming it."""
        if not all(bool(torch.isfinite(o).all()) for o in out):
            raise ValueError(f"hf_tensorcomp calibration: the outputs of decoder layer {li} ({self.prefix}.{li}){when} are "
                             "not finite (Inf/NaN) on the calibration batch, its inputs were; check that layer's weights "
                             "and the model's dtype (float16 overflows where bfloat16 / float32 do not)")

    def run(
        self,
        wanted: dict[int, dict[str, frozenset]],
        on_layer: Callable[[int, dict[str, ModuleStats]], bool],
        last: int,
        propagate: bool = True,
        progress: bool = True,
        desc: str = "hf_tensorcomp: calibrated compression",
        stream=None,
    ) -> None:
        """Layers 0..last in order: gather `wanted[li]` ({module name under the layer list: kinds}),
        call ``on_layer(li, stats)`` (True if it changed the layer), move the hidden states on.
        `stream`: ``stream.upto(li)`` before layer ``li`` runs (loads it, releases those before it)."""
        hidden = list(self.hidden)
        # a second, dense stream only when some module asks for "cross" and the streams can differ
        paired = propagate and any("cross" in k for w in wanted.values() for k in w.values())
        dense = list(self.hidden) if paired else None
        for li in tqdm(range(last + 1), desc=desc, disable=not progress, unit="layer"):
            if stream is not None:  # layers streamed from a checkpoint: this one loaded, the ones before released
                stream.upto(li)
            want = {n: k - PASS_KINDS for n, k in wanted.get(li, {}).items()}
            dense_inputs = None
            if paired:
                cap = InputCapture(self.layers[li], [n for n, k in want.items() if "cross" in k], f"{li}.")
                try:
                    dense_out = self._forward(li, dense)
                finally:
                    dense_inputs = cap.close()
            hooks = StatsHooks(self.layers[li], want, f"{li}.", dense_inputs)
            try:
                out = self._forward(li, hidden)
            finally:
                stats = hooks.close()
            self._check_finite(li, out, "")
            for n, st in stats.items():
                st.kinds = wanted[li][n]
                st.fisher = self.fisher.get(n)
                st.weight_grad = self.weight_grad.get(n)
            changed = on_layer(li, stats)
            del stats
            if changed and propagate and li < last:
                out = self._forward(li, hidden)
                self._check_finite(li, out, " once compressed")
            hidden = out
            if paired:
                dense = dense_out
