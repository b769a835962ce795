"""Where a transformers model keeps its decoder layers (no dependency on the rest of the package)."""

from __future__ import annotations

from torch import nn


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.split(".")[-1] == "layers" and len(mod) > 0:
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise ValueError(
            f"{type(model).__name__}: no decoder-layer list (an nn.ModuleList named '...layers') found; "
            "hf_tensorcomp supports decoder-only transformers models such as Llama, Qwen3 and Gemma3"
        )
    return best


def first_output(out):
    """The hidden states a module returned: decoder layers and attention modules return a tuple whose
    first element they are (some transformers versions return the tensor alone)."""
    return out[0] if isinstance(out, tuple) else out


def embedding_names(model: nn.Module) -> tuple[str | None, str | None]:
    """Module names of the input embedding and of the output head (None where the model has none, or
    where the head is not a linear layer)."""
    names = {id(m): n for n, m in model.named_modules()}
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    return names.get(id(emb)), names.get(id(head)) if isinstance(head, nn.Linear) else None


def set_tied_embeddings(model_config, tied: bool) -> None:
    """``tie_word_embeddings`` on a model's config and on its text config (one object or two)."""
    for c in {id(c): c for c in (model_config, model_config.get_text_config())}.values():
        c.tie_word_embeddings = tied


def head_dim(config) -> int:
    """Width of one attention head: the config's ``head_dim``, else hidden size over the number of heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def resolve_layers(layers: list[int] | None, n: int) -> list[int]:
    """The decoder layers a config's `layers` names (None: all of the model's `n`), sorted, negative indices
    counted from the end; an index out of range refused naming the field."""
    if layers is None:
        return list(range(n))
    out = []
    for i in layers:
        if not -n <= i < n:
            raise ValueError(f"TensorCompressionConfig.layers: got {i}; allowed: ints in [{-n}, {n - 1}] (the model has {n} decoder layers)")
        j = i % n
        if j not in out:
            out.append(j)
    return sorted(out)
