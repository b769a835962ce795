"""KV caches that compress what they hold: `EinSortCache` (sorted tensor networks over segments of old tokens)."""

from .einsort_cache import EinSortCache, EinSortCacheSettings, EinSortLayer, PackedSegment, compress_segment

__all__ = ["EinSortCache", "EinSortCacheSettings", "EinSortLayer", "PackedSegment", "compress_segment"]
