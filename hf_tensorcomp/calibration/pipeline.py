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
calibration batch (samples x length x hidden, float of the model's dtype). With ``states_dir`` the
hidden states live in files there instead (`DiskStates`, one per batch) and memory holds one batch
of them at a time.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

from .. import distributed
from ..layout import first_output
from .stats import PASS_KINDS, InputCapture, ModuleStats, StatsHooks


class _Stop(Exception):
    pass


class DiskStates:
    """The hidden states of the calibration batches as files in ``folder`` (one safetensors file per batch),
    read back one batch at a time: a sequence of tensors like the list it stands in for."""

    def __init__(self, folder: Path, tensors: Iterable[torch.Tensor]):
        from safetensors.torch import save_file

        folder.mkdir(parents=True)
        self.folder, self.shapes = folder, []
        for i, t in enumerate(tensors):
            save_file({"h": t.contiguous()}, str(folder / f"{i}.safetensors"))
            self.shapes.append(tuple(t.shape))

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, i: int) -> torch.Tensor:
        from safetensors.torch import load_file

        return load_file(str(self.folder / f"{i}.safetensors"))["h"]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def drop(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def drop_states(states, *keep) -> None:
    """Remove `states`' files when it is a `DiskStates` none of `keep` still uses."""
    if isinstance(states, DiskStates) and all(states is not k for k in keep):
        states.drop()


class LayerwiseRunner:
    """Holds the captured layer inputs and runs the calibration batches through one layer at a time.

    ``states_dir``: a folder for the hidden states (`DiskStates`) instead of memory. ``distribute``: in a distributed
    run (`hf_tensorcomp.distributed`), this rank holds its share of the batches and each layer's statistics are summed
    over the ranks (compression); else every rank holds every batch (healing's runners)."""

    def __init__(self, model: nn.Module, prefix: str, layers: nn.ModuleList, ids: torch.Tensor, batch_size: int = 8,
                 states_dir: str | Path | None = None, distribute: bool = False):
        self.model, self.prefix, self.layers, self.ids, self.batch_size = model, prefix, layers, ids, batch_size
        self.states_dir = None if states_dir is None else Path(states_dir)
        self._written = 0  # DiskStates folders made so far (each gets a fresh name)
        #: {module name: per-output-channel Fisher} from `sensitivity.output_fisher`, attached to every
        #: statistic of that module the runner hands out (computed once, on the dense model)
        self.fisher: dict[str, torch.Tensor] = {}
        self.fisher_fallback: list[str] = []  # modules whose Fisher is the fallback (see `output_fisher`)
        #: {module name: the loss gradient of its weight} from `sensitivity.weight_gradients`, likewise
        self.weight_grad: dict[str, torch.Tensor] = {}
        base = model.get_submodule(prefix.rpartition(".")[0])  # the decoder stack: embeddings, layers, norm
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))  # streamed: some on meta
        self.kwargs: list[list[dict]] = []  # [batch][layer] -> kwargs of that layer's call
        batches = ids.split(batch_size)
        #: distributed (`hf_tensorcomp.distributed`): this rank runs its share of the batches, the statistics are summed
        self.group, self.n_batches = distributed.group() if distribute else None, len(batches)
        if self.group is not None:
            distributed.agree(self.group, "calibration", calibration_ids=distributed.fingerprint(ids))
            batches = [batches[i] for i in self.group.mine(
                len(batches), "calibration batches", f"{ids.shape[0]} samples in batches of {batch_size}: more "
                "calibration_samples or a smaller calibration_batch_size")]

        def captured():  # each batch's layer-0 inputs, as they are captured (kept, or written, one by one)
            for batch in batches:
                calls: list[dict] = []
                first: list[torch.Tensor] = []

                def recorder(li):
                    def forward(hidden_states, *args, **kwargs):
                        if args:
                            raise RuntimeError(f"hf_tensorcomp calibration: decoder layer {li} got positional arguments "
                                               "beyond the hidden states; this architecture is not supported")
                        if li == 0:
                            first.append(hidden_states.detach())
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
                if not bool(torch.isfinite(first[0]).all()):
                    raise ValueError("hf_tensorcomp calibration: the embeddings of the calibration tokens are not finite "
                                     "(Inf/NaN); check the model's input embedding weights")
                self.kwargs.append(calls)
                yield first[0]

        self.hidden = self._keep(captured())

    @property
    def samples(self) -> int:
        return sum(s[0] for s in self._shapes())

    @property
    def n_tokens(self) -> int:
        return sum(s[0] * s[1] for s in self._shapes())

    def _shapes(self) -> list[tuple]:
        if self.group is not None:  # every rank's batches
            return [tuple(b.shape) for b in self.ids.split(self.batch_size)]
        return self.hidden.shapes if isinstance(self.hidden, DiskStates) else [tuple(h.shape) for h in self.hidden]

    def _keep(self, tensors: Iterable[torch.Tensor]):
        """The batches' states as a list, or written one by one to a fresh `DiskStates` folder."""
        if self.states_dir is None:
            return list(tensors)
        self._written += 1
        return DiskStates(self.states_dir / f"states-{self._written}", tensors)

    def _forward(self, li: int, hidden) -> list[torch.Tensor] | DiskStates:
        layer = self.layers[li]

        def outputs():
            for h, kw in zip(hidden, self.kwargs):
                with torch.no_grad():
                    o = layer(h, **kw[li])
                yield first_output(o)

        return self._keep(outputs())

    def close(self) -> None:
        """Remove the states' files (``states_dir``); the runner cannot run again."""
        drop_states(self.hidden)

    def _check_finite(self, li: int, out: list[torch.Tensor], when: str) -> None:
        """Stop at the first decoder layer whose outputs are not finite (its inputs were), naming it."""
        finite = all(bool(torch.isfinite(o).all()) for o in out)
        if self.group is not None:  # every rank stops alike
            finite = all(self.group.gather(finite, f"decoder layer {li}"))
        if not finite:
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
        keep_last: bool = False,
        after: Callable[[int], None] | None = None,
    ):
        """Layers 0..last in order: gather `wanted[li]` ({module name under the layer list: kinds}),
        call ``on_layer(li, stats)`` (True if it changed the layer), move the hidden states on.
        `stream`: ``stream.upto(li)`` before layer ``li`` runs (loads it, releases those before it).
        `keep_last`: return layer `last`'s outputs (recomputed once it changed, with `propagate`; the caller
        drops them with `drop_states`), else None. `after(li)`: called once layer ``li``'s outputs are the
        next layer's inputs (before the stream moves past it)."""
        hidden = self.hidden
        # a second, dense stream only when some module asks for "cross" and the streams can differ
        paired = propagate and any("cross" in k for w in wanted.values() for k in w.values())
        dense = self.hidden if paired else None
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
            distributed.reduce_stats(self.group, stats, self.n_batches, f"decoder layer {li}")
            self._check_finite(li, out, "")
            device = next((p.device for p in self.layers[li].parameters()), None)  # the layer ran: not on meta
            for n, st in stats.items():
                st.kinds = wanted[li][n]
                st.fisher = self.fisher.get(n)
                st.weight_grad = self.weight_grad.get(n)
                if device is not None:
                    st.to(device)  # gathered on the host; a no-op on the CPU
            st = None  # the loop's last statistics: on_layer may free them
            changed = on_layer(li, stats)
            del stats
            if changed and propagate and (li < last or keep_last):  # the outputs again, from the compressed layer
                drop_states(out, self.hidden)
                out = None  # the dense layer's outputs are not needed: freed before the forward, not after it
                out = self._forward(li, hidden)
                self._check_finite(li, out, " once compressed")
            drop_states(hidden, self.hidden, dense)
            hidden = out
            if paired:
                drop_states(dense, self.hidden, hidden)
                dense = dense_out
            if after is not None:
                after(li)
        drop_states(dense, self.hidden, hidden)
        if keep_last:
            return hidden
        drop_states(hidden, self.hidden)
        return None

    def drop_states(self, states) -> None:
        """Remove the files of states `run` returned (``keep_last``), unless they are the runner's own."""
        drop_states(states, self.hidden)
