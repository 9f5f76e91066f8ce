"""Benchmarks run at toy size in a subprocess, so that they cannot rot. Their figures are not checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, *args: str, cwd: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    p = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_store_bench_smoke(tmp_path):
    r = run_bench("store_bench.py", "--records", "3", "--record-size", "1MiB", "--loops", "1", "--depth", "1",
                  "--dir", str(tmp_path / "d"), cwd=tmp_path)  # fmt: skip
    assert {"raw_read_GBps", "store_read_GBps", "store_over_raw", "first_read_wait_s", "exposed_wait_s"} <= set(r)
    assert not any((tmp_path / "d").iterdir()), "the benchmark left files behind"


def test_moments_bench_smoke(tmp_path):
    r = run_bench("moments_bf16.py", "--steps", "3", "--dim", "32", "--layers", "1", "--seq", "16", "--batch", "2",
                  "--host-budget", "48KiB", "--chunk-bytes", "12KiB", cwd=tmp_path)  # fmt: skip
    assert len(r["fp32"]["losses"]) == len(r["bf16"]["losses"]) == 3
    assert r["summary"]["state_bytes_ratio"] == 0.6667
    assert r["fp32"]["nvme_write_bytes"] > 0  # the state streamed, so the byte ratio means something


def test_engine_overhead_bench_smoke(tmp_path):
    r = run_bench("engine_overhead.py", "--size", "8MiB", "--dir", str(tmp_path), cwd=tmp_path)
    assert [row["tasks"] for row in r["rows"]] == [8, 8, 1]


def test_depth_sweep_smoke(tmp_path):
    r = run_bench("depth_sweep.py", "--params", "300000", "--host-budget", "4MiB", "--chunk-bytes", "1MiB",
                  "--depths", "0,2", "--rounds", "1", "--steps", "1", "--dir", str(tmp_path), cwd=tmp_path)  # fmt: skip
    assert sorted(r["median_step_s_by_depth"]) == ["0", "2"]
    assert all(run["nvme_bytes"] > 0 for run in r["runs"])
