"""TieredStore streaming benchmark: NVMe-resident records read through the store vs io_engine raw.

    python bench/store_bench.py --dir /mnt/nvme/sb --records 32 --record-size 64MiB

Three figures, each the median of --loops scans over the same records (O_DIRECT, fresh files):
  raw       io_engine reading every record file into one pinned buffer, back to back (the ceiling)
  store     a scan with prefetch: ``prefetch`` k ahead, ``pin`` (waits for the read), ``retire``
  compute   the same scan with a simulated compute of --compute-ratio x (record bytes / raw GB/s) per
            record: the exposed I/O wait (time blocked in ``pin`` after the first record, whose read
            nothing can hide) should be near zero when compute >= I/O.
Prints a table to stderr and one JSON line to stdout. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from io_engine import IOConfig, IOEngine, PinnedBufferPool, parse_size
from tiered import TieredStore


def scan(store: TieredStore, keys: list[str], depth: int, compute_s: float) -> tuple[float, list[float]]:
    """One pass over ``keys`` through the store; returns (seconds, seconds blocked on each record's read)."""
    waits = []
    t0 = time.perf_counter()
    store.prefetch(keys[:depth])
    for i, key in enumerate(keys):
        store.prefetch(keys[i + 1 : i + 1 + depth])
        t = time.perf_counter()
        with store.pin(key, tier="host"):
            waits.append(time.perf_counter() - t)
            if compute_s:
                time.sleep(compute_s)  # the GIL is free, as it is during a real (native) update
        store.retire(key)
    return time.perf_counter() - t0, waits


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="folder on the disk to test (default: a temp folder here)")
    ap.add_argument("--records", type=int, default=16)
    ap.add_argument("--record-size", default="64MiB")
    ap.add_argument("--depth", type=int, default=4, help="records prefetched ahead")
    ap.add_argument("--loops", type=int, default=3)
    ap.add_argument("--compute-ratio", type=float, default=1.2)
    ap.add_argument("--no-verify", action="store_true", help="skip checksum checks on reads")
    a = ap.parse_args(argv)
    size = parse_size(a.record_size)
    root = a.dir or tempfile.mkdtemp(prefix="store-bench-", dir=".")
    os.makedirs(root, exist_ok=True)
    work = tempfile.mkdtemp(dir=root)
    cfg = IOConfig.from_env()
    result: dict = {
        "records": a.records,
        "record_bytes": size,
        "depth": a.depth,
        "verify": not a.no_verify,
        "io": cfg.to_dict(),
    }
    try:
        # Budget: the prefetch window plus two in use; "scan" with no resident room streams everything.
        budget = (a.depth + 3) * size
        with TieredStore(os.path.join(work, "store"), host_budget=budget, policy="scan", io=cfg,
                         stream_reserve=budget, verify=not a.no_verify) as store:  # fmt: skip
            data = torch.randint(0, 2**31 - 1, (size // 4,), dtype=torch.int32)
            keys = [f"r{i}" for i in range(a.records)]
            for k in keys:
                store.put(k, data, tier="nvme")
            store.flush()
            files = [
                os.path.join(work, "store", "records", f)
                for f in sorted(os.listdir(os.path.join(work, "store", "records")))
            ]
            raw, plain, comp, waits = [], [], [], []
            with IOEngine(cfg) as eng, PinnedBufferPool(size) as pool:
                buf = pool.acquire(size)
                for _ in range(a.loops + 1):  # the first of each is a warm-up
                    t = time.perf_counter()
                    futs = [eng.pread(buf.tensor, f) for f in files]  # one buffer: bandwidth only
                    for f in futs:
                        f.result()
                    raw.append(a.records * size / (time.perf_counter() - t) / 1e9)
                buf.release()
            raw_gbps = statistics.median(raw[1:])
            compute_s = a.compute_ratio * size / (raw_gbps * 1e9)
            for _ in range(a.loops + 1):
                s, _w = scan(store, keys, a.depth, 0.0)
                plain.append(a.records * size / s / 1e9)
                s, w = scan(store, keys, a.depth, compute_s)
                comp.append(s)
                waits.append((w[0], sum(w[1:])))  # the first read cannot hide behind any compute
        result.update(
            raw_read_GBps=round(raw_gbps, 3),
            store_read_GBps=round(statistics.median(plain[1:]), 3),
            store_over_raw=round(statistics.median(plain[1:]) / raw_gbps, 3),
            compute_per_record_s=round(compute_s, 4),
            compute_scan_s=round(statistics.median(comp[1:]), 3),
            first_read_wait_s=round(statistics.median(w[0] for w in waits[1:]), 3),
            exposed_wait_s=round(statistics.median(w[1] for w in waits[1:]), 3),
            compute_total_s=round(compute_s * a.records, 3),
            samples=dict(raw=raw, store=plain, compute_scan=comp, waits=waits),
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"raw {result['raw_read_GBps']} GB/s, store {result['store_read_GBps']} GB/s "
        f"({result['store_over_raw']}x); with {result['compute_total_s']} s of compute a scan took "
        f"{result['compute_scan_s']} s: {result['first_read_wait_s']} s waiting for the first read, "
        f"{result['exposed_wait_s']} s on all the others",
        file=sys.stderr,
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
