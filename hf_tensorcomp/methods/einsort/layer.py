"""`EinSortLinear`: a linear layer whose weight is stored as a sorted tensorization (EinSort).

The stored form is exactly what `hf_tensorcomp.methods.einsort.decomposition.EinSortTensor.to_dict` gives:

- ``weight``: every stored factor entry, concatenated (1-D, the factor dtype) — never the dense shape;
- ``perm``, ``signs``, ``pivots``: uint8 buffers holding the bit-packed permutation indices
  (ceil(log2 n) bits each), sign bits (1 per entry) and block-identity pivot indices; persistent,
  so ``save_pretrained`` writes them into the safetensors file next to the factors;
- ``in_scale`` (activation-aware only): the ASVD input-channel scaling s; the stored weight
  approximates W diag(s), and the layer divides it back out.

A sorted layout cannot run factored (the permutation scatters entries of the product), so the
forward multiplies with the dense weight rebuilt from these tensors. ``cache_weight=True`` (default)
rebuilds it once — at the first forward after a load, a device or dtype move, or a change of the
stored tensors — and keeps it (not saved: the checkpoint holds only the stored form), so inference
runs at dense speed and holds the dense weight in memory next to the stored form.
``cache_weight=False`` rebuilds it at every call: memory holds only the stored form (plus one weight
while it is used), each forward pays the rebuild. Either way the stored tensors get no gradient
(the rebuild reads them detached); LoRA adapters on the layer do (`hf_tensorcomp.integration.peft`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .decomposition import EinSortTensor
from ...layers.base import FactorizedModule, change_key, register_layer

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_BUFFERS = ("pivots", "perm", "signs")


@register_layer
class EinSortLinear(FactorizedModule):
    """Stands in for ``nn.Linear(in_features, out_features)``; see the module doc for the stored tensors.

    ``meta``: the `EinSortTensor` metadata (its ``shape`` is the tensor that was fitted: the weight,
    transposed if ``transposed``, reshaped). ``factor_dtype``: a pinned factor dtype (e.g. bfloat16
    factors in a float32 model) or None (the factors follow the model's dtype).
    """

    layer_type = "einsort_linear"
    spec_fields = {"in_features": "int>=1", "out_features": "int>=1", "bias": "bool", "transposed": "bool", "cache_weight": "bool",
                   "scaled": "bool", "factor_dtype": (None, *_DTYPES), "einsort": "dict"}

    def __init__(self, in_features: int, out_features: int, meta: dict, transposed: bool = False, bias: bool = False,
                 scaled: bool = False, factor_dtype: str | None = None, dtype=None, device=None, cache_weight: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.cache_weight = cache_weight
        self._cached = None  # (key, weight): see `_weight_for`
        self.meta, self.transposed, self.scaled, self.factor_dtype = dict(meta), transposed, scaled, factor_dtype
        self.compute_dtype = dtype or torch.get_default_dtype()
        fdtype = _DTYPES[factor_dtype] if factor_dtype else self.compute_dtype
        specs = EinSortTensor.tensor_specs(self.meta)
        self.weight = nn.Parameter(torch.empty(specs["cores"][0], dtype=fdtype, device=device))
        for name in _BUFFERS:
            if name in specs:
                self.register_buffer(name, torch.empty(specs[name][0], dtype=torch.uint8, device=device))
            else:
                setattr(self, name, None)
        self.in_scale = nn.Parameter(torch.empty(in_features, dtype=fdtype, device=device), requires_grad=False) if scaled else None
        self.bias = nn.Parameter(torch.empty(out_features, dtype=self.compute_dtype, device=device)) if bias else None

    @classmethod
    def from_fitted(cls, fitted: EinSortTensor, in_features: int, out_features: int, transposed: bool = False,
                    bias: torch.Tensor | None = None, in_scale: torch.Tensor | None = None,
                    factor_dtype: str | None = None, dtype=None, cache_weight: bool = True) -> "EinSortLinear":
        tensors, meta = fitted.to_dict()
        dtype = dtype or torch.float32
        m = cls(in_features, out_features, meta, transposed=transposed, bias=bias is not None, scaled=in_scale is not None,
                factor_dtype=factor_dtype, dtype=dtype, device=tensors["cores"].device, cache_weight=cache_weight)
        with torch.no_grad():
            m.weight.copy_(tensors["cores"])
            for name in _BUFFERS:
                if name in tensors:
                    getattr(m, name).copy_(tensors[name])
            if in_scale is not None:
                m.in_scale.copy_(in_scale)
            if bias is not None:
                m.bias.copy_(bias)
        return m

    def fitted(self) -> EinSortTensor:
        tensors = {"cores": self.weight.detach()}
        tensors.update({n: getattr(self, n) for n in _BUFFERS if getattr(self, n) is not None})
        return EinSortTensor.from_dict(tensors, self.meta)

    def _weight_fp32(self) -> torch.Tensor:
        w = self.fitted().reconstruct(torch.float32)
        w = w.reshape(self.in_features, self.out_features).T if self.transposed else w.reshape(self.out_features, self.in_features)
        if self.in_scale is not None:
            w = w / self.in_scale.float()
        return w

    def _stored(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.pivots, self.perm, self.signs, self.in_scale) if t is not None]

    def _weight_for(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight at ``dtype``: kept from an earlier call unless a stored tensor moved or changed."""
        key = (dtype, *change_key(self._stored()))
        if self._cached is None or self._cached[0] != key:
            self._cached = None  # free the old weight before building the new one
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable outside inference mode too
                self._cached = (key, self._weight_fp32().to(dtype))
        return self._cached[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.cache_weight:
            self._cached = None
            return F.linear(x, self._weight_fp32().to(x.dtype), self.bias)
        return F.linear(x, self._weight_for(x.dtype), self.bias)

    def _apply(self, fn, recurse=True):
        self._cached = None  # a device / dtype move: rebuild at the next forward, from the moved tensors
        return super()._apply(fn, recurse)

    def cached_nbytes(self) -> int:
        """Bytes of the dense weight kept for the forward (0 if none is kept now)."""
        return 0 if self._cached is None else self._cached[1].numel() * self._cached[1].element_size()

    def dense_weight(self) -> torch.Tensor:
        return self._weight_fp32().to(self.compute_dtype)

    def to_dense(self) -> nn.Module:
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=self.compute_dtype,
                        device=self.weight.device)
        with torch.no_grad():
            lin.weight.copy_(self.dense_weight())
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin

    def nbytes(self) -> int:
        """Honest bytes of the stored weight: factors at their dtype + packed bits (+ the ASVD scale); bias excluded."""
        n = self.weight.numel() * self.weight.element_size()
        n += sum(getattr(self, b).numel() for b in _BUFFERS if getattr(self, b) is not None)
        if self.in_scale is not None:
            n += self.in_scale.numel() * self.in_scale.element_size()
        return n

    def spec(self) -> dict:
        return {"layer": self.layer_type, "in_features": self.in_features, "out_features": self.out_features,
                "bias": self.bias is not None, "transposed": self.transposed, "scaled": self.scaled,
                "factor_dtype": self.factor_dtype, "cache_weight": self.cache_weight, "einsort": self.meta}

    @classmethod
    def check_spec(cls, name: str, spec: dict) -> None:
        """The generic field checks, then the EinSort layout: it must describe an out x in weight (tried on meta)."""
        super().check_spec(name, spec)
        meta = spec["einsort"]
        try:
            specs = EinSortTensor.tensor_specs(meta)
            tensors = {k: torch.empty(shape, dtype=dt, device="meta") for k, (shape, dt) in specs.items()}
            numel = EinSortTensor.from_dict(tensors, meta).reconstruct().numel()
        except Exception as e:  # any malformed field: KeyError, TypeError, ValueError, RuntimeError, ...
            raise ValueError(f"compressed_modules[{name!r}].einsort: not a valid EinSort layout ({type(e).__name__}: {e}); "
                             "the checkpoint's config.json is corrupt or edited") from None
        if numel != spec["in_features"] * spec["out_features"]:
            raise ValueError(f"compressed_modules[{name!r}].einsort.shape: got {meta['shape']}; allowed: a layout of "
                             f"{spec['out_features']} x {spec['in_features']} entries")

    def validate_loaded(self, name: str) -> None:
        """After loading: stored permutation and pivot indices must be valid (else the rebuild reads garbage)."""
        try:
            problem = self.fitted().check_indices()
        except (RuntimeError, IndexError) as e:  # pivots out of range or repeated: the blocks cannot be put back
            problem = f"the stored pivot indices cannot be unpacked ({e})"
        if problem:
            raise ValueError(f"{name}: {problem}; the checkpoint is corrupt (re-create or re-download it)")

    @classmethod
    def from_spec(cls, spec: dict, dtype=None, root=None) -> "EinSortLinear":
        return cls(spec["in_features"], spec["out_features"], spec["einsort"], transposed=spec["transposed"],
                   bias=spec["bias"], scaled=spec["scaled"], factor_dtype=spec["factor_dtype"], dtype=dtype,
                   cache_weight=spec.get("cache_weight", True))

    def extra_repr(self) -> str:
        m = self.meta
        sort = "none" if m["sort_axis"] is None else ("full" if not m["reduce_over"] else f"shared over {m['reduce_over']}")
        return (f"in_features={self.in_features}, out_features={self.out_features}, network={m['network']}, "
                f"fold={tuple(m['fold_shape'])}, sort={sort}, nonnegative={m['nonnegative']}, bytes={self.nbytes()}, "
                f"cache_weight={self.cache_weight}")
