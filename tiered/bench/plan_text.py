"""How `tiered-bench plan` writes its figures: bytes in GB, rounded up for what a model needs and down for the room
left (the advice must fit when taken), parameter counts rounded down (a limit is never overstated), a host_budget as
the optimizer parses it. Nothing here imports torch."""

from __future__ import annotations

import math

from .plan_memory import GiB, MiB


def gb(n: int | float, *, up: bool = False, down: bool = False) -> str:
    """Bytes in GB, one decimal; ``up`` rounds up, for what a model needs (never understated); ``down`` rounds down,
    for room left (never overstated: the advice must fit when taken)."""
    if up:
        return f"{math.ceil(n / 1e8) / 10:.1f} GB"
    return f"{math.floor(n / 1e8) / 10 if down else n / 1e9:.1f} GB"


def gib_str(n: int) -> str:
    """A RAM size in GiB, whole where it is whole: 145 GiB, 12.5 GiB."""
    return f"{n / GiB:.0f} GiB" if n % GiB == 0 else f"{n / GiB:.1f} GiB"


def count_str(n: int) -> str:
    """A parameter count, rounded down (a limit is never overstated): 18.23B, 950.2M, 1.2k."""
    for unit, scale, digits in (("B", 10**9, 2), ("M", 10**6, 1), ("k", 10**3, 1)):
        if n >= scale:
            q = 10**digits
            return f"{math.floor(n * q / scale) / q:.{digits}f}{unit}"
    return str(n)


def budget_str(n: int) -> str:
    if n and n % GiB == 0:
        return f"{n // GiB}GiB"
    if n and n % MiB == 0:
        return f"{n // MiB}MiB"
    return str(n)
