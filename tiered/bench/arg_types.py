"""The argument types of `tiered-bench`'s flags: each parses one flag's text or raises argparse's error, whose
message argparse prints as one line under the usage."""

from __future__ import annotations

import argparse

from .common import parse_count

__all__ = ["count", "int_list", "nonneg", "positive", "seconds", "size", "size_list"]


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


def seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0 (0: no bound), got {text!r}")
    return v


def positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n
