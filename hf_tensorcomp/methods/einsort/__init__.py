"""EinSort (Koike-Akino et al.): sorted tensorization, for weights and for the KV cache.

- `decomposition`: the math — a tensor's indices sorted, magnitudes mapped, tensorized (`EinSortTensor`);
- `layer`: `EinSortLinear`, the factored linear a checkpoint stores;
- `method`: the ``method="einsort"`` weight compression (and `activation_scales`);
- `segments` / `cache`: `EinSortCache`, a transformers KV cache of compressed segments (the segment
  codec, then the `Cache` subclass).
"""

from .cache import EinSortCache, EinSortCacheSettings, EinSortLayer
from .decomposition import EinSortTensor
from .layer import EinSortLinear
from .method import EinSort, activation_scales, save_activation_scales
from .segments import PackedSegment, compress_segment

__all__ = ["EinSort", "EinSortCache", "EinSortCacheSettings", "EinSortLayer", "EinSortLinear", "EinSortTensor",
           "PackedSegment", "activation_scales", "compress_segment", "save_activation_scales"]
