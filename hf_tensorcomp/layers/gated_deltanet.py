"""`GatedDeltaNetAttention`: a Gated DeltaNet (linear attention) layer in place of a softmax self-attention.

The mixer itself is transformers' own `Qwen3_5GatedDeltaNet` (its PyTorch reference path runs on
CPU; flash-linear-attention must not be installed, or transformers dispatches to Triton kernels). It
sits at ``self_attn.gdn`` with its own attribute names, so code that finds Gated DeltaNet modules by
structure (``in_proj_qkv``, ``conv1d``, ``norm``, ``head_k_dim``) finds it here too:

- ``gdn.in_proj_qkv``: one fused ``Linear(hidden, 2 * key_dim + value_dim)``, rows laid out
  ``[q | k | v]``, each head-major (head ``h`` of q is rows ``h * head_k_dim : (h + 1) * head_k_dim``);
- ``gdn.conv1d``: the depthwise causal short convolution over the same ``2 * key_dim + value_dim``
  channels, in the same order, then SiLU;
- ``gdn.in_proj_z`` (output gate), ``gdn.in_proj_a`` / ``gdn.dt_bias`` / ``gdn.A_log`` (decay),
  ``gdn.in_proj_b`` (write strength beta), ``gdn.norm`` (per-head gated RMSNorm over ``head_v_dim``,
  ``weight * x``: this one is *not* zero-centred), ``gdn.out_proj``;
- q and k are L2-normalised per head inside the delta rule and q is scaled by ``head_k_dim ** -0.5``.

The wrapper takes the Llama ``self_attn`` call (``hidden_states``, ``position_embeddings``,
``attention_mask``, ``past_key_values``, ...; rotary embeddings are not used) and returns
``(output, None)``. Its layout (the Qwen3.5 config fields) is read off the live module by `spec`, so a
method that slices key channels in place (updating ``gdn.head_k_dim``, ``gdn.key_dim`` and
``gdn.conv_dim``) is saved with the smaller key head dim.

Cache: generation keeps each Gated DeltaNet layer's conv and recurrent state in the model's ordinary
`DynamicCache`: on first use the layer's slot becomes a transformers
`LinearAttentionAndFullAttentionLayer`, which holds both states, and one float per token is written
to its key/value part so that the cache's sequence length (read from layer 0 for masks and
positions) stays right whichever layers are linear. Greedy and sampled decoding are exact against a
no-cache forward; beam search reorders both states (transformers' layer does).

Loading without hf_tensorcomp fails loudly: a (1,)-shaped ``q_proj.weight`` marker sits where the
softmax attention's (out, in) query weight was, so plain transformers stops with a size mismatch.
"""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import torch
from torch import nn

from .base import FactorizedModule, register_layer


def gdn_config(hidden_size: int, num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int,
               conv_kernel: int, layer_idx: int, norm_eps: float) -> SimpleNamespace:
    """The config `Qwen3_5GatedDeltaNet` reads, under its Qwen3.5 field names."""
    return SimpleNamespace(hidden_size=hidden_size, linear_num_key_heads=num_k_heads, linear_key_head_dim=head_k_dim,
                           linear_num_value_heads=num_v_heads, linear_value_head_dim=head_v_dim,
                           linear_conv_kernel_dim=conv_kernel, hidden_act="silu", rms_norm_eps=norm_eps,
                           layer_types=["linear_attention"] * (layer_idx + 1))


class _Marker(nn.Module):
    """Holds the (1,)-shaped ``weight`` that makes a plain-transformers load stop (see the module doc)."""

    def __init__(self, dtype=None, device=None):
        super().__init__()
        self.register_buffer("weight", torch.zeros(1, dtype=dtype, device=device))


def _cache_slot(cache, layer_idx: int):
    """The cache layer of `layer_idx`, turned into one that holds linear-attention states (see the module doc)."""
    from transformers.cache_utils import LinearAttentionAndFullAttentionLayer, LinearAttentionCacheLayerMixin

    slot = cache.layers[layer_idx]
    if isinstance(slot, LinearAttentionCacheLayerMixin):
        return slot
    if getattr(slot, "is_initialized", False):
        raise ValueError(f"hf_tensorcomp: cache layer {layer_idx} already holds softmax-attention keys, and this layer is "
                         "Gated DeltaNet; allowed: a fresh DynamicCache (or none) for a model with linearized layers")
    cache.layers[layer_idx] = LinearAttentionAndFullAttentionLayer()
    return cache.layers[layer_idx]


def _padding_mask(attention_mask, q_len: int):
    """(batch, seq) bool of the real tokens from a 4-D (or 2-D) attention mask, on a prefill; else None."""
    if attention_mask is None or not isinstance(attention_mask, torch.Tensor):
        return None
    if attention_mask.ndim == 2:
        return attention_mask.bool() if attention_mask.shape[-1] == q_len else None
    if attention_mask.ndim != 4 or attention_mask.shape[-1] != q_len or attention_mask.shape[-2] != q_len:
        return None
    diag = attention_mask[:, 0].diagonal(dim1=-2, dim2=-1)  # can token i see itself: not padding
    return diag if diag.dtype == torch.bool else diag == 0


@register_layer
class GatedDeltaNetAttention(FactorizedModule):
    layer_type = "gated_deltanet"
    spec_fields = {"hidden_size": "int>=1", "num_k_heads": "int>=1", "head_k_dim": "int>=1", "num_v_heads": "int>=1",
                   "head_v_dim": "int>=1", "conv_kernel": "int>=1", "layer_idx": "int>=0", "norm_eps": "number>0"}
    #: its tensors sit in child modules (``gdn.*``, ``q_proj.weight``): checks look below it
    nested = True

    def __init__(self, hidden_size: int, num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int,
                 conv_kernel: int = 4, layer_idx: int = 0, norm_eps: float = 1e-6, dtype=None, device=None):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"GatedDeltaNetAttention: num_v_heads={num_v_heads} is not a multiple of num_k_heads="
                             f"{num_k_heads}; allowed: value heads a multiple of key heads")
        self.in_features = self.out_features = hidden_size
        self.layer_idx, self.norm_eps = layer_idx, norm_eps
        cfg = gdn_config(hidden_size, num_k_heads, head_k_dim, num_v_heads, head_v_dim, conv_kernel, layer_idx, norm_eps)
        with torch.device(device) if device is not None else nullcontext():
            self.gdn = Qwen3_5GatedDeltaNet(cfg, layer_idx)
            self.q_proj = _Marker()
        if dtype is not None:
            self.to(dtype)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, past_key_values=None,
                **kwargs):
        cache = past_key_values
        if cache is not None:
            slot = _cache_slot(cache, self.layer_idx)
            b, t = hidden_states.shape[:2]
            length = hidden_states.new_zeros(b, 1, t, 1)  # one float per token: the cache's sequence length
            slot.update(length, length)
        mask = _padding_mask(attention_mask, hidden_states.shape[1])
        out = self.gdn(hidden_states, cache_params=cache, attention_mask=mask)
        return out, None

    def spec(self) -> dict:
        g = self.gdn
        return {"layer": self.layer_type, "hidden_size": g.hidden_size, "num_k_heads": g.num_k_heads,
                "head_k_dim": g.head_k_dim, "num_v_heads": g.num_v_heads, "head_v_dim": g.head_v_dim,
                "conv_kernel": g.conv_kernel_size, "layer_idx": self.layer_idx, "norm_eps": self.norm_eps}

    @classmethod
    def from_spec(cls, spec: dict, dtype=None, root=None) -> "GatedDeltaNetAttention":
        return cls(**{k: spec[k] for k in cls.spec_fields}, dtype=dtype)

    @classmethod
    def from_attention(cls, attn: nn.Module, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                       layer_idx: int, conv_kernel: int = 4, norm_eps: float = 1e-6, seed: int = 0) -> "GatedDeltaNetAttention":
        """Initialised from a softmax attention's q/k/v/o (``num_heads`` key and value heads of ``head_dim``).

        q rows are q_proj's; k and v rows are k_proj's / v_proj's, each KV head repeated for the query heads
        that share it (grouped-query attention, the order of transformers' ``repeat_kv``); out_proj is
        o_proj. The short convolution is the identity (last tap 1). Beta starts at 1/2 (in_proj_b = 0);
        the decay g = -exp(A_log) * softplus(a + dt_bias) starts at -A * dt per head with A ~ U[1, 16] and dt
        log-uniform in [1e-3, 1e-1] (in_proj_a = 0; Mamba's initialisation), drawn from a generator seeded
        with `seed`. The output gate in_proj_z starts at zero, so the layer's output starts at exactly zero
        (the gated RMSNorm fixes the scale of each head's output, and only the gate can set it: a random
        gate started a tiny Llama's layers at 78 x the attention output's energy, a zero one at 1 x).
        """
        q, k, v, o = (getattr(attn, n).weight.detach().float() for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        rep = num_heads // num_kv_heads
        k = k.reshape(num_kv_heads, head_dim, hidden_size).repeat_interleave(rep, dim=0).reshape(-1, hidden_size)
        v = v.reshape(num_kv_heads, head_dim, hidden_size).repeat_interleave(rep, dim=0).reshape(-1, hidden_size)
        new = cls(hidden_size, num_heads, head_dim, num_heads, head_dim, conv_kernel, layer_idx, norm_eps,
                  device=q.device)
        g = new.gdn
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            g.in_proj_qkv.weight.copy_(torch.cat([q, k, v]))
            g.out_proj.weight.copy_(o)
            g.conv1d.weight.zero_()
            g.conv1d.weight[:, 0, -1] = 1.0
            g.norm.weight.fill_(1.0)
            g.in_proj_b.weight.zero_()
            g.in_proj_a.weight.zero_()
            g.in_proj_z.weight.zero_()
            dt = torch.exp(torch.rand(num_heads, generator=gen) * (torch.log(torch.tensor(0.1)) - torch.log(torch.tensor(1e-3)))
                           + torch.log(torch.tensor(1e-3)))
            g.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
            g.A_log.copy_(torch.log(1 + 15 * torch.rand(num_heads, generator=gen)))
        return new

    def dense_weight(self) -> torch.Tensor:
        raise ValueError("a Gated DeltaNet layer has no dense weight: it is not a linear map; allowed: mode='factorized'")

    def to_dense(self):
        self.dense_weight()

    def extra_repr(self) -> str:
        g = self.gdn
        return (f"layer_idx={self.layer_idx}, key heads {g.num_k_heads} x {g.head_k_dim}, "
                f"value heads {g.num_v_heads} x {g.head_v_dim}, conv {g.conv_kernel_size}")

