"""Benchmarks run at toy size in a subprocess, so that they cannot rot, and the pieces of tiered.bench that
they share, in process. Their figures are not checked."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from io_engine import IOConfig
from tiered.bench.common import emit_json
from tiered.bench.mixed import FLOOR_SWEEP, measure_floor, parse_configs, parse_shape
from tiered.bench.workload import build_llama, build_tiny

ROOT = Path(__file__).resolve().parents[2]  # the repository


def run_bench(script: str, *args: str, cwd: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    p = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = p.stdout.strip()
    last = out.splitlines()[-1]
    return json.loads(last if last.startswith("{") else out)  # its last JSON line, or one indented document


def test_store_bench_smoke(tmp_path):
    r = run_bench("store_bench.py", "--records", "3", "--record-size", "1MiB", "--loops", "1", "--depth", "1",
                  "--dir", str(tmp_path / "d"), cwd=tmp_path)  # fmt: skip
    assert {"raw_read_GBps", "store_read_GBps", "store_over_raw", "first_read_wait_s", "exposed_wait_s"} <= set(r)
    assert not any((tmp_path / "d").iterdir()), "the benchmark left files behind"


def test_compute_alone_smoke(tmp_path):
    r = run_bench("compute_alone.py", "--hidden", "64", "--layers", "6", "--heads", "4", "--inter", "128", "--seq",
                  "16", "--batch", "2", "--accumulate", "2", "--vocab", "256", "--fit-layers", "1,2", "--steps", "1",
                  "--device", "cpu", "--json", str(tmp_path / "c.json"), cwd=tmp_path)  # fmt: skip
    assert set(r["runs"]) == {"1", "2"} and all(len(x["step_s"]) == 1 for x in r["runs"].values())
    assert r["estimate_s"] == pytest.approx(r["intercept_s"] + 6 * r["per_layer_s"], abs=1e-3)
    assert json.loads((tmp_path / "c.json").read_text()) == r


def test_moments_bench_smoke(tmp_path):
    r = run_bench("moments_bf16.py", "--steps", "3", "--dim", "32", "--layers", "1", "--seq", "16", "--batch", "2",
                  "--host-budget", "48KiB", "--chunk-bytes", "12KiB", cwd=tmp_path)  # fmt: skip
    assert len(r["fp32"]["losses"]) == len(r["bf16"]["losses"]) == 3
    assert r["summary"]["state_bytes_ratio"] == 0.6667
    assert r["fp32"]["nvme_write_bytes"] > 0  # the state streamed, so the byte ratio means something


def test_moments_study_smoke(tmp_path):
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=path)  # the study writes its JSON into $OUT
    args = ["--steps", "2", "--eval-every", "1", "--val-batches", "1", "--dim", "32", "--layers", "1", "--seq", "16",
            "--batch", "2", "--corpus-bytes", "200000", "--seeds", "0", "--options", "fp32,bf16,int8"]  # fmt: skip
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "moments_study.py"), *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "moments_study.json").read_text())
    assert [r["option"] for r in doc["runs"]] == ["fp32", "bf16", "int8"]
    assert all(len(r["curve"]) == 2 for r in doc["runs"])
    state = {o: s["state_bytes"] for o, s in doc["summary"].items()}
    assert state["int8"] < state["bf16"] < state["fp32"]


def test_engine_overhead_bench_smoke(tmp_path):
    r = run_bench("engine_overhead.py", "--size", "8MiB", "--dir", str(tmp_path), cwd=tmp_path)
    assert [row["tasks"] for row in r["rows"]] == [8, 8, 1]


def test_depth_sweep_smoke(tmp_path):
    # 7.2 MB of state, 4 MiB of host budget: part of it streams at either depth (the rest stays resident).
    r = run_bench("depth_sweep.py", "--params", "600000", "--host-budget", "4MiB", "--chunk-bytes", "1MiB",
                  "--depths", "0,2", "--rounds", "1", "--steps", "1", "--dir", str(tmp_path), cwd=tmp_path)  # fmt: skip
    assert sorted(r["median_step_s_by_depth"]) == ["0", "2"]
    assert all(run["nvme_bytes"] > 0 for run in r["runs"])


def test_disk_mixed_smoke(tmp_path):
    r = run_bench("disk_mixed.py", "--dir", str(tmp_path / "d"), "--size", "8MiB", "--configs", "2x1MiB,4x1MiB",
                  cwd=tmp_path)  # fmt: skip
    assert [(row["threads"], row["block_MiB"]) for row in r["rows"]] == [(2, 1), (4, 1)]
    assert r["best_read"] > 0 and r["best_write"] > 0 and all(row["mixed_s"] > 0 for row in r["rows"])
    assert not (tmp_path / "d").exists(), "the benchmark left files behind"


def test_gil_busy_smoke(tmp_path):
    r = run_bench("gil_busy.py", "--dir", str(tmp_path / "d"), "--size", "4MiB", "--shapes", "2x1MiB,4x1MiB",
                  "--rounds", "2", cwd=tmp_path)  # fmt: skip
    assert set(r["shapes"]) == {"2x1MiB", "4x1MiB"}
    row = r["shapes"]["2x1MiB"]
    assert [len(row["passes"][k]) for k in ("idle", "native", "python")] == [2, 2, 2]  # each load, each round
    assert {"python_over_idle_read", "native_over_idle_write"} <= set(row)
    assert not (tmp_path / "d").exists(), "the benchmark left files behind"


def test_disk_probe_smoke(tmp_path):
    out = tmp_path / "o" / "probe.json"
    run_bench("disk_probe.py", "--dir", str(tmp_path / "d"), "--out", str(out), "--size", "8MiB", "--chunk",
              "1MiB", "--budget", "60", "--no-libaio", "--calib-bytes", "16MiB", cwd=tmp_path)  # fmt: skip
    doc = json.loads(out.read_text())
    phases = {r["phase"] for r in doc["rows"]}
    assert {"engine", "state", "step", "mixed", "calib", "grid", "drift"} <= phases, (phases, doc["notes"])
    assert not [n for n in doc["notes"] if "stopped" in n], doc["notes"]
    kinds = {r.get("file") for r in doc["rows"] if r["phase"] == "state" and r["op"] == "write"}
    assert kinds == {"fresh", "fallocated", "overwrite"}
    assert not (tmp_path / "d").exists(), "the probe left files behind"


def test_disk_compare_smoke(tmp_path):
    """The final disk call's script at toy sizes without DeepSpeed: tiered-bench io, the calibration."""
    out = tmp_path / "o" / "cmp.json"
    tiny = "--size 8MiB --block-sizes 1MiB --threads 2 --warmup 0 --loops 1 -q"
    s = run_bench("disk_compare.py", "--dir", str(tmp_path / "d"), "--out", str(out), "--no-libaio", "--size", "16MiB",
                  "--calib-bytes", "16MiB", "--budget", "60", "--io-extra", tiny, cwd=tmp_path)  # fmt: skip
    assert {"io_default_read", "io_default_write", "calib_read", "calib_write"} <= set(s)
    doc = json.loads(out.read_text())
    assert [r["phase"] for r in doc["rows"]] == ["io", "calib", "calib"], doc["skipped"]
    assert doc["skipped"] == [] and not (tmp_path / "d").exists()


def test_checkpoint_bench_smoke(tmp_path):
    r = run_bench("checkpoint_bench.py", "--params", "300000", "--loops", "1", "--dir", str(tmp_path / "d"),
                  cwd=tmp_path)  # fmt: skip
    assert r["state_bytes"] == 12 * 300_000  # fp32 parameters: the optimizer's count, 12 bytes each
    assert r["results"]["save"]["median"] > 0 and r["ratios"]["load_over_raw_read"] > 0
    assert not (tmp_path / "d").exists(), "the benchmark left files behind"


def test_contention_smoke(tmp_path):
    r = run_bench("contention.py", "--numel", "4096", "--busy", "0,1", "--threads", "1", cwd=tmp_path)
    assert [(row["busy_checksum_threads"], row["torch_threads"]) for row in r["rows"]] == [(0, 1), (1, 1)]


def test_llama_ab_smoke(tmp_path):
    pytest.importorskip("transformers")
    toy = "--device cpu --layers 1 --hidden 128 --seq 32 --batch 2 --vocab 512 --steps 2".split()
    variants = "default;verify=0,chunk_bytes=256KiB,switch=0.001"
    r = run_bench("llama_ab.py", *toy, "--host-budget", "4MiB", "--variants", variants, "--nvme", str(tmp_path / "ab"),
                  cwd=tmp_path)  # fmt: skip
    assert sorted(r["summary"]) == variants.split(";")
    assert r["args"]["inter"] == 5504 * 128 // 2048 and all(len(run["step_s"]) == 2 for run in r["runs"])
    assert not (tmp_path / "ab").exists() or not any((tmp_path / "ab").iterdir())


# ------------------------------------------------------------------------------ the shared pieces
def test_floor_measures_the_disk(tmp_path):
    """bench/llama_step.py's disk floor at toy size: one row per config until the budget, files cleaned up."""
    cfg = IOConfig(threads=4, block_size="1MiB")
    floor = measure_floor(str(tmp_path / "nvme"), cfg, 8 << 20, budget_s=30, log=lambda msg: None)
    assert floor["rows"][0]["threads"] == 4 and floor["rows"][0]["block_MiB"] == 1
    assert 1 <= len(floor["rows"]) <= 1 + len(FLOOR_SWEEP)
    # Each row also times both directions at once, against the two taken in turn.
    assert all(r["mixed_s"] > 0 and r["turns_s"] > r["overlap_s"] > 0 for r in floor["rows"])
    assert floor["read_GBps"] == max(r["read_GBps"] for r in floor["rows"]) > 0
    assert floor["write_GBps"] == max(r["write_GBps"] for r in floor["rows"]) > 0
    assert not (tmp_path / "nvme").exists() or not any((tmp_path / "nvme").iterdir())


def test_a_shape_names_its_submission():
    """disk_compare's --shapes and llama_ab's io= knob: [aio:]threads x block."""
    assert parse_shape("64x1MiB") == ("threads", 64, 1 << 20)
    assert parse_shape("aio:32x8MiB") == ("aio", 32, 8 << 20)
    for bad in ("libaio:32x1MiB", "x1MiB", "32x1QiB"):
        with pytest.raises(ValueError):
            parse_shape(bad)
    with pytest.raises(ValueError, match="threads x block"):
        parse_configs("aio:32x1MiB")  # disk_mixed measures threaded shapes only


def test_parse_configs_reads_threads_by_block():
    assert parse_configs("16x8MiB, 32x512KiB") == [(16, 8 << 20), (32, 512 << 10)]
    with pytest.raises(ValueError, match="32x1MiB"):
        parse_configs("16")


def test_emit_json_writes_the_record_under_out_and_prints_the_last(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    emit_json({"a": 1 / 3, "b": [2.123456], "c": "x"}, "rec", final=False)
    assert capsys.readouterr().out == ""
    assert json.loads((tmp_path / "rec.json").read_text()) == {"a": 0.3333, "b": [2.1235], "c": "x"}
    emit_json({"a": 1.0}, "rec", final=True)
    assert json.loads(capsys.readouterr().out) == json.loads((tmp_path / "rec.json").read_text()) == {"a": 1.0}


def test_tiny_workload_is_seeded_and_trains():
    a, b = build_tiny(dim=32, layers=1, seq=16, batch=2), build_tiny(dim=32, layers=1, seq=16, batch=2)
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))
    loss = a.loss()
    loss.backward()
    assert loss.ndim == 0 and a.params == sum(p.numel() for p in a.model.parameters())
    with pytest.raises(ValueError, match="shorter than one window"):
        build_tiny(seq=16, corpus=b"too short")


def test_llama_workload_defaults_to_the_reference_shape():
    pytest.importorskip("transformers")
    w = build_llama("cpu", layers=1, hidden=128, vocab=512, seq=32, batch=2)
    cfg = w.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads) == (1, 128, 344, 1)
    assert next(w.model.parameters()).dtype == torch.bfloat16
    assert w.loss().ndim == 0
    defaults = {k: v.default for k, v in inspect.signature(build_llama).parameters.items()}
    assert {k: defaults[k] for k in ("layers", "hidden", "vocab", "seq", "batch")} == dict(
        layers=16, hidden=2048, vocab=32000, seq=1024, batch=8
    )


def test_llama_ab_names_the_engine_s_submission():
    """`io=aio:32x1MiB` is IOConfig(submit="aio", threads=32, block_size=1 MiB): the step's A/B of the two."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("llama_ab_under_test", ROOT / "bench" / "llama_ab.py")
    assert spec is not None and spec.loader is not None
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    knobs, _ = ab.parse_variant("io=aio:32x1MiB", "2GiB")
    assert knobs["io"] == IOConfig(submit="aio", threads=32, block_size="1MiB")
    knobs, _ = ab.parse_variant("io=16x8MiB", "2GiB")
    assert knobs["io"] == IOConfig(threads=16, block_size="8MiB")
    knobs, _ = ab.parse_variant("switch=0.0005,io=16x8MiB", "2GiB")
    assert knobs["switch"] == 0.0005 and knobs["io"] == IOConfig(threads=16, block_size="8MiB")
    with pytest.raises(SystemExit, match="switch must be"):
        ab.parse_variant("switch=0", "2GiB")


def test_step_timeline_counts_any_kernel_once_and_the_gpu_after_backward(tmp_path):
    """bench/step_timeline.py on a made-up trace: a 10 ms step, backward's kernels on stream 7 (0-4 ms, 3-6 ms)
    with a 2 GB copy of its own (4-4.5 ms), the optimizer from 5 ms, an update's kernel on stream 9 (5-8 ms) and a
    copy (6-9 ms): kernels busy 8 ms (the union: 0-8), copies 3.5, each copy counted on its side of the
    optimizer's start, and after backward's last compute kernel (6 ms) the GPU ran 3 ms of the 4 left."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from step_timeline import timeline, union_ms
    finally:
        sys.path.remove(str(ROOT / "bench"))

    def x(name: str, cat: str, start_ms: float, end_ms: float, stream: int | None = None) -> dict:
        e = {"ph": "X", "name": name, "cat": cat, "ts": 1000 * start_ms, "dur": 1000 * (end_ms - start_ms)}
        return {**e, "args": {"stream": stream}} if stream is not None else e

    events = [x("step", "user_annotation", 0, 10), x("backward", "user_annotation", 0, 3),
              x("opt.step", "user_annotation", 5, 10), x("Memcpy DtoH", "gpu_memcpy", 4, 4.5, 7),
              x("gemm", "kernel", 0, 4, 7), x("gemm", "kernel", 3, 6, 7), x("adamw", "kernel", 5, 8, 9),
              x("Memcpy HtoD", "gpu_memcpy", 6, 9, 11)]  # fmt: skip
    events[3]["args"]["bytes"] = 2e9
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = timeline(str(path), "step")
    assert out["step_ms"] == 10 and out["backward"]["busy_ms"] == 3
    assert out["kernels_busy_ms"] == 8 and out["copies_busy_ms"] == 3.5
    before = {"Memcpy DtoH": {"n": 1, "busy_ms": 0.5, "gb": 2.0}}
    after = {"Memcpy HtoD": {"n": 1, "busy_ms": 3.0, "gb": 0.0}}
    assert out["copies"] == {"before_opt": {"stream 7": before}, "after_opt": {"stream 11": after}}
    # Until the optimizer's start (5 ms) kernels ran 0-5; the compute stream too (its copy lies under a kernel).
    assert out["until_opt_ms"] == {"wall": 5, "kernels": 5, "compute_stream": 5}
    assert out["compute_stream"] == "stream 7 kernel" and out["backward_gpu_end_ms"] == 6
    assert out["gpu_after_backward_ms"] == {"wall": 4, "busy": 3}
    assert union_ms([]) == 0 and union_ms([(0, 1000), (500, 1500), (2000, 2500)]) == 2
