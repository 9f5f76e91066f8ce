"""How fast host memory is page-locked: the pool's way (fault in on torch's threads, then cudaHostRegister)
against registering untouched pages and against torch's own pinned allocator (cudaHostAlloc).

    python bench/pin_bench.py --gib 16 --block 64MiB > pin.json

A benchmark: it prints JSON (GiB/s per way, each on fresh memory, freed before the next); it checks only that
each registration succeeded. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import mmap
import time

import torch

from io_engine import PinnedBufferPool, parse_size


def register_untouched(n: int, size: int) -> float:
    t0 = time.perf_counter()
    blocks = []
    for _ in range(n):
        mm = mmap.mmap(-1, size)
        t = torch.frombuffer(mm, dtype=torch.uint8)
        assert int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), size, 0)) == 0
        blocks.append((mm, t))
    dt = time.perf_counter() - t0
    for _mm, t in blocks:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    return dt


def pool_way(n: int, size: int) -> float:
    pool = PinnedBufferPool(n * size)
    t0 = time.perf_counter()
    bufs = [pool.acquire(size) for _ in range(n)]
    dt = time.perf_counter() - t0
    for b in bufs:
        b.release()
    pool.close()
    return dt


def torch_pinned(n: int, size: int) -> float:
    t0 = time.perf_counter()
    bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
    dt = time.perf_counter() - t0
    del bufs
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gib", type=float, default=16)
    p.add_argument("--block", default="64MiB")
    args = p.parse_args()
    size = parse_size(args.block)
    n = int(args.gib * 2**30 // size)
    out = {"gib": n * size / 2**30, "block": size, "threads": torch.get_num_threads()}
    ways = (("register_untouched", register_untouched), ("pool", pool_way), ("torch_pin_memory", torch_pinned))
    for name, fn in ways:
        dt = fn(n, size)
        out[name] = {"s": round(dt, 3), "GiB_per_s": round(n * size / 2**30 / dt, 2)}
        print(json.dumps({name: out[name]}), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
