"""Step telemetry: the distance to the disk floor, the bound, SSD wear, and the disk's calibrated bandwidth."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import shutil
import threading
import time

import pytest
import torch
from helpers import small_tmpfs
from torch import nn

import tiered.calibration as calibration
import tiered.telemetry as telemetry
from io_engine import IOConfig
from tiered import TieredOptimizer
from tiered.config import TierConfig
from tiered.optim.step_stats import PHASES
from tiered.telemetry import DiskRate, Wear, disk_rate, report, summary_line


def phases(**kw) -> dict:
    return {**dict.fromkeys(PHASES, 0.0), **kw}


def test_report_gives_the_floor_for_the_bytes_and_the_bound():
    rate = DiskRate(read_gbps=2.0, write_gbps=1.0, source="test")
    ph = phases(step_s=2.0, read_wait_s=1.2, update_s=0.5, nvme_read_bytes=2e9, nvme_write_bytes=1e9)
    r = report(ph, rate, "host", "cuda")
    assert r["floor_s"] == pytest.approx(2.0)  # 2 GB at 2 GB/s + 1 GB at 1 GB/s
    assert r["over_floor"] == pytest.approx(1.0) and r["nvme_gbps"] == pytest.approx(1.5)
    assert r["bound"] == "disk" and r["disk_rate"]["source"] == "test"
    update_bound = phases(step_s=1.0, update_s=0.6, read_wait_s=0.3)
    assert report(update_bound, rate, "host", "cuda")["bound"] == "CPU"
    assert report(update_bound, rate, "device", "cuda")["bound"] == "GPU"
    assert report(update_bound, rate, "device", "cpu")["bound"] == "CPU"  # "device" is the parameters': the CPU here
    assert report(phases(step_s=1.0, grad_d2h_s=0.4, h2d_s=0.3, update_s=0.5), rate, "host", "cuda")["bound"] == "PCIe"
    # No NVMe byte moved, or no calibration: no floor, and no ratio to one.
    assert report(phases(step_s=1.0, update_s=1.0), rate, "host", "cpu")["floor_s"] is None
    assert report(ph, None, "host", "cpu")["over_floor"] is None
    for damaged in (DiskRate(0.0, 1.0, "x"), DiskRate(2.0, -1.0, "x"), DiskRate(float("nan"), 1.0, "x")):
        assert report(ph, damaged, "host", "cpu")["over_floor"] is None  # divided by, it broke the step


def test_wear_projects_the_run_and_warns_once(caplog):
    wear = Wear(tbw=1.0, run_steps=1000, share=0.1)
    with caplog.at_level(logging.WARNING, logger="tiered"):
        quiet = wear.report(50e6, 50e6)  # 50 MB a step: 0.05 TB a run, 5 % of the drive
        assert quiet["run_tb"] == pytest.approx(0.05) and quiet["run_share_of_tbw"] == pytest.approx(0.05)
        assert not caplog.records
        loud = wear.report(200e6, 250e6)  # 0.2 TB a run: 20 % of it
        wear.report(200e6, 450e6)
    assert loud["tb_per_1000_steps"] == pytest.approx(0.2) and loud["bytes_written_total"] == 250_000_000
    (rec,) = caplog.records  # once, not every step
    assert "host_budget" in rec.getMessage() and "moments_dtype" in rec.getMessage()


@pytest.mark.parametrize("hbm", [False, True])
def test_the_wear_warning_names_gpu_budget_only_where_it_applies(caplog, hbm):
    """The warning advised "a larger host_budget or gpu_budget" for CPU parameters too, where gpu_budget is ignored
    (with a warning saying so): a user following it changed nothing. It names gpu_budget only where state can live
    in HBM (the parameters on a GPU, or streamed to one with the update there)."""
    wear = Wear(tbw=1.0, run_steps=1000, share=0.1, hbm=hbm)
    with caplog.at_level(logging.WARNING, logger="tiered"):
        wear.report(200e6, 200e6)  # 0.2 TB a run: 20 % of the drive
    (rec,) = caplog.records
    assert "larger host_budget" in rec.getMessage() and ("gpu_budget" in rec.getMessage()) == hbm, rec.getMessage()


@pytest.mark.parametrize(
    "moments, advised, not_advised",
    [
        ("fp32", ["host_budget", "moments_dtype=torch.bfloat16", "moments_dtype='int8'"], ["gpu_budget"]),
        ("bf16", ["host_budget", "moments_dtype='int8'"], ["bfloat16", "gpu_budget"]),
        ("int8", ["host_budget"], ["moments_dtype", "bfloat16", "int8", "gpu_budget"]),
    ],
)
def test_the_wear_warning_advises_only_moments_that_write_less(tmp_path, caplog, moments, advised, not_advised):
    """The warning advised bf16 and 8-bit moments whatever the optimizer kept: bf16 to an int8 optimizer (which
    writes more) and the moments it already had. It names only the moments that write less than the optimizer's, and
    on these CPU parameters not gpu_budget, which is ignored there."""
    p = nn.Parameter(torch.randn(20000))
    with caplog.at_level(logging.WARNING, logger="tiered"):
        with TieredOptimizer([p], tmp_path, moments_dtype=moments, chunk_bytes="12KiB", host_budget="48KiB",
                             tbw=1e-6, run_steps=1000) as opt:  # fmt: skip
            for _ in range(2):
                p.grad = torch.randn(20000)
                opt.step()
            assert opt.stats()["total"]["nvme_write_bytes"] > 0
    (message,) = [r.getMessage() for r in caplog.records if "TBW" in r.getMessage()]
    assert [a for a in advised if a not in message] == [] and [n for n in not_advised if n in message] == []


def test_wear_knobs_are_checked():
    bad_knobs = (dict(tbw=0), dict(tbw="1"), dict(run_steps=0), dict(run_steps=1.5), dict(wear_share=0),
                 dict(wear_share=2))  # fmt: skip
    for bad in bad_knobs:
        with pytest.raises(ValueError):
            TierConfig(**bad)


@pytest.fixture
def small_calibration(monkeypatch, tmp_path):
    """The calibration's method at 64 MiB (the default 1 GiB takes 1-3 s), this test's own cache, no tune file."""
    monkeypatch.setattr(calibration, "CALIBRATE_BYTES", 64 << 20)
    monkeypatch.setattr(calibration, "REQUEST_BYTES", 16 << 20)
    monkeypatch.setenv("TIERED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TIERED_IO_CONFIG", raising=False)
    return tmp_path / "cache" / "disk_rates.json"


def cache_key(folder) -> str:
    return f"{platform.node()}:dev-{os.stat(folder).st_dev}"


def test_the_disk_is_measured_once_with_its_provenance_then_read_from_the_cache(tmp_path, small_calibration):
    first = disk_rate(str(tmp_path), None)
    assert first is not None and first.read_gbps > 0 and first.write_gbps > 0 and "now" in first.source
    assert not first.earlier and not (tmp_path / telemetry.CALIBRATE_NAME).exists()
    prov = first.provenance
    assert prov["method"] == calibration.METHOD and prov["io"] == IOConfig().to_dict()
    assert prov["bytes"] == 64 << 20 and prov["request_bytes"] == 16 << 20 and prov["passes"] >= 1
    assert prov["in_flight"] == min(calibration.IN_FLIGHT, 4)  # no more than the file's requests
    assert prov["host"] == platform.node()
    assert prov["filesystem"] == calibration.filesystem_of(tmp_path) and prov["boot_id"] == calibration._boot_id()
    assert prov["device"].startswith(f"{os.major(os.stat(tmp_path).st_dev)}:")
    assert abs(prov["measured_at"] - time.time()) < 600
    (entry,) = json.loads(small_calibration.read_text())[cache_key(tmp_path)]
    assert entry == {"read_gbps": first.read_gbps, "write_gbps": first.write_gbps, "provenance": prov}

    def no_second_measurement(*a):
        raise AssertionError("measured again")

    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as m:
        m.setattr(calibration, "calibrate", no_second_measurement)
        again = disk_rate(str(tmp_path), None)
    assert (again.read_gbps, again.write_gbps, again.provenance) == (first.read_gbps, first.write_gbps, prov)
    assert again.earlier and str(small_calibration) in again.source and "in this boot" in again.source


def test_each_ioconfig_has_its_own_figure(tmp_path, small_calibration, monkeypatch):
    measured = []

    def fake(folder, io):
        measured.append(io.threads)
        return DiskRate(float(io.threads), 1.0, "measured now", provenance={**calibration._identity(folder, io),
                        "measured_at": time.time()})  # fmt: skip

    monkeypatch.setattr(calibration, "calibrate", fake)
    for threads in (4, 8, 4, 8):
        assert disk_rate(str(tmp_path), IOConfig(threads=threads)).read_gbps == threads
    assert measured == [4, 8] and len(json.loads(small_calibration.read_text())[cache_key(tmp_path)]) == 2


@pytest.mark.parametrize(
    "change, why",
    [
        (dict(boot_id="another-boot"), "another boot"),
        (dict(host="elsewhere"), "another machine"),
        (dict(io=IOConfig(threads=3).to_dict()), "another IOConfig"),
        (dict(method=1), "an older calibration method"),
        (dict(filesystem="xfs-elsewhere"), "another filesystem"),
        (dict(measured_at=time.time() - 3 * 86400), "more than 24 h ago"),
        (None, "an older calibration method"),  # a figure cached before provenance existed
    ],
)
def test_a_cached_figure_measured_otherwise_is_refused_and_the_new_one_says_so(tmp_path, small_calibration,
                                                                               monkeypatch, change, why):  # fmt: skip
    prov = {**calibration._identity(str(tmp_path), IOConfig()), "measured_at": time.time() - 60}
    if change is None:
        entry = {"read_gbps": 9.0, "write_gbps": 9.0, "date": "2020-01-01", "host": platform.node()}
    else:
        entry = {"read_gbps": 9.0, "write_gbps": 9.0, "provenance": {**prov, **change}}
    small_calibration.parent.mkdir()
    small_calibration.write_text(json.dumps({cache_key(tmp_path): entry if change is None else [entry]}))
    monkeypatch.setattr(calibration, "calibrate", lambda folder, io: DiskRate(1.5, 1.25, "measured now in here",
                        provenance={**prov, "measured_at": time.time()}))  # fmt: skip
    rate = disk_rate(str(tmp_path), None)
    assert (rate.read_gbps, rate.write_gbps) == (1.5, 1.25) and not rate.earlier
    assert f"the figure cached in {small_calibration} was not used: measured on {why}" in rate.source
    # The new figure is cached; one of another boot or method is never kept.
    kept = json.loads(small_calibration.read_text())[cache_key(tmp_path)]
    assert kept[0]["read_gbps"] == 1.5 and len(kept) == (2 if why in ("another IOConfig", "another filesystem") else 1)
    assert disk_rate(str(tmp_path), None).earlier  # and serves the next optimizer


@pytest.mark.parametrize("bad", [0, -1.5, "abc", None, True, float("nan"), float("inf"), 1e308])
def test_a_damaged_cached_figure_is_measured_again(tmp_path, small_calibration, monkeypatch, bad):
    """A cached figure of this machine, boot and IOConfig whose rate is no GB/s a disk can have (a hand edit,
    another tool's write): the optimizer's constructor raised (float("abc")), or its step divided by zero."""
    _assert_measured_again(tmp_path, small_calibration, monkeypatch, read_gbps=bad, write_gbps=1.0)
    assert [e["read_gbps"] for e in json.loads(small_calibration.read_text())[cache_key(tmp_path)]] == [1.5]


_A_MINUTE_AGO = object()


def _assert_measured_again(tmp_path, cache, monkeypatch, *, read_gbps, write_gbps, at=_A_MINUTE_AGO) -> None:
    """A figure of this machine, boot and IOConfig cached with these rates (and ``measured_at``, else a minute ago)
    is refused as damaged, and the disk measured again."""
    prov = {**calibration._identity(str(tmp_path), IOConfig()), "measured_at": time.time() - 60}
    cache.parent.mkdir()
    entry = {"read_gbps": read_gbps, "write_gbps": write_gbps, "provenance": prov}
    if at is not _A_MINUTE_AGO:
        entry["provenance"] = {**prov, "measured_at": at}
    cache.write_text(json.dumps({cache_key(tmp_path): [entry]}))
    monkeypatch.setattr(calibration, "calibrate", lambda folder, io: DiskRate(1.5, 1.25, "measured now in here",
                        provenance={**prov, "measured_at": time.time()}))  # fmt: skip
    rate = disk_rate(str(tmp_path), None)
    assert (rate.read_gbps, rate.write_gbps) == (1.5, 1.25) and not rate.earlier
    assert f"the figure cached in {cache} was not used: it is damaged" in rate.source


@pytest.mark.parametrize("at", [float("nan"), float("inf"), 1e308, "abc", None, True, 10**7])
def test_a_cached_figure_measured_at_no_real_time_is_measured_again(tmp_path, small_calibration, monkeypatch, at):
    """A cached figure of this machine, boot and IOConfig with good rates but a measured_at that is no time it was
    measured (NaN, infinite, far in the future: a hand edit, another tool's write) never aged out: it was trusted for
    ever as measured just now. It is refused as damaged and measured again (``10**7``: that many seconds ahead)."""
    stamp = time.time() + at if isinstance(at, int) and not isinstance(at, bool) else at
    _assert_measured_again(tmp_path, small_calibration, monkeypatch, read_gbps=9.0, write_gbps=9.0, at=stamp)


def test_a_cached_figure_measured_at_a_huge_whole_number_is_measured_again(tmp_path, small_calibration, monkeypatch):
    """JSON reads 400 digits as a Python int: math.isfinite of it raised OverflowError out of disk_rate."""
    _assert_measured_again(tmp_path, small_calibration, monkeypatch, read_gbps=9.0, write_gbps=9.0, at=10**400)


def test_one_process_measures_at_a_time_and_the_others_take_its_figure(tmp_path, small_calibration, monkeypatch):
    """The ranks of a job on one machine: measured at once, each would see a share of the disk."""
    calls = []

    def slow(folder, io):
        calls.append(folder)
        time.sleep(0.3)
        return DiskRate(2.0, 1.0, "measured now", provenance={**calibration._identity(folder, io),
                        "measured_at": time.time()})  # fmt: skip

    monkeypatch.setattr(calibration, "calibrate", slow)
    got = []
    threads = [threading.Thread(target=lambda: got.append(disk_rate(str(tmp_path), None))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1 and sorted(r.earlier for r in got) == [False, True, True]
    # A holder that never lets go delays the measurement by LOCK_WAIT_S, no more.
    monkeypatch.setattr(calibration, "LOCK_WAIT_S", 0.2)
    fd = os.open(str(small_calibration) + ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert disk_rate(str(tmp_path), IOConfig(threads=5)).read_gbps == 2.0 and len(calls) == 2
    finally:
        os.close(fd)


def test_a_tune_files_figure_is_not_the_floor(tmp_path, small_calibration, monkeypatch):
    """tiered-bench tune's figures come from its sweep, another method under another load: the optimizer measures
    at the tuned IOConfig itself."""
    tune = tmp_path / "tiered-io.json"
    measured = {"read_gbps": 6.5, "write_gbps": 4.25, "dir": str(tmp_path)}
    tune.write_text(json.dumps({"threads": 8, "_measured": measured}))
    monkeypatch.setenv("TIERED_IO_CONFIG", str(tune))
    monkeypatch.setattr(calibration, "calibrate", lambda folder, io: DiskRate(io.threads, 1.0, "measured now"))
    got = disk_rate(str(tmp_path), None)
    assert (got.read_gbps, got.write_gbps) == (8, 1.0)


def test_the_calibration_is_bounded_in_time(tmp_path, small_calibration, monkeypatch):
    """A slow disk gets a smaller file, not a longer wait: the first write stops after LAYOUT_S, and a second pass
    runs only within BUDGET_S."""
    monkeypatch.setattr(calibration, "LAYOUT_S", 0.0)
    monkeypatch.setattr(calibration, "BUDGET_S", 0.0)
    rate = calibration.calibrate(str(tmp_path), IOConfig(threads=4))
    assert rate is not None and rate.provenance["bytes"] == rate.provenance["request_bytes"] == 16 << 20
    assert rate.provenance["passes"] == 1 and rate.provenance["in_flight"] == min(calibration.IN_FLIGHT, 4)
    assert not (tmp_path / telemetry.CALIBRATE_NAME).exists()


def test_an_ioconfig_asking_more_buffers_than_the_file_holds_is_measured_with_the_files_requests(
    tmp_path, small_calibration, monkeypatch, caplog
):
    """threads x block_size asks for more requests in flight than the file holds (1024 x 64 MiB asked 64 GiB of
    buffers, and the ENOMEM broke the optimizer's constructor): the calibration keeps no more in flight than the
    file's requests, and buffers it cannot have leave the floor unknown, the optimizer whole."""
    asked = []

    def little_memory(nbytes, alignment=4096):  # a machine with 256 MiB to spare
        asked.append(nbytes)
        if nbytes > 256 << 20:
            raise OSError(12, "Cannot allocate memory")
        return real(nbytes, alignment)

    real = calibration.aligned_empty
    monkeypatch.setattr(calibration, "aligned_empty", little_memory)
    rate = calibration.calibrate(str(tmp_path), IOConfig(threads=64, block_size=64 << 20))
    assert rate is not None and rate.provenance["in_flight"] == 4 and asked == [64 << 20]  # 64 MiB in 16 MiB requests

    def no_memory(nbytes, alignment=4096):
        raise MemoryError

    monkeypatch.setattr(calibration, "aligned_empty", no_memory)
    with caplog.at_level(logging.INFO, logger="tiered"):
        assert calibration.calibrate(str(tmp_path), IOConfig()) is None
    assert "could not be measured" in caplog.text and "64.00 MiB of buffers" in caplog.text
    assert not (tmp_path / telemetry.CALIBRATE_NAME).exists()


def test_the_summary_names_the_floors_rates_and_where_they_came_from(tmp_path):
    ph = phases(step_s=4.0, read_wait_s=3.0, nvme_read_bytes=2e9, nvme_write_bytes=1e9)
    prov = {"bytes": 1 << 30, "request_bytes": 64 << 20, "in_flight": 8, "io": IOConfig().to_dict(), "direct": True}
    fresh = report(ph, DiskRate(2.0, 1.0, "measured now in /x", provenance=prov), "host", "cpu")
    assert fresh["disk_rate"]["provenance"] == prov
    assert summary_line(3, ph, fresh).startswith(
        "step 3: 4.000 s, 2.00x the disk floor (read 2.00, write 1.00 GB/s; calibrated now: 1.00 GiB, "
        "64.00 MiB requests x 8, 32 threads x 1.00 MiB), disk-bound"
    )
    cached = report(ph, DiskRate(2.0, 1.0, "cached in /c/disk_rates.json, measured 2 h ago in this boot", True, prov),
                    "host", "cpu")  # fmt: skip
    assert "(read 2.00, write 1.00 GB/s; cached in /c/disk_rates.json, measured 2 h ago in this boot: 1.00 GiB" in (
        summary_line(3, ph, cached)
    )
    assert "x the disk floor" not in summary_line(3, ph, cached, floor=False)  # for a report with its own


def test_a_full_disk_leaves_the_floor_unknown_and_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TIERED_IO_CONFIG", raising=False)
    with small_tmpfs("1m") as full:
        assert disk_rate(full, None) is None
        assert os.listdir(full) == []
    with small_tmpfs("200m") as almost:  # room for the file, not for its whole pass: ENOSPC on the way
        monkeypatch.setattr(calibration, "MIN_BYTES", 1 << 20)
        monkeypatch.setattr(calibration, "CALIBRATE_BYTES", 1 << 30)
        monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(8 << 30, 0, 8 << 30))
        assert calibration.calibrate(almost, IOConfig(threads=2)) is None
        assert os.listdir(almost) == []


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))


def train(model: nn.Module, opt: TieredOptimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_a_steps_nvme_writes_are_its_streamed_chunks_every_step(tmp_path):
    # Each step writes back every chunk it streams, once. Counted as they landed, a step's last write-backs (still
    # in flight when step() returns) fell into the next step: 41.7 or 44.9 MB a step for 48.0 (tiered-bench optim),
    # and the disk floor and wear figures read it.
    model = mlp()
    with TieredOptimizer(model, tmp_path / "nvme", chunk_bytes="48KiB", host_budget="160KiB") as opt:
        written = []
        for _ in range(4):
            train(model, opt, 1)
            written.append(opt.stats()["last_step"]["nvme_write_bytes"])
        keys = opt.store.keys()
        streamed = sum(opt.store.info(k).nbytes for k in keys if not opt.store.is_resident(k))
    assert streamed > 0 and written == [streamed] * 4


def test_stats_and_summary_after_each_step(tmp_path, small_calibration, caplog):
    model = mlp()
    with caplog.at_level(logging.WARNING, logger="tiered"):
        with TieredOptimizer(model, tmp_path / "nvme", chunk_bytes="48KiB", host_budget="160KiB", tbw=1e-9,
                             run_steps=100) as opt:  # fmt: skip
            train(model, opt, 3)
            tele = opt.stats()["telemetry"]
            last = opt.stats()["last_step"]
            summary = opt.summary()
    assert tele["floor_s"] > 0 and tele["over_floor"] > 0 and tele["nvme_gbps"] > 0
    assert tele["bound"] in ("disk", "PCIe", "CPU") and tele["disk_rate"]["read_gbps"] > 0
    assert tele["disk_rate"]["provenance"]["method"] == calibration.METHOD and "calibrated now: 64.00 MiB" in summary
    assert tele["wear"]["bytes_written_per_step"] == last["nvme_write_bytes"] > 0
    assert summary.startswith("step 3:") and "x the disk floor" in summary and "per 1000 steps" in summary
    assert sum("rated" in r.getMessage() for r in caplog.records) == 1  # the wear warning, once


def test_an_update_on_the_device_of_cpu_parameters_is_cpu_bound(tmp_path):
    # update_on="device" updates where the parameters are; on the CPU it was labelled "GPU"-bound.
    model = mlp()
    with TieredOptimizer(model, tmp_path / "nvme", update_on="device", host_budget="64MiB") as opt:
        train(model, opt, 2)  # the whole state in memory, no PCIe: the update is most of the step
        tele, summary = opt.stats()["telemetry"], opt.summary()
    assert tele["bound"] == "CPU" and "CPU-bound" in summary and "GPU" not in summary


def test_a_state_that_fits_in_memory_measures_no_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_CACHE_DIR", str(tmp_path / "cache"))
    model = mlp()
    with TieredOptimizer(model, tmp_path / "nvme", host_budget="8MiB") as opt:
        train(model, opt, 2)
        tele = opt.stats()["telemetry"]
    assert tele["floor_s"] is None and tele["disk_rate"] is None and tele["wear"]["bytes_written_per_step"] == 0
    assert not (tmp_path / "cache").exists()
