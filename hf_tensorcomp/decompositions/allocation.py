"""Global budget allocation: choose one option per matrix so the total cost fits a budget.

Each matrix offers a ladder of options (e.g. ranks 1, 2, ..., then "keep it dense"), each with a cost
(parameters or bytes, increasing up the ladder) and a loss (decreasing: e.g. the whitened truncation
loss, the squared output error the dropped singular values carry, relative to the matrix's output
energy). Every matrix starts on its first rung; the rung whose loss saved per unit of cost is largest
across all matrices is climbed next, as long as it fits, until nothing fits. With convex ladders
(singular values sorted, so each further rank saves less) this greedy rule is the optimum of the
relaxed problem; the budget is never exceeded, and what is left unspent is smaller than the cheapest
rung that could still be climbed. Ladders are not always convex (a quantizer's widths beside its correction
ranks), and then the climb from the cheapest rungs can end worse than a plain setting that fits: given that
setting (``seed``, e.g. one width everywhere), the climb is made from it as well and the lower total loss kept,
so an allocation never loses to the setting it contains (by the loss it is given).
"""

from __future__ import annotations

import heapq
from typing import Callable, Hashable, Sequence

import torch


def allocate(ladders: dict[Hashable, tuple[Sequence[float], Sequence[float]]], budget: float,
             seed: dict[Hashable, int] | None = None) -> dict[Hashable, int]:
    """``ladders[key] = (costs, losses)`` (same length, costs increasing); returns the chosen rung per key.

    ``seed`` ({key: rung}, keys absent on rung 0): a setting to climb from as well when it fits the budget; the
    climb with the lower total loss is returned (ties: the seed's). Raises ValueError if even the first rungs
    exceed the budget.
    """
    chosen = _climb(ladders, budget, {k: 0 for k in ladders})
    if seed:
        start = {k: seed.get(k, 0) for k in ladders}
        if sum(ladders[k][0][j] for k, j in start.items()) <= budget:
            seeded = _climb(ladders, budget, start)
            if total_loss(ladders, seeded) <= total_loss(ladders, chosen):
                return seeded
    return chosen


def total_loss(ladders: dict[Hashable, tuple[Sequence[float], Sequence[float]]], rungs: dict[Hashable, int]) -> float:
    """The summed loss of the rungs chosen (what `allocate` minimises)."""
    return float(sum(ladders[k][1][j] for k, j in rungs.items()))


def _climb(ladders, budget: float, chosen: dict) -> dict:
    """The greedy rule from the rungs `chosen` (updated in place and returned): the step with the most loss saved
    per unit of cost next, while it fits."""
    spent = sum(ladders[k][0][j] for k, j in chosen.items())
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
    while heap:
        _, _, k, dc = heapq.heappop(heap)
        if spent + dc <= budget:
            spent += dc
            chosen[k] += 1
            push(k)
        # else: this matrix stops here, climbing further would break the budget
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


def water_fill_widths(energy: torch.Tensor, mean: float, widths: Sequence[int]) -> list[int]:
    """A code width per channel from `widths` (increasing) averaging at most `mean`, for the least summed squared
    round-trip error when channel i's error is ``energy[i] · 4^-width`` (reverse water-filling: each further bit
    quarters a channel's error, so the bits go where the energy is). Every channel gets at least ``widths[0]``."""
    e = [float(x) for x in energy]
    ladders = {i: (list(widths), [x * 4.0 ** -b for b in widths]) for i, x in enumerate(e)}
    chosen = allocate(ladders, max(mean * len(e), widths[0] * len(e)))
    return [widths[chosen[i]] for i in range(len(e))]
