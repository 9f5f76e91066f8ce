"""`tiered-bench kv` (tiered/bench/kv.py) at toy size on the CPU: its JSON has the figures it promises, the
tiered run's tokens equal DynamicCache's, and the bytes a token moves follow the budgets."""

from __future__ import annotations

import argparse
import json

import pytest
from helpers import run_bounded

pytest.importorskip("transformers", minversion="5.0")
from tiered.bench import kv  # noqa: E402
from tiered.bench.common import UsageError  # noqa: E402


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    kv.add_arguments(p)
    return p.parse_args(list(argv))


def test_kv_bench_json(tmp_path, capsys):
    out = tmp_path / "kv.json"
    args = parse("--layers", "2", "--context", "40", "--new-tokens", "6", "--page-tokens", "8", "--gpu-budget", "0",
                 "--host-budget", "16KiB", "--disk-size", "1MiB", "--dir", str(tmp_path), "--json",
                 "--out", str(out))  # fmt: skip
    assert run_bounded(lambda: kv.run(args), 600) == 0
    res = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text())["runs"].keys() == res["runs"].keys()
    tiered, dynamic = res["runs"]["tiered"], res["runs"]["dynamic"]
    assert res["runs"]["offloaded"] == "needs CUDA"
    assert tiered["equal"] and dynamic["equal"]
    for row in (tiered, dynamic):
        assert row["prefill_s"] > 0 and row["decode_tokens_per_s"] > 0
    moved = tiered["bytes_per_token"]
    layer_kv = res["kv_bytes_per_token"] // res["layers"]
    assert moved["host_to_gpu"] >= 40 * res["kv_bytes_per_token"]  # every layer streams its whole context
    assert 0 < moved["gpu_to_host"] <= res["kv_bytes_per_token"] + layer_kv  # each new token written once
    assert moved["nvme_read"] > 0  # past the host budget
    assert tiered["resident_layers"] == 0
    assert tiered["floor_s_per_token"]["disk"] > 0 and tiered["floor_ratio"] > 0
    assert res["bandwidth"]["disk_read"] > 0 and res["bandwidth"]["h2d"] is None  # no PCIe on the CPU


def test_kv_bench_refuses_bad_arguments():
    with pytest.raises(UsageError, match="--caches"):
        kv.run(parse("--caches", "tiered,static"))
    with pytest.raises(UsageError, match="--new-tokens"):
        kv.run(parse("--new-tokens", "0"))


def test_tokens_are_compared_with_dynamic_caches_and_where_they_part_is_named():
    from tiered.bench.kv import _compare

    runs = {"tiered": {}, "dynamic": {}, "offloaded": {}}
    _compare(runs, {"tiered": [5, 6, 7, 8], "dynamic": [5, 6, 9, 8], "offloaded": [5, 6, 9, 8]})
    assert runs["dynamic"] == {"equal": True} and runs["offloaded"] == {"equal": True}
    assert runs["tiered"] == {"equal": False, "first_difference": 2}
    runs = {"tiered": {}, "offloaded": {}}
    _compare(runs, {"tiered": [1, 2], "offloaded": [1]})
    assert runs["offloaded"] == {"equal": False, "first_difference": 1}
