"""Base class and registry for the modules that run compressed weights in factored form.

Every factored module:
- describes its own layout with `spec()` (a JSON-able dict saved in the config), and can be rebuilt
  empty from that spec with `from_spec()` (under the meta device on reload: no dense weight made);
- can rebuild the dense weight it stands for with `dense_weight()` (only for `mode="dense"`, LoRA
  merging and tests: the forward never does);
- keeps at least one tensor under the replaced module's dense parameter name (`weight`) with a shape
  that cannot equal the dense one. Loading such a checkpoint without hf_tensorcomp therefore stops
  with transformers' size-mismatch error instead of silently random-initialising the dense weights;
- can store its own factor tensors quantized (`quantize_factors`: ``factor_bits``): the parameter
  becomes a uint8 buffer of packed codes under the same name, with ``NAME_scale`` (float16) and
  ``NAME_zero`` (uint8) per group, and reading ``self.NAME`` gives the dequantized tensor, so every
  forward works unchanged. The spec records it under ``"quant"``;
- holds a quantized factor in the layout its product reads (`hold_kernels`: PyTorch's CPU int4 kernel's,
  built once when the factor is quantized or loaded, in place of the packed codes, never beside them):
  the state dict still gives the packed codes (`_save_to_state_dict`), and `quantized` / `quantized_rows`
  read the stored codes back from either layout.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..decompositions.quantize import (BITS, GROUP_SIZE_RANGE, Int4Kernel, QTensor, code_bytes, dequantize_rows,
                                       int4pack_layout_ok, n_groups, pack, quantize_rtn, unpack)

LAYER_TYPES: dict[str, type["FactorizedModule"]] = {}


def register_layer(cls):
    LAYER_TYPES[cls.layer_type] = cls
    return cls


def _is_int(x, lo: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


#: what a spec field may hold: (test, allowed text for the error)
FIELD_KINDS = {
    "int>=1": (lambda x: _is_int(x, 1), "an int >= 1"),
    "int>=0": (lambda x: _is_int(x, 0), "an int >= 0"),
    "bool": (lambda x: isinstance(x, bool), "true | false"),
    "str": (lambda x: isinstance(x, str) and bool(x), "a module name"),
    "ints>=1": (lambda x: isinstance(x, list) and bool(x) and all(_is_int(i, 1) for i in x), "a list of ints >= 1"),
    "dict": (lambda x: isinstance(x, dict), "a dict"),
    "number>0": (lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0, "a number > 0"),
}


class FactorizedModule(nn.Module):
    layer_type: str = ""
    #: modules with a lower order are rebuilt first on reload (containers of shared factors: -1)
    build_order: int = 0
    #: the fields `spec()` writes and their kinds (`FIELD_KINDS`), or a tuple of allowed values
    spec_fields: dict = {}
    #: fields `spec()` writes only when they differ from their default (checkpoints written before them load)
    optional_fields: dict = {}
    #: True when the module keeps its tensors in child modules (checked recursively on reload)
    nested: bool = False

    @classmethod
    def check_spec(cls, name: str, spec: dict) -> None:
        """Raise ValueError naming the module and field if `spec` is not one this class writes."""
        if not isinstance(spec, dict):
            raise ValueError(f"compressed_modules[{name!r}]: got {spec!r}; allowed: a dict written by hf_tensorcomp")
        unknown = sorted(set(spec) - set(cls.spec_fields) - set(cls.optional_fields) - {"layer", "new", "quant"})
        if unknown:
            raise ValueError(f"compressed_modules[{name!r}]: unknown field(s) {unknown} for layer {cls.layer_type!r}; "
                             f"allowed: {sorted({**cls.spec_fields, **cls.optional_fields})}")
        for field, kind in {**cls.spec_fields, **cls.optional_fields}.items():
            if field not in spec and field in cls.optional_fields:
                continue
            if field not in spec:
                raise ValueError(f"compressed_modules[{name!r}].{field}: missing; the checkpoint's config.json is "
                                 f"incomplete or edited (layer {cls.layer_type!r} needs {sorted(cls.spec_fields)})")
            value = spec[field]
            ok, allowed = (value in kind, " | ".join(map(repr, kind))) if isinstance(kind, tuple) else \
                (FIELD_KINDS[kind][0](value), FIELD_KINDS[kind][1])
            if not ok:
                raise ValueError(f"compressed_modules[{name!r}].{field}: got {value!r}; allowed: {allowed}")
        quant = spec.get("quant", {})
        # group_size sizes the de-quantized groups: bounded as the config bounds it (a group at least a row long
        # gives one scale per row, so the stored shapes alone could not tell 64 from 2**20); bits an int (4.0 sizes
        # nothing)
        lo, hi = GROUP_SIZE_RANGE
        bits, group = " | ".join(map(str, BITS)), f"an int in [{lo}, {hi}]"
        if not isinstance(quant, dict):
            quant = {"": quant}
        for factor, q in quant.items():
            where = f"compressed_modules[{name!r}].quant" + (f".{factor}" if factor else "")
            if not isinstance(q, dict) or set(q) != {"bits", "group_size"}:
                bad = (where, q, f"{{'bits': {bits}, 'group_size': {group}}}" if factor else
                       f"{{factor name: {{'bits': {bits}, 'group_size': {group}}}}}")
            elif not (_is_int(q["bits"], 0) and q["bits"] in BITS):
                bad = (f"{where}.bits", q["bits"], bits)
            elif not (_is_int(q["group_size"], lo) and q["group_size"] <= hi):
                bad = (f"{where}.group_size", q["group_size"], group)
            else:
                continue
            raise ValueError(f"{bad[0]}: got {bad[1]!r}; allowed: {bad[2]}; the checkpoint's config.json is corrupt or "
                             "edited")
        if spec.get("new", False) is not (cls.build_order < 0):
            raise ValueError(f"compressed_modules[{name!r}].new: got {spec.get('new')!r}; allowed: "
                             f"{cls.build_order < 0} for layer {cls.layer_type!r}")

    def spec(self) -> dict:
        raise NotImplementedError

    def full_spec(self) -> dict:
        """`spec()` plus the quantization of its factors, if any (what the config saves)."""
        spec = self.spec()
        q = self.__dict__.get("_qfactors")
        if q:
            spec["quant"] = {n: {"bits": b, "group_size": g} for n, (b, g, _, _) in q.items()}
        return spec

    def quantizable(self, group_size: int | None = None) -> list[str]:
        """This module's own floating factor tensors (biases aside) that `factor_bits` quantizes: those of
        at least four groups of `group_size` values (smaller ones, e.g. a TRAWL slice's few weights, would
        only grow by their scales); every candidate when `group_size` is None."""
        return [n for n, p in self._parameters.items() if p is not None and n != "bias" and p.is_floating_point()
                and (group_size is None or p.numel() >= 4 * group_size)]

    def quantize_factors(self, bits: int, group_size: int, names=None, given: dict[str, QTensor] | None = None) -> None:
        """Store the factor parameters `names` (default: `quantizable`) quantized in place (see the module
        docstring); `given` supplies ready quantized tensors (e.g. GPTQ's). On the meta device: empty
        buffers of the stored shapes (a skeleton being rebuilt)."""
        q = self.__dict__.setdefault("_qfactors", {})
        for n in self.quantizable(group_size) if names is None else names:
            p = self._parameters.pop(n)
            groups = n_groups(p.shape, group_size)
            if p.is_meta:
                codes = torch.empty(code_bytes(p.numel(), bits), dtype=torch.uint8, device="meta")
                scale = torch.empty(groups, dtype=torch.float16, device="meta")
                zero = torch.empty(groups, dtype=torch.uint8, device="meta")
            else:
                qt = (given or {}).get(n) or quantize_rtn(p.data, bits, group_size)
                codes, scale, zero = pack(qt.codes, bits), qt.scale, qt.zero
            self.register_buffer(n, codes.to(p.device))
            self.register_buffer(f"{n}_scale", scale.to(p.device))
            self.register_buffer(f"{n}_zero", zero.to(p.device))
            q[n] = (bits, group_size, tuple(p.shape), p.dtype)
            if not p.is_meta:
                self._hold(n)

    def train_scales(self, on: bool = True) -> list[nn.Parameter]:
        """Make the per-group scales of the quantized factors trainable float32 parameters (``on``; the
        codes and zero points stay), or fold them back into the stored float16 buffers (``on=False``:
        rounded to float16, which a scale that never moved survives bit for bit). Returns the
        parameters (empty when off)."""
        out = []
        for n in self.__dict__.get("_qfactors", {}):
            key = f"{n}_scale"
            if on and key in self._buffers:
                self._release(n)  # trained scales multiply the stored codes (`__getattr__`); the layout comes back after
                self.register_parameter(key, nn.Parameter(self._buffers.pop(key).float()))
            if on:
                out.append(self._parameters[key])
            elif key in self._parameters:
                self.register_buffer(key, self._parameters.pop(key).detach().half())
                self._hold(n)
        return out

    def training_form(self) -> bool:
        """Switch to the parametrization healing trains (the stored one by default: nothing to do); True when
        it changed, and then `storage_form` must switch back."""
        return False

    def storage_form(self, keep: bool = True) -> None:
        """Back to the stored form after `training_form`: the trained values (``keep``) or the tensors exactly
        as they were before it."""

    def _apply(self, fn, recurse=True):
        """`nn.Module._apply` (``.to``, ``.half``, ``.cuda`` ...) keeping quantized factors' float16 scales as
        stored (a bfloat16 cast would round them) and de-quantizing to the module's new float dtype; a factor
        held in the kernel's layout goes back to its packed codes for the move and is held again after it
        where the kernel runs (CPU, CUDA)."""
        q = self.__dict__.get("_qfactors")
        if not q or any(f"{n}_scale" in self._parameters for n in q):  # scales in training: moved like parameters
            return super()._apply(fn, recurse)
        with self._packed_meanwhile():
            scales = {n: self._buffers[f"{n}_scale"] for n in q}
            out = super()._apply(fn, recurse)
            for n, (bits, group, shape, dtype) in list(q.items()):
                moved = self._buffers[f"{n}_scale"]
                if moved.dtype != scales[n].dtype:
                    self._buffers[f"{n}_scale"] = scales[n].to(moved.device)
                q[n] = (bits, group, shape, fn(torch.empty(0, dtype=dtype)).dtype)
        return out

    def factor_linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, <factor name>, bias)``. A quantized factor held in the kernel's layout (`hold_kernels`)
        runs through PyTorch's int4 kernel (`quantize.Int4Kernel`: the CPU kernel, or tinygemm on CUDA) when the
        activations are on its device and no gradient flows to them: bfloat16 activations as they are, float32 ones rounded to bfloat16 for the
        product (the kernel's only input type; the result is cast back) — faster than the float32 dense product
        it replaces, where de-quantizing at every call is several times slower. Otherwise (on other devices,
        where the kernel refuses the shape, or while `train_scales` trains the scales) on its de-quantized value,
        exactly."""
        kernel = self._held(name)
        if (kernel is not None and x.dtype in (torch.bfloat16, torch.float32) and x.device == kernel.packed.device
                and not (torch.is_grad_enabled() and x.requires_grad)):
            y = kernel(x.to(torch.bfloat16)).to(x.dtype)
            return y if bias is None else y + bias
        return F.linear(x, getattr(self, name), bias)

    # -- quantized factors: what is stored, and the layout held ------------------------------------------------

    def qspec(self, name: str) -> tuple | None:
        """(bits, group_size, shape, dtype) of quantized factor `name`, or None when it is not quantized."""
        return self.__dict__.get("_qfactors", {}).get(name)

    def quantized_names(self) -> list[str]:
        return list(self.__dict__.get("_qfactors", {}))

    def quantized(self, name: str) -> QTensor:
        """Quantized factor `name` as stored (codes unpacked), whichever layout the module holds."""
        bits, group, shape, _ = self.qspec(name)
        codes, scale, zero = self._factor_tensors(name)
        kernel = self._held(name)
        flat = kernel.codes(zero).reshape(-1) if kernel is not None else unpack(codes, bits)
        return QTensor(flat, scale, zero, bits, group, shape)

    def quantized_rows(self, name: str, rows: torch.Tensor, dtype) -> torch.Tensor:
        """Rows `rows` of a quantized (n, cols) factor, de-quantized (an embedding lookup: only those rows read)."""
        bits, group, shape, _ = self.qspec(name)
        codes, scale, zero = self._factor_tensors(name)
        kernel = self._held(name)
        if kernel is None:
            return dequantize_rows(codes, scale, zero, bits, group, shape, rows, dtype)
        per_row = n_groups((1, shape[1]), group)
        pick = lambda t: t.view(shape[0], per_row)[rows].reshape(-1)  # noqa: E731
        return QTensor(kernel.codes(zero, rows).reshape(-1), pick(scale), pick(zero), bits, group,
                       (rows.numel(), shape[1])).dequantize(dtype)

    def _held(self, name: str) -> Int4Kernel | None:
        return self.__dict__.get("_kernels", {}).get(name)

    def _hold(self, name: str) -> bool:
        """Hold quantized factor `name` in the int4 kernel's layout (CPU, or tinygemm's on CUDA), in place of its packed codes (2- and
        3-bit codes then take 4 bits in memory, 5- and 6-bit codes 8, plus 4 bytes a group and nibble of bfloat16
        scales and offsets beside the stored scales and zero points); True when it is (or already was)."""
        if self._held(name) is not None:
            return True
        bits, group, shape, _ = self.qspec(name)
        codes, scale, zero = self._factor_tensors(name)
        device = codes.device
        if (any(t.device != device for t in (scale, zero)) or f"{name}_scale" in self._parameters
                or not Int4Kernel.fits(bits, group, shape, device) or (device.type == "cpu" and not int4pack_layout_ok())):
            return False
        kernel = Int4Kernel.build(self.quantized(name))
        if kernel is None:
            return False
        self._buffers[name] = kernel.packed
        self.register_buffer(f"{name}_kernel_sz", kernel.sz, persistent=False)
        self.__dict__.setdefault("_kernels", {})[name] = kernel
        return True

    def _release(self, name: str) -> None:
        """Back from the kernel's layout to the packed codes (before a move to another device or dtype)."""
        if self._held(name) is not None:
            self._buffers[name] = self._packed(name)
            del self.__dict__["_kernels"][name]
            self._buffers.pop(f"{name}_kernel_sz", None)
            self._non_persistent_buffers_set.discard(f"{name}_kernel_sz")

    def hold_kernels(self) -> int:
        """Hold every quantized factor the kernel can run in its layout (`_hold`); returns how many are held.
        Called when factors are quantized and after a checkpoint's tensors are loaded."""
        return sum(self._hold(n) for n in self.quantized_names())

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """The state dict holds the packed codes as saved, whatever layout the module holds."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in self.__dict__.get("_kernels", {}):
            destination[prefix + name] = self._packed(name)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        with self._packed_meanwhile():
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _packed(self, name: str) -> torch.Tensor:
        """The packed codes of quantized factor `name` as saved, from whichever layout is held."""
        return pack(self.quantized(name).codes, self.qspec(name)[0])

    @contextlib.contextmanager
    def _packed_meanwhile(self):
        """The held factors back in their packed codes for the block (a move, a load), held again after it."""
        held = [n for n in self.quantized_names() if self._held(n) is not None]
        for n in held:
            self._release(n)
        try:
            yield
        finally:
            for n in held:
                self._hold(n)

    def _factor_tensors(self, name: str) -> list[torch.Tensor]:
        """The tensors that store factor `name`: its codes (packed, or in the kernel's layout), scale and zero
        point when quantized (the scale a parameter while `train_scales` trains it), else the parameter itself."""
        if name not in self.__dict__.get("_qfactors", {}):
            return [self._parameters[name]]
        scale = f"{name}_scale"
        return [self._buffers[name], self._buffers.get(scale, self._parameters.get(scale)), self._buffers[f"{name}_zero"]]

    def __getattr__(self, name: str):
        q = self.__dict__.get("_qfactors")
        if q is not None and name in q:
            codes, scale, zero = self._factor_tensors(name)
            if "meta" in (codes.device.type, scale.device.type, zero.device.type):
                return codes  # a skeleton being loaded: the loader reads and fills the stored tensor itself
            return self.quantized(name).dequantize(q[name][3])
        return super().__getattr__(name)

    @classmethod
    def from_spec(cls, spec: dict, dtype: torch.dtype | None = None, root: nn.Module | None = None) -> "FactorizedModule":
        """Empty module with the layout of `spec`; `root` (the model) resolves references to shared factors."""
        raise NotImplementedError

    def dense_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def to_dense(self) -> nn.Module | None:
        """An ordinary ``nn.Linear`` computing the same function (what `mode="dense"` writes).

        Containers of shared factors override this to return None: dense mode drops them.
        """
        w = self.dense_weight()
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=w.dtype, device=w.device)
        with torch.no_grad():
            lin.weight.copy_(w)
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin


def hold_kernels(model: nn.Module) -> int:
    """`FactorizedModule.hold_kernels` on every compressed module of `model` (after a load); returns how many
    quantized factors are held in the kernel's layout."""
    return sum(m.hold_kernels() for m in model.modules() if isinstance(m, FactorizedModule))


def change_key(tensors) -> tuple:
    """What a cache built from `tensors` is keyed on: their device, storage and in-place version (a load, a
    move or an optimiser step changes it; tensors made under inference mode have no version, and cannot change)."""
    return tuple((t.device, t.data_ptr(), 0 if t.is_inference() else t._version) for t in tensors)


def _layer_class(spec: dict) -> type[FactorizedModule]:
    kind = spec.get("layer") if isinstance(spec, dict) else None
    if kind not in LAYER_TYPES:
        raise ValueError(
            f"compressed_modules: unknown layer type {kind!r}; allowed: {sorted(LAYER_TYPES)} "
            "(was the checkpoint written by a newer hf_tensorcomp?)"
        )
    return LAYER_TYPES[kind]


def layer_build_order(spec: dict) -> int:
    return _layer_class(spec).build_order


def build_from_spec(spec: dict, dtype: torch.dtype | None = None, root: nn.Module | None = None,
                    name: str = "?") -> FactorizedModule:
    """The one way a saved spec becomes a module: checked (`check_spec`), then built empty."""
    cls = _layer_class(spec)
    cls.check_spec(name, spec)
    return cls.from_spec(spec, dtype=dtype, root=root)
