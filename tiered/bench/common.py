"""Small pieces every benchmark shares: the usage error, statistics, counts and progress bars."""

from __future__ import annotations

import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

GB = 10**9  # bandwidth is quoted in GB/s (10**9 bytes), as fio, DeepSpeed and perf.md do


class UsageError(Exception):
    """A bad argument or an unusable folder: the CLI prints the message and exits with code 2.

    Raised before anything is written, or from inside a `Workspace`, which removes what it made.
    """


class BenchFailure(RuntimeError):
    """A measurement could not be made or gave a wrong answer: the CLI prints the message, exit code 1."""


@dataclass
class Stat:
    """Median of repeated measurements with their spread (perf.md: median of >= 3, show the spread)."""

    median: float
    min: float
    max: float
    samples: list[float]

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stat:
        if not samples:
            raise ValueError("Stat.of needs at least one sample")
        xs = [round(float(x), 4) for x in samples]
        return cls(median=round(statistics.median(xs), 4), min=min(xs), max=max(xs), samples=xs)

    def spread(self) -> str:
        """`median (min-max)` for tables."""
        if len(self.samples) == 1:
            return f"{self.median:.2f}"
        return f"{self.median:.2f} ({self.min:.2f}-{self.max:.2f})"


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / GB


_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgtb]?)\s*$", re.IGNORECASE)
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9, "t": 10**12}


def parse_count(value: str | int, *, name: str = "count") -> int:
    """A decimal count such as "50M" (5e7) or "1.5B" parameters; unlike sizes, M means a million."""
    if isinstance(value, int) and not isinstance(value, bool):
        n: float = value
    else:
        m = _COUNT_RE.match(str(value))
        if m is None:
            raise ValueError(f"cannot parse {name} {value!r}: use a number like 50M, 1.5B or 2000000")
        n = float(m.group(1)) * _COUNT_UNITS[m.group(2).lower()]
    if n != int(n) or n < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    return int(n)


def progress(total: float, desc: str, *, enabled: bool, unit: str = "pass") -> tqdm:
    """A tqdm bar on stderr that appears only once the work has run for a second.

    `delay=1` keeps quick runs (and the tests) free of bar noise; `disable=None` turns bars off when
    stderr is not a terminal, so logs of CI runs stay readable.
    """
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        delay=1.0,
        leave=False,
        dynamic_ncols=True,
        disable=None if enabled else True,
    )


def host_info() -> dict[str, Any]:
    """What the figures were measured on, for the JSON record."""
    import os
    import platform

    import torch

    return {
        "hostname": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
