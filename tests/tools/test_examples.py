"""Smoke tests: examples/*.py, bench/llama_step.py and bench/ds_big.py run as a user runs them, in a subprocess.

They check exit codes and outputs, never timings (benchmarks are not tests).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository
TRAIN = ROOT / "examples" / "train.py"
BIG_MODEL = ROOT / "examples" / "big_model.py"
KV = ROOT / "examples" / "kv_batch_generate.py"
LLAMA_STEP = ROOT / "bench" / "llama_step.py"
DS_BIG = ROOT / "bench" / "ds_big.py"


def run(args: list[str], cwd: Path, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    """Python on `args`, with the repo importable whether or not it is installed."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {k: v for k, v in os.environ.items() if k != "OUT"}  # results go where the test says
    full_env.update(PYTHONPATH=path, PYTHONUNBUFFERED="1", **env)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def test_train_example_learns_streams_state_and_saves(tmp_path):
    state, ckpt = tmp_path / "state", tmp_path / "ckpt"
    # Half the default model (2 layers, batch 8: a 5.4 MiB state over the 4 MiB default budget) for 20 steps; its
    # loss falls by about 1.5 in them.
    small = ["--layers", "2", "--batch", "8", "--steps", "20", "--log-every", "1"]
    p = run([str(TRAIN), *small, "--nvme-path", str(state), "--save", str(ckpt)], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    losses = [float(x) for x in re.findall(r"^step\s+\d+\s+loss\s+([0-9.]+)$", p.stdout, re.M)]
    assert len(losses) == 20, p.stdout
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"loss did not fall: {losses}"
    # The default host budget is smaller than the state, so some of it must come from the disk each step.
    read = re.search(r"^last step: read ([0-9.]+) MiB from disk", p.stdout, re.M)
    assert read is not None and float(read.group(1)) > 0, p.stdout
    assert ckpt.exists() and any(ckpt.iterdir() if ckpt.is_dir() else [ckpt]), "no checkpoint written"


USER_ERRORS = [
    (["--host-budget", "1KiB"], "cannot hold one state chunk"),
    (["--host-budget", "lots"], "cannot parse host_budget"),
    (["--chunk-bytes", "0"], "chunk_bytes"),
    (["--steps", "0"], "--steps"),
    (["--log-every", "0"], "--log-every"),
    (["--nvme-path", "{file}/state"], "nvme"),
    (["--save", "{file}"], "not a tiered checkpoint"),
    # What torch or the run's end refused with a traceback, or after training: the path under a file, the
    # optimizer's own folder, which holds its state when the save comes.
    (["--seq", "99999"], "--seq 99999 is longer than the training text"),  # the text: train.py, ~8 KB
    (["--dim", "100"], "--dim 100 does not split into 3 equal heads"),
    (["--device", "bogus"], "argument --device: expected cpu, cuda or cuda:N"),
    (["--save", "{file}/ckpt"], "is a file, not a folder"),
    (["--nvme-path", "{dir}/same", "--save", "{dir}/same"], "would hold the optimizer's state folder"),
    (["--device", "cuda"], "--device cuda: no CUDA device here; pass --device cpu"),  # where CUDA is missing
]

# A script's main() on each argument list in one interpreter (one torch import, not one a case), each as
# `python SCRIPT ARGS` ends: the exit code and what it wrote, a traceback printed as the interpreter would.
_MAINS_CHILD = """
import contextlib, importlib.util, io, json, os, sys, traceback
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))  # the script's folder, as when run
spec = importlib.util.spec_from_file_location("script", sys.argv[1])
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
results = []
for argv in json.loads(sys.argv[2]):
    sys.argv = [spec.origin, *argv]  # argparse names the script in its messages, as when run
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            script.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append(dict(returncode=code, stdout=out.getvalue(), stderr=err.getvalue()))
print(json.dumps(results))
"""


def run_mains(script: Path, argvs: list[list[str]], cwd: Path, **env: str) -> list[subprocess.CompletedProcess]:
    """``script``'s main() on each of ``argvs`` in one child process: what each `python script ARGS` gave."""
    p = run(["-c", _MAINS_CHILD, str(script), json.dumps(argvs)], cwd, **env)
    assert p.returncode == 0, p.stdout + p.stderr
    return [subprocess.CompletedProcess([str(script), *argv], r["returncode"], r["stdout"], r["stderr"])
            for argv, r in zip(argvs, json.loads(p.stdout.strip().splitlines()[-1]), strict=True)]  # fmt: skip


def with_paths(args: list[str], folder: Path) -> list[str]:
    """``args`` with {dir} as ``folder`` and {file} as a file in it, which is made."""
    blocker = folder / "a-file"
    blocker.write_text("not a folder")
    return [a.replace("{file}", str(blocker)).replace("{dir}", str(folder)) for a in args]


@pytest.fixture(scope="module")
def user_error_runs(tmp_path_factory) -> dict[int, subprocess.CompletedProcess]:
    """Every case of USER_ERRORS in its own folder, run by one child process; --device cuda only without CUDA
    (with it, that would train)."""
    argvs = {}
    for i, (args, _) in enumerate(USER_ERRORS):
        if args == ["--device", "cuda"] and _cuda_available():
            continue
        folder = tmp_path_factory.mktemp(f"user-error-{i}")
        args = with_paths(args, folder)
        nvme = [] if "--nvme-path" in args else ["--nvme-path", str(folder / "state")]
        argvs[i] = ["--steps", "2", *nvme, *args]
    return dict(zip(argvs, run_mains(TRAIN, list(argvs.values()), tmp_path_factory.mktemp("user-errors")), strict=True))


@pytest.mark.parametrize("case", range(len(USER_ERRORS)), ids=[" ".join(a) for a, _ in USER_ERRORS])
def test_train_example_answers_a_user_error_with_a_message_not_a_traceback(user_error_runs, case):
    """Each is refused before the first step (a --save that cannot be written, before the training it would
    end), with exit code 2 and a message naming the value."""
    if case not in user_error_runs:
        pytest.skip("CUDA is here: --device cuda works")
    p, words = user_error_runs[case], USER_ERRORS[case][1]
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and words in p.stderr, p.stderr
    if "cannot hold one state chunk" not in words:  # that one needs the model's chunks: the rest come before it
        assert "params on" not in p.stdout, p.stdout
    assert "step    0" not in p.stdout  # refused before training


def import_example(name: str):
    """examples/NAME.py as a module, imported as its script would run it (its folder on sys.path)."""
    sys.path.insert(0, str(TRAIN.parent))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(TRAIN.parent))


def test_train_example_refuses_a_save_its_disk_cannot_hold_before_training(tmp_path, monkeypatch, capsys):
    """Where --save's disk has less room than the checkpoint's rows (12 bytes a parameter), the run is refused
    once the model is built, before the optimizer and the training; it used to fail after the last step."""
    import shutil

    disk_usage = shutil.disk_usage
    small = tmp_path / "small"  # a disk with nothing free, where the checkpoint would go
    monkeypatch.setattr(shutil, "disk_usage", lambda p: disk_usage(p)._replace(free=0)
                        if Path(p).is_relative_to(small) else disk_usage(p))  # fmt: skip
    small.mkdir()
    argv = ["--steps", "2", "--layers", "1", "--nvme-path", str(tmp_path / "state"), "--save", str(small / "ckpt")]
    with pytest.raises(SystemExit) as e:
        import_example("train").main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and "--save" in err and "0 B is free there" in err, err
    assert "step    0" not in out and not (tmp_path / "state").exists()


def test_llama_step_help_lists_its_options(tmp_path):
    p = run([str(LLAMA_STEP), "--help"], tmp_path, timeout=60)
    assert p.returncode == 0, p.stderr
    flags = ("--nvme", "--host-budget", "--steps", "--plain", "--moments-dtype", "--deadline", "--floor-size")
    for flag in flags:
        assert flag in p.stdout, flag


def test_llama_step_import_touches_neither_cuda_nor_transformers(tmp_path):
    code = (
        "import importlib.util, sys, torch\n"
        "before = set(sys.modules)\n"
        "spec = importlib.util.spec_from_file_location('llama_step', sys.argv[1])\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "new = set(sys.modules) - before\n"
        "print(torch.cuda.is_initialized(), 'transformers' in new, 'tiered.optimizer' in new)\n"
    )
    p = run(["-c", code, str(LLAMA_STEP)], tmp_path, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "False", "False"]


def test_llama_step_runs_a_toy_llama_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    out, nvme = tmp_path / "out", tmp_path / "nvme"
    out.mkdir()
    toy = "--device cpu --layers 1 --hidden 128 --seq 32 --batch 2 --vocab 512 --steps 3".split()
    small = "--host-budget 1MiB --chunk-bytes 256KiB --floor-size 8MiB --floor-budget 5 --name toy".split()
    p = run([str(LLAMA_STEP), *toy, *small, "--nvme", str(nvme)], tmp_path, OUT=str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res == json.loads((out / "toy.json").read_text())
    assert res["complete"] and res["mode"] == "tiered" and len(res["step_s"]) == len(res["losses"]) == 3
    assert len(res["phases"]) == 3 and all(ph["nvme_read_bytes"] > 0 for ph in res["phases"][1:])
    assert res["floor_s"] > 0 and res["ratio"] > 0
    assert not nvme.exists() or not any(nvme.iterdir()), "the run's state folder was left behind"


def test_train_example_llama_builds_the_shared_workload(tmp_path):
    """`--llama` trains tiered.bench.workload's model, shrunk by the flags, on the CPU."""
    pytest.importorskip("transformers")
    toy = "--llama --device cpu --layers 1 --hidden 128 --seq 32 --batch 2 --steps 2 --log-every 1".split()
    budget = "--host-budget 4MiB --chunk-bytes 256KiB".split()
    p = run([str(TRAIN), *toy, *budget, "--nvme-path", str(tmp_path / "state")], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("LlamaForCausalLM: ") and len(re.findall(r"^step\s+\d+\s+loss", p.stdout, re.M)) == 2


def test_big_model_example_trains_a_toy_llama_on_cpu_with_state_on_disk(tmp_path):
    """examples/big_model.py at toy size: bf16 Llama made in place, checkpointing, accumulation, part of the
    state streamed from disk every step, the loss of its fixed batches falling, nothing left on disk, and the
    run's figures in --json; --trace profiles one step more, not counted in them, which bench/step_timeline.py
    reads."""
    pytest.importorskip("transformers")
    state, figures, trace = tmp_path / "state", tmp_path / "big.json", tmp_path / "trace.json"
    toy = "--device cpu --hidden 32 --layers 2 --heads 4 --inter 64 --vocab 128 --seq 16 --batch 2".split()
    knobs = "--accumulate 2 --steps 3 --lr 1e-2 --host-budget 96KiB --chunk-bytes 48KiB".split()
    argv = [str(BIG_MODEL), *toy, *knobs, "--nvme-path", str(state), "--json", str(figures), "--trace", str(trace)]
    p = run(argv, tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"^profiled step: loss \S+, [0-9.]+ s \(not counted\)$", p.stdout, re.M), p.stdout
    t = run([str(ROOT / "bench" / "step_timeline.py"), str(trace), "--step", "step"], tmp_path)
    assert t.returncode == 0, t.stderr
    summary = json.loads(t.stdout)
    assert summary["step_ms"] > 0 and summary["backward"]["n"] == 2 and summary["opt.step"]["n"] == 1
    assert "kernels_busy_ms" not in summary  # no CUDA here: the host's labels only
    assert re.match(r"LlamaForCausalLM: [0-9,]+ params, bf16, on cpu", p.stdout), p.stdout
    losses = [float(x) for x in re.findall(r"^step\s+\d+\s+loss\s+(\S+)", p.stdout, re.M)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), p.stdout
    assert losses[-1] < losses[0], f"the loss of the fixed batches did not fall: {losses}"
    # opt.summary() after each step: the 96 KiB budget holds part of the ~0.4 MB state, the rest streams.
    summaries = re.findall(r"^  step (\d+): .*NVMe ([0-9.]+) KiB read", p.stdout, re.M)
    assert [int(s) for s, _ in summaries] == [1, 2, 3] and all(float(r) > 0 for _, r in summaries), p.stdout
    # and where the optimizer's time went, a line a step
    line = r"^  optimizer: clip [0-9.]+ s, read wait [0-9.]+ s, write wait [0-9.]+ s, update [0-9.]+ s"
    assert len(re.findall(line, p.stdout, re.M)) == 3, p.stdout
    assert not state.exists() or not any(state.iterdir()), "the optimizer's folder was left behind"
    assert re.search(r"^first step done [0-9.]+ s after start$", p.stdout, re.M), p.stdout
    assert re.search(r"^peak host memory \(this process\): [0-9.]+ GiB \(ru_maxrss\)", p.stdout, re.M), p.stdout

    # --json: one line, the figures bench/ds_big.py's DeepSpeed run is compared on.
    (line,) = figures.read_text().splitlines()
    res = json.loads(line)
    keys = {"engine", "params", "host_budget", "moments_dtype", "batch", "seq", "accumulate", "tokens_per_step",
            "model_s", "optimizer_s", "first_step_at_s", "step_s", "compute_s", "optimizer_step_s", "tokens_per_s",
            "peak_gpu_GiB", "peak_host_GiB", "losses", "close_s", "gpu_memory_cap", "gpu_budget"}  # fmt: skip
    assert keys <= res.keys(), keys - res.keys()
    assert res["engine"] == "tiered" and res["host_budget"] == 96 << 10 and res["tokens_per_step"] == 2 * 16 * 2
    assert res["gpu_budget"] == 0  # "auto" on the CPU: no HBM
    assert res["losses"] == pytest.approx(losses, abs=1e-4)
    assert (
        len(res["step_s"]) == len(res["compute_s"]) == len(res["optimizer_step_s"]) == len(res["optimizer_phases"]) == 3
    )
    assert all(ph["update_s"] > 0 for ph in res["optimizer_phases"])
    assert res["peak_gpu_GiB"] is None and res["gpu_memory_cap"] is None and res["peak_host_GiB"] > 0
    assert res["first_step_at_s"] > res["model_s"] + res["optimizer_s"] - 0.01 and res["tokens_per_s"] > 0  # rounding


# The refusals of examples/big_model.py, run by one child process (big_model_refusals).
BIG_MODEL_REFUSALS = {
    # 4 B a parameter of bf16 weights and gradients: this 1.7T-parameter shape fits no machine's RAM, and was
    # the kernel's OOM killer's to end, silently, before the check.
    "larger than the device": "--device cpu --hidden 16384 --layers 400 --inter 65536 --heads 128 --steps 1".split(),
    "bad gpu budget": ["--device", "cpu", "--gpu-budget", "lots"],
    "gpu memory cap on the cpu": ["--device", "cpu", "--gpu-memory-cap", "24GB"],
    "no cuda": ["--steps", "1"],  # only where CUDA is missing: with it, this would train the default model
}
# Flags torch or transformers refused with a traceback, the first forward after the optimizer was built (--kv-heads
# 3), or the run's end (--json, --trace); and a --gpu-budget that the optimizer ignores on the CPU, which the plan
# of --host-budget auto counted in HBM: each is refused before the model is built, naming the flag.
_TOY = "--device cpu --hidden 64 --layers 2 --heads 4 --inter 128 --vocab 256 --seq 32 --steps 1".split()
BIG_MODEL_FLAG_ERRORS = {
    "--hidden 65": "--hidden 65 is not divisible by --heads 4",
    "--hidden 12": "a head's width, 3 here; rotary embeddings need it even",
    "--kv-heads 3": "--kv-heads 3 must be >= 1 and divide --heads 4",
    "--kv-heads 0": "--kv-heads 0 must be >= 1",
    "--device bogus": "argument --device: expected cpu, cuda or cuda:N",
    "--json {dir}/missing/f.json": "argument --json: the folder",
    "--trace {dir}/missing/t.json": "argument --trace: the folder",
    "--gpu-budget 32MiB": "--gpu-budget sizes a CUDA device's memory; --device cpu has none",
    "--nvme-path {file}/state": "is a file, not a folder",
    # The optimizer's knobs, which TieredOptimizer refused only after the model was built (exit 1).
    "--chunk-bytes 0": "chunk_bytes must be at least 4 KiB",
    "--host-budget 1000TiB": "exceeds 90 % of this machine's",
    "--max-grad-norm -1": "max_grad_norm must be a number > 0",
}
BIG_MODEL_REFUSALS.update({flags: [*_TOY, *flags.split()] for flags in BIG_MODEL_FLAG_ERRORS})


@pytest.fixture(scope="module")
def big_model_refusals(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    cases = {k: v for k, v in BIG_MODEL_REFUSALS.items() if k != "no cuda" or not _cuda_available()}
    folder = tmp_path_factory.mktemp("big-model-refusals")
    argvs = [with_paths(argv, folder) + ([] if "--nvme-path" in argv else ["--nvme-path", str(folder / f"state{i}")])
             for i, argv in enumerate(cases.values())]  # fmt: skip
    return dict(zip(cases, run_mains(BIG_MODEL, argvs, folder), strict=True))


@pytest.mark.parametrize("flags", BIG_MODEL_FLAG_ERRORS)
def test_big_model_example_refuses_a_bad_flag_before_building_the_model(big_model_refusals, flags):
    p = big_model_refusals[flags]
    assert p.returncode == 2 and BIG_MODEL_FLAG_ERRORS[flags] in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert "LlamaForCausalLM:" not in p.stdout, p.stdout


def test_big_model_example_plans_no_hbm_on_the_cpu(tmp_path):
    """gpu_budget() is 0 for a model on the CPU, whatever --gpu-budget says: the optimizer keeps no state in HBM
    there, and the host budget is planned for the whole state."""
    import torch

    args = argparse.Namespace(gpu_budget=32 << 20)
    assert import_example("big_model").gpu_budget(args, None, None, 1000, torch.device("cpu"), None) == 0


def test_big_model_example_refuses_a_model_larger_than_the_device_before_building_it(big_model_refusals):
    p = big_model_refusals["larger than the device"]
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert re.search(r"B-parameter Llama needs .* for its bf16 weights and gradients alone", p.stderr), p.stderr
    assert "LlamaForCausalLM:" not in p.stdout


def test_big_model_example_refuses_a_bad_gpu_budget(big_model_refusals):
    p = big_model_refusals["bad gpu budget"]
    assert p.returncode != 0 and "--gpu-budget" in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.gpu
def test_big_model_example_keeps_what_the_gpu_leaves_spare_in_hbm(tmp_path):
    """--gpu-budget auto on CUDA: a micro-batch measured before the optimizer exists; a toy's whole state then
    fits in HBM, so the host budget is planned for nothing and nothing touches the disk."""
    if not _cuda_available():
        pytest.skip("needs CUDA")
    toy = "--hidden 64 --layers 2 --heads 4 --inter 128 --vocab 256 --seq 32 --batch 2 --steps 3".split()
    p = run([str(BIG_MODEL), *toy, "--nvme-path", str(tmp_path / "state"), "--json", str(tmp_path / "f.json")],
            tmp_path, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"^gpu_budget auto: .* of state in HBM", p.stdout, re.M), p.stdout
    assert re.search(r"^host_budget auto: .* 0 B on NVMe$", p.stdout, re.M), p.stdout
    res = json.loads((tmp_path / "f.json").read_text())
    assert res["gpu_budget"] > 0 and res["losses"][-1] < res["losses"][0]
    summaries = re.findall(r"^  step \d+: .*$", p.stdout, re.M)
    assert len(summaries) == 3 and not any("NVMe" in s for s in summaries), p.stdout


def test_a_profiled_step_whose_trace_was_not_written_is_an_error(tmp_path, capsys):
    """torch.profiler's export into a missing folder logs a C++ line and returns: profiled() says so, instead of
    naming a trace that does not exist."""
    import torch

    from tiered.bench.training_run import profiled

    path = tmp_path / "missing" / "trace.json"
    with pytest.raises(OSError, match="could not write the step's trace"):
        with profiled(str(path), torch.device("cpu")):
            torch.ones(2).sum()
    assert "the step's trace" not in capsys.readouterr().out


def test_big_model_example_refuses_a_gpu_memory_cap_on_the_cpu(big_model_refusals):
    p = big_model_refusals["gpu memory cap on the cpu"]
    assert p.returncode == 2 and "--gpu-memory-cap" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_ds_big_shares_big_models_flags_and_reports_a_failure_as_a_json_line(tmp_path):
    """bench/ds_big.py parses without DeepSpeed (it is imported only to run), takes big_model.py's model and
    training flags, and a run that cannot start (here: no GPU) still leaves its error line in --json."""
    p = run([str(DS_BIG), "--help"], tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    for flag in ("--hidden", "--kv-heads", "--accumulate", "--max-grad-norm", "--no-checkpointing", "--gpu-memory-cap",
                 "--offload", "--offload-param", "--nvme-path", "--min-free-ram", "--json"):  # fmt: skip
        assert flag in p.stdout, flag
    if _cuda_available():
        return
    out = tmp_path / "ds.json"
    p = run([str(DS_BIG), "--layers", "1", "--hidden", "32", "--heads", "4", "--json", str(out)], tmp_path, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert res == json.loads(p.stdout.strip().splitlines()[-1])
    assert res["engine"] == "deepspeed" and res["phase"] == "start" and "no CUDA device" in res["error"]


_STAND_IN = """
import json, sys, types, torch
from transformers import LlamaForCausalLM  # before the stand-in: transformers looks for a real deepspeed
sys.path.insert(0, sys.argv[1])
import ds_big
from big_model import batches, build_model

# A CUDA-less run of ds_big's loop: the model on the CPU, an engine that steps nothing.
torch.cuda.is_available = lambda: True
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.max_memory_allocated = lambda *a, **k: 0
torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(total_memory=80 * 10**9)
ds_big.build_model = lambda args, device: build_model(args, torch.device("cpu"))
ds_big.batches = lambda args, device: batches(args, torch.device("cpu"))


class Engine:
    def __init__(self, model):
        self.model = model

    def __call__(self, **kw):
        return self.model(**kw)

    def backward(self, loss):
        loss.backward()

    def step(self):
        pass


deepspeed = types.ModuleType("deepspeed")
def initialize(model, model_parameters, config):
    print("zero_optimization:", json.dumps(config["zero_optimization"]), "on", next(model.parameters()).device)
    return Engine(model), None, None, None


def partition(module, config_dict_or_path, remote_device, pin_memory, dtype):
    print("zero.Init:", remote_device, "the same config:", config_dict_or_path["zero_optimization"]["stage"] == 3)


deepspeed.initialize = initialize
deepspeed.zero = types.SimpleNamespace(Init=partition)
sys.modules["deepspeed"] = deepspeed
ds_big.main(sys.argv[2:])
"""


@pytest.mark.parametrize("offload_param", ["none", "cpu", "nvme"])
def test_ds_big_reports_its_steps_as_big_model_does(tmp_path, offload_param):
    """bench/ds_big.py's loop, with a stand-in for DeepSpeed's engine on the CPU: a line a step and the JSON
    figures under big_model's keys, so that the two runs compare key for key; ZeRO-3 is asked to keep the weights
    off the GPU only with --offload-param, partitioned by zero.Init before initialize (the model is never whole
    on the GPU), on NVMe in buffers that hold the largest parameter (the embedding)."""
    pytest.importorskip("transformers")
    script, out = tmp_path / "stand_in.py", tmp_path / "ds.json"
    script.write_text(_STAND_IN)
    toy = "--hidden 32 --layers 1 --heads 4 --inter 64 --vocab 128 --seq 8 --batch 1 --accumulate 2 --steps 3"
    flags = [*toy.split(), "--offload", "cpu", "--offload-param", offload_param, "--json", str(out)]
    p = run([str(script), str(DS_BIG.parent), *flags], tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    (zero,) = re.findall(r"^zero_optimization: (.*) on cpu$", p.stdout, re.M)
    zero = json.loads(zero)
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"
    partitioned = re.findall(r"^zero.Init: (\w+) the same config: True$", p.stdout, re.M)
    if offload_param == "none":
        assert "offload_param" not in zero and not partitioned  # initialize moves the model to the GPU whole
    else:
        assert zero["offload_param"]["device"] == offload_param and zero["offload_param"]["pin_memory"]
        assert partitioned == [offload_param]  # partitioned before initialize: never whole on the GPU
    if offload_param == "nvme":
        assert zero["offload_param"]["nvme_path"] == "./ds-nvme" and (tmp_path / "ds-nvme").is_dir()
        assert zero["offload_param"]["buffer_size"] >= 128 * 32  # the toy's embedding: vocab x hidden
    assert len(re.findall(r"^step\s+\d+\s+loss", p.stdout, re.M)) == 3, p.stdout
    res = json.loads(out.read_text())
    shared = {"params", "batch", "seq", "accumulate", "tokens_per_step", "model_s", "first_step_at_s", "step_s",
              "compute_s", "optimizer_step_s", "tokens_per_s", "peak_gpu_GiB", "peak_host_GiB", "losses",
              "gpu_memory_cap"}  # fmt: skip
    assert shared <= res.keys() and "error" not in res, res
    assert res["engine"] == "deepspeed" and res["offload"] == "cpu" and res["tokens_per_step"] == 16
    assert res["offload_param"] == offload_param
    assert len(res["losses"]) == len(res["step_s"]) == 3 and all(math.isfinite(x) for x in res["losses"])


@pytest.mark.parametrize("moments, fmt", [("fp32", "full"), ("int8", "int8")])
def test_big_model_example_auto_budget_is_the_plans(tmp_path, moments, fmt):
    """--host-budget auto: tiered-bench plan's budget for this machine's RAM and the record format the
    optimizer will use: here the whole (tiny) state, so nothing streams."""
    pytest.importorskip("transformers")
    import psutil

    from tiered.bench.plan import recommend_host_budget

    toy = "--device cpu --hidden 32 --layers 1 --heads 4 --inter 64 --vocab 128 --seq 8 --batch 1 --steps 2".split()
    toy += ["--moments-dtype", moments]
    p = run([str(BIG_MODEL), *toy, "--nvme-path", str(tmp_path / "state")], tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    params = int(re.match(r"LlamaForCausalLM: ([0-9,]+) params", p.stdout).group(1).replace(",", ""))
    auto = re.search(r"^host_budget auto: (\d+) \(.*\) for .* of state, 0 B on NVMe$", p.stdout, re.M)
    assert auto is not None, p.stdout
    # A CPU model updates on the host with fp32 masters: the plan's "full" (12 B a parameter) or "int8" format.
    assert int(auto.group(1)) == recommend_host_budget(params, fmt, psutil.virtual_memory().total)
    summaries = re.findall(r"^  step \d+: .*$", p.stdout, re.M)
    assert len(summaries) == 2 and not any("NVMe" in s for s in summaries), p.stdout


def test_big_model_example_without_cuda_says_what_to_do(big_model_refusals):
    if _cuda_available():
        pytest.skip("CUDA is here: the default device works")
    p = big_model_refusals["no cuda"]
    assert p.returncode != 0 and "no CUDA device here: pass --device cpu" in p.stderr
    assert "Traceback" not in p.stderr


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def test_big_model_example_keeps_the_last_blocks_weights_as_the_room_allows_on_the_cpu_stand_in(tmp_path):
    """--offload on --keep-for-backward room: the parameters offloaded to the CPU stand-in, and after the first
    backwards every block's weights kept from forward to backward (the stand-in's room is unbounded); each step
    says how many. A number keeps that many; anything else is refused by name."""
    pytest.importorskip("transformers")
    toy = "--device cpu --hidden 32 --layers 2 --heads 4 --inter 64 --vocab 128 --seq 16 --batch 2".split()
    knobs = "--accumulate 2 --steps 2 --lr 1e-2 --offload on --keep-for-backward room".split()
    p = run([str(BIG_MODEL), *toy, *knobs, "--nvme-path", str(tmp_path / "state")], tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    counts = re.findall(r"^  weights kept from forward to backward: the last (\d) of 2 blocks", p.stdout, re.M)
    assert counts == ["2", "2"], p.stdout  # sized at the second backward, within the first step
    assert "the update runs on the CPU, beside the state" in p.stdout and "update runs on the GPU" not in p.stdout

    from tiered.bench.example_args import keep_arg

    assert [keep_arg(v) for v in ("auto", "on", "off", "room", "3")] == ["auto", "on", "off", "room", 3]
    with pytest.raises(argparse.ArgumentTypeError, match="number of blocks"):
        keep_arg("-1")


# examples/kv_batch_generate.py: flags refused before the model is built, and a run under the cache's default root
KV_FLAG_ERRORS = {
    "--page-tokens 0": "argument --page-tokens: expected an integer >= 1",
    "--host-budget lots": "--host-budget",
    "--nvme-path {file}": "is a file, not a folder",
    "--vocab 1": "--vocab must be >= 2",
    "--kv-heads 3": "--kv-heads 3 must be >= 1 and divide --heads 4",
    "--device bogus": "argument --device: expected cpu, cuda or cuda:N",
    "--json {dir}/missing/r.json": "argument --json: the folder",
    **({} if _cuda_available() else {"--device cuda": "--device cuda: no CUDA device here; pass --device cpu"}),
}


def test_the_examples_path_flags_name_what_their_checks_read(tmp_path, monkeypatch):
    """``--save=~/ckpt`` and ``--json=~/r.json`` reach the script unexpanded (the shell expands ``~`` only at a
    word's start): the checks read the home folder, and the run wrote a literal ``~`` folder in the working
    directory (or failed after every step, the figures lost). The run uses the path the checks read."""
    from tiered.bench.example_args import output_file, user_path

    monkeypatch.setenv("HOME", str(tmp_path))
    assert output_file("~/r.json") == str(tmp_path / "r.json")
    assert user_path("~/ckpt") == str(tmp_path / "ckpt") and user_path("rel/ckpt") == "rel/ckpt"
    work = tmp_path / "work"
    work.mkdir()
    small = ["--layers", "1", "--batch", "2", "--steps", "1", "--nvme-path=~/state", "--save=~/ckpt"]
    p = run([str(TRAIN), *small], work, HOME=str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "ckpt" / "manifest.json").is_file() and os.listdir(work) == []


@pytest.fixture(scope="module")
def kv_runs(tmp_path_factory) -> tuple[dict[str, subprocess.CompletedProcess], Path]:
    """KV_FLAG_ERRORS' cases, then a small run without --nvme-path (under $TIERED_NVME_PATH, the root given
    here), by one child process; and that root."""
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("kv")
    small = "--requests 2 --running 1 --quantum 2 --new-tokens 3 --layers 1 --host-budget 8KiB".split()
    cases = {**{flags: with_paths(flags.split(), folder) for flags in KV_FLAG_ERRORS}, "run": small}
    root = folder / "root"
    runs = run_mains(KV, list(cases.values()), folder, TIERED_NVME_PATH=str(root))
    return dict(zip(cases, runs, strict=True)), root


@pytest.mark.parametrize("flags", KV_FLAG_ERRORS)
def test_kv_example_refuses_a_bad_flag_before_building_the_model(kv_runs, flags):
    p = kv_runs[0][flags]
    assert p.returncode == 2 and KV_FLAG_ERRORS[flags] in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_kv_example_keeps_its_pages_under_the_caches_default_root(kv_runs):
    """Without --nvme-path the pages go under TieredCache's default root, not a new temporary folder a run: the
    folder of a killed run is then removed by the next run under it. This one's is removed as it ends."""
    runs, root = kv_runs
    assert runs["run"].returncode == 0, runs["run"].stdout + runs["run"].stderr
    assert root.is_dir() and os.listdir(root) == []


def test_examples_end_through_their_cleanup_on_sigterm():
    """exit_on_sigterm (each example's __main__): SIGTERM raises SystemExit(143) in the main thread, so that the
    `with` blocks remove the state and page files, as on Ctrl-C; Python's default would leave them."""
    from tiered.bench.example_args import exit_on_sigterm

    previous = signal.getsignal(signal.SIGTERM)
    try:
        exit_on_sigterm("an-example.py")
        with pytest.raises(SystemExit) as e:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode: long before this ends
        assert e.value.code == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
