"""Prefetch depth against step time: one flat fp32 parameter, its state streaming from disk.

    python bench/depth_sweep.py --params 200M --host-budget 512MiB --depths 2,4,6 --rounds 3

Each round builds a TieredOptimizer at every depth in turn (interleaved, so that a noisy disk hits all
depths alike), takes --steps steps with random gradients, and keeps the median step. Prints one JSON line
with every step time. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from io_engine import parse_size
from tiered import TieredOptimizer
from tiered.bench.common import parse_count


def one_run(n: int, depth: int, a: argparse.Namespace) -> dict:
    p = torch.nn.Parameter(torch.randn(n))
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        with TieredOptimizer([p], d, host_budget=a.host_budget, chunk_bytes=a.chunk_bytes, prefetch_depth=depth) as opt:
            times, moved = [], []
            for _ in range(a.steps + 1):  # the first step warms up
                p.grad = torch.randn(n) * 1e-3
                t = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t)
                last = opt.stats()["last_step"]
                moved.append(last["nvme_read_bytes"] + last["nvme_write_bytes"])
            return dict(depth=opt.prefetch_depth, steps_s=times[1:], median_s=statistics.median(times[1:]),
                        nvme_bytes=statistics.median(moved[1:]))  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="200M", help="parameters (M = 10^6)")
    ap.add_argument("--host-budget", default="512MiB")
    ap.add_argument("--chunk-bytes", default="64MiB")
    ap.add_argument("--depths", default="2,4,6")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", default=".")
    a = ap.parse_args(argv)
    n = parse_count(a.params, name="--params")
    depths = [int(x) for x in a.depths.split(",")]
    runs = []
    for r in range(a.rounds):
        for depth in depths:
            row = one_run(n, depth, a)
            row["round"] = r
            runs.append(row)
            print(f"[depth_sweep] round {r} depth {depth}: median step {row['median_s']:.2f} s", file=sys.stderr)
    summary = {
        d: round(statistics.median(x["median_s"] for x in runs if x["depth"] == d), 3)
        for d in sorted({x["depth"] for x in runs})
    }
    out = dict(bench="depth_sweep", params=n, host_budget=parse_size(a.host_budget), chunk_bytes=a.chunk_bytes,
               median_step_s_by_depth=summary, runs=runs)  # fmt: skip
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
