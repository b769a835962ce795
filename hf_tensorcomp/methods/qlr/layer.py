"""`QuantizedLowRankLinear`: y = Q(W) x + B (A x) + b — a quantized weight plus a low-rank correction.

The shape of a quantized base with a LoRA adapter (EoRA, QERA, LQ-LoRA, CALDERA): ``weight`` holds
the integer codes of Q(W) (packed, with its per-group ``weight_scale`` / ``weight_zero``, see
`FactorizedModule.quantize_factors`), ``lora_A`` (rank x in) and ``lora_B`` (out x rank) the
correction, in the model's dtype or quantized too (``factor_bits``). The forward dequantizes Q(W)
on the fly, or runs PyTorch's CPU int4 kernel (8 bits as two calls; `FactorizedModule.factor_linear`); the
correction costs 2 r (in + out) flops per token (in float32 on CPU at inference, also in a bfloat16 model).

With ``rotation_block`` b (``qlr``'s ``rotate=True``) the codes are those of W R, R a random block-Hadamard
rotation (`decompositions.hadamard`; its signs in the ``input_signs`` buffer): the layer computes
(W R)(Rᵀ x), rotating its input first (one b x b product per block of inputs), the correction on x itself.
Layers that read one input with the same rotation (q / k / v of an attention, gate / up of an MLP: the
signs are seeded per input width) share its product through `share_input_rotations`: the parent rotates
its input once per call and hands it to them (at decode a rotation costs about a sixth of the int4
product it precedes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...decompositions.hadamard import rotate, unrotate
from ...layers.base import FactorizedModule, change_key, register_layer


@register_layer
class QuantizedLowRankLinear(FactorizedModule):
    layer_type = "qlr"
    spec_fields = {"in_features": "int>=1", "out_features": "int>=1", "rank": "int>=0", "bias": "bool"}
    optional_fields = {"rotation_block": "int>=1"}

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False, dtype=None, device=None,
                 rotation_block: int = 0):
        super().__init__()
        if rotation_block and (rotation_block & (rotation_block - 1) or in_features % rotation_block):
            raise ValueError(f"QuantizedLowRankLinear.rotation_block: got {rotation_block!r} for {in_features} inputs; "
                             "allowed: 0 (no rotation) or a power of two dividing the input width")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.rotation_block = rotation_block
        if rotation_block:
            self.register_buffer("input_signs", torch.ones(in_features, dtype=torch.int8, device=device))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        if rank:
            self.lora_A = nn.Parameter(torch.empty(rank, in_features, dtype=dtype, device=device))
            self.lora_B = nn.Parameter(torch.empty(out_features, rank, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def build(cls, qweight, a: torch.Tensor | None, b: torch.Tensor | None, bias: torch.Tensor | None, dtype,
              rotation: tuple[torch.Tensor, int] | None = None) -> "QuantizedLowRankLinear":
        """From a quantized weight (`decompositions.quantize.QTensor`, out x in) and the correction B A;
        `rotation` (signs, block): the codes are those of W R (see the module docstring)."""
        out_f, in_f = qweight.shape
        rank = 0 if a is None else a.shape[0]
        m = cls(in_f, out_f, rank, bias=bias is not None, dtype=dtype, device=qweight.codes.device,
                rotation_block=rotation[1] if rotation else 0)
        with torch.no_grad():
            if rotation:
                m.input_signs.copy_(rotation[0])
            if rank:
                m.lora_A.copy_(a.to(dtype))
                m.lora_B.copy_(b.to(dtype))
            if bias is not None:
                m.bias.copy_(bias.to(dtype))
        m.quantize_factors(qweight.bits, qweight.group_size, ["weight"], given={"weight": qweight})
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xr = x
        if self.rotation_block:
            given = self.__dict__.get("_rotated_input")  # (x, x R) from the parent's call (`share_input_rotations`)
            xr = given[1] if given is not None and given[0] is x else rotate(x, self.input_signs, self.rotation_block)
        y = self.factor_linear(xr, "weight", self.bias)
        if self.rank:
            if x.dtype == torch.bfloat16 and x.device.type == "cpu":
                # two thin bfloat16 products cost ~3x their float32 equivalents on CPU at decode shapes
                a, b = (self.lora_A.float(), self.lora_B.float()) if torch.is_grad_enabled() else self._float_correction()
                return y + F.linear(F.linear(x.float(), a), b).to(y.dtype)
            # the correction's second product and the add as one BLAS call (y + t Bᵀ): one op fewer per layer
            t = F.linear(x, self.lora_A)
            y = torch.addmm(y.reshape(-1, self.out_features), t.reshape(-1, self.rank), self.lora_B.t()).view(y.shape)
        return y

    def _float_correction(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 copies of ``lora_A`` / ``lora_B`` for inference on CPU in a bfloat16 model, made on first
        use and remade when the factors change (a step, a load, a move; keyed like `_int4_kernel`): casting
        both factors at every call doubled the casts of a decode step. Not part of the state dict."""
        key = change_key(self._factor_tensors("lora_A") + self._factor_tensors("lora_B"))
        cached = self.__dict__.get("_float_factors")
        if cached is None or cached[0] != key:
            a, b = self.lora_A.detach().float(), self.lora_B.detach().float()
            cached = self.__dict__["_float_factors"] = (key, a, b)
        return cached[1], cached[2]

    def base_weight(self) -> torch.Tensor:
        """The de-quantized base Q(W R) Rᵀ, acting on the layer's input as it comes (no correction)."""
        w = self.weight
        return unrotate(w, self.input_signs, self.rotation_block) if self.rotation_block else w

    def dense_weight(self) -> torch.Tensor:
        w = self.base_weight()
        return w + self.lora_B @ self.lora_A if self.rank else w

    def append_factors(self, u: torch.Tensor, v: torch.Tensor) -> None:
        """Add ``u @ v`` (u: out x k, v: k x in) to the correction, growing its rank by k (LoRA merge)."""
        if {"lora_A", "lora_B"} & set(self.quantized_names()):
            raise ValueError("LoRA merge: this layer's correction is quantized (factor_bits); allowed: keeping the adapter "
                             "separate (peft_model.save_pretrained)")
        dtype = self.qspec("weight")[3] if self.qspec("weight") else self.weight.dtype
        a = torch.cat([self.lora_A.data, v.to(self.lora_A)]) if self.rank else v.detach().to(dtype).clone()
        b = torch.cat([self.lora_B.data, u.to(self.lora_B)], 1) if self.rank else u.detach().to(dtype).clone()
        self.lora_A, self.lora_B = nn.Parameter(a), nn.Parameter(b)
        self.rank = a.shape[0]

    def truncate(self, rank: int) -> None:
        """Drop the correction's factors beyond `rank` (the inverse of `append_factors`)."""
        if rank == 0:
            del self.lora_A, self.lora_B
        else:
            self.lora_A = nn.Parameter(self.lora_A.data[:rank].clone())
            self.lora_B = nn.Parameter(self.lora_B.data[:, :rank].clone())
        self.rank = rank

    def spec(self) -> dict:
        return {"layer": self.layer_type, "in_features": self.in_features, "out_features": self.out_features,
                "rank": self.rank, "bias": self.bias is not None,
                **({"rotation_block": self.rotation_block} if self.rotation_block else {})}

    @classmethod
    def from_spec(cls, spec: dict, dtype=None, root=None) -> "QuantizedLowRankLinear":
        return cls(spec["in_features"], spec["out_features"], spec["rank"], bias=spec["bias"], dtype=dtype,
                   rotation_block=spec.get("rotation_block", 0))

    def extra_repr(self) -> str:
        q = self.qspec("weight")
        bits = f", bits={q[0]}, group_size={q[1]}" if q else ""
        rot = f", rotation_block={self.rotation_block}" if self.rotation_block else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}{bits}{rot}"


# The children of one module that read the module's own input in transformers' decoder layers (LlamaAttention,
# Gemma3Attention, Qwen3Attention, ... call q / k / v on `hidden_states` as it comes, the MLPs gate / up).
SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def share_input_rotations(model: nn.Module, share: bool = True) -> int:
    """Rotate a module's input once for its rotated `QuantizedLowRankLinear` children of `SHARED_INPUTS` with
    the same block and signs; returns the number of groups. The parent's forward pre-hook hands each child
    (x, x R); a child uses it only when its input *is* that x (the same tensor object, as transformers passes
    it), else rotates on its own, so a parent that feeds them something else still computes the same thing;
    a post-hook (run on errors too) drops the hand-off. Outputs are bit-identical with and without. Called
    after compression and after loading; calling it again replaces the hooks (after a module swap);
    ``share=False`` only removes them (each child rotating its own input, as before: for measuring)."""
    groups = 0
    for parent in model.modules():
        for handle in parent.__dict__.pop("_rotation_hooks", ()):
            handle.remove()
        if not share:
            continue
        hooks = []
        for names in SHARED_INPUTS:
            found = {n: m for n in names if isinstance(m := getattr(parent, n, None), QuantizedLowRankLinear)
                     and m.rotation_block and m.input_signs.device.type != "meta"}
            lead = next(iter(found.values()), None)
            same = [n for n, m in found.items()
                    if m.rotation_block == lead.rotation_block and torch.equal(m.input_signs, lead.input_signs)]
            if len(same) > 1:
                hand = _HandOff(same)
                hooks += [parent.register_forward_pre_hook(hand.give, with_kwargs=True),
                          parent.register_forward_hook(hand.drop, with_kwargs=True, always_call=True)]
                groups += 1
        if hooks:
            parent.__dict__["_rotation_hooks"] = hooks
    return groups


class _HandOff:
    """The hooks `share_input_rotations` puts on a parent, for its children `names`: bound methods of an
    object, not closures, so a model holding them deep-copies and pickles, and a copy's parent hands its
    input to its own children (found at each call; a child swapped for another kind of module since ends
    the sharing there)."""

    def __init__(self, names: list[str]):
        self.names = names

    def give(self, parent, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        members = [parent._modules.get(n) for n in self.names]
        lead = members[0]
        if (isinstance(x, torch.Tensor) and all(isinstance(m, QuantizedLowRankLinear) for m in members)
                and x.shape[-1] == lead.in_features):
            given = (x, rotate(x, lead.input_signs, lead.rotation_block))
            for m in members:
                m.__dict__["_rotated_input"] = given

    def drop(self, parent, args, kwargs, output):
        for n in self.names:
            m = parent._modules.get(n)
            if m is not None:
                m.__dict__.pop("_rotated_input", None)
