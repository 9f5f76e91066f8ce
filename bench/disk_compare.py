"""One call, one process: `tiered-bench io` beside DeepSpeed's libaio handle on the same disk, and the floor
the optimizer's telemetry divides by (tiered.calibration) beside the floor at libaio's rates.

    python3 bench/disk_compare.py --dir /root/cmp [--budget 175] [--no-libaio]

On the GPU machine, with DeepSpeed importable (carry `.anchors`, made by ../shared/anchors/prepare.sh):

    PYTHONPATH=$PWD bash .anchors/run_on_device.sh ../bench/disk_compare.py --dir /root/cmp

DeepSpeed builds its aio op first (56-68 s on the GPU machine when it builds; its row says whether the op was
built, rebuilt or reused, and why). The libaio sweep then runs its configs best first: the first whenever it
and the phases after it fit the budget (FIRST_AFTER_S), so that a ratio to libaio always exists; each further
one only while RESERVE_S seconds remain for the phases after it.

A build in another process is reused only if DeepSpeed's sources are older than the built op: ninja compares
their times. ../shared/anchors/run_on_device.sh reinstalls the wheels at each start (pip --upgrade writes every
file anew), so an op built by an earlier run_on_device.sh is rebuilt in full by the next (56 s in the GPU call
of 2026-12-02 after a 59 s prebuild): prebuild in the same start, or install the wheels once.

Phases, in this order; one that would end past `--budget` seconds (DeepSpeed's build of its aio op included)
is cut short or left out, and the JSON says which:

  libaio   ds_aio_bw.py's method (../shared/anchors), in this process: one 4 GiB pinned tensor, block {1, 8} MiB
           x queue depth {8, 32} x threads {1, 4, 8}, each config sync_pwrite (an overwrite: the first config
           writes the fresh file once before, a row of its own) then sync_pread of the whole file, no fsync;
           its best read and best write
  interleaved  libaio's best read config (L), `tiered-bench io` at each of `--shapes` (T: [aio:]threads x block,
           one timed pass; by default 64 x 1 MiB, its defaults' first; "aio:" for IOConfig(submit="aio"), kernel
           AIO from one thread) and the calibration (C), in that order and then mirrored (L T C C T L), `--rounds`
           times: each one's median against libaio's. This disk drifts by 20-40 % within a call (2026-12-03:
           libaio's best config read 2.30 GB/s, then 1.75-2.15), so a phase run minutes after libaio's sweep is
           measured on another disk; the mirrored order gives each the same share of early and late minutes, and
           these are the ratios the call can stand by
  io       `tiered-bench io --json --no-fio` as a user runs it (its defaults: libaio's 4 GiB file, 1 and 8 MiB blocks
           x 8, 32 and 64 threads, at least 8 requests in flight, the GPU machine's winners first), through
           tiered.cli.main, within what the call has left and at most its own default budget
  calib    tiered.calibration.calibrate at the optimizer's IOConfig ($TIERED_IO_CONFIG, else the defaults), twice
  drift    libaio's best read config once more: how far the disk moved during the call

The summary: io over libaio, read and write (each run's best against libaio's best), and the floor of a step
that reads and writes B bytes, B/read + B/write, at the calibration's rates over that at libaio's (within
10 %: the telemetry's floor is libaio's); the same from the interleaved rounds' medians under `interleaved`;
a ratio without a libaio figure is None. Writes one JSON file (--out,
default $OUT/disk_compare.json; again after each phase, so that a failure keeps the rows so far), prints one
row per measurement on stderr and the summary as one JSON line on stdout. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import io as _io
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from io_engine import IOConfig, format_size, parse_size
from tiered import calibration, cli
from tiered.bench.files import filesystem_of
from tiered.bench.io_types import QUICK_BUDGET_S
from tiered.bench.mixed import parse_shape
from tiered.bench.workspace import Workspace

MiB = 1 << 20
# ds_aio_bw.py's grid, (block MiB, queue depth, threads); its best rows on the GPU machine first (bench/disk_probe.py,
# 4 GiB: 8 MiB qd 32 x 8 read 1.87 and wrote 2.70 GB/s, the best floor of one config; 8 MiB qd 8 x 4 wrote 2.79,
# the best write; 1 MiB qd 32 x 1 1.75 / 2.77), so that a short budget still measures those.
LIBAIO = [(8, 32, 8), (8, 8, 4), (1, 32, 1), (1, 32, 8)]
LIBAIO += [(b, q, t) for b in (1, 8) for q in (8, 32) for t in (1, 4, 8) if (b, q, t) not in LIBAIO]
IO_DEFAULT_MIN_S = 30.0  # tiered-bench io's budget at the least: its first two 4 GiB configurations on the GPU machine
CALIB_S = 8.0  # the calibration twice (2.7 s each on the GPU machine), and its setup
DRIFT_S = 8.0  # libaio's best read config once more: 4 GiB written and read
LIBAIO_PASS_S = 4.0  # libaio's 4 GiB overwritten and read back on the GPU machine
IO_PASS_S = 10.0  # tiered-bench io at one shape, one pass (its 4 GiB file laid out, overwritten, read back): 8-13 s
FIRST_AFTER_S = IO_DEFAULT_MIN_S + CALIB_S + DRIFT_S  # the least the phases after libaio's first config need
RESERVE_S = QUICK_BUDGET_S + CALIB_S + DRIFT_S  # what they take on the GPU machine: each further libaio config


class Call:
    def __init__(self, budget: float):
        self.t0, self.budget = time.perf_counter(), budget
        self.rows: list[dict[str, Any]] = []
        self.skipped: list[str] = []
        self.dir = ""  # the workspace's folder, once made

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def fits(self, seconds: float, what: str) -> bool:
        if seconds > self.left():
            self.skipped.append(f"{what}: needs about {seconds:.0f} s, {self.left():.0f} s left")
            log(f"skip {self.skipped[-1]}")
            return False
        return True

    def row(self, phase: str, name: str, **fields: Any) -> dict[str, Any]:
        r = dict(phase=phase, name=name, at_s=round(time.perf_counter() - self.t0, 1), **fields)
        self.rows.append(r)
        log(f"{phase:7s} {name:44s} " + " ".join(f"{k}={v}" for k, v in fields.items() if k != "doc"))
        return r


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_aio(c: Call) -> Any:
    """DeepSpeed's aio op, its load timed and its build state a row: "reused" (a build newer than its sources),
    "rebuilt" (one older than them: ninja builds it again in full) or "built" (none yet); None where DeepSpeed
    cannot load it here."""
    t = time.perf_counter()
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder  # type: ignore[import-not-found]

        builder = AsyncIOBuilder()
        before = op_build_state(builder)
        aio = builder.load()
    except Exception as e:  # noqa: BLE001 - any failure only means no libaio rows
        c.skipped.append(f"libaio: DeepSpeed's aio handle is not importable here ({type(e).__name__}: {e})")
        log(c.skipped[-1])
        return None
    after = op_build_state(builder)
    state = before["state"]
    if state == "reused" and after.get("mtime") != before.get("mtime"):
        state = "rebuilt"  # ninja found another reason (flags, headers)
    c.row("libaio", "DeepSpeed AsyncIOBuilder().load()", seconds=round(time.perf_counter() - t, 1), build=state,
          why=before["why"], op=after.get("path"))  # fmt: skip
    return aio


def op_build_state(builder: Any) -> dict[str, Any]:
    """Whether torch's JIT build of ``builder``'s op can be reused as it stands: ninja rebuilds an op whose
    sources are newer than it, which a reinstall of DeepSpeed makes them (pip writes every file anew)."""
    try:
        from torch.utils import cpp_extension

        folder = cpp_extension._get_build_directory(builder.name, False)
        path = os.path.join(folder, f"{builder.name}.so")
        sources = [os.path.abspath(builder.deepspeed_src_path(p)) for p in builder.sources()]
        newest = max(os.stat(p).st_mtime for p in sources)
    except Exception as e:  # noqa: BLE001 - a private torch API or DeepSpeed's layout moved: say so, nothing more
        return dict(state="unknown", why=f"{type(e).__name__}: {e}")
    if not os.path.exists(path):
        return dict(state="built", why=f"no build in {folder}: a cold build", path=path)
    mtime = os.stat(path).st_mtime
    if newest > mtime:
        why = f"DeepSpeed's sources are {newest - mtime:.0f} s newer than {path} (reinstalled since)"
        return dict(state="rebuilt", why=why, path=path, mtime=mtime)
    return dict(state="reused", why=f"{path} is newer than DeepSpeed's sources", path=path, mtime=mtime)


def round_seconds(shapes: int) -> float:
    """One interleaved round (L, each shape, C, mirrored) on the GPU machine."""
    return 2 * (LIBAIO_PASS_S + IO_PASS_S * shapes + CALIB_S / 2)


def libaio_room(rounds: int, shapes: int) -> tuple[float, float]:
    """The seconds libaio's sweep leaves for what follows it: before its first config, the least of the phases
    after it and one interleaved round (the rounds the budget cannot hold are cut, each saying so; without
    libaio's figure there is no round and no ratio at all: the sixteenth session's five-shape call lost both
    that way); before each further config, every round."""
    one = round_seconds(shapes) if rounds else 0.0
    return FIRST_AFTER_S + one, RESERVE_S + rounds * round_seconds(shapes)


def phase_libaio(c: Call, size: int, aio: Any, first_after: float, reserve: float) -> dict[str, Any] | None:
    """ds_aio_bw.py's sweep, its configs in LIBAIO's order: the first while it and ``first_after`` seconds fit
    the budget, each further one while ``reserve`` seconds are left for the phases after it. The first config
    lays the file out (a fresh write, a row of its own), so every timed write, as ds_aio_bw's, overwrites."""
    buf = torch.empty(size, dtype=torch.uint8)
    buf = buf.pin_memory() if torch.cuda.is_available() else buf
    template = torch.randint(0, 255, (64 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for s in range(0, size, template.numel()):  # random bytes as ds_aio_bw.py's, seconds faster than random_
        buf[s : s + template.numel()] = template[: size - s]
    path = str(Path(c.dir) / "aio.bin")
    pace = 2 * size / 1.0e9  # seconds a config takes at 1 GB/s, until one was measured
    best: dict[str, Any] = {"read": 0.0, "write": 0.0}
    try:
        for k, (block, qd, threads) in enumerate(LIBAIO):
            what = f"libaio block {block} MiB, qd {qd}, {threads} threads"
            if not c.fits(pace * 1.5 + first_after if k == 0 else pace + reserve, what):
                break
            h = aio.aio_handle(block * MiB, qd, False, True, threads)
            cfg = dict(block_MiB=block, qd=qd, threads=threads)
            if k == 0:  # the file's layout: a fresh file's first write is slower (blocks converted as written)
                t0 = time.perf_counter()
                h.sync_pwrite(buf, path)
                c.row("libaio", f"block {block} MiB, qd {qd}, {threads} threads", file="fresh",
                      write_gbps=round(size / (time.perf_counter() - t0) / 1e9, 3), **cfg)  # fmt: skip
            t0 = time.perf_counter()
            h.sync_pwrite(buf, path)
            t1 = time.perf_counter()
            h.sync_pread(buf, path)
            t2 = time.perf_counter()
            w, r = size / (t1 - t0) / 1e9, size / (t2 - t1) / 1e9
            pace = 1.2 * (t2 - t0)
            c.row("libaio", f"block {block} MiB, qd {qd}, {threads} threads", write_gbps=round(w, 3),
                  read_gbps=round(r, 3), file="overwrite", **cfg)  # fmt: skip
            if r > best["read"]:
                best.update(read=r, read_cfg=cfg)
            if w > best["write"]:
                best.update(write=w, write_cfg=cfg)
    except Exception as e:  # noqa: BLE001 - the other phases still run
        c.skipped.append(f"libaio stopped by {type(e).__name__}: {e}")
        log(c.skipped[-1])
    if not best["read"]:
        return None
    best["aio"], best["buf"], best["path"] = aio, buf, path
    return best


def run_bench_io(c: Call, name: str, args: list[str]) -> dict[str, Any] | None:
    """`tiered-bench io ARGS --json` in this process; its JSON document."""
    argv = ["io", "--dir", str(Path(c.dir) / "io"), "--json", "--no-fio", *args]
    out = _io.StringIO()
    t = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out):
            rc = cli.main(argv)
    except SystemExit as e:  # argparse's refusal of a bad argument
        rc = e.code if isinstance(e.code, int) else 2
    s = time.perf_counter() - t
    if rc != 0:
        c.skipped.append(f"tiered-bench {shlex.join(argv)}: exit code {rc}")
        log(c.skipped[-1])
        return None
    doc = json.loads(out.getvalue())
    # Each configuration's medians and timed passes: which ones a budget let run, and what each gave.
    sweep = [
        f"{r['threads']}x{format_size(r['block_size'])} r{r['read_gbps']['median']:.3f} "
        f"w{r['write_gbps']['median']:.3f} ({len(r['read_gbps']['samples'])} timed)"
        for r in doc["sweep"]
    ]
    c.row("io", name, seconds=round(s, 1), read_gbps=doc["best_read"]["read_gbps"],
          write_gbps=doc["best_write"]["write_gbps"], complete=doc.get("complete"), sweep=sweep,
          command="tiered-bench " + shlex.join(argv))  # fmt: skip
    return doc


def phase_calib(c: Call) -> list[dict[str, Any]]:
    out = []
    for k in range(2):
        if not c.fits(CALIB_S / 2, f"calibration ({k})"):
            break
        t = time.perf_counter()
        rate = calibration.calibrate(c.dir, IOConfig.from_env())  # the optimizer's IOConfig, as it would calibrate
        if rate is None:
            c.skipped.append("calibration: could not measure (see the log)")
            break
        p = rate.provenance
        out.append(c.row("calib", f"calibration.calibrate, method {p['method']} ({k})", read_gbps=rate.read_gbps,
                         write_gbps=rate.write_gbps, seconds=round(time.perf_counter() - t, 2), bytes=p["bytes"],
                         passes=p["passes"], fsync_s=p["fsync_s"], in_flight=p["in_flight"]))  # fmt: skip
    return out


def phase_drift(c: Call, lib: dict[str, Any], size: int) -> None:
    cfg = lib.get("read_cfg")
    if cfg is None or not c.fits(min(DRIFT_S, 2 * size / (lib["read"] * 1e9) + 2), "drift"):
        return
    h = lib["aio"].aio_handle(cfg["block_MiB"] * MiB, cfg["qd"], False, True, cfg["threads"])
    t0 = time.perf_counter()
    h.sync_pwrite(lib["buf"], lib["path"])
    t1 = time.perf_counter()
    h.sync_pread(lib["buf"], lib["path"])
    t2 = time.perf_counter()
    c.row("drift", "libaio's best read config again", write_gbps=round(size / (t1 - t0) / 1e9, 3),
          read_gbps=round(size / (t2 - t1) / 1e9, 3), file="fresh", **cfg)  # fmt: skip


def phase_interleaved(c: Call, lib: dict[str, Any], size: int, rounds: int, shapes: list[str],
                      io_extra: list[str]) -> dict[str, Any]:  # fmt: skip
    """libaio's best read config (L), `tiered-bench io` at each of ``shapes`` (T: [aio:]threads x block, one
    timed pass) and the calibration (C), in that order and then mirrored, ``rounds`` times (each only while its
    estimate fits): the disk's drift within a call falls on each alike. Returns each one's median read and write
    and its ratios to libaio's; ``io_over_libaio_*`` is the first shape's (tiered-bench io's defaults start with
    64 x 1 MiB)."""
    cfg = lib["read_cfg"]
    h = lib["aio"].aio_handle(cfg["block_MiB"] * MiB, cfg["qd"], False, True, cfg["threads"])
    h.sync_pwrite(lib["buf"], lib["path"])  # the layout again (the sweep removed its file): timed writes overwrite
    got: dict[str, list[tuple[float, float]]] = {}

    def libaio() -> None:
        t0 = time.perf_counter()
        h.sync_pwrite(lib["buf"], lib["path"])
        t1 = time.perf_counter()
        h.sync_pread(lib["buf"], lib["path"])
        w, r = size / (t1 - t0) / 1e9, size / (time.perf_counter() - t1) / 1e9
        got.setdefault("libaio", []).append((r, w))
        c.row("inter", "L: libaio's best read config", read_gbps=round(r, 3), write_gbps=round(w, 3), **cfg)

    def bench_io(shape: str) -> Any:
        submit, threads, block = parse_shape(shape)
        args = [
            "--block-sizes",
            str(block),
            "--threads",
            str(threads),
            "--submit",
            submit,
            "--warmup",
            "0",
            "--loops",
            "1",
        ]

        def run() -> None:
            d = run_bench_io(c, f"T: tiered-bench io {shape}", [*args, *io_extra])
            if d is not None:
                got.setdefault(f"io_{shape}", []).append((d["best_read"]["read_gbps"], d["best_write"]["write_gbps"]))

        return run

    def calib() -> None:
        rate = calibration.calibrate(c.dir, IOConfig.from_env())  # the optimizer's IOConfig, as it would calibrate
        if rate is not None:
            got.setdefault("calib", []).append((rate.read_gbps, rate.write_gbps))
            c.row("inter", "C: calibration.calibrate", read_gbps=rate.read_gbps, write_gbps=rate.write_gbps)

    order = [libaio, *(bench_io(s) for s in shapes), calib]
    round_s = round_seconds(len(shapes))
    try:
        for k in range(rounds):
            if not c.fits(round_s, f"interleaved round {k + 1} of {rounds}"):
                break
            for run in (*order, *reversed(order)):
                run()
    finally:
        Path(lib["path"]).unlink(missing_ok=True)
    med = {name: (median([r for r, _ in v]), median([w for _, w in v])) for name, v in got.items()}
    order_names = ["L", *(f"T{s}" for s in shapes), "C"]
    out: dict[str, Any] = {"rounds": len(got.get("libaio", [])) // 2, "order": " ".join(order_names)}
    for name, (r, w) in med.items():
        out[f"{name}_read"], out[f"{name}_write"] = round(r, 3), round(w, 3)
    if "libaio" in med:
        lr, lw = med["libaio"]
        for name, (r, w) in med.items():
            if name not in ("libaio", "calib"):
                out[f"{name}_over_libaio_read"], out[f"{name}_over_libaio_write"] = ratio(r, lr), ratio(w, lw)
        if shapes and f"io_{shapes[0]}" in med:
            out["io_over_libaio_read"] = out[f"io_{shapes[0]}_over_libaio_read"]
            out["io_over_libaio_write"] = out[f"io_{shapes[0]}_over_libaio_write"]
        if "calib" in med:
            out["floor_telemetry_over_libaio"] = ratio(1 / med["calib"][0] + 1 / med["calib"][1], 1 / lr + 1 / lw)
    return out


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded, or None where either figure is missing (no libaio figure: no ratio, never a division by 0)."""
    return round(a / b, 3) if a and b else None


def summarize(lib: dict[str, Any] | None, ios: dict[str, dict[str, Any]], cal: list[dict[str, Any]]) -> dict[str, Any]:
    """The call's figures and their ratios; every ratio is None where a figure it needs is missing."""
    lib_r = (lib or {}).get("read") or None
    lib_w = (lib or {}).get("write") or None
    s: dict[str, Any] = {"libaio_read": lib_r and round(lib_r, 3), "libaio_write": lib_w and round(lib_w, 3)}
    for name, doc in ios.items():
        r, w = doc["best_read"]["read_gbps"], doc["best_write"]["write_gbps"]
        s[f"{name}_read"], s[f"{name}_write"] = r, w
        s[f"{name}_over_libaio_read"], s[f"{name}_over_libaio_write"] = ratio(r, lib_r), ratio(w, lib_w)
    if cal:
        first = cal[0]  # what an optimizer would have measured: its first calibration
        s["calib_read"], s["calib_write"] = first["read_gbps"], first["write_gbps"]
        s["calib_best_read"] = max(x["read_gbps"] for x in cal)
        s["calib_best_write"] = max(x["write_gbps"] for x in cal)
        # A step reads and writes B bytes: floor = B/read + B/write. >1: the telemetry's floor is longer (its
        # rates slower) than libaio's, and a step's ratio to it would flatter the step.
        ours = 1 / first["read_gbps"] + 1 / first["write_gbps"] if first["read_gbps"] and first["write_gbps"] else None
        theirs = 1 / lib_r + 1 / lib_w if lib_r and lib_w else None
        s["floor_telemetry_over_libaio"] = ratio(ours, theirs)
        f = s["floor_telemetry_over_libaio"]
        s["floor_agrees_within_10pct"] = None if f is None else abs(f - 1) <= 0.10
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a folder on the disk to measure (removed after)")
    ap.add_argument("--out", default=None, help="the JSON file (default: $OUT/disk_compare.json, else ./)")
    ap.add_argument("--size", default="4GiB", help="libaio's file, as ds_aio_bw.py's (default 4GiB)")
    ap.add_argument("--budget", type=float, default=175.0, help="seconds for everything, DeepSpeed's build included")
    ap.add_argument("--no-libaio", action="store_true", help="do not try DeepSpeed")
    ap.add_argument("--io-extra", default="", help="arguments appended to the tiered-bench io run (a smoke "
                    "test's sizes)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds: L T.. C, then mirrored (0: none)")
    ap.add_argument("--shapes", default="64x1MiB", help="tiered-bench io's shapes in the rounds, [aio:]threads x "
                    "block (aio: kernel AIO from one thread, that many requests in flight), comma-separated; the "
                    "first is the one compared for the issue (the defaults' first)")  # fmt: skip
    ap.add_argument("--calib-bytes", default=None, help="the calibration's file (default: its own); for a smoke test")
    a = ap.parse_args(argv)
    size = parse_size(a.size)
    if a.calib_bytes:
        calibration.CALIBRATE_BYTES = parse_size(a.calib_bytes)
    out = Path(a.out or os.path.join(os.environ.get("OUT", "."), "disk_compare.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(a.io_extra)
    doc: dict[str, Any] = dict(name="disk_compare", argv=sys.argv[1:], libaio_bytes=size, budget_s=a.budget)
    c = Call(a.budget)
    lib: dict[str, Any] | None = None
    ios: dict[str, dict[str, Any]] = {}
    cal: list[dict[str, Any]] = []
    inter: dict[str, Any] = {}
    shapes = [x for x in a.shapes.split(",") if x]
    for shape in shapes:
        try:
            parse_shape(shape)
        except ValueError as e:
            ap.error(str(e))
    first_after, reserve = libaio_room(a.rounds, len(shapes))

    def save() -> None:
        """The document so far: a phase that fails later leaves these rows, not nothing."""
        doc.update(rows=c.rows, skipped=c.skipped, seconds=round(time.perf_counter() - c.t0, 1), io_docs=ios,
                   summary={**summarize(lib, ios, cal), "interleaved": inter})  # fmt: skip
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(tmp, out)

    with Workspace(a.dir) as ws:
        assert ws.dir is not None
        c.dir = str(ws.dir)
        # libaio's file and the calibration's; tiered-bench io checks for its own (after libaio's is removed).
        ws.require_free(
            (0 if a.no_libaio else size) + calibration.CALIBRATE_BYTES, "libaio's and the calibration's files"
        )
        doc["system"] = dict(host=os.uname().nodename, kernel=os.uname().release, cpus=os.cpu_count(),
                             filesystem=filesystem_of(ws.dir), torch=torch.__version__, cuda=torch.cuda.is_available(),
                             boot_id=calibration._boot_id())  # fmt: skip
        log(f"disk_compare: {ws.dir} ({doc['system']['filesystem']}), budget {a.budget:.0f} s")
        aio = None if a.no_libaio else load_aio(c)
        if aio is not None:
            lib = phase_libaio(c, size, aio, first_after, reserve)
        if lib is not None:
            Path(lib["path"]).unlink(missing_ok=True)  # room for io's files; drift writes it again
        save()
        if lib is not None and a.rounds:
            inter.update(phase_interleaved(c, lib, size, a.rounds, shapes, extra))
            save()
        after = CALIB_S + (DRIFT_S if lib is not None else 0.0)  # what must stay for the calibration (and drift)
        if c.fits(IO_DEFAULT_MIN_S + after, "tiered-bench io (defaults)"):
            own = min(QUICK_BUDGET_S, c.left() - after)  # its own default, or what the call has left
            d = run_bench_io(c, "tiered-bench io (defaults)",
                             [*(["--budget", f"{own:.0f}"] if own < QUICK_BUDGET_S else []), *extra])  # fmt: skip
            if d is not None:
                ios["io_default"] = d
            save()
        cal = phase_calib(c)
        save()
        if lib is not None:
            phase_drift(c, lib, size)
            Path(lib["path"]).unlink(missing_ok=True)
        save()
    print(json.dumps(doc["summary"]))
    log(f"disk_compare: {doc['seconds']} s, {len(c.rows)} rows, {len(c.skipped)} skipped; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
