"""How far each step is from the disk's floor, what bounds it, and what it costs the SSD.

After every step ``opt.stats()["telemetry"]`` holds (``report``):

- ``nvme_gbps``: the NVMe bytes the step moved (read + written) over its time;
- ``floor_s``: those bytes at the disk's calibrated bandwidth (read bytes / read GB/s + written bytes / write
  GB/s), and ``over_floor``, the step's time over it (near 1: the step is as fast as the disk allows);
- ``bound``: the phase that took the most of the step: "disk" (waiting for reads or write-backs), "PCIe"
  (gradients down, weights up), "CPU" or "GPU" (the update itself);
- ``wear``: bytes written a step, terabytes per 1000 steps, and with ``run_steps`` the run's projection.

The calibrated bandwidth (``disk_rate``) comes, in this order, from ``tiered-bench tune``'s file named by
``$TIERED_IO_CONFIG`` when it was measured on the same filesystem; from a cache file
(``$TIERED_CACHE_DIR``, else ``$XDG_CACHE_HOME/tiered``, else ``~/.cache/tiered``) keyed by the machine and
the filesystem; else it is measured once, a 128 MiB overwrite and read-back in the optimizer's folder, and
cached. Only an optimizer whose state does not fit its host budget measures; a failed measurement (a full
disk) leaves the floor unknown (None), never the optimizer broken. A rate measured earlier (the cache, a tune
file) was measured under another load, maybe by another run: its ``source`` names the file, its age and the
machine, and ``summary_line`` shows that beside the ratio it gives.

SSD wear: with ``tbw`` (the drive's rated endurance, in terabytes written) and ``run_steps``, a run projected
to write more than ``wear_share`` of it is warned about once, naming the knobs that write less.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from typing import Any

from io_engine import IOConfig, IOEngine, format_size, write_json_atomic
from io_engine.buffers import aligned_empty

__all__ = ["DiskRate", "disk_rate", "report", "summary_line", "Wear", "CALIBRATE_NAME"]

CALIBRATE_NAME = ".calibrate.bin"  # the measuring file, in the optimizer's private folder while it runs
CALIBRATE_BYTES = 128 << 20
_log = logging.getLogger("tiered")


@dataclass(frozen=True)
class DiskRate:
    read_gbps: float
    write_gbps: float
    source: str  # where the figures come from: "measured now in ...", or the file, its age and its machine
    earlier: bool = False  # from a cache or a tune file, not measured by this optimizer


def _age(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= n:
            return f"{seconds / n:.0f} {unit} ago"
    return "just now"


def _earlier(path: str, entry: dict[str, Any], what: str) -> str:
    """``source`` for a rate read from ``path``: where, how long ago and on which machine it was measured."""
    at = entry.get("measured_at")
    when = _age(time.time() - at) if isinstance(at, int | float) else f"on {entry.get('date', '?')}"
    return f"{what} {path}, measured {when} on {entry.get('host', '?')}"


def cache_dir() -> str:
    explicit = os.environ.get("TIERED_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tiered")


def disk_rate(folder: str, io: IOConfig | None) -> DiskRate | None:
    """The read and write bandwidth of the disk under ``folder`` (see the module docstring for the order)."""
    dev = os.stat(folder).st_dev
    tuned = _from_tune_file(dev)
    if tuned is not None:
        return tuned
    cache = os.path.join(cache_dir(), "disk_rates.json")
    host = platform.node()
    key = f"{host}:dev-{dev}"  # a cache in a shared home folder serves several machines; each has its own disks
    known = _read_json(cache).get(key)
    if isinstance(known, dict) and {"read_gbps", "write_gbps"} <= set(known):
        source = _earlier(cache, {"host": host, **known}, "cached in")
        return DiskRate(float(known["read_gbps"]), float(known["write_gbps"]), source, earlier=True)
    measured = _measure(folder, io or IOConfig.from_env())
    if measured is None:
        return None
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        doc = _read_json(cache)
        doc[key] = {"read_gbps": measured.read_gbps, "write_gbps": measured.write_gbps, "folder": folder,
                    "date": time.strftime("%Y-%m-%d"), "measured_at": round(time.time()), "host": host}  # fmt: skip
        write_json_atomic(cache, doc, indent=2)
    except OSError as e:  # no cache: measured again next time, that is all
        _log.info("tiered: could not cache the disk's bandwidth in %s: %s", cache, e)
    return measured


def _from_tune_file(dev: int) -> DiskRate | None:
    path = os.environ.get("TIERED_IO_CONFIG")
    measured = _read_json(path).get("_measured") if path else None
    if not isinstance(measured, dict):
        return None
    try:
        same = os.stat(measured["dir"]).st_dev == dev
        source = _earlier(str(path), measured, "tiered-bench tune's")
        rate = DiskRate(float(measured["read_gbps"]), float(measured["write_gbps"]), source, earlier=True)
    except (OSError, KeyError, TypeError, ValueError):
        return None
    return rate if same else None


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _measure(folder: str, io: IOConfig) -> DiskRate | None:
    """Overwrite a ``CALIBRATE_BYTES`` file (fsync included), drop its cached pages, read it back.

    Overwrite, not a fresh file: the optimizer overwrites its state files every step, and on ext4 writing
    fresh blocks is much slower (0.79 GB/s fresh against 2.0-3.2 overwriting on the GPU machine's disk:
    bench/RESULTS.md, "after the restructuring"), which halved the floor's write rate."""
    path = os.path.join(folder, CALIBRATE_NAME)
    buf, _owner = aligned_empty(CALIBRATE_BYTES, io.alignment)
    try:
        with IOEngine(io, follow_symlinks=False) as eng:
            eng.pwrite(buf, path).result()  # allocate the blocks, untimed
            eng.flush(path)
            t0 = time.perf_counter()
            eng.pwrite(buf, path).result()
            eng.flush(path)
            t1 = time.perf_counter()
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # a read from the page cache is no disk
            finally:
                os.close(fd)
            t2 = time.perf_counter()
            eng.pread(buf, path).result()
            t3 = time.perf_counter()
    except OSError as e:
        _log.info("tiered: the disk's bandwidth could not be measured in %s (%s): no floor in stats()", folder, e)
        return None
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    gb = CALIBRATE_BYTES / 1e9
    return DiskRate(round(gb / (t3 - t2), 3), round(gb / (t1 - t0), 3), f"measured now in {folder}")


def report(phases: dict[str, float], rate: DiskRate | None, update_on: str) -> dict[str, Any]:
    """The telemetry of one step from its phases (``step_stats.PHASES``)."""
    step = phases["step_s"]
    r, w = phases["nvme_read_bytes"], phases["nvme_write_bytes"]
    floor = r / (rate.read_gbps * 1e9) + w / (rate.write_gbps * 1e9) if rate is not None and r + w else None
    parts = {
        "disk": phases["read_wait_s"] + phases["write_wait_s"],
        "PCIe": phases["grad_d2h_s"] + phases["h2d_s"],
        "GPU" if update_on == "device" else "CPU": phases["update_s"],
    }
    return {
        "nvme_gbps": round((r + w) / step / 1e9, 3) if step > 0 else 0.0,
        "floor_s": None if floor is None else round(floor, 4),
        "over_floor": None if not floor else round(step / floor, 3),
        "bound": max(parts, key=lambda k: parts[k]),
        "disk_rate": None if rate is None else asdict(rate),
    }


def summary_line(steps: int, phases: dict[str, float], tele: dict[str, Any], *, floor: bool = True) -> str:
    """One line for a progress bar or a log: the last step against its floor, what bounds it, the wear.
    ``floor=False``: without the ratio to the floor, for a report that gives its own from a rate it measured
    (tiered-bench optim): one such figure a report. A ratio from a rate measured earlier says where from."""
    r, w = phases["nvme_read_bytes"], phases["nvme_write_bytes"]
    out = f"step {steps}: {phases['step_s']:.3f} s"
    if floor and tele.get("over_floor") is not None:
        out += f", {tele['over_floor']:.2f}x the disk floor"
        rate = tele.get("disk_rate") or {}
        if rate.get("earlier"):
            out += f" (at the disk rate {rate['source']})"
    out += f", {tele['bound']}-bound"
    if r + w:
        out += f"; NVMe {format_size(int(r))} read + {format_size(int(w))} written at {tele['nvme_gbps']:.2f} GB/s"
    wear = tele.get("wear") or {}
    if wear.get("tb_per_1000_steps"):
        out += f"; {wear['tb_per_1000_steps']:.2f} TB written per 1000 steps"
    return out


class Wear:
    """SSD wear: bytes written a step, and the warning once a run would wear more than its share."""

    def __init__(self, tbw: float | None, run_steps: int | None, share: float):
        self.tbw, self.run_steps, self.share = tbw, run_steps, share
        self._warned = False

    def report(self, written_per_step: float, written_total: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "bytes_written_per_step": int(written_per_step),
            "bytes_written_total": int(written_total),
            "tb_per_1000_steps": round(written_per_step * 1000 / 1e12, 4),
        }
        if self.run_steps:
            run_tb = written_per_step * self.run_steps / 1e12
            out["run_tb"] = round(run_tb, 3)
            if self.tbw:
                out["run_share_of_tbw"] = round(run_tb / self.tbw, 4)
                if run_tb > self.share * self.tbw and not self._warned:
                    self._warned = True
                    _log.warning(
                        "TieredOptimizer: %d steps at %s written a step would write %.1f TB, %.0f %% of the drive's "
                        "rated %.0f TBW (wear_share=%.2f). Write less with a larger host_budget (more of the state "
                        "stays in memory), moments_dtype=torch.bfloat16 (a third fewer bytes a step) or "
                        "moments_dtype='int8' (a half to three fifths fewer; neither is exact AdamW).",
                        self.run_steps, format_size(int(written_per_step)), run_tb, 100 * run_tb / self.tbw,
                        self.tbw, self.share,
                    )  # fmt: skip
        return out
