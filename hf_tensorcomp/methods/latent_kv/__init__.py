"""``latent_kv``: key and value projections through a calibrated latent, and a KV cache of latents.

- `layer`: `LatentKVLinear`, a k_proj / v_proj as a down-projection to the latent and the factors back up;
- `method`: the ``method="latent_kv"`` replacer (ranks from the ``kv_bytes`` budget on the whitened spectra);
- `cache`: `LatentKVCache`, the transformers `Cache` of quantized latents;
- `stores`: the latents of one stream each (codes per channel, widths from the prompt, the CPU int4 kernel's layouts);
- `attention`: the ``latent_kv`` attention registered with transformers, reading that cache, and `enable`.
"""

from .attention import enable
from .cache import LatentKVCache, LatentKVLayer, dense_cache_bytes
from .layer import LatentKVLinear
from .method import LatentKV

__all__ = ["LatentKV", "LatentKVCache", "LatentKVLayer", "LatentKVLinear", "dense_cache_bytes", "enable"]
