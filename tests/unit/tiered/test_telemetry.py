"""Step telemetry: the distance to the disk floor, the bound, SSD wear, and the disk's calibrated bandwidth."""

from __future__ import annotations

import json
import logging
import os
import platform
import time

import pytest
import torch
from helpers import small_tmpfs
from torch import nn

import tiered.telemetry as telemetry
from tiered import TieredOptimizer
from tiered.config import TierConfig
from tiered.optim.step_stats import PHASES
from tiered.telemetry import DiskRate, Wear, disk_rate, report, summary_line


def phases(**kw) -> dict:
    return {**dict.fromkeys(PHASES, 0.0), **kw}


def test_report_gives_the_floor_for_the_bytes_and_the_bound():
    rate = DiskRate(read_gbps=2.0, write_gbps=1.0, source="test")
    ph = phases(step_s=2.0, read_wait_s=1.2, update_s=0.5, nvme_read_bytes=2e9, nvme_write_bytes=1e9)
    r = report(ph, rate, "host")
    assert r["floor_s"] == pytest.approx(2.0)  # 2 GB at 2 GB/s + 1 GB at 1 GB/s
    assert r["over_floor"] == pytest.approx(1.0) and r["nvme_gbps"] == pytest.approx(1.5)
    assert r["bound"] == "disk" and r["disk_rate"]["source"] == "test"
    assert report(phases(step_s=1.0, update_s=0.6, read_wait_s=0.3), rate, "host")["bound"] == "CPU"
    assert report(phases(step_s=1.0, update_s=0.6, read_wait_s=0.3), rate, "device")["bound"] == "GPU"
    assert report(phases(step_s=1.0, grad_d2h_s=0.4, h2d_s=0.3, update_s=0.5), rate, "host")["bound"] == "PCIe"
    # No NVMe byte moved, or no calibration: no floor, and no ratio to one.
    assert report(phases(step_s=1.0, update_s=1.0), rate, "host")["floor_s"] is None
    assert report(ph, None, "host")["over_floor"] is None


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


def test_wear_knobs_are_checked():
    bad_knobs = (dict(tbw=0), dict(tbw="1"), dict(run_steps=0), dict(run_steps=1.5), dict(wear_share=0),
                 dict(wear_share=2))  # fmt: skip
    for bad in bad_knobs:
        with pytest.raises(ValueError):
            TierConfig(**bad)


def test_the_disk_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TIERED_IO_CONFIG", raising=False)
    first = disk_rate(str(tmp_path), None)
    assert first is not None and first.read_gbps > 0 and first.write_gbps > 0 and "now" in first.source
    assert not (tmp_path / telemetry.CALIBRATE_NAME).exists()
    cached = json.loads((tmp_path / "cache" / "disk_rates.json").read_text())
    key = f"{platform.node()}:dev-{os.stat(tmp_path).st_dev}"
    assert list(cached) == [key] and cached[key]["host"] == platform.node()
    assert abs(cached[key]["measured_at"] - time.time()) < 3600

    def no_second_measurement(*a):
        raise AssertionError("measured again")

    monkeypatch.setattr(telemetry, "_measure", no_second_measurement)
    again = disk_rate(str(tmp_path), None)
    assert (again.read_gbps, again.write_gbps) == (first.read_gbps, first.write_gbps)
    assert again.earlier and not first.earlier


def test_a_cached_rate_names_its_file_its_age_and_its_machine(tmp_path, monkeypatch):
    """A floor from a rate another run measured, under another load, says so: the cache file, how long ago,
    on which machine."""
    monkeypatch.setenv("TIERED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TIERED_IO_CONFIG", raising=False)
    cache = tmp_path / "cache" / "disk_rates.json"
    cache.parent.mkdir()
    entry = {"read_gbps": 2.0, "write_gbps": 1.0, "measured_at": time.time() - 7300, "host": platform.node()}
    cache.write_text(json.dumps({f"{platform.node()}:dev-{os.stat(tmp_path).st_dev}": entry}))
    rate = disk_rate(str(tmp_path), None)
    assert (rate.read_gbps, rate.write_gbps) == (2.0, 1.0) and rate.earlier
    assert str(cache) in rate.source and "2 h ago" in rate.source and platform.node() in rate.source
    ph = phases(step_s=4.0, read_wait_s=3.0, nvme_read_bytes=2e9, nvme_write_bytes=1e9)
    tele = report(ph, rate, "host")
    line = summary_line(3, ph, tele)
    assert "2.00x the disk floor (at the disk rate cached in " in line and str(cache) in line
    assert "x the disk floor" not in summary_line(3, ph, tele, floor=False)  # for a report with its own
    fresh = report(ph, DiskRate(2.0, 1.0, "measured now in /x"), "host")
    assert summary_line(3, ph, fresh).startswith("step 3: 4.000 s, 2.00x the disk floor, disk-bound")


def test_another_machines_cached_rate_is_not_used(tmp_path, monkeypatch):
    """A cache in a shared home folder: an entry for the same device number on another machine (or one that
    does not say its machine) is another disk, measured again."""
    monkeypatch.setenv("TIERED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TIERED_IO_CONFIG", raising=False)
    cache = tmp_path / "cache" / "disk_rates.json"
    cache.parent.mkdir()
    dev = os.stat(tmp_path).st_dev
    entry = {"read_gbps": 9.0, "write_gbps": 9.0, "date": "2020-01-01"}
    cache.write_text(json.dumps({f"dev-{dev}": entry, f"elsewhere-{platform.node()}:dev-{dev}": entry}))
    monkeypatch.setattr(telemetry, "_measure", lambda *a: DiskRate(1.5, 1.25, "measured now in here"))
    rate = disk_rate(str(tmp_path), None)
    assert (rate.read_gbps, rate.write_gbps) == (1.5, 1.25) and not rate.earlier


def test_a_tune_file_of_the_same_filesystem_is_used_and_another_ones_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_CACHE_DIR", str(tmp_path / "cache"))
    tune = tmp_path / "tiered-io.json"
    tune.write_text(json.dumps({"_measured": {"read_gbps": 6.5, "write_gbps": 4.25, "dir": str(tmp_path)}}))
    monkeypatch.setenv("TIERED_IO_CONFIG", str(tune))
    got = disk_rate(str(tmp_path), None)
    assert (got.read_gbps, got.write_gbps) == (6.5, 4.25) and "tune" in got.source and str(tune) in got.source
    assert got.earlier
    with small_tmpfs("64m") as other:  # another filesystem: the tune file says nothing about it
        monkeypatch.setattr(telemetry, "_measure", lambda *a: DiskRate(1.0, 1.0, "measured"))
        assert disk_rate(other, None).source == "measured"


def test_a_full_disk_leaves_the_floor_unknown_and_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TIERED_IO_CONFIG", raising=False)
    with small_tmpfs("1m") as full:
        assert disk_rate(full, None) is None
        assert os.listdir(full) == []


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))


def train(model: nn.Module, opt: TieredOptimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_stats_and_summary_after_each_step(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TIERED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TIERED_IO_CONFIG", raising=False)
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
    assert tele["wear"]["bytes_written_per_step"] == last["nvme_write_bytes"] > 0
    assert summary.startswith("step 3:") and "x the disk floor" in summary and "per 1000 steps" in summary
    assert sum("rated" in r.getMessage() for r in caplog.records) == 1  # the wear warning, once


def test_a_state_that_fits_in_memory_measures_no_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_CACHE_DIR", str(tmp_path / "cache"))
    model = mlp()
    with TieredOptimizer(model, tmp_path / "nvme", host_budget="8MiB") as opt:
        train(model, opt, 2)
        tele = opt.stats()["telemetry"]
    assert tele["floor_s"] is None and tele["disk_rate"] is None and tele["wear"]["bytes_written_per_step"] == 0
    assert not (tmp_path / "cache").exists()
