"""The embedding-table step of compression (``embedding_bits``): the input embedding and the output head stored
as low-bit codes (`quantize_embeddings`), a tied head reading the embedding's codes. With calibration text the
table the head multiplies by is quantized by GPTQ on the Gram of the head's inputs (`head_gram` in memory,
`final_gram` while streaming, one `table_plan` for both); `install_tables` and `table_stats` are shared with the
streamed table (`hf_tensorcomp.layer_stream.LayerStream.quantize_table`). The table's rungs in a byte budget are
the allocation's (`hf_tensorcomp.pipeline`)."""

from __future__ import annotations

import torch
from torch import nn

from .decompositions.quantize import QTensor
from .layout import embedding_names, set_tied_embeddings
from .surgery import set_module


def table_names(model: nn.Module) -> tuple[str, str | None]:
    """`layout.embedding_names`, refusing an embedding that is quantized already or not an nn.Embedding."""
    from .layers import QuantizedEmbedding

    emb = model.get_input_embeddings()
    emb = getattr(emb, "original", emb)  # streaming: the module a `StreamedEmbedding` stands in for
    if isinstance(emb, QuantizedEmbedding):
        raise ValueError("TensorCompressionConfig.embedding_bits: the embedding is quantized already; allowed: "
                         "embedding_bits=None when compressing a compressed model again")
    if not isinstance(emb, nn.Embedding):
        raise ValueError(f"TensorCompressionConfig.embedding_bits: the input embedding is a {type(emb).__name__}; "
                         "allowed: models whose input embedding is an nn.Embedding")
    return embedding_names(model)


class _HeadReached(Exception):
    pass


def head_gram(model: nn.Module, head: nn.Module, ids: torch.Tensor, batch_size: int) -> torch.Tensor:
    """XᵀX of the head's inputs (the final hidden states) over the calibration ids, by forward passes of the
    model as it is now (its compressed layers included) that stop at the head: its inputs are gathered and
    no logits are computed (a batch of 8 x 256 tokens over Gemma-3's 262k-token vocabulary would be 2 GB)."""
    from .calibration.stats import ModuleStats

    stats = ModuleStats(frozenset({"gram"}))

    def grab(module, args, kwargs):
        x = args[0] if args else kwargs["input"]
        stats.add(x.detach().reshape(-1, x.shape[-1]).float())
        raise _HeadReached

    handle = head.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            for i in range(0, len(ids), batch_size):
                try:
                    model(ids[i: i + batch_size].to(head.weight.device))
                except _HeadReached:
                    pass
    finally:
        handle.remove()
    return stats.gram.float()


def final_norm(model: nn.Module, prefix: str) -> nn.Module | None:
    """The norm after the decoder layers (named `prefix`) that the final hidden states go through to the head."""
    return getattr(model.get_submodule(prefix.rpartition(".")[0]), "norm", None)


def final_gram(model: nn.Module, runner, final) -> torch.Tensor | None:
    """XᵀX of the head's inputs from the `final` hidden states (the last decoder layer's outputs, propagated
    through the compressed layers; dropped here) through the model's final norm: what `head_gram` gathers
    with a forward pass of the whole model, for a model that is never whole (streaming). None without
    calibration."""
    if runner is None:
        return None
    from .calibration.stats import ModuleStats

    norm = final_norm(model, runner.prefix)
    if norm is None:
        raise ValueError("compress_checkpoint: embedding_bits: this architecture has no final `norm` after its decoder "
                         "layers to give the head's inputs; allowed: embedding_bits=None, or compress in memory")
    stats = ModuleStats(frozenset({"gram"}))
    with torch.no_grad():
        for h in final:
            x = norm(h)
            stats.add(x.detach().reshape(-1, x.shape[-1]).float())
    from . import distributed

    distributed.reduce_stats(runner.group, {"head": stats}, runner.n_batches, "the head's inputs")  # every rank's batches
    runner.drop_states(final)
    return stats.gram.float()


def table_plan(gram: torch.Tensor) -> tuple:
    """The GPTQ plan (`gptq_plan`: damped inverse and column order) the table a head multiplies by is
    quantized with: activation order on the Gram of the head's inputs. The one place the in-memory
    (`quantize_embeddings`) and the streamed (`LayerStream.quantize_table`) tables take it from, so the two
    stay bit-identical."""
    from .decompositions.quantize import gptq_plan

    return gptq_plan(gram, act_order=True)


def quantize_embeddings(model: nn.Module, bits: int, group_size: int, ids: torch.Tensor | None = None,
                        batch_size: int = 8, gram: torch.Tensor | None = None) -> dict:
    """The input embedding and the output head stored as `bits`-bit codes in groups of `group_size` along
    each row; a tied head reads the embedding's codes, so the table is stored once, and transformers' own
    tying is switched off (``tie_word_embeddings=False``: this module is the tie).

    With calibration `ids` the head's weight (the tied table) is quantized by GPTQ in activation order on
    the Gram of the head's inputs: the head's output error is what a 4-bit table costs (SmolLM2, 4 bits in
    groups of 128: round to nearest in the head alone 1.155x dense perplexity, in the lookups alone 1.007x;
    GPTQ tied 1.058x; the head's relative output error on the calibration text 0.122 rounded to nearest,
    0.053 GPTQ in column order, 0.045 in activation order); without, round to nearest. An untied
    embedding is always rounded to nearest. `gram`: that Gram, when the caller has it (`final_gram` of the
    compression pass's propagated states: no forward pass of the model here)."""
    from .decompositions.quantize import quantize_gptq

    emb_name, head_name = table_names(model)
    emb = model.get_submodule(emb_name)
    head = model.get_submodule(head_name) if head_name else None
    tied = head is not None and head.weight is emb.weight
    if gram is None:
        gram = head_gram(model, head, ids, batch_size) if head is not None and ids is not None else None
    quantizer = "gptq" if gram is not None else "rtn"

    def q(w):
        return quantize_gptq(w.detach().float(), None, bits, group_size, plan=table_plan(gram)) if gram is not None else None

    def err(ref, approx):
        ref, approx = ref.detach().float(), approx.detach().float()
        return round(float((ref - approx).norm() / ref.norm().clamp_min(1e-30)), 6)

    new_emb, new_head = install_tables(model, emb, head, bits, group_size, q(emb.weight) if tied else None,
                                       None if head is None or tied else q(head.weight))
    out = {emb_name: table_stats(bits, group_size, quantizer if tied else "rtn", err(emb.weight, new_emb.weight), tied)}
    if head is not None and not tied:
        out[head_name] = table_stats(bits, group_size, quantizer, err(head.weight, new_head.weight))
    return out


def table_stats(bits: int, group_size: int, quantizer: str, rel_error: float, tied: bool | None = None) -> dict:
    """The stats of a quantized embedding table (``tied``: given for the input embedding, not an untied head)."""
    return {"method": "embedding", "bits": bits, "group_size": group_size,
            **({"tied_head": tied} if tied is not None else {}), "quantizer": quantizer, "rel_error": rel_error}


def install_tables(model: nn.Module, emb: nn.Module, head: nn.Module | None, bits: int, group_size: int,
                   given: QTensor | None = None, given_head: QTensor | None = None):
    """`QuantizedEmbedding` and `QuantizedHead` put in place of the input embedding `emb` and the head (a tied
    head reads the embedding's codes, and transformers' own tying is switched off: this module is the tie);
    their codes `given` (e.g. GPTQ's), else rounded to nearest, or on the meta device empty buffers (a
    streamed skeleton). Returns (the new embedding, the new head or None)."""
    from .layers import QuantizedEmbedding, QuantizedHead

    emb_name, head_name = embedding_names(model)
    tied = head is not None and head.weight is emb.weight
    new_emb = QuantizedEmbedding.build(emb, bits, group_size, given)
    new_head = None
    if head is not None:
        new_head = QuantizedHead.build(head, bits, group_size, new_emb if tied else None, emb_name if tied else None,
                                       given=given_head)
        set_module(model, head_name, new_head)
    set_module(model, emb_name, new_emb)
    if tied:
        set_tied_embeddings(model.config, False)
        model.all_tied_weights_keys = {}
    return new_emb, new_head
