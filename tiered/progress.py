"""Progress for long work: the initial state, checkpoints, state dicts, the benchmarks' sweeps.

On a terminal, a tqdm bar on stderr that appears only once the work has run for ``DELAY_S`` seconds: quick
calls stay free of bar noise, while writing the first state of a 13B model (a minute or more) shows how far
it is. Elsewhere (a batch job's log, a framework's output file) a bar would be noise, and nothing at all left
a run that spent minutes in setup silent: there a line goes to the "tiered" logger (INFO) every
``LOG_EVERY_S`` seconds that the work lasts, and one when work that logged ends. The tests and quick calls
log nothing.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

__all__ = ["DELAY_S", "LOG_EVERY_S", "progress"]

DELAY_S = 2.0
LOG_EVERY_S = 30.0


def progress(total: float, desc: str, *, unit: str = "B", enabled: bool = True, delay: float | None = None) -> Any:
    """A context manager with ``update(n)`` as work is done, and ``close()``: a tqdm bar where stderr is a
    terminal, else the logged lines. ``unit="B"``: sizes in KiB, MiB, GiB."""
    if enabled and not _is_terminal():
        return _Logged(total, desc, unit)
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
        disable=not enabled,
    )


def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


class _Logged:
    """Progress as log lines, at most one every ``LOG_EVERY_S`` seconds, from the first such interval on."""

    def __init__(self, total: float, desc: str, unit: str) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.n = 0.0
        self.t0 = time.monotonic()
        self.next = self.t0 + LOG_EVERY_S
        self.logged = False
        self.postfix = ""

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now >= self.next:
            self.next = now + LOG_EVERY_S
            self.logged = True
            share = f"{100 * self.n / self.total:.0f} %" if self.total else "?"
            logging.getLogger("tiered").info("%s: %s (%s of %s) after %.0f s%s", self.desc, share, self._amount(self.n),
                                             self._amount(self.total), now - self.t0, self.postfix)  # fmt: skip

    def set_postfix_str(self, s: str) -> None:
        self.postfix = f"; {s}" if s else ""

    def _amount(self, x: float) -> str:
        return f"{x / 2**30:.2f} GiB" if self.unit == "B" else f"{x:.0f} {self.unit}"

    def close(self) -> None:
        if self.logged:
            self.logged = False
            logging.getLogger("tiered").info("%s: done in %.0f s", self.desc, time.monotonic() - self.t0)

    def __enter__(self) -> _Logged:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
