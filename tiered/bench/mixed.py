"""Reads and writes at once: does the disk overlap them, and what is the floor of an optimizer step?

An optimizer step reads one part of its state while it writes another back. If the disk serves reads and
writes in parallel, a step's floor is max(read s, write s); if they take turns, it is read s + write s.
`measure_mixed` tells which, on one engine (io_engine.IOEngine, O_DIRECT), for one config:

  write   overwrite file A (already written once, as an optimizer's state files are), fsync counted
  read    read file A back
  mixed   read file A while overwriting file B, both streams submitted at once to the same engine

    overlap = (read_s + write_s - mixed_s) / (read_s + write_s - max(read_s, write_s))

0 means the two directions take turns, 1 that they overlap fully. The write-then-read order matches
DeepSpeed's `ds_aio_bw.py` anchor, so its rows compare with these. `sweep_mixed` measures configs in turn
within a time budget (bench/disk_mixed.py); `measure_floor` is that sweep as bench/llama_step.py's disk
floor: the optimizer's own IOConfig first, then `FLOOR_SWEEP`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from io_engine import IOConfig, IOEngine, PinnedBufferPool, format_size, parse_size
from io_engine.config import SubmitMode

from .common import gbps
from .files import direct_supported
from .ring import Ring, ring_shape, stream, write_files
from .workspace import Workspace

# (threads, block MiB): the best rows of bench/disk_mixed.py on the H200 (bench/RESULTS.md).
FLOOR_SWEEP = ((32, 1), (16, 1), (64, 2), (16, 8))


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_shape(item: str) -> tuple[SubmitMode, int, int]:
    """ "32x1MiB" -> ("threads", 32, 1 MiB); "aio:32x1MiB" -> ("aio", 32, 1 MiB): IOConfig's submit, threads (with
    aio, requests in flight) and block_size."""
    submit, _, shape = item.strip().rpartition(":")
    threads, _, block = shape.partition("x")
    if submit not in ("", "threads", "aio") or not threads.isdigit() or not block:
        raise ValueError(f"a shape looks like 32x1MiB (threads x block) or aio:32x1MiB (kernel AIO), got {item!r}")
    return cast(SubmitMode, submit or "threads"), int(threads), parse_size(block)


def parse_configs(text: str) -> list[tuple[int, int]]:
    """ "16x8MiB,32x1MiB" -> [(16, 8 MiB), (32, 1 MiB)]: threaded shapes only."""
    out = []
    for item in text.split(","):
        submit, threads, block = parse_shape(item)
        if submit != "threads":
            raise ValueError(f"--configs items are threads x block, as 32x1MiB; got {item!r}")
        out.append((threads, block))
    return out


def whole_mib(size: int) -> int:
    """`size` rounded down to whole MiB: every block size of a sweep divides it."""
    return size // (1 << 20) * (1 << 20)


def measure_mixed(cfg: IOConfig, a: Path, b: Path, size: int) -> dict[str, Any]:
    """One config's row (the module doc): `a` and `b` already hold `size` bytes (`write_files`)."""
    request, inflight = ring_shape(cfg, size)
    with (
        PinnedBufferPool(request * 3 * inflight) as pool,
        Ring(pool, inflight, request, pattern=True) as wring,
        Ring(pool, inflight, request, pattern=False) as rring,
        Ring(pool, inflight, request, pattern=True) as mring,
        IOEngine(cfg) as engine,
    ):
        write_s = stream(engine, wring, a, size, write=True)
        read_s = stream(engine, rring, a, size, write=False)
        done: dict[str, float] = {}
        writer = threading.Thread(target=lambda: done.update(w=stream(engine, mring, b, size, write=True)))
        t0 = time.perf_counter()
        writer.start()
        done["r"] = stream(engine, rring, a, size, write=False)
        writer.join()
        mixed_s = time.perf_counter() - t0
    turns, overlap = read_s + write_s, max(read_s, write_s)
    return dict(
        threads=cfg.threads,
        block_MiB=cfg.block_size / 2**20,
        read_GBps=gbps(size, read_s),
        write_GBps=gbps(size, write_s),
        mixed_s=mixed_s,
        mixed_read_s=done["r"],
        mixed_write_s=done["w"],
        mixed_GBps=gbps(2 * size, mixed_s),
        turns_s=turns,
        overlap_s=overlap,
        overlap=(turns - mixed_s) / (turns - overlap) if turns > overlap else None,
    )


def sweep_mixed(
    ws: Workspace,
    configs: Sequence[IOConfig],
    size: int,
    budget_s: float,
    *,
    log: Callable[[str], None] = _stderr,
) -> list[dict[str, Any]]:
    """`measure_mixed` for each config in turn, on two files in `ws` written once with the first config.

    The sweep stops before a config that would, at the average pace so far, end past `budget_s` seconds;
    the first config always runs. Call order: ``ws.require_free(2 * size, ...)``, then this.
    """
    start = time.perf_counter()
    a, b = ws.path("mixed-a.bin"), ws.path("mixed-b.bin")
    write_files(configs[0], (a, b), size)
    rows: list[dict[str, Any]] = []
    for cfg in configs:
        spent = time.perf_counter() - start
        if rows and spent + spent / len(rows) > budget_s:
            log(f"budget: sweep stopped after {len(rows)} of {len(configs)} configs ({spent:.0f} s)")
            break
        rows.append(measure_mixed(cfg, a, b, size))
        r = rows[-1]
        overlap = "-" if r["overlap"] is None else f"{r['overlap']:.2f}"
        log(
            f"{cfg.threads:4d} threads x {format_size(cfg.block_size)}: read {r['read_GBps']:.2f}, write "
            f"{r['write_GBps']:.2f} GB/s; both at once {r['mixed_s']:.2f} s against turns {r['turns_s']:.2f} / "
            f"overlap {r['overlap_s']:.2f} s (overlap {overlap})"
        )
    return rows


def measure_floor(
    directory: str,
    base_cfg: IOConfig,
    size: int,
    budget_s: float,
    *,
    flag: str = "--nvme",
    log: Callable[[str], None] = _stderr,
) -> dict[str, Any]:
    """Read and write GB/s of the disk under `directory`: `base_cfg` (the optimizer's) first, then FLOOR_SWEEP.

    The step's floor is then nvme_read_bytes / read B/s + nvme_write_bytes / write B/s. The keys are
    bench/llama_step.py's JSON record `disk`: the best read and write of all rows, and of the first row
    (`optimizer_*`), and `best_cfg`, the config fastest to read and then write the same bytes.
    """
    size = whole_mib(size)
    sweep = [base_cfg.replace(threads=t, block_size=b << 20) for t, b in FLOOR_SWEEP]
    configs = list(dict.fromkeys([base_cfg, *sweep]))  # the optimizer's first, each config once
    start = time.perf_counter()
    with Workspace(directory, flag=flag) as ws:
        ws.require_free(2 * size, "the floor's two test files")
        assert ws.dir is not None
        direct = direct_supported(ws.dir)
        if not direct:
            log(f"{directory} refuses O_DIRECT: buffered I/O measured (the page cache may flatter it)")
        configs = [c.replace(direct="on" if direct else "off") for c in configs]
        rows = sweep_mixed(ws, configs, size, budget_s, log=log)
    best = min(rows, key=lambda r: 1 / r["read_GBps"] + 1 / r["write_GBps"])
    return dict(
        size=size,
        direct=direct,
        rows=rows,
        seconds=time.perf_counter() - start,
        read_GBps=max(r["read_GBps"] for r in rows),
        write_GBps=max(r["write_GBps"] for r in rows),
        mixed_GBps=max(r["mixed_GBps"] for r in rows),
        optimizer_read_GBps=rows[0]["read_GBps"],
        optimizer_write_GBps=rows[0]["write_GBps"],
        best_cfg=dict(threads=best["threads"], block_size=int(best["block_MiB"] * 2**20)),
    )
