"""`tiered-bench tune`: the io sweep's best configuration, written where IOConfig can load it.

The file is exactly `IOConfig.to_file`'s JSON plus a `_measured` object (the figures it was chosen by,
and where); `IOConfig.from_file` ignores that key, so the file loads with `IOConfig.from_file(PATH)` or
through `TIERED_IO_CONFIG=PATH` (`IOConfig.from_env()`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from io_engine import IOConfig, format_size, write_json_atomic

from .common import BenchFailure, UsageError, host_info
from .io_types import IoResult


@dataclass
class TuneResult:
    out: str
    config: dict[str, Any]
    io: IoResult


def check_out(out: str) -> Path:
    """Refuse an --out that cannot be written, before the sweep spends minutes."""
    path = Path(out).expanduser().absolute()
    if path.is_dir():
        raise UsageError(f"--out {out} is a folder; name a file such as {path / 'tiered-io.json'}")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise UsageError(f"--out {out}: the folder {path.parent} does not exist or is not writable")
    return path


def write_tune(io: IoResult, out: Path) -> TuneResult:
    cfg = io.best_config()
    cfg.to_file(out)
    _annotate(out, io)
    if IOConfig.from_file(out) != cfg:  # the file must load back to what was measured
        raise BenchFailure(f"{out} does not load back to {cfg}")
    return TuneResult(out=str(out), config=cfg.to_dict(), io=io)


def _annotate(out: Path, io: IoResult) -> None:
    """Add the `_measured` record to the file to_file wrote (atomically, like to_file)."""
    with open(out) as f:
        doc = json.load(f)
    doc["_measured"] = {
        "read_gbps": io.best.read_gbps,
        "write_gbps": io.best.write_gbps,
        "dir": io.dir,
        "filesystem": io.filesystem,
        "size_bytes": io.size_bytes,
        "direct_effective": io.direct_effective,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "measured_at": round(time.time()),  # what the figures were chosen by; the floor is calibration.py's
        "host": host_info()["hostname"],
    }
    write_json_atomic(out, doc, indent=2)


def render_tune(r: TuneResult) -> str:
    from .report import render_io

    c = r.config
    return "\n".join(
        [
            render_io(r.io),
            "",
            f"wrote {r.out}: block_size {format_size(c['block_size'])}, threads {c['threads']}, "
            f"queue_depth {c['queue_depth']}, direct {c['direct']}",
            f"use it:  export TIERED_IO_CONFIG={r.out}   (or IOConfig.from_file({r.out!r}))",
        ]
    )
