"""Quantized input embedding and output head (``embedding_bits``), the tie between them kept.

`QuantizedEmbedding` stands for an ``nn.Embedding`` (or Gemma's scaled one: ``embed_scale`` in its
spec): its table is stored as integer codes in groups of ``group_size`` along each token's row
(`FactorizedModule.quantize_factors`), and a lookup de-quantizes only the rows it reads.

`QuantizedHead` stands for the output head. Tied (``source``: the embedding's module name) it holds no
tensor of its own and multiplies by the embedding's quantized table, so the checkpoint stores the
table once, as the dense model did; untied it keeps its own quantized ``weight``. transformers' own
tying (which would assign the embedding's code buffer to ``head.weight``) is switched off by the
pipeline (``tie_word_embeddings=False`` in the saved config): this module is the tie.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..decompositions.quantize import QTensor
from .base import FactorizedModule, register_layer


@register_layer
class QuantizedEmbedding(FactorizedModule):
    layer_type = "qembedding"
    spec_fields = {"num_embeddings": "int>=1", "embedding_dim": "int>=1", "embed_scale": "number>0"}

    def __init__(self, num_embeddings: int, embedding_dim: int, embed_scale: float = 1.0, padding_idx=None,
                 dtype=None, device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.embed_scale = num_embeddings, embedding_dim, float(embed_scale)
        self.padding_idx = padding_idx
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype, device=device))

    @classmethod
    def build(cls, emb: nn.Embedding, bits: int, group_size: int, given: QTensor | None = None) -> "QuantizedEmbedding":
        """From a dense embedding, its table rounded to nearest, or `given` (e.g. GPTQ's codes of a tied head)."""
        scale = getattr(emb, "scalar_embed_scale", None)
        if scale is None and isinstance(getattr(emb, "embed_scale", None), torch.Tensor):
            scale = float(emb.embed_scale)
        m = cls(emb.num_embeddings, emb.embedding_dim, 1.0 if scale is None else scale, emb.padding_idx,
                dtype=emb.weight.dtype, device=emb.weight.device)
        with torch.no_grad():
            m.weight.copy_(emb.weight)
        m.quantize_factors(bits, group_size, ["weight"], given=None if given is None else {"weight": given})
        return m

    def train_scales(self, on: bool = True) -> list:
        """The table's scales stay as stored (a lookup reads the stored rows directly)."""
        return []

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        q = self.qspec("weight")
        if q is None:
            out = F.embedding(input_ids, self.weight, self.padding_idx)
        else:
            out = self.quantized_rows("weight", input_ids.reshape(-1), q[3]).view(*input_ids.shape, self.embedding_dim)
        if self.embed_scale != 1.0:  # as Gemma's scaled embedding: the scale cast to the output dtype
            out = out * torch.tensor(self.embed_scale).to(out.dtype)
        return out

    def dense_weight(self) -> torch.Tensor:
        return self.weight

    def to_dense(self) -> nn.Module:
        emb = nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx, dtype=self.weight.dtype)
        with torch.no_grad():
            emb.weight.copy_(self.weight)
        return emb

    def spec(self) -> dict:
        return {"layer": self.layer_type, "num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim,
                "embed_scale": self.embed_scale}

    @classmethod
    def from_spec(cls, spec: dict, dtype=None, root=None) -> "QuantizedEmbedding":
        return cls(spec["num_embeddings"], spec["embedding_dim"], spec["embed_scale"], dtype=dtype)

    def extra_repr(self) -> str:
        q = self.qspec("weight")
        return f"{self.num_embeddings}, {self.embedding_dim}" + (f", bits={q[0]}, group_size={q[1]}" if q else "")


@register_layer
class QuantizedHead(FactorizedModule):
    layer_type = "qhead"
    build_order = 1  # after the embedding it may read
    spec_fields = {"in_features": "int>=1", "out_features": "int>=1", "bias": "bool"}

    def __init__(self, in_features: int, out_features: int, source: nn.Module | None = None, source_name: str | None = None,
                 bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features, self.source_name = in_features, out_features, source_name
        self.__dict__["_source"] = source  # not a child: its tensors are saved once, under the embedding's name
        if source is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def build(cls, head: nn.Linear, bits: int, group_size: int, source: QuantizedEmbedding | None = None,
              source_name: str | None = None, given: QTensor | None = None) -> "QuantizedHead":
        """Tied (`source`: the quantized embedding), or with its own weight rounded to nearest or `given`."""
        bias = getattr(head, "bias", None)
        m = cls(head.in_features, head.out_features, source, source_name, bias=bias is not None, dtype=head.weight.dtype,
                device=head.weight.device)
        with torch.no_grad():
            if bias is not None:
                m.bias.copy_(bias)
            if source is None:
                m.weight.copy_(head.weight)
        if source is None:
            m.quantize_factors(bits, group_size, ["weight"], given=None if given is None else {"weight": given})
        return m

    @property
    def tied(self) -> bool:
        return self.__dict__["_source"] is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        owner = self.__dict__["_source"] or self
        return owner.factor_linear(x, "weight", self.bias)

    def dense_weight(self) -> torch.Tensor:
        return (self.__dict__["_source"] or self).weight

    def spec(self) -> dict:
        s = {"layer": self.layer_type, "in_features": self.in_features, "out_features": self.out_features,
             "bias": self.bias is not None}
        if self.tied:
            s["source"] = self.source_name
        return s

    @classmethod
    def check_spec(cls, name: str, spec: dict) -> None:
        spec = dict(spec)
        source = spec.pop("source", None)
        if source is not None and (not isinstance(source, str) or not source):
            raise ValueError(f"compressed_modules[{name!r}].source: got {source!r}; allowed: the embedding's module name")
        super().check_spec(name, spec)

    @classmethod
    def from_spec(cls, spec: dict, dtype=None, root=None) -> "QuantizedHead":
        source = None
        if spec.get("source") is not None:
            source = root.get_submodule(spec["source"])
            if not isinstance(source, QuantizedEmbedding):
                raise ValueError(f"compressed_modules: {spec['source']!r} is not a quantized embedding; the checkpoint is corrupt")
            if (source.num_embeddings, source.embedding_dim) != (spec["out_features"], spec["in_features"]):
                raise ValueError(f"compressed_modules: the head's shape differs from its embedding {spec['source']!r}'s; "
                                 "the checkpoint's config.json is corrupt or edited")
        return cls(spec["in_features"], spec["out_features"], source, spec.get("source"), bias=spec["bias"], dtype=dtype)

    def extra_repr(self) -> str:
        tie = f", tied to {self.source_name}" if self.tied else ""
        q = self.qspec("weight")
        return f"in_features={self.in_features}, out_features={self.out_features}{tie}" + (
            f", bits={q[0]}, group_size={q[1]}" if q else "")
