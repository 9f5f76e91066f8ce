"""What a TieredCache stores, from the model's config: layers, KV heads, head size; pages and their keys.

A page is ``page_tokens`` consecutive tokens of one sequence in one layer, keys and values together: a store
record of shape ``(2, kv_heads, page_tokens, head_dim)`` (row 0 the keys, row 1 the values) in the cache's dtype.
A growing sequence fills its last page in place and starts a new record when it is full, so earlier pages are
never rewritten. Pure arithmetic and argument checks: no I/O, no tensors moved.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from io_engine import parse_size, pool_bytes

__all__ = ["KVLayout", "layout_from_config", "page_key", "page_seq", "check_budgets", "check_page_room",
           "stream_reserve"]  # fmt: skip


@dataclass(frozen=True)
class KVLayout:
    layers: int
    kv_heads: int
    head_dim: int
    page_tokens: int

    def pages(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        return -(-tokens // self.page_tokens)

    def rounded(self, tokens: int) -> int:
        """``tokens`` rounded up to whole pages."""
        return self.pages(tokens) * self.page_tokens

    def room(self, tokens: int) -> int:
        """Window capacity a slot grows to when it must hold ``tokens``: whole pages, at least a page and a quarter
        more, so that a growing sequence reallocates its buffers rarely."""
        return self.rounded(max(tokens + self.page_tokens, tokens + tokens // 4))

    def page_shape(self) -> tuple[int, int, int, int]:
        return (2, self.kv_heads, self.page_tokens, self.head_dim)

    def token_bytes(self, element_size: int) -> int:
        """Bytes of one token's keys and values in one layer."""
        return 2 * self.kv_heads * self.head_dim * element_size

    def window_bytes(self, lengths: list[int], element_size: int) -> int:
        """Device bytes a TieredCache's window takes to keep every layer of sequences of these lengths resident
        (a block with room for each, and its tail page): a ``gpu_budget`` of at least this keeps them all."""
        page = self.token_bytes(element_size) * self.page_tokens
        return sum(self.pages(self.room(n)) + 1 for n in lengths) * page * self.layers


def page_key(seq: int, layer: int, page: int) -> str:
    return f"kv/s{seq}/l{layer}/p{page}"


def page_seq(key: str) -> int | None:
    """The sequence of a ``page_key``; None for any other key."""
    m = _PAGE_KEY.fullmatch(key)
    return int(m[1]) if m else None


_PAGE_KEY = re.compile(r"kv/s(\d+)/l\d+/p\d+")


def _positive_int(value: Any, name: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}: {hint}")
    return value


def layout_from_config(config: Any, page_tokens: Any) -> KVLayout:
    """The KV geometry of a transformers ``PretrainedConfig`` (its text decoder's, for multimodal models).

    Only full-attention layers are supported: a sliding-window, chunked or linear-attention layer keeps a
    different state, which this cache would get wrong, so such a config is refused by name."""
    # The text decoder's first: a multimodal config (Llava, Qwen2-VL, ...) keeps its layer count there, not on top.
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    if config is None or not hasattr(config, "num_hidden_layers"):
        raise TypeError(f"config must be a transformers PretrainedConfig (model.config), got {type(config).__name__}")
    layers = _positive_int(config.num_hidden_layers, "config.num_hidden_layers", "the model's layer count")
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    kv_heads = _positive_int(kv_heads, "config.num_key_value_heads", "the model's KV head count")
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    head_dim = _positive_int(head_dim, "config.head_dim", "hidden_size / num_attention_heads")
    types = _layer_types(config, layers)
    other = sorted({t for t in types if t != "full_attention"})
    if other:
        raise ValueError(f"config has {other} layers: TieredCache keeps full-attention layers only; use "
                         f"DynamicCache for this model{_window_off_hint(config, layers)}")  # fmt: skip
    page_tokens = _positive_int(page_tokens, "page_tokens", "tokens per page, e.g. 64")
    return KVLayout(layers, kv_heads, head_dim, page_tokens)


def _window_off_hint(config: Any, layers: int) -> str:
    """Where the window is only ``config.sliding_window`` (Mistral, Mixtral, Starcoder2: no per-layer list), the way
    to turn it off, which changes nothing for contexts within it; "" where that would leave a layer not full."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return ""
    trial = copy.copy(config)
    trial.sliding_window = None
    if any(t != "full_attention" for t in _layer_types(trial, layers)):
        return ""
    return (f", or, where no context is longer than its window of {window} tokens (the outputs are then the same), "
            "set sliding_window = None on the model's config (model.config.sliding_window = None) before building the "
            "cache from it")  # fmt: skip


def _layer_types(config: Any, layers: int) -> list[str]:
    """Each layer's attention kind, as DynamicCache reads it (sliding windows inferred from the config)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # an older transformers: the explicit list, if any
        return list(getattr(config, "layer_types", None) or ["full_attention"] * layers)
    return list(get_layer_types_and_kwargs(config)[0])


def page_charge(layout: KVLayout, element_size: int) -> int:
    """Host bytes one page takes in the store: its bytes rounded up to whole memory pages, as the pinned pool
    charges them."""
    return pool_bytes([layout.token_bytes(element_size) * layout.page_tokens])


def stream_reserve(layout: KVLayout, host_budget: int) -> int:
    """The store's streaming reserve for a cache: its default quarter of ``host_budget``, but at least one fp32
    page. The cache holds its resident pages pinned for good (``Page.hold``), so the reserve is all the room the
    streamed pages ever get, and a load must pin one: a reserve below a page left every NVMe load waiting for
    room nothing would free (a hang on the mover thread; ``BudgetError`` for the serial twin)."""
    return min(host_budget, max(host_budget // 4, page_charge(layout, 4)))


def check_page_room(layout: KVLayout, host_budget: int, element_size: int) -> None:
    """Refuse a ``host_budget`` whose streaming reserve (``stream_reserve``) cannot hold one page of keys and
    values (``element_size`` bytes each), as the pinned pool charges it: pages streamed from NVMe could never
    be loaded. Below one page that is the whole budget; wider than fp32, a quarter of it."""
    raw = layout.token_bytes(element_size) * layout.page_tokens
    charge = page_charge(layout, element_size)
    if stream_reserve(layout, host_budget) >= charge:
        return
    what = (f"one page of this model's keys and values ({raw} bytes: {layout.page_tokens} tokens x "
            f"{layout.kv_heads} kv heads x {layout.head_dim} x 2 x {element_size} bytes; {charge} as pinned "
            "memory pages)")  # fmt: skip
    if host_budget < charge:
        raise ValueError(f"host_budget {host_budget} bytes cannot hold {what}: raise host_budget to at least "
                         f"{charge} bytes or lower page_tokens")  # fmt: skip
    raise ValueError(f"host_budget {host_budget} bytes cannot hold {what} in its quarter for pages streamed from "
                     f"NVMe: raise host_budget to at least {4 * charge} bytes or lower page_tokens")  # fmt: skip


def check_budgets(gpu_budget: Any, host_budget: Any) -> tuple[int | None, int]:
    """The byte budgets (``"8GiB"``, ``"512MB"``, an int). ``gpu_budget`` None: no limit. ``host_budget`` None is
    refused by name: the pages in host memory are pinned, and pinned memory, which cannot be paged out, needs a
    bound."""
    if host_budget is None:
        raise TypeError('host_budget must be a byte count such as "32GiB" (pinned host memory for pages), got None: '
                        "unlike gpu_budget it has no 'no limit', as pinned memory cannot be paged out")  # fmt: skip
    gpu = None if gpu_budget is None else parse_size(gpu_budget, name="gpu_budget")
    return gpu, parse_size(host_budget, name="host_budget")
