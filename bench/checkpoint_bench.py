"""Checkpoint save/load GB/s, against io_engine's raw bandwidth and torch.save/torch.load of the same state.

    python3 bench/checkpoint_bench.py --params 25M --dir /mnt/nvme/tmp [--host-budget 64MiB] [--drop-caches]

One JSON document on stdout (progress on stderr). Everything is measured in one run, on one disk, on
the same bytes (the optimizer's `state_bytes`: with fp32 parameters, 12 bytes each: master, exp_avg, exp_avg_sq):

  raw.write / raw.read   io_engine streaming the state's bytes from/to 64 MiB page-aligned buffers, fsync
                         included: what the disk and the engine can do.
  raw.copy               read one file while writing another, 64 MiB at a time: the floor of a save whose
                         state mostly streams from the NVMe tier (it reads the tier and writes the checkpoint).
  save / load / verify   tiered.checkpoint on a TieredOptimizer whose host_budget holds a quarter of the state.
  torch.save / .load     {"model": params, "optim": opt.state_dict()} through torch.save + fsync, and
                         torch.load + load_state_dict: the in-memory way (it needs the whole state in RAM).
  reflink                store.flush() + FICLONE of every record file, where the filesystem can (btrfs, XFS
                         with reflink=1): what a copy-on-write checkpoint would cost (not what tiered does).

--drop-caches (root) empties the page cache before every read, so reads come from the disk.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import glob
import json
import os
import shutil
import sys
import time
from typing import Any

import torch

from io_engine import IOConfig, IOEngine, PinnedBufferPool, format_size, parse_size, pool_bytes
from tiered import TieredOptimizer
from tiered.bench.common import Stat, gbps, host_info, parse_count
from tiered.bench.steps import synthetic_params
from tiered.bench.workspace import Workspace
from tiered.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
from tiered.layout.chunking import FULL

BLOCK = 64 << 20
FICLONE = 0x40049409


def log(msg: str) -> None:
    print(f"[checkpoint_bench] {msg}", file=sys.stderr, flush=True)


def drop_caches(enabled: bool) -> None:
    if enabled:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def raw(ws: Workspace, nbytes: int, cfg: IOConfig, loops: int, drop: bool) -> dict[str, Any]:
    """io_engine alone: write, read and copy ``nbytes`` in BLOCK requests (all submitted at once)."""
    blk = min(BLOCK, nbytes)
    src, dst = str(ws.path("raw-a.bin")), str(ws.path("raw-b.bin"))
    offsets = list(range(0, nbytes, blk))
    out: dict[str, list[float]] = {"write": [], "read": [], "copy": []}
    with IOEngine(cfg) as eng, PinnedBufferPool(pool_bytes([blk] * 3), pin=False) as pool:
        bufs = [pool.acquire(blk) for _ in range(3)]
        for b in bufs:
            b.tensor.random_(0, 255)

        def write(path: str) -> None:
            futs = [eng.pwrite(bufs[0].tensor, path, o, nbytes=min(blk, nbytes - o)) for o in offsets]
            for f in futs:
                f.result()
            eng.flush(path)

        def read() -> None:
            futs = [eng.pread(bufs[i % 2].tensor, src, o, nbytes=min(blk, nbytes - o)) for i, o in enumerate(offsets)]
            for f in futs:
                f.result()

        def copy() -> None:  # block i is written while block i+1 is read; 3 buffers rotate
            writes = []
            for i, o in enumerate(offsets):
                n = min(blk, nbytes - o)
                eng.pread(bufs[i % 3].tensor, src, o, nbytes=n).result()
                writes.append(eng.pwrite(bufs[i % 3].tensor, dst, o, nbytes=n))
                if len(writes) > 1:
                    writes[-2].result()
            for f in writes:
                f.result()
            eng.flush(dst)

        for _ in range(loops):
            out["write"].append(gbps(nbytes, timed(lambda: write(src))))
            drop_caches(drop)
            out["read"].append(gbps(nbytes, timed(read)))
            drop_caches(drop)
            out["copy"].append(gbps(nbytes, timed(copy)))
            os.unlink(dst)
        for b in bufs:
            b.release()
    os.unlink(src)
    return {k: Stat.of(v).__dict__ for k, v in out.items()}


def torch_baseline(ws: Workspace, params: list[torch.nn.Parameter], opt: Any, loops: int, drop: bool) -> dict[str, Any]:
    path = str(ws.path("torch.pt"))
    res: dict[str, list[float]] = {"save_gbps": [], "save_file_gbps": [], "load_gbps": [], "load_file_gbps": []}
    size = 0
    for _ in range(loops):
        t0 = time.perf_counter()
        sd = {"model": [p.detach() for p in params], "optim": opt.state_dict()}  # materializes the state
        t1 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        t2 = time.perf_counter()
        size = os.path.getsize(path)
        del sd
        res["save_gbps"].append(gbps(opt.state_bytes, t2 - t0))
        res["save_file_gbps"].append(gbps(opt.state_bytes, t2 - t1))
        drop_caches(drop)
        t0 = time.perf_counter()
        sd = torch.load(path, weights_only=True)
        t1 = time.perf_counter()
        opt.load_state_dict(sd["optim"])
        with torch.no_grad():
            for p, v in zip(params, sd["model"]):
                p.copy_(v)
        t2 = time.perf_counter()
        del sd
        res["load_gbps"].append(gbps(opt.state_bytes, t2 - t0))
        res["load_file_gbps"].append(gbps(opt.state_bytes, t1 - t0))
    os.unlink(path)
    return {"file_bytes": size, **{k: Stat.of(v).__dict__ for k, v in res.items()}}


def reflink_probe(ws: Workspace, opt: Any) -> dict[str, Any]:
    """store.flush() then FICLONE each record file: the cost of a copy-on-write checkpoint, where possible."""
    clone_dir = ws.path("clone")
    os.mkdir(clone_dir)
    flush_s = timed(opt.store.flush)
    files = sorted(glob.glob(os.path.join(opt.store.path, "records", "*.bin")))
    t0 = time.perf_counter()
    try:
        for src in files:
            with open(src, "rb") as s, open(os.path.join(clone_dir, os.path.basename(src)), "wb") as d:
                fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS):
            raise
        return {"supported": False, "why": os.strerror(e.errno or 0), "flush_s": round(flush_s, 4)}
    finally:
        shutil.rmtree(clone_dir, ignore_errors=True)
    return {"supported": True, "files": len(files), "flush_s": round(flush_s, 4),
            "clone_s": round(time.perf_counter() - t0, 4)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="25M", help="fp32 parameters (25M: 300 MB of state)")
    p.add_argument("--dir", default="./ckpt-bench-data", help="folder on the disk to measure (removed after)")
    p.add_argument("--host-budget", default=None, help="optimizer host budget (default: a quarter of the state)")
    p.add_argument("--chunk-bytes", default=None, help="state chunk size (default: state/16, at most 64 MiB)")
    p.add_argument("--loops", type=int, default=3, help="timed repetitions of each measurement (median reported)")
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache before reads (needs root)")
    args = p.parse_args(argv)
    n = parse_count(args.params, name="--params")
    # Sizes the knobs before the optimizer exists: its fp32 record layout (tiered/layout/chunking.py) for fp32
    # parameters. Every figure below divides the optimizer's own count, opt.state_bytes.
    planned = FULL.nbytes(n)
    unit = FULL.nbytes(1024)  # chunks of whole 1024-element rows: page-aligned rows, no O_DIRECT bounce copies
    chunk = parse_size(args.chunk_bytes) if args.chunk_bytes else max(1, min(planned // 16, 64 << 20) // unit) * unit
    budget = parse_size(args.host_budget) if args.host_budget else max(planned // 4, 4 * chunk)
    cfg = IOConfig.from_env()
    with Workspace(args.dir) as ws:
        ws.require_free(4 * planned, "optimizer state, checkpoint, torch file and raw test file")
        params = synthetic_params(n, torch.device("cpu"))
        opt = TieredOptimizer(params, ws.path("nvme"), chunk_bytes=chunk, host_budget=budget, io=cfg)
        state = opt.state_bytes
        try:
            opt.step()  # moments become non-zero, steps 1
            log(f"{format_size(state)} of state, {len(opt.chunks)} chunks of {format_size(chunk)}, host budget "
                f"{format_size(budget)}")  # fmt: skip
            results: dict[str, Any] = {"raw": raw(ws, state, cfg, args.loops, args.drop_caches)}
            log(f"raw: {results['raw']}")
            ck = str(ws.path("ckpt"))
            save, load, verify = [], [], []
            for _ in range(args.loops):
                shutil.rmtree(ck, ignore_errors=True)
                save.append(gbps(state, timed(lambda: save_checkpoint(opt, ck, io=cfg))))
                drop_caches(args.drop_caches)
                load.append(gbps(state, timed(lambda: load_checkpoint(opt, ck, io=cfg))))
                drop_caches(args.drop_caches)
                verify.append(gbps(state, timed(lambda: verify_checkpoint(ck, io=cfg))))
            shutil.rmtree(ck, ignore_errors=True)
            results.update(save=Stat.of(save).__dict__, load=Stat.of(load).__dict__, verify=Stat.of(verify).__dict__)
            log(f"save {results['save']['median']} GB/s, load {results['load']['median']} GB/s")
            results["torch"] = torch_baseline(ws, params, opt, args.loops, args.drop_caches)
            results["reflink"] = reflink_probe(ws, opt)
        finally:
            opt.close()
    med = {k: v["median"] for k, v in results.items() if isinstance(v, dict) and "median" in v}

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b else None

    out = {
        "bench": "checkpoint",
        "host": host_info(),
        "params": n,
        "state_bytes": state,
        "chunk_bytes": chunk,
        "host_budget": budget,
        "io_config": cfg.to_dict(),
        "drop_caches": args.drop_caches,
        "results": results,
        "ratios": {
            "save_over_raw_write": ratio(med["save"], results["raw"]["write"]["median"]),
            "save_over_raw_copy": ratio(med["save"], results["raw"]["copy"]["median"]),
            "load_over_raw_read": ratio(med["load"], results["raw"]["read"]["median"]),
            "save_over_torch_save": ratio(med["save"], results["torch"]["save_gbps"]["median"]),
            "load_over_torch_load": ratio(med["load"], results["torch"]["load_gbps"]["median"]),
        },
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
