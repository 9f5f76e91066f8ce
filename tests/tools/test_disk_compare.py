"""bench/disk_compare.py's pieces, in process, with DeepSpeed's aio handle played by a file-backed fake: the
summary without a libaio figure, the libaio sweep's first config under a budget that holds no more, and whether
an op built earlier would be reused. The whole script runs at toy size in test_bench_smoke.py."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dc():
    spec = importlib.util.spec_from_file_location("disk_compare_under_test", ROOT / "bench" / "disk_compare.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def io_doc(read: float, write: float) -> dict:
    return {"best_read": {"read_gbps": read}, "best_write": {"write_gbps": write}}


CAL = [{"read_gbps": 1.358, "write_gbps": 2.264}, {"read_gbps": 1.299, "write_gbps": 2.364}]


@pytest.mark.parametrize("lib", [None, {"read": 0.0, "write": 0.0}, {"read": 1.8}])
def test_summary_without_a_libaio_figure_has_no_ratio_and_divides_by_nothing(dc, lib):
    """Call 3 of 2026-12-02 crashed here (ZeroDivisionError) after measuring everything else."""
    s = dc.summarize(lib, {"io_default": io_doc(1.119, 2.147)}, CAL)
    assert s["io_default_read"] == 1.119 and s["calib_read"] == 1.358 and s["calib_best_write"] == 2.364
    assert s["io_default_over_libaio_write"] is None and s["libaio_write"] is None
    assert s["floor_telemetry_over_libaio"] is None and s["floor_agrees_within_10pct"] is None
    if lib and lib.get("read"):
        assert s["io_default_over_libaio_read"] == round(1.119 / 1.8, 3)
    else:
        assert s["io_default_over_libaio_read"] is None and s["libaio_read"] is None


def test_summary_with_libaio_gives_every_ratio(dc):
    s = dc.summarize({"read": 2.0, "write": 3.0}, {"io_default": io_doc(2.2, 2.7)}, CAL)
    assert (s["io_default_over_libaio_read"], s["io_default_over_libaio_write"]) == (1.1, 0.9)
    floor = (1 / 1.358 + 1 / 2.264) / (1 / 2.0 + 1 / 3.0)
    assert s["floor_telemetry_over_libaio"] == round(floor, 3) and s["floor_agrees_within_10pct"] is False


class FakeHandle:
    """DeepSpeed's aio_handle's two calls, through plain file I/O."""

    def __init__(self, calls: list):
        self.calls = calls

    def sync_pwrite(self, buf: torch.Tensor, path: str) -> None:
        self.calls.append(("write", os.path.exists(path)))
        with open(path, "wb") as f:
            f.write(buf.numpy().tobytes())

    def sync_pread(self, buf: torch.Tensor, path: str) -> None:
        self.calls.append(("read", True))
        with open(path, "rb") as f:
            buf.copy_(torch.frombuffer(bytearray(f.read()), dtype=torch.uint8))


def fake_aio(calls: list) -> SimpleNamespace:
    return SimpleNamespace(aio_handle=lambda block, qd, single, overlap, threads: FakeHandle(calls))


def fake_lib(calls: list, folder: Path, size: int) -> dict:
    """What phase_libaio returns: its best read config, the handle's module, the buffer and the file."""
    buf = torch.zeros(size, dtype=torch.uint8)
    return dict(read_cfg=dict(block_MiB=1, qd=8, threads=1), aio=fake_aio(calls), buf=buf, path=str(folder / "aio.bin"))


def test_libaio_first_config_runs_under_a_budget_that_holds_no_more_and_times_an_overwrite(dc, tmp_path):
    """Call 3 of 2026-12-02: 61 s left after the op's build, the first config skipped for the 85 s reserve of the
    phases after it, and no ratio at all. Now the first config runs whenever it and the least of the rest fit;
    its file is laid out first, so its timed write overwrites, as ds_aio_bw's."""
    calls: list = []
    c = dc.Call(budget=60.0)
    c.dir = str(tmp_path)
    best = dc.phase_libaio(c, 1 << 20, fake_aio(calls), first_after=30.0, reserve=1000.0)
    assert best is not None and best["read"] > 0 and best["write"] > 0
    assert best["read_cfg"] == best["write_cfg"] == dict(zip(("block_MiB", "qd", "threads"), dc.LIBAIO[0]))
    assert calls == [("write", False), ("write", True), ("read", True)]
    assert [r.get("file") for r in c.rows] == ["fresh", "overwrite"]
    assert len(c.skipped) == 1 and "needs about" in c.skipped[0]  # the second config, for the reserve


def test_libaio_first_config_leaves_room_for_one_round_not_all(dc):
    """The seventeenth session's five-shape call (budget 320 s, 265 s left after the op's build): the first config
    waited for room for both rounds (232 s) and the rest, so neither libaio nor any round ran. Now it needs room
    for one round; each further config, for every round."""
    one = dc.round_seconds(5)
    first_after, reserve = dc.libaio_room(2, 5)
    assert first_after == dc.FIRST_AFTER_S + one
    assert reserve == dc.RESERVE_S + 2 * one
    first = 1.5 * 2 * (4 << 30) / 1e9  # phase_libaio's first guess: 4 GiB written and read at 1 GB/s, and half
    assert first + first_after < 265 < first + dc.FIRST_AFTER_S + 2 * one
    assert dc.libaio_room(0, 5) == (dc.FIRST_AFTER_S, dc.RESERVE_S)


def test_libaio_sweep_left_out_when_even_one_config_does_not_fit(dc, tmp_path):
    c = dc.Call(budget=10.0)
    c.dir = str(tmp_path)
    assert dc.phase_libaio(c, 1 << 20, fake_aio([]), first_after=30.0, reserve=85.0) is None
    assert c.rows == [] and len(c.skipped) == 1


def test_an_op_built_before_its_sources_were_reinstalled_is_rebuilt(dc, tmp_path, monkeypatch):
    """What made call 3's prebuilt aio op useless: run_on_device.sh reinstalled DeepSpeed (new file times), so
    ninja rebuilt the op. The load's row says so, and why."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    src = tmp_path / "src.cpp"
    src.write_text("int f() { return 0; }\n")
    builder = SimpleNamespace(name="async_io", sources=lambda: ["src.cpp"], deepspeed_src_path=lambda p: tmp_path / p)
    assert dc.op_build_state(builder)["state"] == "built"
    from torch.utils import cpp_extension

    so = Path(cpp_extension._get_build_directory("async_io", False)) / "async_io.so"
    so.write_bytes(b"")
    os.utime(src, (1000, 1000))
    assert dc.op_build_state(builder)["state"] == "reused"
    os.utime(src, None)  # reinstalled: newer than the build
    state = dc.op_build_state(builder)
    assert state["state"] == "rebuilt" and "newer than" in state["why"]


def test_interleaved_rounds_run_mirrored_and_compare_medians(dc, tmp_path, monkeypatch):
    """The disk drifts by a fifth within a call (2026-12-03: libaio's best config read 2.30, then 1.83), so
    the comparison that stands runs L T C C T L: every engine as often early as late, medians compared."""
    monkeypatch.setattr(dc.calibration, "CALIBRATE_BYTES", 4 << 20)
    monkeypatch.setattr(dc.calibration, "MIN_BYTES", 1 << 20)
    calls: list = []
    c = dc.Call(budget=600.0)
    c.dir = str(tmp_path)
    size = 1 << 20
    lib = fake_lib(calls, tmp_path, size)
    tiny = ["--size", "4MiB", "-q"]
    out = dc.phase_interleaved(c, lib, size, 2, ["2x1MiB"], tiny)
    assert [r["name"][0] for r in c.rows] == list("LTCCTL" * 2), c.skipped
    assert out["order"] == "L T2x1MiB C"
    assert out["rounds"] == 2 and not (tmp_path / "aio.bin").exists()
    assert calls[0] == ("write", False)  # the layout, untimed; every timed write then overwrites
    lib_reads = sorted(r["read_gbps"] for r in c.rows if r["name"][0] == "L")
    io_reads = sorted(r["read_gbps"] for r in c.rows if r["name"][0] == "T")
    # The rows are rounded to 3 decimals, the medians taken before: equal to within that rounding.
    assert out["libaio_read"] == pytest.approx((lib_reads[1] + lib_reads[2]) / 2, abs=2e-3)
    lib_med, io_med = (lib_reads[1] + lib_reads[2]) / 2, (io_reads[1] + io_reads[2]) / 2
    # Each row is rounded to 3 decimals (±5e-4, and so each median of them), the medians compared before that
    # and their ratio rounded after (±5e-4): the bound follows from the rates' own sizes, which a loaded machine
    # makes small (fake rates of 0.3 GB/s put the rows' rounding at 0.2 % of the ratio).
    bound = io_med / lib_med * (5e-4 / lib_med + 5e-4 / io_med) * 1.1 + 5e-4
    assert abs(out["io_over_libaio_read"] - io_med / lib_med) <= bound
    assert out["io_over_libaio_read"] == out["io_2x1MiB_over_libaio_read"]
    assert out["floor_telemetry_over_libaio"] > 0 and out["io_over_libaio_write"] > 0


def test_interleaved_rounds_stop_at_the_budget(dc, tmp_path):
    c = dc.Call(budget=10.0)
    c.dir = str(tmp_path)
    lib = fake_lib([], tmp_path, 1 << 20)
    out = dc.phase_interleaved(c, lib, 1 << 20, 3, ["64x1MiB", "aio:32x1MiB"], [])
    assert out == {"rounds": 0, "order": "L T64x1MiB Taio:32x1MiB C"} and len(c.skipped) == 1 and c.rows == []


def test_kernel_aio_takes_its_turn_in_the_rounds(dc, tmp_path, monkeypatch):
    """An "aio:" shape runs tiered-bench io with IOConfig(submit="aio"), in its place in the mirrored order."""
    from io_engine.kernel_aio import unavailable_reason

    if unavailable_reason():
        pytest.skip(unavailable_reason())
    monkeypatch.setattr(dc.calibration, "CALIBRATE_BYTES", 4 << 20)
    monkeypatch.setattr(dc.calibration, "MIN_BYTES", 1 << 20)
    c = dc.Call(budget=600.0)
    c.dir = str(tmp_path)
    size = 1 << 20
    out = dc.phase_interleaved(c, fake_lib([], tmp_path, size), size, 1, ["2x1MiB", "aio:4x256KiB"],
                               ["--size", "4MiB", "-q"])  # fmt: skip
    assert [r["name"].split(" ")[-1] if r["name"][0] == "T" else r["name"][0] for r in c.rows] == [
        "L", "2x1MiB", "aio:4x256KiB", "C", "C", "aio:4x256KiB", "2x1MiB", "L"]  # fmt: skip
    aio_rows = [r for r in c.rows if r["name"].endswith("aio:4x256KiB")]
    assert all("--submit aio" in r["command"] for r in aio_rows)
    assert out["io_aio:4x256KiB_read"] > 0 and out["io_aio:4x256KiB_over_libaio_write"] > 0
