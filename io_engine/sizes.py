"""Human byte sizes: parse "8GiB" / "512k" / 4096 and format 1610612736 as "1.50 GiB"."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip
# The largest file offset and tensor size (int64). A size beyond is a typo, and the float arithmetic done with
# sizes (a plan's figures, format_size) would overflow on it: an OverflowError traceback instead of a usage error.
MAX_SIZE = (1 << 63) - 1
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, *, name: str = "size") -> int:
    """Return ``value`` in bytes. Binary units for k/M/G/T and KiB..TiB, decimal for kB..TB."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a byte count or a string like '8GiB', not a bool")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of bytes, got {value!r}")
    if isinstance(value, float) and value.is_integer() and value >= 0:
        value = int(value)
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {value}")
        _check_bound(value, value, name)
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be an int or a string like '8GiB', got {type(value).__name__}")
    m = _RE.match(value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"cannot parse {name} {value!r}: use a byte count or a number with a unit, e.g. '512MiB', '8GiB', '4k'"
        )
    # Exact arithmetic on the digits given: in floats 4.1 * 1e9 is 4099999999.9999995, and "4.1GB" was refused.
    number = Decimal(m.group(1))
    _check_bound(number, value, name)  # before the exact product: a size of 5000 digits is refused at once
    n = Fraction(number) * _UNITS[unit]
    if n.denominator != 1:
        raise ValueError(f"{name} {value!r} is not a whole number of bytes")
    _check_bound(n, value, name)
    return int(n)


def _check_bound(n: int | Decimal | Fraction, value: object, name: str) -> None:
    if n > MAX_SIZE:
        raise ValueError(f"{name} {value!r} is beyond any machine: at most 2**63 - 1 bytes (8 EiB)")


def format_size(n: int | float) -> str:
    """Format a byte count with a binary unit, e.g. ``format_size(3 << 30) == '3.00 GiB'``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
