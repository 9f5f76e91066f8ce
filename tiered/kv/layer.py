"""TieredLayer: the transformers ``CacheLayerMixin`` of one decoder layer; the data lives in its TieredCache.

transformers' attention calls ``cache.update(k, v, layer_idx)``, and the mask code asks a layer for its length
(``get_seq_length``, ``get_mask_sizes``). Every answer comes from the owning cache, which knows each sequence's
slot in this layer and where it lies (window, host, NVMe). ``offload``/``prefetch`` are no-ops: the cache moves
its layers itself. Beam search and cropping rewrite rows and tails of the cache, which this cache does not
support: they raise ``NotImplementedError`` by name rather than give wrong tokens.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from transformers.cache_utils import CacheLayerMixin

__all__ = ["TieredLayer", "LayerOwner"]


class LayerOwner(Protocol):
    """What a layer needs of its cache (TieredCache), seen as a Protocol so that this module need not import it."""

    def _update_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def _layer_length(self, layer: int) -> int: ...

    def reset(self) -> None: ...


class TieredLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache: LayerOwner, index: int) -> None:
        super().__init__()
        # Weakly: the cache owns its layers, and a cycle would keep a dropped cache (its threads, pinned pages
        # and folder) alive until a garbage collection, in whatever thread that runs.
        self._cache, self.index = weakref.proxy(cache), index

    def __repr__(self) -> str:
        return f"TieredLayer({self.index})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._cache._update_layer(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self._cache._layer_length(self.index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        self._cache.reset()

    def _unsupported(self, what: str) -> None:
        raise NotImplementedError(f"TieredCache does not support {what}: decode greedily or by sampling (with any "
                                  "num_return_sequences: generate repeats the prompt before the first forward), "
                                  "num_beams=1, no assistant model or prompt lookup. generate asks for it after its "
                                  "first forward, which the cache holds now: reset() the cache before using it "
                                  "again")  # fmt: skip

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("crop (assisted or speculative decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._unsupported("reorder_cache (beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            self._unsupported("batch_repeat_interleave (repeating the rows of a filled cache)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._unsupported("batch_select_indices")
