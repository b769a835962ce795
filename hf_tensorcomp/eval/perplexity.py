"""Strided (sliding-window) perplexity of a causal LM on a list of texts."""

from __future__ import annotations

import inspect
import math
import time
from typing import Sequence

import torch
import torch.nn.functional as F

__all__ = ["perplexity"]


def _windows(n: int, context_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, n_target) for each window of the HF strided-perplexity recipe."""
    out = []
    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + context_length, n)
        out.append((begin, end, end - prev_end))
        prev_end = end
        if end == n:
            break
    return out


def bos_prefix(tokenizer, add_bos: bool | None) -> list[int]:
    """``[bos_token_id]`` when BOS is to be prepended (``add_bos=None``: if the tokenizer adds it itself), else ``[]``."""
    if add_bos is None:
        add_bos = _tokenizer_adds_bos(tokenizer)
    if add_bos and tokenizer.bos_token_id is None:
        raise ValueError("add_bos=True but the tokenizer has no bos_token_id")
    return [tokenizer.bos_token_id] if add_bos else []


def _tokenizer_adds_bos(tokenizer) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    probe = tokenizer("a", verbose=False)["input_ids"]
    return len(probe) > 0 and probe[0] == bos


@torch.no_grad()  # not inference_mode: quantized peers (optimum-quanto int4) fail on inference tensors
def perplexity(
    model,
    tokenizer,
    texts: str | Sequence[str],
    context_length: int = 512,
    stride: int = 512,
    max_tokens: int | None = None,
    batch_size: int = 1,
    progress: bool = True,
    add_bos: bool | None = None,
) -> dict:
    """Perplexity of ``model`` on ``texts`` with the standard HF strided sliding-window recipe.

    The texts are joined with ``"\\n\\n"`` and tokenized once (without special tokens).
    Windows of ``context_length`` tokens start every ``stride`` tokens; each window scores
    only the tokens not scored by the previous window (its last ``stride`` tokens when
    ``stride < context_length``, so every scored token sees at least
    ``context_length - stride`` tokens of context). With ``stride == context_length``
    (default) the windows are disjoint and the first token of each window, which has no
    context, is not scored (as in the HF recipe).

    Args:
        model: a causal LM returning ``.logits`` (any transformers ``*ForCausalLM``);
            inputs go to the device of its first parameter. Put in eval mode for the call
            (its previous train/eval mode is restored afterwards).
        tokenizer: the model's tokenizer.
        texts: a string or a list of strings (e.g. ``hf_tensorcomp.assets.load_text()``).
        context_length: tokens of text per window (default 512).
        stride: step between window starts (default 512, i.e. disjoint windows at the
            default context; values above ``context_length`` are clamped to it). Smaller
            strides give more context per scored token and cost ``context_length / stride``
            times more compute.
        max_tokens: use only the first ``max_tokens`` tokens of the joined text (default
            None = all); keeps it quick on CPU (e.g. 16384 tokens ~ 32 windows of 512).
        batch_size: windows of equal shape per forward pass (default 1). Results agree
            with batch_size=1 up to float rounding.
        progress: show a tqdm bar over windows (default True).
        add_bos: prepend the tokenizer's BOS token to every window as unscored context.
            Default None = auto: only if the tokenizer itself adds BOS to its inputs (Gemma
            does and needs it: without a leading <bos> its perplexity explodes; SmolLM2
            does not). ``context_length`` counts text tokens, BOS not included, and with a
            BOS the first text token of each window is scored too.

    Returns:
        dict with ``ppl`` (exp of nll), ``nll`` (mean negative log-likelihood per scored
        token, natural log), ``n_tokens`` (scored tokens), ``n_windows``, ``context_length``,
        ``stride``, ``add_bos`` and ``seconds`` (wall time of the forward passes).
        Deterministic for a given model, text and settings (fp64 accumulation).
    """
    if isinstance(texts, str):
        texts = [texts]
    _check_settings(context_length, stride, max_tokens, batch_size)
    stride = min(stride, context_length)  # a larger stride would skip text

    ids = tokenizer("\n\n".join(texts), add_special_tokens=False, verbose=False)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    bos = bos_prefix(tokenizer, add_bos)
    if len(ids) + len(bos) < 2:
        raise ValueError("texts are too short: need at least 2 tokens to score")
    if context_length + len(bos) < 2:
        raise ValueError("context_length must be >= 2 without a BOS token")

    windows = _windows(len(ids), context_length, stride)
    t0 = time.perf_counter()
    nll_sum, n_scored = _score(model, ids, bos, _batches(windows, batch_size), len(windows), progress)
    nll = nll_sum / n_scored
    return {
        "ppl": math.exp(nll),
        "nll": nll,
        "n_tokens": n_scored,
        "n_windows": len(windows),
        "context_length": context_length,
        "stride": stride,
        "add_bos": bool(bos),
        "seconds": time.perf_counter() - t0,
    }


def _check_settings(context_length, stride, max_tokens, batch_size) -> None:
    if not isinstance(context_length, int) or context_length < 1:
        raise ValueError(f"context_length must be a positive int, got {context_length!r}")
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride must be a positive int, got {stride!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 2):
        raise ValueError(f"max_tokens must be None or an int >= 2, got {max_tokens!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")


def _batches(windows: list[tuple[int, int, int]], batch_size: int) -> list[list[tuple[int, int, int]]]:
    """Consecutive windows of the same (length, n_target), up to ``batch_size`` a batch."""
    batches: list[list[tuple[int, int, int]]] = []
    for w in windows:
        if batches and len(batches[-1]) < batch_size and _key(batches[-1][0]) == _key(w):
            batches[-1].append(w)
        else:
            batches.append([w])
    return batches


def _score(model, ids: list[int], bos: list[int], batches, n_windows: int, progress: bool) -> tuple[float, int]:
    """(summed negative log-likelihood, tokens scored) over the windows' batches, the model in eval mode meanwhile."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    keep_kw = "logits_to_keep" in inspect.signature(model.forward).parameters
    was_training = model.training
    model.eval()
    nll_sum = 0.0
    n_scored = 0
    try:
        with tqdm(total=n_windows, desc="perplexity", disable=not progress, unit="win") as bar:
            for batch in batches:
                rows = [bos + ids[b:e] for b, e, _ in batch]
                inp = torch.tensor(rows, dtype=torch.long, device=device)
                length = inp.shape[1]
                # input positions whose tokens are scored: the last n_target, never position 0
                n_score = min(batch[0][2], length - 1)
                kw = {"logits_to_keep": n_score + 1} if keep_kw else {}
                logits = model(input_ids=inp, use_cache=False, **kw).logits
                logits = logits[:, -(n_score + 1) : -1, :].float()
                targets = inp[:, length - n_score :]
                loss = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
                )
                nll_sum += float(loss.double())
                n_scored += targets.numel()
                bar.update(len(batch))
    finally:
        model.train(was_training)
    return nll_sum, n_scored


def _key(w: tuple[int, int, int]) -> tuple[int, int]:
    return (w[1] - w[0], w[2])
