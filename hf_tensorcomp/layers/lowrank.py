"""`LowRankLinear`: y = U (V x) + b, the factored form of a truncated SVD (LASER) or any rank-r product.

Pivoted form (``pivoted=True``): r of V's columns are the identity, so only the other in - r columns (T)
and U are stored — r (in + out - r) numbers, the degrees of freedom of a rank-r matrix, instead of
r (in + out). Any rank-r product can be written so exactly: with J the columns of a well-conditioned
r x r block of V (chosen by QR with column pivoting), U V = (U V_J) [I | V_J⁻¹ V_rest] up to the column
order, kept in the int32 buffer ``pivots`` (J first). The forward gathers the input's columns once:
y = U (x_J + T x_rest) + b. At one parameter budget this buys a higher rank (a 576 x 576 matrix at 80 %
of its parameters: rank 318 instead of 230), and at full rank it costs exactly the dense matrix.

Quantized factors (``factor_bits``): the codes of ``weight`` are stored transposed (``channel_groups``), one row per
input channel of V (or T) and per output channel of U, each grouped along the rank: whitened factors mix their
channels' scales by orders of magnitude, and groups along a rank component (the layout before, still read for
checkpoints without the field) rounded the small-scale channels — those the large activations multiply — to zero
(SmolLM2, calibrated LASER, plain form: perplexity x5.36). The plain form is balanced first (each rank component
scaled so U[:, i] and V[i, :] have equal norms: the same product). The forward de-quantizes the factors once and
keeps them (rebuilt when the codes change): decode runs at the float factors' speed, at the cost of holding the
float factors in memory beside the codes; only the codes are saved.
"""

from __future__ import annotations

import torch
from torch import nn

from ..decompositions.rrqr import pivot_order
from .base import FactorizedModule, change_key, register_layer


@register_layer
class LowRankLinear(FactorizedModule):
    """Stands in for an ``nn.Linear(in_features, out_features)`` with weight ``U @ V``.

    Both factors live in one parameter, ``weight`` of shape ``(rank, in_features + out_features)``:
    ``weight[:, :in]`` is V (rank x in), ``weight[:, in:]`` is U transposed (rank x out). One tensor
    keeps the checkpoint small and plain, and its shape can never equal the dense ``(out, in)``
    (see `FactorizedModule`). The forward is two thin matmuls: 2 r (in + out) flops per token
    instead of 2 in out, cheaper whenever r < in out / (in + out). In the pivoted form ``weight`` is
    ``(rank, in_features - rank + out_features)``: T (rank x (in - rank)), then U transposed.
    """

    layer_type = "lowrank"
    spec_fields = {"in_features": "int>=1", "out_features": "int>=1", "rank": "int>=1", "bias": "bool"}
    optional_fields = {"pivoted": "bool", "channel_groups": "bool"}

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False, dtype=None, device=None,
                 pivoted: bool = False):
        super().__init__()
        if pivoted and not rank < min(in_features, out_features):
            raise ValueError(f"LowRankLinear.rank: got {rank} with pivoted=True for a {out_features}x{in_features} "
                             f"matrix; allowed: an int in [1, {min(in_features, out_features) - 1}] (at full rank the "
                             "pivoted form is the dense matrix)")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.channel_groups = False  # quantized codes stored transposed (see the module docstring)
        cols = in_features - rank if pivoted else in_features
        self.weight = nn.Parameter(torch.empty(rank, cols + out_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        if pivoted:
            self.register_buffer("pivots", torch.arange(in_features, dtype=torch.int32, device=device))
        else:
            self.pivots = None

    @classmethod
    def from_factors(cls, u: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None, dtype=None):
        """u: (out, r), v: (r, in)."""
        out_features, rank = u.shape
        dtype = dtype or u.dtype
        m = cls(v.shape[1], out_features, rank, bias=bias is not None, dtype=dtype, device=u.device)
        with torch.no_grad():
            m.weight.copy_(torch.cat([v, u.T], dim=1).to(dtype))
            if bias is not None:
                m.bias.copy_(bias.to(dtype))
        return m

    @classmethod
    def pivoted_from_factors(cls, u: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None, dtype=None):
        """The pivoted form of ``u @ v`` (u: out x r, v: r x in, r < min(out, in)); exact up to rounding.

        V's rows are made orthonormal first (Vᵀ = Q R, then u R' and Qᵀ: the same product), so the pivot block is
        invertible even where V is rank-deficient (an all-zero weight) and as well conditioned as QR with column
        pivoting makes it."""
        rank, n = v.shape
        q, r = torch.linalg.qr(v.double().T)
        vd, ud = q.T, u.double() @ r.T
        chosen = pivot_order(vd, rank)  # the columns QR with column pivoting picks first
        rest = sorted(set(range(n)) - set(chosen))
        block = vd[:, chosen]
        m = cls(n, u.shape[0], rank, bias=bias is not None, dtype=dtype or u.dtype, device=u.device, pivoted=True)
        with torch.no_grad():
            t = torch.linalg.solve(block, vd[:, rest])
            m.weight.copy_(torch.cat([t, (ud @ block).T], dim=1).to(m.weight.dtype))
            m.pivots.copy_(torch.tensor(chosen + rest, dtype=torch.int32))
            if bias is not None:
                m.bias.copy_(bias.to(m.weight.dtype))
        return m

    def validate_loaded(self, name: str) -> None:
        """After loading: the stored ``pivots`` must be a permutation of the input's columns (a repeated column
        would run silently wrong, one out of range fail at the first forward), as EinSort's indices are checked."""
        p = self.pivots
        if p is None or p.device.type == "meta":
            return
        problem = None
        if p.dtype not in (torch.int32, torch.int64) or tuple(p.shape) != (self.in_features,):
            problem = f"{p.dtype} of shape {list(p.shape)}, not int32 of shape [{self.in_features}]"
        elif p.numel() and not 0 <= int(p.min()) <= int(p.max()) < self.in_features:
            problem = f"holds {int(p.min())}..{int(p.max())}, outside the input's columns 0..{self.in_features - 1}"
        elif torch.unique(p).numel() != self.in_features:
            problem = f"repeats {self.in_features - torch.unique(p).numel()} column(s); allowed: a permutation"
        if problem:
            raise ValueError(f"{name}.pivots: {problem}; the checkpoint is corrupt (re-create or re-download it)")

    def quantize_factors(self, bits: int, group_size: int, names=None, given=None) -> None:
        """`FactorizedModule.quantize_factors`, with ``weight`` balanced (plain form) and stored transposed
        (``channel_groups``: groups along the rank, a scale per channel); a skeleton being rebuilt (meta) keeps
        the layout its spec says."""
        names = self.quantizable(group_size) if names is None else names
        if "weight" not in names or given:
            return super().quantize_factors(bits, group_size, names, given)
        p = self._parameters["weight"]
        if not p.is_meta:
            self.channel_groups = True
            if self.pivots is None:
                p = self._balanced(p.data)
        if self.channel_groups:
            self._parameters["weight"] = nn.Parameter(p.data.T.contiguous(), requires_grad=False)
        super().quantize_factors(bits, group_size, names, given)

    def _balanced(self, w: torch.Tensor) -> torch.Tensor:
        """Plain-form ``weight`` with each rank component scaled so that U[:, i] and V[i, :] have equal norms
        (V[i] * d, U[:, i] / d: the same product), so no factor's codes spend their range on the other's scale."""
        v, ut = w[:, : self.in_features].double(), w[:, self.in_features :].double()
        nv, nu = v.norm(dim=1), ut.norm(dim=1)
        d = torch.where((nv > 0) & (nu > 0), (nu / nv.clamp(min=1e-300)).sqrt(), torch.ones_like(nv))
        return torch.cat([v * d[:, None], ut / d[:, None]], 1).to(w.dtype)

    def __getattr__(self, name: str):
        if name == "weight" and self.qspec("weight"):
            return self._dequantized_weight()
        return super().__getattr__(name)

    def _dequantized_weight(self) -> torch.Tensor:
        """The quantized ``weight`` de-quantized in the stored (rank, ...) layout: built once and kept while its
        codes, scales and dtype stay (decode then runs at the float factors' speed); computed afresh while
        `train_scales` trains the scales (gradients flow to them)."""
        parts = self._factor_tensors("weight")
        if any(t.device.type == "meta" for t in parts) or "weight_scale" in self._parameters:
            w = super().__getattr__("weight")
            return w.T if self.channel_groups and w.device.type != "meta" else w
        key = (change_key(parts), self.qspec("weight")[3], self.channel_groups)
        cache = self.__dict__.get("_dequantized")
        if cache is None or cache[0] != key:
            with torch.inference_mode(False), torch.no_grad():
                w = super().__getattr__("weight")
                w = w.T.contiguous() if self.channel_groups else w
            self.__dict__["_dequantized"] = cache = (key, w)
        return cache[1]

    @property
    def _split(self) -> int:
        return self.in_features - self.rank if self.pivots is not None else self.in_features

    @property
    def t(self) -> torch.Tensor:
        """The stored part of V: all of it, or in the pivoted form its columns outside the identity block."""
        return self.weight[:, : self._split]

    @property
    def v(self) -> torch.Tensor:
        if self.pivots is None:
            return self.t
        t = self.t
        full = torch.cat([torch.eye(self.rank, dtype=t.dtype, device=t.device), t], dim=1)
        return full.index_select(1, torch.argsort(self.pivots.long()))

    @property
    def u(self) -> torch.Tensor:
        return self.weight[:, self._split :].T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pivots is None:
            return self.factor_linear(self.factor_linear(x, "v"), "u", self.bias)
        x = x.index_select(-1, self.pivots)
        return self.factor_linear(x[..., : self.rank] + self.factor_linear(x[..., self.rank :], "t"), "u", self.bias)

    def dense_weight(self) -> torch.Tensor:
        return self.u @ self.v

    def append_factors(self, u: torch.Tensor, v: torch.Tensor) -> None:
        """Add ``u @ v`` (u: out x k, v: k x in) exactly, by growing the rank by k (used to merge LoRA); the
        pivoted form becomes the plain one first."""
        self._unpivot()
        extra = torch.cat([v, u.T], dim=1).to(self.weight)
        self.weight = nn.Parameter(torch.cat([self.weight.data, extra], dim=0), requires_grad=self.weight.requires_grad)
        self.rank = self.weight.shape[0]

    def truncate(self, rank: int) -> None:
        """Drop the factors beyond `rank` (the inverse of `append_factors`)."""
        self._unpivot()
        self.weight = nn.Parameter(self.weight.data[:rank].clone(), requires_grad=self.weight.requires_grad)
        self.rank = rank

    def _unpivot(self) -> None:
        if self.pivots is not None:
            plain = torch.cat([self.v, self.u.T], dim=1)
            self.weight = nn.Parameter(plain.detach(), requires_grad=self.weight.requires_grad)
            self.pivots = None

    def training_form(self) -> bool:
        """The pivoted form trains badly (T expresses the other columns through the pivot columns: a step of a
        fraction of each entry moves a product of heavy cancellation much further than the plain factors, and
        healing made SmolLM2 worse): healing trains the same product as balanced plain factors, U = Q_u X Σ^½,
        V = Σ^½ Yᵀ Q_vᵀ (from the SVD of the r x r product of the factors' triangular parts), and
        `storage_form` pivots the result again. A quantized pivoted factor stays as it is."""
        if self.pivots is None or self.qspec("weight"):
            return False
        qu, ru = torch.linalg.qr(self.u.detach().double())
        qv, rv = torch.linalg.qr(self.v.detach().double().T)
        x, s, yh = torch.linalg.svd(ru @ rv.T)
        root = s.sqrt()
        u, v = qu @ x * root, (root[:, None] * yh) @ qv.T
        self.__dict__["_stored"] = (self.weight, self.pivots)
        self.weight = nn.Parameter(torch.cat([v, u.T], dim=1).to(self.weight.dtype),
                                   requires_grad=self.weight.requires_grad)
        self.pivots = None
        return True

    def storage_form(self, keep: bool = True) -> None:
        weight, pivots = self.__dict__.pop("_stored", (None, None))
        if weight is None:
            return
        if keep:
            again = self.pivoted_from_factors(self.u.detach(), self.v.detach(), dtype=self.weight.dtype)
            weight = nn.Parameter(again.weight.data, requires_grad=weight.requires_grad)
            pivots = again.pivots
        self.weight, self.pivots = weight, pivots

    def spec(self) -> dict:
        spec = {"layer": self.layer_type, "in_features": self.in_features, "out_features": self.out_features,
                "rank": self.rank, "bias": self.bias is not None}
        if self.pivots is not None:
            spec["pivoted"] = True
        if self.channel_groups and self.qspec("weight"):
            spec["channel_groups"] = True
        return spec

    @classmethod
    def from_spec(cls, spec: dict, dtype=None, root=None) -> "LowRankLinear":
        m = cls(spec["in_features"], spec["out_features"], spec["rank"], bias=spec["bias"], dtype=dtype,
                pivoted=spec.get("pivoted", False))
        m.channel_groups = spec.get("channel_groups", False)  # absent (older checkpoints): codes by rank component
        return m

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
                f"bias={self.bias is not None}" + (", pivoted=True" if self.pivots is not None else ""))
