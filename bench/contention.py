"""How much busy checksum threads slow torch's fused AdamW, per intra-op thread count.

    python3 bench/contention.py [--numel 6627328] [--busy 0,1,2] [--threads 2,1]

During a step the update (torch's intra-op threads) runs beside the store's checksum threads. Every
parallel torch op waits for its slowest thread, so a core taken by a checksum can slow the whole op
more than the core's share. This times fused AdamW on one chunk-sized row while `busy` threads compute
zlib.crc32 in a loop (crc32 releases the GIL, as the store's checksums do), for each torch thread count.
Also times crc32 alone, and xxhash's xxh3 where installed, for the cost side. One JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import zlib

import torch


def adamw_ms(n: int, repeats: int = 20) -> float:
    t = [torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)]
    steps = [torch.tensor(1.0)]

    def once() -> None:
        torch._fused_adamw_([t[0]], [t[1]], [t[2]], [t[3]], [], steps, lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip

    once()
    t0 = time.perf_counter()
    for _ in range(repeats):
        once()
    return 1e3 * (time.perf_counter() - t0) / repeats


def hash_gbps(fn, data: bytes, repeats: int = 5) -> float:
    fn(data)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn(data)
    return len(data) * repeats / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=6_627_328, help="elements (a 64 MiB chunk of split masters)")
    p.add_argument("--busy", default="0,1,2", help="counts of busy checksum threads")
    p.add_argument("--threads", default=f"{os.cpu_count()},1", help="torch intra-op thread counts")
    a = p.parse_args(argv)
    block = os.urandom(64 << 20)  # random: a calloc-ed zero block maps one physical page and flatters memory
    res: dict = dict(cpus=os.cpu_count(), numel=a.numel, rows=[])
    res["crc32_GBps"] = hash_gbps(zlib.crc32, block)
    try:
        import xxhash

        res["xxh3_GBps"] = hash_gbps(xxhash.xxh3_64_intdigest, block)
    except ImportError:
        res["xxh3_GBps"] = None
    default_threads = torch.get_num_threads()
    for busy in (int(b) for b in a.busy.split(",")):
        stop = threading.Event()

        def spin(stop: threading.Event = stop) -> None:
            while not stop.is_set():
                zlib.crc32(block)

        workers = [threading.Thread(target=spin, daemon=True) for _ in range(busy)]
        for w in workers:
            w.start()
        time.sleep(0.2)
        for nt in (int(t) for t in a.threads.split(",")):
            torch.set_num_threads(nt)
            ms = adamw_ms(a.numel)
            res["rows"].append(dict(busy_checksum_threads=busy, torch_threads=nt, adamw_ms=ms))
            print(f"{busy} busy checksum threads, {nt} torch threads: fused AdamW {ms:.2f} ms", file=sys.stderr)
        stop.set()
        for w in workers:
            w.join()
    torch.set_num_threads(default_threads)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
