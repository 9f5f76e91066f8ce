"""Rounding sizes up to whole pages or blocks: the one place the library writes it."""

from __future__ import annotations

import mmap

PAGE = mmap.PAGESIZE


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n`` (0 stays 0)."""
    return -(-n // multiple) * multiple
