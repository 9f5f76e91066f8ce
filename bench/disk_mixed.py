"""Do the disk's reads and writes overlap? Read alone, write alone, then both at once, per engine config.

    python3 bench/disk_mixed.py --dir /root/mixed [--size 4GiB] [--configs 16x8MiB,32x1MiB] [--budget 120]

An optimizer step reads one file set while it writes another. If the disk serves reads and writes in
parallel (separate queues, a device that is not saturated by one direction), a step's floor is
max(read s, write s); if they take turns, it is read s + write s. This measures which, on one engine
(io_engine.IOEngine, O_DIRECT), per config:

  write   overwrite file A (already written once, as an optimizer's state files are), fsync counted
  read    read file A back
  mixed   read file A while overwriting file B, both streams submitted at once to the same engine

and reports mixed_s against read_s + write_s (take turns) and max(read_s, write_s) (full overlap):
    overlap = (read_s + write_s - mixed_s) / (read_s + write_s - max(read_s, write_s))
0 means the two directions take turns, 1 means they overlap fully. The write-then-read order matches
DeepSpeed's `ds_aio_bw.py` anchor, so its rows compare with these. One JSON line goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

from io_engine import IOConfig, IOEngine, PinnedBufferPool, parse_size
from tiered.bench.common import gbps
from tiered.bench.disk import Ring, direct_supported, ring_shape, stream
from tiered.bench.files import preallocate
from tiered.bench.workspace import Workspace


def parse_configs(text: str) -> list[tuple[int, int]]:
    """ "16x8MiB,32x1MiB" -> [(16, 8 MiB), (32, 1 MiB)]."""
    out = []
    for item in text.split(","):
        threads, _, block = item.strip().partition("x")
        if not block:
            raise ValueError(f"--configs items look like 32x1MiB (threads x block), got {item!r}")
        out.append((int(threads), parse_size(block)))
    return out


def measure(cfg: IOConfig, a: Path, b: Path, size: int) -> dict:
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


def write_once(cfg: IOConfig, paths: tuple[Path, ...], size: int) -> None:
    """Lay out and write each file once, untimed, so that every timed write overwrites, as a step does."""
    request, inflight = ring_shape(cfg, size)
    with (
        PinnedBufferPool(request * inflight) as pool,
        Ring(pool, inflight, request, pattern=True) as ring,
        IOEngine(cfg) as engine,
    ):
        for path in paths:
            preallocate(path, size)
            stream(engine, ring, path, size, write=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="a folder on the disk to measure (files are removed after)")
    p.add_argument("--size", default="4GiB", help="bytes per file (two files are made)")
    p.add_argument("--configs", default="16x8MiB,16x1MiB,32x1MiB,64x1MiB,32x512KiB,128x1MiB,32x4MiB,64x2MiB")
    p.add_argument("--budget", type=float, default=120.0, help="seconds; configs that would pass it are skipped")
    args = p.parse_args(argv)
    size = parse_size(args.size) // (1 << 20) * (1 << 20)
    rows: list[dict] = []
    start = time.perf_counter()
    with Workspace(args.dir) as ws:
        ws.require_free(2 * size, "the two test files")
        direct = "on" if direct_supported(ws.dir) else "off"
        a, b = ws.path("mixed-a.bin"), ws.path("mixed-b.bin")
        write_once(IOConfig(direct=direct), (a, b), size)
        for threads, block in parse_configs(args.configs):
            spent = time.perf_counter() - start
            if rows and spent + spent / len(rows) > args.budget:
                print(f"budget: stopped after {len(rows)} configs ({spent:.0f} s)", file=sys.stderr)
                break
            rows.append(measure(IOConfig(threads=threads, block_size=block, direct=direct), a, b, size))
            r = rows[-1]
            print(
                f"{threads:4d} x {block >> 10:5d} KiB: read {r['read_GBps']:.2f} write {r['write_GBps']:.2f} GB/s;"
                f" both {r['mixed_s']:.2f} s against turns {r['turns_s']:.2f} / overlap {r['overlap_s']:.2f}"
                f" (overlap {r['overlap']:.2f})",
                file=sys.stderr,
                flush=True,
            )
    print(
        json.dumps(
            dict(
                name="disk_mixed",
                size=size,
                direct=direct,
                rows=rows,
                best_read=max(r["read_GBps"] for r in rows),
                best_write=max(r["write_GBps"] for r in rows),
                seconds=time.perf_counter() - start,
            )
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
