"""How a 4 GiB overwrite reaches the disk: DeepSpeed's libaio handle beside the same bytes sent other ways.

    python3 bench/disk_streams.py --dir /root/streams [--size 4GiB] [--rounds 2] [--variants a,b,...]

Why (issue 31): `tiered-bench io` writes at 0.80-0.84x libaio's best on the GPU machines in every shape tried
(threads of 1 or 8 MiB, 16 to 64 of them, and kernel AIO from one thread), while its reads come within 0-16 %.
libaio's best rows split the file into one contiguous region a thread, each thread keeping its own queue of
requests: several sequential streams, submitted from several CPUs. The engine sends one sequential front from a
shared first-in first-out queue. This probe sends the same bytes each way, in one process, interleaved and
mirrored (each variant gets the disk's early and late minutes alike), so that the variant that closes the gap,
if any, names what the engine lacks:

  ds        DeepSpeed's aio_handle(8 MiB, qd 32, 8 threads): libaio's best read row, its write near its best
  engine    IOEngine as the optimizer runs it: threads x block, every 64 MiB request of the file submitted at once
  regions   K Python threads, each with its own kernel AIO context (io_engine.kernel_aio) of depth Q, each
            sending its own contiguous region of the file in requests of B bytes: libaio's pattern, our calls
  pwrite    K Python threads, each writing its own contiguous region with blocking pwrite of B bytes

A variant is ``ds``, ``engine:threads:64x1MiB``, ``engine:aio:256x8MiB``, ``regions:KxQxB`` or ``pwrite:KxB``.
Every write overwrites a laid-out file (as ds_aio_bw.py's and a step's); each read follows its write. Writes
one JSON file ($OUT/disk_streams.json, or --out) with every pass and each variant's medians and ratios to
``ds``, and the block devices' queue settings. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from io_engine import IOConfig, IOEngine, aligned_empty, parse_size
from io_engine.kernel_aio import AioContext

MiB = 1 << 20
REQUEST = 64 * MiB
DEFAULT_VARIANTS = (
    "ds,engine:threads:64x1MiB,engine:threads:32x1MiB,engine:aio:256x8MiB,"
    "regions:8x32x8MiB,regions:1x256x8MiB,regions:8x4x1MiB,pwrite:8x8MiB"
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def queue_settings() -> dict[str, Any]:
    """Each block device's scheduler, queue sizes and hardware queue count (virtio-blk maps CPUs to queues)."""
    out: dict[str, Any] = {}
    for dev in sorted(Path("/sys/block").glob("*")):
        if dev.name.startswith(("loop", "ram")):
            continue
        q = dev / "queue"
        row = {}
        for key in ("scheduler", "nr_requests", "max_sectors_kb", "max_hw_sectors_kb", "rotational", "nomerges"):
            try:
                row[key] = (q / key).read_text().strip()
            except OSError:
                pass
        mq = dev / "mq"
        row["hw_queues"] = len(list(mq.iterdir())) if mq.is_dir() else None
        out[dev.name] = row
    return out


def split(size: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous regions of whole MiBs covering [0, size)."""
    step = -(-size // parts // MiB) * MiB
    return [(s, min(step, size - s)) for s in range(0, size, step)]


def in_regions(one: Callable[[int, int], None], size: int, k: int, errors: list[BaseException]) -> None:
    """``one(start, length)`` on a thread of its own for each of ``k`` regions; the first error raised again."""
    threads = [threading.Thread(target=one, args=r) for r in split(size, k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def regions_aio(address: int, path: str, size: int, write: bool, k: int, depth: int, block: int) -> None:
    """libaio's pattern with our kernel AIO calls: k threads, each its own context and its own region."""
    flags = (os.O_WRONLY if write else os.O_RDONLY) | os.O_DIRECT
    errors: list[BaseException] = []

    def one(start: int, length: int) -> None:
        fd = os.open(path, flags)
        ctx = AioContext(depth)
        try:
            pos, end, inflight, tag = start, start + length, 0, 0
            while pos < end or inflight:
                batch = []
                while pos < end and inflight + len(batch) < depth:
                    n = min(block, end - pos)
                    batch.append((tag, fd, write, address + pos, n, pos))
                    tag, pos = tag + 1, pos + n
                if batch:
                    taken = ctx.submit(batch)
                    inflight += taken
                    pos -= sum(r[4] for r in batch[taken:])
                for _, res in ctx.events(min_nr=1, timeout_s=None):
                    if res < 0:
                        raise OSError(-res, os.strerror(-res))
                    inflight -= 1
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)
        finally:
            ctx.close()
            os.close(fd)

    in_regions(one, size, k, errors)


def regions_pwrite(view: memoryview, path: str, size: int, write: bool, k: int, block: int) -> None:
    flags = (os.O_WRONLY if write else os.O_RDONLY) | os.O_DIRECT
    errors: list[BaseException] = []

    def one(start: int, length: int) -> None:
        fd = os.open(path, flags)
        try:
            for pos in range(start, start + length, block):
                n = min(block, start + length - pos)
                got = os.pwrite(fd, view[pos : pos + n], pos) if write else os.preadv(fd, [view[pos : pos + n]], pos)
                if got != n:
                    raise OSError(f"short {'write' if write else 'read'} at {pos}: {got} of {n}")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            os.close(fd)

    in_regions(one, size, k, errors)


def shape(text: str) -> list[int]:
    return [int(parse_size(p)) if p[-1:].isalpha() else int(p) for p in text.split("x")]


def make(variant: str, buf: torch.Tensor, view: memoryview, address: int, path: str, size: int,
         aio: Any) -> Callable[[bool], None] | None:  # fmt: skip
    kind, _, rest = variant.partition(":")
    if kind == "ds":
        if aio is None:
            return None
        h = aio.aio_handle(8 * MiB, 32, False, True, 8)

        def ds(write: bool) -> None:
            (h.sync_pwrite if write else h.sync_pread)(buf, path)

        return ds
    if kind == "engine":
        submit, _, tb = rest.partition(":")
        threads, block = shape(tb)
        engine = IOEngine(IOConfig(submit=submit, threads=threads, block_size=block, direct="on"))  # type: ignore[arg-type]

        def run(write: bool) -> None:
            op = engine.pwrite if write else engine.pread
            futs = [op(buf[o : o + min(REQUEST, size - o)], path, o) for o in range(0, size, REQUEST)]
            for f in futs:
                f.result()

        run.engine = engine  # type: ignore[attr-defined]
        return run
    if kind == "regions":
        k, depth, block = shape(rest)
        return lambda write: regions_aio(address, path, size, write, k, depth, block)
    if kind == "pwrite":
        k, block = shape(rest)
        return lambda write: regions_pwrite(view, path, size, write, k, block)
    raise SystemExit(f"unknown variant {variant!r}")


def load_deepspeed_aio() -> Any:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder  # type: ignore[import-not-found]

        t = time.perf_counter()
        aio = AsyncIOBuilder().load()
        log(f"DeepSpeed's aio op loaded in {time.perf_counter() - t:.1f} s")
        return aio
    except Exception as e:  # noqa: BLE001 - then no ds rows
        log(f"no DeepSpeed aio op here ({type(e).__name__}: {e})")
        return None


def median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", default="4GiB")
    ap.add_argument("--rounds", type=int, default=2, help="each round runs the variants, then mirrored")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds: no round starts past what is left")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    size = int(parse_size(a.size))
    out_path = a.out or os.path.join(os.environ.get("OUT", "."), "disk_streams.json")
    Path(a.dir).mkdir(parents=True, exist_ok=True)
    path = os.path.join(a.dir, "streams.bin")
    doc: dict[str, Any] = {"size": size, "queues": queue_settings(), "cpus": os.cpu_count(), "passes": []}
    log(json.dumps(doc["queues"]))
    aio = load_deepspeed_aio() if "ds" in a.variants.split(",") else None
    if torch.cuda.is_available():
        buf = torch.empty(size, dtype=torch.uint8).pin_memory()  # as ds_aio_bw.py's
        address = buf.data_ptr()
        view = memoryview(buf.numpy()).cast("B")
    else:
        view, owner = aligned_empty(size)
        buf = torch.frombuffer(view, dtype=torch.uint8)
        address = buf.data_ptr()
    template = torch.randint(0, 255, (64 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for s in range(0, size, template.numel()):
        buf[s : s + template.numel()] = template[: size - s]
    runs = {v: make(v, buf, view, address, path, size, aio) for v in a.variants.split(",")}
    runs = {v: r for v, r in runs.items() if r is not None}
    with open(path, "wb") as f:  # the layout: every timed write overwrites
        f.truncate(size)
    regions_pwrite(view, path, size, True, 8, 8 * MiB)
    order = list(runs)
    per_round = None
    try:
        for k in range(a.rounds):
            left = a.budget - (time.perf_counter() - t0)
            if per_round is not None and per_round > left:
                log(f"round {k + 1}: needs about {per_round:.0f} s, {left:.0f} s left: stopped")
                break
            tr = time.perf_counter()
            for v in (*order, *reversed(order)):
                t = time.perf_counter()
                runs[v](True)
                t1 = time.perf_counter()
                runs[v](False)
                t2 = time.perf_counter()
                w, r = size / (t1 - t) / 1e9, size / (t2 - t1) / 1e9
                doc["passes"].append(dict(variant=v, round=k + 1, write_gbps=round(w, 3), read_gbps=round(r, 3),
                                          at_s=round(t - t0, 1)))  # fmt: skip
                log(f"round {k + 1} {v:28s} write {w:.3f} read {r:.3f} GB/s")
            per_round = time.perf_counter() - tr
    finally:
        for r in runs.values():
            eng = getattr(r, "engine", None)
            if eng is not None:
                eng.close()
        Path(path).unlink(missing_ok=True)
    med = {}
    for v in order:
        ps = [p for p in doc["passes"] if p["variant"] == v]
        med[v] = {"write": median([p["write_gbps"] for p in ps]), "read": median([p["read_gbps"] for p in ps]),
                  "n": len(ps)}  # fmt: skip
    if "ds" in med and med["ds"]["write"]:
        for m in med.values():
            m["write_over_ds"] = round(m["write"] / med["ds"]["write"], 3) if m["write"] else None
            m["read_over_ds"] = round(m["read"] / med["ds"]["read"], 3) if m["read"] else None
    doc["medians"] = med
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(med))
    return 0


if __name__ == "__main__":
    sys.exit(main())
