"""How fast io_engine moves bytes when the disk is not the limit: reads of a file in /dev/shm (memory).

    python bench/engine_overhead.py [--size 1GiB]

If these figures sit far above the disk's bandwidth, the engine's Python threads and per-task overhead are
not what limits a disk run, even at 1 MiB tasks. Prints one JSON line. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from io_engine import IOConfig, IOEngine, PinnedBufferPool, parse_size


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args(argv)
    n = parse_size(a.size)
    rows = []
    with tempfile.TemporaryDirectory(dir=a.dir) as d, PinnedBufferPool(n) as pool:
        path = os.path.join(d, "f.bin")
        buf = pool.acquire(n)
        buf.tensor.fill_(7)
        with IOEngine(IOConfig(direct="off")) as eng:
            eng.write(buf.tensor, path)
        for block, threads in ((1 << 20, 16), (1 << 20, 64), (8 << 20, 16)):
            with IOEngine(IOConfig(block_size=block, threads=threads, direct="off")) as eng:
                times = []
                for _ in range(3):
                    t = time.perf_counter()
                    eng.read(buf.tensor, path)
                    times.append(time.perf_counter() - t)
            rows.append(
                dict(block_MiB=block >> 20, threads=threads, tasks=n // block, best_GBps=round(n / min(times) / 1e9, 2))
            )
        buf.release()
    out = dict(bench="engine_overhead", bytes=n, cpus=os.cpu_count(), rows=rows)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
