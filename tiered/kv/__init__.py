"""tiered.kv: the KV cache of a transformers model on the store's tiers (GPU window, pinned DDR, NVMe).

    from tiered.kv import TieredCache
    cache = TieredCache(config=model.config, nvme_path="/mnt/nvme", host_budget="32GiB", gpu_budget="8GiB")
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=256)
    cache.swap_out(seq); cache.swap_in(seq)     # preempt a sequence and resume it bit-exactly
    cache.close()

Stands on tiered.store and tiered.store.workdir; knows no optimizer. See cache.py for where the bytes are.
"""

from __future__ import annotations

from .cache import SwapIntegrityError, TieredCache
from .forward import cache_kwargs

__all__ = ["TieredCache", "SwapIntegrityError", "cache_kwargs"]
