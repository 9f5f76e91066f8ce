"""Progress bars for long work: the initial state, checkpoints, state dicts, the benchmarks' sweeps.

A tqdm bar on stderr that appears only once the work has run for ``DELAY_S`` seconds, and only when stderr
is a terminal (``disable=None``): quick calls, the tests and the logs of batch jobs stay free of bar noise,
while writing the first state of a 13B model (a minute or more) shows how far it is.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["DELAY_S", "progress"]

DELAY_S = 2.0


def progress(total: float, desc: str, *, unit: str = "B", enabled: bool = True, delay: float | None = None) -> Any:
    """A tqdm bar (a context manager; ``update(n)`` as work is done). ``unit="B"``: sizes in KiB, MiB, GiB."""
    from tqdm import tqdm  # here: importing tqdm is not free, and most calls never show a bar

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024 if unit == "B" else 1000,
        file=sys.stderr,
        delay=DELAY_S if delay is None else delay,
        leave=False,
        dynamic_ncols=True,
        disable=None if enabled else True,
    )
