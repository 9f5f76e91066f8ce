"""The keyword a model's forward takes its cache by: ``cache`` in newer transformers, ``past_key_values`` before.

A cache passed under a keyword the model does not know lands in ``**kwargs`` and is ignored: the model makes a
``DynamicCache`` of its own, and a test or a benchmark then measures that one while believing it measures ours.
So hand-written decode loops ask the model's signature which keyword it reads, and refuse a model that has none.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["cache_kwargs"]

_KEYWORDS = ("cache", "past_key_values")  # the current name first: where both exist, the other is deprecated


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for ``model(..., **cache_kwargs(model, cache))``, the keyword its forward reads."""
    params = inspect.signature(model.forward).parameters
    for name in _KEYWORDS:
        if name in params:
            return {name: cache}
    raise TypeError(
        f"{type(model).__name__}.forward takes neither {' nor '.join(_KEYWORDS)}: it cannot be given a cache"
    )
