"""Small pieces every benchmark shares: the usage error, statistics, counts, progress bars, and the
bench/ scripts' log lines and JSON records."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from ..progress import progress as bar

if TYPE_CHECKING:
    from tqdm import tqdm

DEFAULT_DIR = "./tiered-bench-data"  # where tiered-bench measures unless --dir says otherwise
GB = 10**9  # bandwidth is quoted in GB/s (10**9 bytes), as fio and DeepSpeed do (README.md)


class UsageError(Exception):
    """A bad argument or an unusable folder: the CLI prints the message and exits with code 2.

    Raised before anything is written, or from inside a `Workspace`, which removes what it made.
    """


class BenchFailure(RuntimeError):
    """A measurement could not be made or gave a wrong answer: the CLI prints the message, exit code 1."""


def check_env(*, io_config: bool = False) -> None:
    """The environment's settings a command reads, checked before it measures or makes anything: $TIERED_HUGE_PAGES,
    which every host buffer reads, and with ``io_config`` $TIERED_IO_CONFIG (the commands that measure their own
    configurations ignore it). A bad one is said in one line (exit 1), not a traceback from where it is first read."""
    from io_engine import IOConfig, hugepages

    try:
        if io_config:
            IOConfig.from_env()
        hugepages.from_env()
    except ValueError as e:
        raise BenchFailure(str(e)) from None


DEVICES = ("auto", "cpu", "cuda")  # a measuring command's --device: auto takes CUDA where it is


def check_device(device: str) -> None:
    """Refuse a ``--device`` that is none of DEVICES nor ``cuda:N``, or a CUDA one where CUDA (or GPU N) is not:
    before a model or a tensor is made there (torch's own error would be a traceback after the work began)."""
    import torch

    index = device.removeprefix("cuda:")
    if device not in DEVICES and not (device.startswith("cuda:") and index.isdigit()):
        raise UsageError(f"--device must be {', '.join(DEVICES)} or cuda:N, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available here; use --device cpu or auto")
    if index.isdigit() and int(index) >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA devices (0 up)")


@dataclass
class Stat:
    """Median of repeated measurements with their spread (README.md: the median of `--loops` runs, min-max)."""

    median: float
    min: float
    max: float
    samples: list[float]

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stat:
        if not samples:
            raise ValueError("Stat.of needs at least one sample")
        xs = [figure(float(x)) for x in samples]
        return cls(median=figure(statistics.median(xs)), min=min(xs), max=max(xs), samples=xs)

    def spread(self) -> str:
        """`median (min-max)` for tables."""
        if len(self.samples) == 1:
            return f"{self.median:.2f}"
        return f"{self.median:.2f} ({self.min:.2f}-{self.max:.2f})"


def figure(x: float, nd: int = 4) -> float:
    """`x` to `nd` decimal places, or to `nd` significant digits where that keeps more: a small figure (a disk
    floor of 3e-5 s a token, a slow disk's 0.00004 GB/s) is reported, never rounded to a zero."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, max(nd, nd - 1 - math.floor(math.log10(abs(x)))))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / GB


_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgtb]?)\s*$", re.IGNORECASE)
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9, "t": 10**12}
_COUNT_MAX = 10**15  # a quadrillion parameters: beyond it a count is a typo, and the plan's figures overflow


def parse_count(value: str | int, *, name: str = "count") -> int:
    """A decimal count such as "50M" (5e7) or "1.5B" parameters; unlike sizes, M means a million."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = Fraction(value)
    else:
        m = _COUNT_RE.match(str(value))
        if m is None:
            raise ValueError(f"cannot parse {name} {value!r}: use a number like 50M, 1.5B or 2000000")
        try:
            number = Decimal(m.group(1))  # the digits given, exactly: 8.03 * 1e9 is 8029999999.999999 in floats
        except InvalidOperation:  # an exponent past Decimal's range (1e99999999999999999999)
            raise ValueError(f"{name} {value!r} is beyond any model: at most {_COUNT_MAX:.0e}") from None
        if number > _COUNT_MAX:  # before the exact product, which for 1e400000000 would take minutes
            raise ValueError(f"{name} {value!r} is beyond any model: at most {_COUNT_MAX:.0e}")
        n = Fraction(number) * _COUNT_UNITS[m.group(2).lower()]
    if n > _COUNT_MAX:
        raise ValueError(f"{name} {value!r} is beyond any model: at most {_COUNT_MAX:.0e}")
    if n.denominator != 1 or n < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    return int(n)


def progress(total: float, desc: str, *, enabled: bool, unit: str = "pass") -> tqdm:
    """tiered.progress's bar, shown after a second (a sweep's passes are short): quick runs and the tests stay
    free of bar noise, and logs of CI runs stay readable (no bar when stderr is not a terminal)."""
    return bar(total, desc, unit=unit, enabled=enabled, delay=1.0)


class SweepProgress:
    """Lines on stderr while a sweep runs: as each configuration starts, which one it is and the time left,
    estimated from the passes done so far (a pass: one file written and read back), and once more after the
    first pass, when the first estimate exists. Lines, not a bar: they read the same in a terminal and in a
    log, and a sweep has few configurations. ``mandatory``: the first passes, which run whatever the budget."""

    def __init__(self, what: str, configs: int, passes_each: int, extra: int, *, enabled: bool,
                 budget_s: float | None = None, mandatory: int = 0) -> None:  # fmt: skip
        self.what, self.configs, self.enabled, self.budget_s = what, configs, enabled, budget_s
        self.mandatory = mandatory
        self.total = configs * passes_each + extra  # extra: the baselines' passes, about one a loop each
        self.done = 0
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def fits(self, passes: int) -> bool:
        """Whether ``passes`` more, at the pace so far, end within the budget (always, before the first pass)."""
        if self.budget_s is None or self.done == 0:
            return True
        return self.elapsed() + self.elapsed() / self.done * passes <= self.budget_s

    def _left(self) -> str:
        elapsed = self.elapsed()
        pace = elapsed / self.done
        left = pace * (self.total - self.done)
        if self.budget_s is not None and elapsed + left > self.budget_s:  # the budget stops it sooner, not those
            cut = max(self.budget_s - elapsed, pace * max(0, self.mandatory - self.done))
            return f"{elapsed:.0f} s so far, about {cut:.0f} s left (--budget)"
        return f"{elapsed:.0f} s so far, about {left:.0f} s left"

    def _say(self, msg: str) -> None:
        if self.enabled:
            print(f"{self.what}: {msg}", file=sys.stderr, flush=True)

    def start(self, k: int, label: str) -> None:
        """Configuration ``k`` (from 0), described by ``label``, begins."""
        when = self._left() if self.done else f"{self.total} passes to go"
        self._say(f"configuration {k + 1} of {self.configs}, {label}; {when}")

    def passed(self) -> None:
        self.done += 1
        if self.done == 1 and self.total > 1:
            self._say(f"first pass done; {self._left()}")

    def note(self, msg: str) -> None:
        self._say(f"{msg}; {self._left()}" if self.done else msg)


def host_info() -> dict[str, Any]:
    """What the figures were measured on, for the JSON record."""
    import platform

    import torch

    return {
        "hostname": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


# ------------------------------------------------------------------------------- the bench/ scripts
def stderr_log(name: str) -> Callable[[str], None]:
    """`log(msg)`: `[name   12.3s] msg` on stderr, the seconds counted from this call."""
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{name} {time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return log


def rounded(obj: Any, nd: int = 4) -> Any:
    """`obj` with every float kept to `nd` places (`figure`), inside dicts, lists and tuples too."""
    if isinstance(obj, float):
        return figure(obj, nd)
    if isinstance(obj, dict):
        return {k: rounded(v, nd) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v, nd) for v in obj]
    return obj


def emit_json(res: dict[str, Any], name: str, final: bool) -> None:
    """The result so far as one JSON line: to $OUT/<name>.json (rewritten each time, so a run cut short
    leaves its figures), and to stdout when ``final``."""
    line = json.dumps(rounded(res), default=str)
    if final:
        print(line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"{name}.json"), "w") as fh:
            fh.write(line + "\n")
