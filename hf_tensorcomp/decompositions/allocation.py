"""Global budget allocation: choose one option per matrix so the total cost fits a budget.

Each matrix offers a ladder of options (e.g. ranks 1, 2, ..., then "keep it dense"), each with a cost
(parameters or bytes, increasing up the ladder) and a loss (decreasing: e.g. the whitened truncation
loss, the squared output error the dropped singular values carry, relative to the matrix's output
energy). Every matrix starts on its first rung; the rung whose loss saved per unit of cost is largest
across all matrices is climbed next, as long as it fits, until nothing fits. With convex ladders
(singular values sorted, so each further rank saves less) this greedy rule is the optimum of the
relaxed problem; the budget is never exceeded, and what is left unspent is smaller than the cheapest
rung that could still be climbed.
"""

from __future__ import annotations

import heapq
from typing import Callable, Hashable, Sequence

import torch


def allocate(ladders: dict[Hashable, tuple[Sequence[float], Sequence[float]]], budget: float) -> dict[Hashable, int]:
    """``ladders[key] = (costs, losses)`` (same length, costs increasing); returns the chosen rung per key.

    Raises ValueError if even the first rungs exceed the budget.
    """
    chosen = {k: 0 for k in ladders}
    spent = sum(c[0] for c, _ in ladders.values())
    if spent > budget:
        raise ValueError(f"budget {budget:,.0f} is below the cheapest setting of every matrix ({spent:,.0f})")
    heap = []

    def push(k):
        costs, losses = ladders[k]
        j = chosen[k]
        if j + 1 < len(costs):
            dc = costs[j + 1] - costs[j]
            gain = (losses[j] - losses[j + 1]) / dc if dc > 0 else float("inf")
            heapq.heappush(heap, (-gain, str(k), k, dc))

    for k in ladders:
        push(k)
    blocked = []
    while heap:
        _, _, k, dc = heapq.heappop(heap)
        if spent + dc <= budget:
            spent += dc
            chosen[k] += 1
            push(k)
        else:
            blocked.append(k)  # this matrix stops here: climbing further would break the budget
    return chosen


def multilinear_ranks(tensor: torch.Tensor, modes: Sequence[int], count: Callable[[list[int]], float],
                      budget: float) -> list[int] | None:
    """Ranks for `modes` of a Tucker decomposition whose parameter ``count(ranks)`` is at most `budget`.

    Greedy on the spectra of the mode unfoldings: from full ranks, drop one rank at a time where the
    discarded squared singular value per parameter saved is smallest (the HOSVD error bound is the
    sum over modes of the discarded squared singular values). None if ranks of 1 still cost too much.
    """
    spectra = [torch.linalg.svdvals(torch.movedim(tensor, n, 0).reshape(tensor.shape[n], -1)).pow(2) for n in modes]
    ranks = [len(s) for s in spectra]
    while count(ranks) > budget:
        best, best_score = None, None
        for n in range(len(ranks)):
            if ranks[n] == 1:
                continue
            smaller = ranks.copy()
            smaller[n] -= 1
            score = spectra[n][ranks[n] - 1].item() / (count(ranks) - count(smaller))
            if best is None or score < best_score:
                best, best_score = n, score
        if best is None:
            return None
        ranks[best] -= 1
    return ranks
