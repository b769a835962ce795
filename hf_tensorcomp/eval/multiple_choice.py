"""Zero-shot multiple-choice accuracy of a causal LM by choice log-likelihood."""

from __future__ import annotations

import inspect
import time
from typing import Sequence

import torch

from .perplexity import bos_prefix

__all__ = ["multiple_choice_accuracy", "NORMALIZATIONS"]

NORMALIZATIONS = ("length", "none")


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _check_examples(examples) -> None:
    for i, ex in enumerate(examples):
        if not isinstance(ex, dict):
            raise ValueError(f"examples[{i}] must be a dict, got {type(ex).__name__}")
        if not isinstance(ex.get("input"), str):
            raise ValueError(f"examples[{i}]['input'] must be a str")
        choices = ex.get("choices")
        if (not isinstance(choices, (list, tuple)) or not choices
                or not all(isinstance(c, str) for c in choices)):
            raise ValueError(f"examples[{i}]['choices'] must be a non-empty list of str")
        for t in ex.get("targets", [ex.get("target")]):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < len(choices):
                raise ValueError(
                    f"examples[{i}]: target {t!r} is not an index into its {len(choices)} choices"
                )


@torch.no_grad()  # not inference_mode: quantized peers (optimum-quanto int4) fail on inference tensors
def multiple_choice_accuracy(
    model,
    tokenizer,
    examples: Sequence[dict],
    max_examples: int | None = None,
    normalize: str = "length",
    batch_size: int = 8,
    progress: bool = True,
    add_bos: bool | None = None,
    delimiter: str = " ",
    return_scores: bool = False,
) -> dict:
    """Accuracy of ``model`` on multiple-choice ``examples`` by the log-likelihood of each choice.

    Every choice is scored as the continuation of its example's input: the sum of the
    log-probabilities of the choice's tokens given the input (``normalize="none"``), or that
    sum divided by the number of choice tokens (``normalize="length"``, the mean per-token
    log-probability; default). The prediction is the argmax (the first choice on exact
    ties); an example is correct if it is ``example["target"]`` or, when the example has
    ``"targets"``, any of those. Both normalizations come from the same forward passes, so
    the result reports both (``accuracy_by_normalize``); ``normalize`` picks ``accuracy``.

    Tokenization: ``context = input``, plus ``delimiter`` if the input is non-empty, does not
    end in whitespace and the choice does not start with whitespace (so ``"...is "`` +
    ``"Buy"`` stays ``"...is Buy"`` while ``"...true or false?"`` + ``"true"`` becomes
    ``"...false? true"``). ``context`` and ``context + choice`` are tokenized (no special
    tokens) and the choice's tokens are those of ``context + choice`` after the longest
    common prefix of the two token lists: normally exactly the context's tokens; if the
    tokenizer merges characters across the boundary (e.g. the input's trailing space joins
    the choice's first word, ``" "`` + ``"Buy"`` -> ``" Buy"``), scoring starts at the first
    token that differs, so the scored tokens always spell the rest of the full text and are
    predicted from a prefix that is a real tokenization of it. A BOS token is prepended as
    unscored context when ``add_bos`` (see below).

    Args:
        model: a causal LM returning ``.logits`` (any transformers ``*ForCausalLM``); inputs go
            to the device of its first parameter. Put in eval mode for the call (its previous
            mode is restored).
        tokenizer: the model's tokenizer.
        examples: dicts with ``"input"`` (str), ``"choices"`` (list of str), ``"target"``
            (int index), optionally ``"targets"`` (several correct indices) and ``"subtask"``
            (reported separately in ``by_subtask``), e.g. from
            ``hf_tensorcomp.assets.load_bigbench_task``.
        max_examples: score only the first ``max_examples`` examples (default None = all).
        normalize: ``"length"`` (default) or ``"none"``, see above.
        batch_size: sequences (example, choice pairs) per forward pass (default 8). They are
            sorted by length and right-padded with an attention mask; results agree with
            ``batch_size=1`` up to float rounding.
        progress: show a tqdm bar over sequences (default True).
        add_bos: prepend the tokenizer's BOS token to every sequence. Default None = auto:
            only if the tokenizer itself adds BOS (Gemma does; SmolLM2 does not), as in
            ``hf_tensorcomp.eval.perplexity``. Without BOS an example needs a non-empty input.
        delimiter: text put between input and choice as described above (default ``" "``;
            ``""`` = plain concatenation).
        return_scores: also return ``scores``: per example, per choice ``(sum_logprob,
            n_tokens)``.

    Returns:
        dict with ``accuracy`` (for ``normalize``), ``accuracy_by_normalize`` (``{"length":
        ..., "none": ...}``), ``n`` (examples scored), ``chance`` (expected accuracy of a
        uniformly random choice: mean of ``n_correct / n_choices``, i.e. mean ``1/len(choices)``
        with one target each), ``normalize``, ``predictions`` (chosen indices for
        ``normalize``), ``n_sequences``, ``n_tokens`` (choice tokens scored), ``add_bos``,
        ``seconds`` (wall time of tokenization and forward passes), ``by_subtask`` (``{subtask:
        {"accuracy", "accuracy_by_normalize", "n", "chance"}}``, only if examples have
        ``"subtask"``) and ``scores`` if ``return_scores``. Deterministic for a given model,
        examples and settings (fp64 accumulation).
    """
    _check_settings(normalize, max_examples, batch_size, delimiter)
    examples = list(examples)[:max_examples]
    if not examples:
        raise ValueError("examples is empty: nothing to score")
    _check_examples(examples)

    t0 = time.perf_counter()
    bos = bos_prefix(tokenizer, add_bos)
    seqs, owner = _sequences(tokenizer, examples, bos, delimiter)
    sums, n_tok = _score_sequences(model, tokenizer, seqs, batch_size, progress)
    scores: list[list[tuple[float, int]]] = [[] for _ in examples]
    for s, (i, _) in enumerate(owner):
        scores[i].append((sums[s], n_tok[s]))
    out = _report(examples, scores, normalize, dict(n_sequences=len(seqs), n_tokens=sum(n_tok), add_bos=bool(bos),
                                                    seconds=time.perf_counter() - t0))
    if return_scores:
        out["scores"] = scores
    return out


def _check_settings(normalize: str, max_examples, batch_size, delimiter) -> None:
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"unknown normalize={normalize!r}; allowed: {', '.join(NORMALIZATIONS)}")
    if max_examples is not None and (isinstance(max_examples, bool) or not isinstance(max_examples, int)
                                     or max_examples < 1):
        raise ValueError(f"max_examples must be None or a positive int, got {max_examples!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(delimiter, str):
        raise ValueError(f"delimiter must be a str, got {delimiter!r}")


def _sequences(tokenizer, examples: list[dict], bos: list[int], delimiter: str):
    """(one sequence per (example, choice): (token ids, index of the first scored token), its (example, choice)),
    tokenized as `multiple_choice_accuracy` describes."""
    seqs: list[tuple[list[int], int]] = []
    owner: list[tuple[int, int]] = []
    for i, ex in enumerate(examples):
        ctx_text = ex["input"]
        ctx_ids = _encode(tokenizer, ctx_text)
        for j, choice in enumerate(ex["choices"]):
            glue = ctx_text and not ctx_text[-1].isspace() and not choice[:1].isspace()
            sep = delimiter if glue else ""
            full_ids = _encode(tokenizer, ctx_text + sep + choice)
            k = _common_prefix(ctx_ids, full_ids)
            if k == len(full_ids):
                raise ValueError(f"examples[{i}]: choice {j} ({choice!r}) adds no tokens to the input")
            if k == 0 and not bos:
                raise ValueError(
                    f"examples[{i}]: the input gives no context token before choice {j} and no BOS "
                    "token is added (add_bos=False): the first choice token cannot be scored"
                )
            seqs.append((bos + full_ids, len(bos) + k))
            owner.append((i, j))
    return seqs, owner


def _score_sequences(model, tokenizer, seqs: list[tuple[list[int], int]], batch_size: int, progress: bool):
    """(sum of the scored tokens' log-probabilities, their count) of each sequence: longest first,
    ``batch_size`` a forward pass, right-padded with an attention mask, the model in eval mode meanwhile."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    keep_kw = "logits_to_keep" in inspect.signature(model.forward).parameters
    pad_id = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else 0
    order = sorted(range(len(seqs)), key=lambda s: (-len(seqs[s][0]), s))
    sums = [0.0] * len(seqs)
    n_tok = [0] * len(seqs)

    was_training = model.training
    model.eval()
    try:
        with tqdm(total=len(seqs), desc="multiple choice", disable=not progress, unit="seq") as bar:
            for b in range(0, len(order), batch_size):
                batch = order[b : b + batch_size]
                length = max(len(seqs[s][0]) for s in batch)
                inp = torch.full((len(batch), length), pad_id, dtype=torch.long)
                mask = torch.zeros((len(batch), length), dtype=torch.long)
                for r, s in enumerate(batch):
                    ids = seqs[s][0]
                    inp[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                    mask[r, : len(ids)] = 1
                # logits are needed from the position before the earliest scored token onwards
                first = min(seqs[s][1] for s in batch) - 1
                kw = {"logits_to_keep": length - first} if keep_kw else {}
                logits = model(
                    input_ids=inp.to(device), attention_mask=mask.to(device), use_cache=False, **kw
                ).logits
                offset = length - logits.shape[1]  # sequence position of logits[:, 0]
                for r, s in enumerate(batch):
                    ids, start = seqs[s]
                    rows = logits[r, start - 1 - offset : len(ids) - 1 - offset].float()
                    target = torch.tensor(ids[start:], dtype=torch.long, device=rows.device)
                    logp = torch.log_softmax(rows, dim=-1).gather(-1, target[:, None])
                    sums[s] = float(logp.double().sum())
                    n_tok[s] = len(ids) - start
                bar.update(len(batch))
    finally:
        model.train(was_training)
    return sums, n_tok


def _report(examples: list[dict], scores: list[list[tuple[float, int]]], normalize: str, extra: dict) -> dict:
    """Accuracy under each normalization, chance, the predictions (for ``normalize``), `extra`, and the
    accuracies by subtask."""

    def pick(sc: list[tuple[float, int]], how: str) -> int:
        values = [v / n if how == "length" else v for v, n in sc]
        return max(range(len(values)), key=lambda c: (values[c], -c))  # first on exact ties

    correct = {how: [] for how in NORMALIZATIONS}
    predictions = []
    chance = []
    for ex, sc in zip(examples, scores):
        targets = set(ex.get("targets", [ex["target"]]))
        for how in NORMALIZATIONS:
            p = pick(sc, how)
            correct[how].append(p in targets)
            if how == normalize:
                predictions.append(p)
        chance.append(len(targets) / len(ex["choices"]))

    def summary(idx: list[int]) -> dict:
        by = {how: sum(correct[how][i] for i in idx) / len(idx) for how in NORMALIZATIONS}
        return {
            "accuracy": by[normalize],
            "accuracy_by_normalize": by,
            "n": len(idx),
            "chance": sum(chance[i] for i in idx) / len(idx),
        }

    out = summary(list(range(len(examples))))
    out.update(normalize=normalize, predictions=predictions, **extra)
    subtasks: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        if "subtask" in ex:
            subtasks.setdefault(str(ex["subtask"]), []).append(i)
    if subtasks:
        out["by_subtask"] = {name: summary(idx) for name, idx in sorted(subtasks.items())}
    return out
