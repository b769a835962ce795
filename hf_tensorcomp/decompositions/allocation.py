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
from typing import Hashable, Sequence


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
