"""The argument types of `tiered-bench`'s flags: each parses one flag's text or raises argparse's error, whose
message argparse prints as one line under the usage."""

from __future__ import annotations

import argparse
import math

from .common import parse_count

__all__ = ["count", "int_list", "nonneg", "positive", "positive_seconds", "seconds", "size", "size_list"]


def size(text: str) -> int:
    from io_engine import parse_size

    try:
        return parse_size(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size_list(text: str) -> tuple[int, ...]:
    values = tuple(size(t) for t in text.split(",") if t.strip())
    if not values:  # an empty list would read as no list given, and the default grid would run unasked
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of sizes such as 1MiB,8MiB, got {text!r}")
    return values


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 4,8,16, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def count(text: str) -> int:
    try:
        return parse_count(text, name="--params")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def nonneg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return n


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan  # refused below, as nan itself is: every comparison with it is false


def seconds(text: str) -> float:
    v = _number(text)
    if not 0 <= v < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0 (0: no bound), got {text!r}")
    return v


def positive_seconds(text: str) -> float:
    """A bound that must bound: nan would ignore it without a word, 0 or less would leave nothing to run."""
    v = _number(text)
    if not 0 < v < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return v


def positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n
