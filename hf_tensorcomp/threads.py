"""How many CPU threads compression uses.

The matrices of small models are decomposed on one thread. Threads save little at these sizes on an
idle machine, and on a busy one OpenMP's threads wait on each other at every parallel region: LASER
on SmolLM2's 60 q,k matrices (576 x 576 and 192 x 576) took 35-49 s with torch's default 2 threads
on a loaded 2-core machine and 2.3 s on one thread (the slowest single matrix: 10.8 s against 0.07 s).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .surgery import find_decoder_layers

#: a model whose largest decoder-layer matrix has fewer entries than this is compressed on one thread
SINGLE_THREAD_BELOW = 1 << 22


def largest_matrix(model: nn.Module) -> int:
    """Entries of the largest 2-D parameter in the model's decoder layers (embeddings excluded)."""
    _, layer_list = find_decoder_layers(model)
    return max((p.numel() for p in layer_list.parameters() if p.ndim == 2), default=0)


@contextlib.contextmanager
def compression_threads(model: nn.Module):
    """Run the enclosed compression on one thread if the model's matrices are small (`SINGLE_THREAD_BELOW`)."""
    n = torch.get_num_threads()
    if n == 1 or largest_matrix(model) >= SINGLE_THREAD_BELOW:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
