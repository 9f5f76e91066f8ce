"""`tiered-bench kv` (tiered/bench/kv.py) at toy size on the CPU: its JSON has the figures it promises, TieredCache's
logits (prefetching and its serial twin) equal DynamicCache's bit for bit, the bytes a token moves follow the
budgets, and the whole target suite runs through in one process (so that it cannot fail for a silly reason on the
GPU machine)."""

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
    args = parse("--layers", "2", "--context", "40", "--new-tokens", "6", "--page-tokens", "8",
                 "--host-budget", "16KiB", "--caches", "tiered,dynamic,serial,offloaded", "--disk-size", "1MiB",
                 "--dir", str(tmp_path), "--json", "--out", str(out))  # fmt: skip
    assert run_bounded(lambda: kv.run(args), 600) == 0
    res = json.loads(capsys.readouterr().out)
    runs = res["runs"]
    assert json.loads(out.read_text())["runs"].keys() == runs.keys()
    assert runs["offloaded"] == "needs CUDA"
    for name in ("tiered", "serial"):
        row = runs[name]
        assert row["tokens_equal"] and row["logits_equal"] and row["max_abs_logit_diff"] == 0
        assert row["prefill_s"] > 0 and row["decode_tokens_per_s"] > 0
        moved = row["bytes_per_token"]
        layer_kv = res["kv_bytes_per_token"] // res["layers"]
        # every layer streams its full pages (40..45 tokens: 5 pages of 8), the tails stay on the device; the
        # prefetching run's first pass copies some pages from the device, where their writes were still in flight
        full = 5 * 8 * res["kv_bytes_per_token"]
        assert moved["host_to_gpu"] == full if name == "serial" else 0.75 * full <= moved["host_to_gpu"] <= full
        assert moved["page_copies"] == 5 * res["layers"]
        assert moved["gpu_to_host"] <= 8 * layer_kv  # a page a layer filled now and then, never a token
        assert moved["nvme_read"] > 0  # past the host budget
        assert row["resident_layers"] == 0
        assert row["floor_s_per_token"]["disk"] > 0 and row["floor_ratio"] > 0
    assert runs["tiered"]["loads"]["waited"] == 0  # every decode pass's loads were issued ahead
    assert runs["serial"]["loads"]["prefetched"] == 0  # the serial twin loads each layer when it is needed
    assert res["bandwidth"]["disk_read"] > 0 and res["bandwidth"]["h2d"] is None  # no PCIe on the CPU


def test_kv_bench_suite_runs_every_target_step(tmp_path):
    out = tmp_path / "suite.json"
    args = parse("--suite", "targets", "--layers", "1", "--context", "24", "--new-tokens", "3", "--long-context", "40",
                 "--long-new-tokens", "2", "--nvme-host-budget", "8KiB", "--nvme-new-tokens", "3", "--page-tokens",
                 "8", "--prefill-chunk", "16", "--preempt-requests", "3", "--preempt-running", "1",
                 "--preempt-prompt", "10", "--preempt-new-tokens", "4", "--disk-size", "1MiB", "--dir", str(tmp_path),
                 "--out", str(out))  # fmt: skip
    assert run_bounded(lambda: kv.run(args), 600) == 0
    suite = json.loads(out.read_text())["suite"]
    assert set(suite) == {"compare", "long", "nvme", "preempt"}
    for name in ("dynamic_again", "tiered", "serial"):
        assert suite["compare"][name]["logits_equal"], name
    assert suite["nvme"]["tiered"]["tokens_equal"] and suite["nvme"]["tiered"]["bytes_per_token"]["nvme_read"] > 0
    assert suite["long"]["dynamic_oom"] is False  # no GPU cap here: nothing runs out
    assert suite["compare"]["reference_spread"]["logits_equal"]  # the CPU's kernels repeat themselves
    assert suite["compare"]["tiered"]["verdict"] == suite["nvme"]["tiered"]["verdict"] == "bitwise"
    pre = suite["preempt"]
    assert pre["swap"]["equal"] and pre["recompute"]["equal"]
    assert pre["alone_again"]["logits_equal"] and pre["swap"]["logits_equal"] and pre["swap"]["verdict"] == "bitwise"
    assert pre["swap"]["swaps"]["in_s"] > 0 and pre["swap"]["swaps"]["crc_s"] > 0
    assert pre["swap"]["preemptions"] >= 3 and pre["swap"]["swaps"]["out"] == pre["swap"]["preemptions"]
    assert pre["recompute"]["recomputed_tokens"] > 0 and pre["swap"]["recomputed_tokens"] == 0


def test_kv_bench_creates_a_missing_dir_and_removes_it_after(tmp_path, capsys):
    # as every tiered-bench command's --dir: made if missing (the NVMe tier's pages land in it), removed after
    new = tmp_path / "new" / "nvme"
    args = parse("--layers", "1", "--context", "16", "--new-tokens", "2", "--page-tokens", "8", "--host-budget",
                 "8KiB", "--caches", "dynamic,tiered", "--disk-size", "1MiB", "--dir", str(new), "--json")  # fmt: skip
    assert run_bounded(lambda: kv.run(args), 600) == 0
    tiered_run = json.loads(capsys.readouterr().out)["runs"]["tiered"]
    # Not whether pages crossed to NVMe: in a run this small that depends on the machine's load (two CI runs side
    # by side moved none); the suite's NVMe run above asserts the traffic
    assert tiered_run["tokens_equal"]
    assert list(tmp_path.iterdir()) == []
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(UsageError, match=f"--dir {blocker / 'sub'}"):  # names the flag, not a random subfolder
        kv.run(parse("--layers", "1", "--caches", "dynamic", "--dir", str(blocker / "sub")))


def test_kv_bench_refuses_bad_arguments(tmp_path, capsys):
    with pytest.raises(UsageError, match="--caches"):
        kv.run(parse("--caches", "tiered,static"))
    with pytest.raises(UsageError, match="--new-tokens"):
        kv.run(parse("--new-tokens", "0"))
    with pytest.raises(UsageError, match="--prefetch"):
        kv.run(parse("--prefetch", "-1"))
    with pytest.raises(UsageError, match="--host-budget 64KiB, --page-tokens 256: .*cannot hold one page"):
        kv.run(parse("--host-budget", "64KiB", "--caches", "tiered"))  # before any generation
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(UsageError, match="--out .*does not exist or is not writable"):  # before the model is built
        kv.run(parse("--caches", "dynamic", "--out", str(blocker / "result.json")))
    for layers in ("0", "-3"):  # 0 ran the shape's own count without a word, -3 ended in a traceback
        with pytest.raises(SystemExit) as exit_:
            parse("--layers", layers)
        assert exit_.value.code == 2
    assert "expected an integer >= 1, got '0'" in capsys.readouterr().err


@pytest.mark.parametrize("entry", ["tiered-bench", "python -m tiered.bench.kv"])
def test_kv_bench_with_a_bad_io_config_file_says_so_in_one_line_before_the_model(tmp_path, monkeypatch, capsys, entry):
    """The disk measurement and TieredCache read $TIERED_IO_CONFIG: a file that is not a valid IOConfig was a
    traceback from inside the run (after the model was built); now one line naming it, exit code 1, from either
    entry (the module's was still a traceback)."""
    from tiered import cli

    bad = tmp_path / "io.json"
    bad.write_text('{"threads": 0}')
    monkeypatch.setenv("TIERED_IO_CONFIG", str(bad))

    def no_model(*a, **kw):
        raise AssertionError("the model was built before the configuration was checked")

    monkeypatch.setattr(kv, "build_model", no_model)
    args = ["--layers", "1", "--context", "16", "--new-tokens", "2", "--caches", "dynamic,tiered", "--device", "cpu",
            "--dir", str(tmp_path / "d")]  # fmt: skip
    code = cli.main(["kv", *args]) if entry == "tiered-bench" else kv.main(args)
    assert code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "$TIERED_IO_CONFIG" in err and str(bad) in err and "threads must be an int >= 1, got 0" in err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("--disk-size", "-1", "error: cannot parse --disk-size '-1'"),
        ("--gpu-budget", "lots", "error: cannot parse --gpu-budget 'lots'"),
        ("--nvme-host-budget", "two", "error: cannot parse --nvme-host-budget 'two'"),
        ("--host-budget", "x", "error: cannot parse --host-budget 'x'"),
        ("--memory-cap", "big", "error: cannot parse --memory-cap 'big'"),
        ("--device", "tpu", "error: --device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
        ("--device", "cuda:x", "error: --device must be auto, cpu, cuda or cuda:N, got 'cuda:x'"),
        ("--device", "cuda", "error: --device cuda: CUDA is not available here; use --device cpu or auto"),
        ("--device", "cuda:0", "error: --device cuda:0: CUDA is not available here; use --device cpu or auto"),
    ],
)
def test_kv_bench_answers_a_bad_size_or_device_with_exit_2(tmp_path, monkeypatch, capsys, flag, value, words):
    """As every tiered-bench command: a malformed size or a device this machine lacks is a usage error (one
    line, exit 2, before the model is built), not a traceback with exit 1 once the work began."""
    import torch

    from tiered import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # --device cuda on a machine without it

    try:  # in the main thread: cli.main sets a SIGTERM handler; refused, nothing runs that could hang
        code = cli.main(["kv", "--layers", "1", "--context", "16", "--new-tokens", "2", "--caches", "dynamic",
                         "--disk-size", "0", "--dir", str(tmp_path / "d"), flag, value])  # fmt: skip
    except SystemExit as e:  # argparse's own usage error
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("value", ["5000", "1", "4095", "1048575"])
def test_kv_bench_refuses_a_disk_size_below_1_mib_before_the_model(tmp_path, monkeypatch, capsys, value):
    """The disk measurement's file, as `tiered-bench io --size`'s: 5000 bytes hung for ever in the buffer pool, 1
    and 4095 ended in a traceback after the model was built; now the usage error io gives, exit 2."""
    from tiered import cli

    def no_model(*a, **kw):
        raise AssertionError("the model was built before --disk-size was checked")

    monkeypatch.setattr(kv, "build_model", no_model)
    try:  # in the main thread: cli.main sets a SIGTERM handler
        code = cli.main(["kv", "--layers", "1", "--context", "16", "--new-tokens", "2", "--caches", "dynamic",
                         "--device", "cpu", "--dir", str(tmp_path / "d"), "--disk-size", value])  # fmt: skip
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "--disk-size must be at least 1 MiB" in err and "Traceback" not in err, err
    assert not (tmp_path / "d").exists()


def test_kv_bench_refuses_a_disk_size_its_folder_has_no_room_for_before_the_model(tmp_path, monkeypatch, capsys):
    """A --disk-size larger than --dir's free space ended in "OSError: No space left on device" after the model was
    built (exit 1); now the usage error io and tour give for their --size, naming the free space, exit 2."""
    from tiered import cli

    def no_model(*a, **kw):
        raise AssertionError("the model was built before the disk's room was checked")

    monkeypatch.setattr(kv, "build_model", no_model)
    try:
        code = cli.main(["kv", "--layers", "1", "--context", "16", "--new-tokens", "2", "--caches", "dynamic",
                         "--device", "cpu", "--dir", str(tmp_path / "d"), "--disk-size", "1000000TiB"])  # fmt: skip
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "free; this run needs" in err and "a smaller --disk-size" in err, err
    assert "Traceback" not in err and not (tmp_path / "d").exists()


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "soon"])
def test_kv_bench_refuses_a_time_limit_that_is_no_number_of_seconds(value, capsys):
    """--time-limit -1 and 0 ran the suite with every step skipped, nan ignored the limit without a word and inf
    asked for no limit the flag does not offer: each is now argparse's usage error, as --budget's."""
    with pytest.raises(SystemExit) as exit_:
        parse("--suite", "targets", "--time-limit", value)
    assert exit_.value.code == 2
    assert f"argument --time-limit: expected a finite number of seconds > 0, got {value!r}" in capsys.readouterr().err
    assert parse("--time-limit", "0.5").time_limit == 0.5


def test_kv_bench_measures_the_disk_on_whole_pages(monkeypatch):
    """A --disk-size past 1 MiB that is no whole number of 4 KiB pages is rounded down, as io's --size: 1048577
    bytes ended in "must be divisible by 8 to view Byte as Long"; 0 still skips the measurement."""
    seen = []

    def measure(args, caches, disk_size):
        seen.append(disk_size)
        raise KeyboardInterrupt  # stop here: the size is what this test is about

    monkeypatch.setattr(kv, "measure", measure)
    for value in ("1048577", "3MiB", "0"):
        with pytest.raises(KeyboardInterrupt):
            kv.run(parse("--caches", "dynamic", "--device", "cpu", "--disk-size", value))
    assert seen == [1 << 20, 3 << 20, 0]


def test_kv_bench_takes_a_gpu_by_index(monkeypatch, capsys):
    """--device cuda:N picks GPU N of a machine with several, as it did before the device was checked (the check
    refused it as an invalid choice); an index past the GPUs there is one line, exit 2."""
    import torch

    from tiered import cli
    from tiered.bench.common import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device("cuda:1")
    check_device("cuda:0")
    code = cli.main(["kv", "--layers", "1", "--context", "16", "--device", "cuda:2"])
    assert code == 2
    assert "error: --device cuda:2: this machine has 2 CUDA devices" in capsys.readouterr().err
    assert "cuda:N" in cli.build_parser()._subparsers._group_actions[0].choices["kv"].format_help()


def test_kv_bench_out_with_a_tilde_writes_to_the_home_folder(tmp_path, monkeypatch, capsys):
    """--out=~/kv.json (the shell leaves a tilde after '=' alone): the early check expanded it and passed, but the
    run then opened the literal '~/kv.json', and failed with FileNotFoundError after the whole measurement."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    args = parse("--layers", "1", "--context", "16", "--new-tokens", "2", "--page-tokens", "8", "--caches", "tiered",
                 "--disk-size", "1MiB", "--dir", str(tmp_path / "d"), "--json", "--out=~/kv.json")  # fmt: skip
    assert run_bounded(lambda: kv.run(args), 600) == 0
    res = json.loads(capsys.readouterr().out)
    assert json.loads((home / "kv.json").read_text())["runs"].keys() == res["runs"].keys()
    assert list(cwd.iterdir()) == []  # no folder named '~'


def test_kv_bench_exact_suite_is_deterministic_and_restores_settings(tmp_path):
    import torch

    out = tmp_path / "exact.json"
    args = parse("--suite", "exact", "--layers", "1", "--context", "20", "--new-tokens", "3", "--nvme-host-budget",
                 "8KiB", "--nvme-new-tokens", "2", "--page-tokens", "8", "--prefill-chunk", "16", "--preempt-requests",
                 "2", "--preempt-running", "1", "--preempt-prompt", "10", "--preempt-new-tokens", "3", "--disk-size",
                 "0", "--dir", str(tmp_path), "--out", str(out))  # fmt: skip
    assert run_bounded(lambda: kv.run(args), 600) == 0
    res = json.loads(out.read_text())
    assert set(res["suite"]) == {"compare", "nvme", "preempt"}  # no long step: DynamicCache cannot be compared there
    assert res["exactness"]["sdpa"] == "math" and res["exactness"]["deterministic"]["deterministic_algorithms"]
    assert res["exactness"]["environment"]["deterministic_algorithms"] is True
    assert "offloaded" not in res["suite"]["compare"]
    assert not torch.are_deterministic_algorithms_enabled()  # put back as it was


def test_judge_against_the_reference_spread():
    from tiered.bench.kv_exact import judge, math_chunk

    spread = {"logits_equal": False, "first_logits_difference": 2, "max_abs_logit_diff": 0.165, "tokens_equal": False}
    row = {"logits_equal": False, "max_abs_logit_diff": 0.15}
    assert judge(row, spread) == "within spread"
    assert judge({**row, "max_abs_logit_diff": 8.31}, spread) == "outside spread"
    assert judge({**row, "again": {"logits_equal": True}}, spread) == "bitwise"  # equal to the reference's 2nd run
    assert judge(row, {**spread, "logits_equal": True, "max_abs_logit_diff": 0.0}) == "outside spread"
    assert judge(row, None) == "differs (no spread measured)" and judge({}, spread) == "no reference"
    # fp32 scores of 32 heads over 32K keys within 512 MiB: 128 tokens a chunk; never above the chunk asked for
    assert math_chunk(2048, 32, 32768) == 128 and math_chunk(64, 32, 1024) == 64
