"""The disk's calibrated bandwidth: the read and write rates the step telemetry's floor divides by (telemetry.py).

``disk_rate(folder, io)``: the GB/s of the disk under ``folder`` as ``IOEngine(io)`` drives it (``io``: the
optimizer's IOConfig). It is measured once (``calibrate``) and cached with its provenance: the method, the
file's size, the requests, the IOConfig, the host, the boot, the device, the filesystem and the time. A cached
figure is used only when that provenance matches this machine, this boot, this device and filesystem, this
IOConfig and this method, it is less than ``MAX_AGE_S`` old and its rates are ones a disk can have (``_a_rate``:
a damaged cache breaks no optimizer); otherwise the disk is measured again and the figure's ``source`` names the
cached one it refused and why. The cache is a JSON file in ``$TIERED_CACHE_DIR``,
else ``$XDG_CACHE_HOME/tiered``, else ``~/.cache/tiered``. A failed measurement (a full disk) leaves the floor
unknown (None), never the optimizer broken.

The method (``METHOD``), so that a slow probe cannot flatter the step's ratio to its floor:

- one file of ``CALIBRATE_BYTES`` (1 GiB) in ``folder``, allocated and written once untimed: a step overwrites
  its state files, and a file that small enough to sit in a drive's or a host's cache measures the cache (a
  128 MiB file read 1.5-1.9 GB/s against 2.3-2.7 at 1-2 GiB on the development VM). That pass also bounds
  the time: where it took longer than ``LAYOUT_S``, the file is cut to what was written by then;
- requests of ``REQUEST_BYTES`` (the optimizer's default chunk, one record) with ``IN_FLIGHT`` of them in
  flight (its default read-ahead), more where fewer would leave engine threads idle, never more than the
  file holds, each into its own buffer, written to before anything is timed (512 MiB by default, freed at
  the end; where that memory cannot be had, no floor): the disk as fast as the engine drives it at ``io``.
  A step with smaller chunks or a shallower read-ahead is slower than that, and its ratio to the floor says
  so;
- the overwrite timed alone, as the step writes (no fsync: neither the step nor DeepSpeed's libaio figure
  has one), then fsynced (timed apart, in the provenance) so that the write-back cannot slow the read; the
  file's cached pages dropped; the read timed; the best of ``PASSES`` passes, as time allows (``BUDGET_S``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import math
import os
import platform
import shutil
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from io_engine import IOConfig, IOEngine, format_size, write_json_atomic
from io_engine.buffers import aligned_empty
from io_engine.posix import O_NOFOLLOW, allocate

__all__ = ["DiskRate", "disk_rate", "calibrate", "describe", "filesystem_of", "cache_dir", "CALIBRATE_NAME"]

METHOD = 2  # 1: a 128 MiB overwrite in one request, fsync included; 2: this module's docstring
CALIBRATE_NAME = ".calibrate.bin"  # the measuring file, in the optimizer's private folder while it runs
CALIBRATE_BYTES = 1 << 30
MIN_BYTES = 16 << 20  # less free space than 8 times this: no calibration (the state needs the disk more)
REQUEST_BYTES = 64 << 20
IN_FLIGHT = 8
PASSES = 2
LAYOUT_S = 1.0  # the untimed first write stops here: on a slow disk the file is smaller, not the wait longer
BUDGET_S = 3.0  # a second pass runs only where the calibration would still end within this
MAX_AGE_S = 24 * 3600
KEEP = 8  # cached figures kept per host and device
LOCK_WAIT_S = 30.0  # for another process's calibration: ~3 s, unless it is stuck
_log = logging.getLogger("tiered")


@dataclass(frozen=True)
class DiskRate:
    read_gbps: float
    write_gbps: float
    source: str  # where the figures come from: "measured now in ...", or the cache file and its age
    earlier: bool = False  # from the cache, not measured by this optimizer
    provenance: dict[str, Any] = field(default_factory=dict)  # how, where and when it was measured


def cache_dir() -> str:
    explicit = os.environ.get("TIERED_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tiered")


def filesystem_of(path: str | os.PathLike) -> str:
    """The filesystem type of the mount holding ``path`` (longest matching mount point), or "unknown"."""
    target, best, fstype = os.path.realpath(path), -1, "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) > best:
                    best, fstype = len(mnt), parts[2]
    except OSError:
        pass
    return fstype


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _device(dev: int) -> str:
    """``major:minor`` and, for a block device, its kernel name: "253:0 vda"."""
    majmin = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open(f"/sys/dev/block/{majmin}/uevent") as f:
            for line in f:
                if line.startswith("DEVNAME="):
                    return f"{majmin} {line.split('=', 1)[1].strip()}"
    except OSError:
        pass
    return majmin


def _identity(folder: str, io: IOConfig) -> dict[str, Any]:
    """What a cached figure must share with this measurement to stand for it."""
    return {"method": METHOD, "host": platform.node(), "boot_id": _boot_id(), "device": _device(os.stat(folder).st_dev),
            "filesystem": filesystem_of(folder), "io": io.to_dict()}  # fmt: skip


_WHY = {"method": "an older calibration method", "host": "another machine", "boot_id": "another boot",
        "device": "another device", "filesystem": "another filesystem", "io": "another IOConfig"}  # fmt: skip
_DAMAGED = "damaged"  # rates no disk has: a hand edit, another tool's write
CLOCK_SLACK_S = 600  # a measured_at this far ahead is a clock stepped back (NTP), not a damaged figure
MAX_GBPS = 1e4  # 10 TB/s: past any disk's, and past the host memory a tmpfs measures


def _a_rate(x: Any) -> bool:
    """A GB/s a disk can have: a finite number > 0 (telemetry.py divides by it), not a bool."""
    return isinstance(x, int | float) and not isinstance(x, bool) and 0 < x <= MAX_GBPS


def _mismatch(entry: dict[str, Any], identity: dict[str, Any], now: float) -> str | None:
    """None when ``entry`` stands for ``identity``; else why not, in words."""
    prov = entry.get("provenance")
    if not isinstance(prov, dict) or not {"read_gbps", "write_gbps"} <= set(entry):
        return _WHY["method"]
    if not (_a_rate(entry["read_gbps"]) and _a_rate(entry["write_gbps"])):
        return _DAMAGED
    for k, why in _WHY.items():
        if prov.get(k) != identity[k]:
            return why
    at = prov.get("measured_at")
    # No real time (NaN, infinite, later than now): it would never age out, trusted for ever as measured just now.
    # (An int is compared as it is: math.isfinite of a 400-digit int raises OverflowError.)
    if not isinstance(at, int | float) or isinstance(at, bool) or isinstance(at, float) and not math.isfinite(at):
        return _DAMAGED
    if at > now + CLOCK_SLACK_S:
        return _DAMAGED
    if now - at > MAX_AGE_S:
        return f"more than {MAX_AGE_S // 3600} h ago"
    return None


def _age(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= n:
            return f"{seconds / n:.0f} {unit} ago"
    return "just now"


def disk_rate(folder: str, io: IOConfig | None) -> DiskRate | None:
    """The read and write bandwidth of the disk under ``folder`` at ``io`` (see the module docstring).

    One process at a time measures (a lock beside the cache file, waited for at most ``LOCK_WAIT_S``): the
    ranks of a job on one machine would otherwise measure the disk at once, each at a share of its rate, and
    the later ones find the first one's figure."""
    io = io or IOConfig.from_env()
    cache = os.path.join(cache_dir(), "disk_rates.json")
    with _one_at_a_time(cache + ".lock"):
        return _disk_rate(folder, io, cache)


@contextlib.contextmanager
def _one_at_a_time(path: str) -> Iterator[None]:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError:  # no cache folder: no lock either, and no figure to share
        yield
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:  # a stuck holder: measure anyway
                    _log.info("tiered: %s is held for over %.0f s; measuring the disk without it", path, LOCK_WAIT_S)
                    break
                time.sleep(0.05)
            except OSError:  # a filesystem without flock
                break
        yield
    finally:
        os.close(fd)  # releases the lock


def _disk_rate(folder: str, io: IOConfig, cache: str) -> DiskRate | None:
    identity = _identity(folder, io)
    key = f"{identity['host']}:dev-{os.stat(folder).st_dev}"  # a cache in a shared home serves several machines
    entries = _entries(_read_json(cache), key)
    now = time.time()
    refused = None
    for e in entries:
        why = _mismatch(e, identity, now)
        if why is None:
            prov = e["provenance"]
            source = f"cached in {cache}, measured {_age(now - prov['measured_at'])} in this boot"
            return DiskRate(float(e["read_gbps"]), float(e["write_gbps"]), source, earlier=True, provenance=prov)
        refused = refused or why
    measured = calibrate(folder, io)
    if measured is None:
        return None
    if refused is not None:
        why = "it is damaged" if refused == _DAMAGED else f"measured on {refused}"
        note = f"; the figure cached in {cache} was not used: {why}"
        measured = DiskRate(measured.read_gbps, measured.write_gbps, measured.source + note,
                            provenance=measured.provenance)  # fmt: skip
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        doc = _read_json(cache)  # again: another process may have added its own since
        # Other IOConfigs' figures of this boot stay; a figure of another boot, method or day never serves again.
        keep = [e for e in _entries(doc, key) if _mismatch(e, identity, now) in (_WHY["io"], _WHY["filesystem"])]
        new = {"read_gbps": measured.read_gbps, "write_gbps": measured.write_gbps, "provenance": measured.provenance}
        doc[key] = [new, *keep][:KEEP]
        write_json_atomic(cache, doc, indent=2)
    except OSError as e:  # no cache: measured again next time, that is all
        _log.info("tiered: could not cache the disk's bandwidth in %s: %s", cache, e)
    return measured


def _entries(doc: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The figures cached under ``key``: a list, newest first (a single object: the format before METHOD 2)."""
    found = doc.get(key)
    return [e for e in (found if isinstance(found, list) else [found]) if isinstance(e, dict)]


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _stream(eng: IOEngine, buf: memoryview, path: str, size: int, request: int, inflight: int, *, write: bool,
            stop_after: float | None = None) -> tuple[int, float]:  # fmt: skip
    """``size`` bytes in ``request``-sized requests, ``inflight`` pending, each from or into its own
    ``request``-sized slot of ``buf`` (slots reused by requests in flight together cost reads 15 % on the
    development VM, as they would cost a step whose buffers were shared). Returns the bytes moved and the
    seconds to the last completion; ``stop_after``: submit no more after that long."""
    pending: deque = deque()
    op = eng.pwrite if write else eng.pread
    slots = len(buf) // request
    t0 = time.perf_counter()
    moved = 0
    for i, offset in enumerate(range(0, size, request)):
        if stop_after is not None and moved and time.perf_counter() - t0 > stop_after:
            break
        if len(pending) >= inflight:
            pending.popleft().result()
        slot = (i % slots) * request
        pending.append(op(buf[slot : slot + request], path, offset))
        moved += request
    for fut in pending:
        fut.result()
    return moved, time.perf_counter() - t0


def calibrate(folder: str, io: IOConfig | None = None) -> DiskRate | None:
    """Measure the disk under ``folder`` now (the module docstring's method); None where it cannot."""
    io = io or IOConfig.from_env()
    t_start = time.perf_counter()
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    size = min(CALIBRATE_BYTES, free // 8)
    if size < MIN_BYTES:
        _log.info("tiered: %s free in %s is too little to calibrate the disk: no floor in stats()",
                  format_size(free), folder)  # fmt: skip
        return None
    request = min(REQUEST_BYTES, size)
    size = size // request * request
    # No more in flight than the file holds requests (as bench/ring.py's ring_shape): threads x a large block_size
    # would otherwise ask buffers that no request uses (1024 x 64 MiB asked 64 GiB).
    inflight = min(max(IN_FLIGHT, math.ceil(io.threads * io.block_size / request) + 1), size // request)
    path = os.path.join(folder, CALIBRATE_NAME)
    try:
        buf, _owner = aligned_empty(inflight * request, io.alignment)
        # Every page present and writable before anything is timed: a read into a page never written faults it
        # in (a copy of the zero page) inside the timed read. (The 128 MiB method 1 read into such a buffer, and
        # read 0.88-0.97 GB/s where the same size into written memory read 1.43-1.56 on the GPU machine,
        # bench/disk_probe.py.)
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(buf)), 1, len(buf))
    except (OSError, MemoryError) as e:  # no memory to spare: no floor, the optimizer whole all the same
        _log.info("tiered: the disk's bandwidth could not be measured in %s (%s of buffers: %s): no floor in "
                  "stats()", folder, format_size(inflight * request), str(e) or type(e).__name__)  # fmt: skip
        return None
    reads: list[float] = []
    writes: list[float] = []
    fsyncs: list[float] = []
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            allocate(fd, 0, size)  # in one call: the engine would allocate request by request, each waiting
        finally:  # for the direct writes in flight on the file
            os.close(fd)
        with IOEngine(io, follow_symlinks=False) as eng:
            size, _ = _stream(eng, buf, path, size, request, inflight, write=True, stop_after=LAYOUT_S)
            eng.flush(path)
            layout_s = time.perf_counter() - t_start
            for k in range(PASSES):
                spent = time.perf_counter() - t_start
                if k and spent + (spent - layout_s) / k > BUDGET_S:  # one more pass at the pace of those so far
                    break
                writes.append(_stream(eng, buf, path, size, request, inflight, write=True)[1])
                t = time.perf_counter()
                eng.flush(path)
                fsyncs.append(time.perf_counter() - t)
                _drop_cache(path)  # a read from the page cache is no disk (buffered I/O where O_DIRECT is refused)
                reads.append(_stream(eng, buf, path, size, request, inflight, write=False)[1])
            direct = eng.stats()["direct_bytes"] > 0
    except OSError as e:
        _log.info("tiered: the disk's bandwidth could not be measured in %s (%s): no floor in stats()", folder, e)
        return None
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    seconds = time.perf_counter() - t_start
    prov = {
        **_identity(folder, io),
        "bytes": size,
        "request_bytes": request,
        "in_flight": inflight,
        "passes": len(reads),
        "direct": direct,
        "fsync_s": round(max(fsyncs), 4),
        "seconds": round(seconds, 2),
        "folder": folder,
        "measured_at": round(time.time()),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    read, write = round(size / min(reads) / 1e9, 3), round(size / min(writes) / 1e9, 3)
    return DiskRate(read, write, f"measured now in {folder}", provenance=prov)


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | O_NOFOLLOW)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def describe(rate: dict[str, Any]) -> str:
    """A floor's rates and their provenance in a few words (``rate``: a DiskRate as a dict), for a summary
    line: "read 2.31, write 3.02 GB/s; calibrated now: 1.00 GiB, 64 MiB requests x 8, 32 threads x 1.00 MiB"."""
    prov = rate.get("provenance") or {}
    out = f"read {rate['read_gbps']:.2f}, write {rate['write_gbps']:.2f} GB/s"
    if not prov:
        return f"{out}; {rate.get('source', '')}".rstrip("; ")
    io = prov.get("io") or {}
    size, request, block = (format_size(x) for x in (prov.get("bytes", 0), prov.get("request_bytes", 0),
                                                        io.get("block_size", 0)))  # fmt: skip
    how = f"{size}, {request} requests x {prov.get('in_flight')}, {io.get('threads')} threads x {block}"
    if not prov.get("direct", True):
        how += ", buffered"
    when = rate.get("source", "") if rate.get("earlier") else "calibrated now"
    return f"{out}; {when}: {how}"
