"""NVMe-tier checkpoints: exact resume, portability, damage detection, retention, full disks.

Crash safety (kill -9 while saving) is in test_checkpoint_crash.py.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import errno
import inspect
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import warnings
import zlib

import numpy as np
import pytest
import torch
from torch import nn

from io_engine import DirectIOUnsupportedError, IOConfig
from tiered import TieredOptimizer
from tiered.checkpoint import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointPathError,
    InsufficientSpaceError,
    export_model_state_dict,
    export_torch_state_dict,
    fsops,
    hidden,
    import_torch_state_dict,
    inspect_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from tiered.checkpoint.cli import add_cli, command_specs
from tiered.checkpoint.cli import main as cli_main
from tiered.checkpoint.manifest import FileEntry
from tiered.checkpoint.reader import SegmentChecker
from tiered.checkpoint.reshard import gather, whole_layout
from tiered.checkpoint.validate import restore_groups
from tiered.optimizer import OptimizerBrokenError
from tiered.store.checksum import Checksummer

CHUNK = "12KiB"  # 1024 elements: the MLP's 6.8k parameters span 7 chunks, split across parameters
BUDGET = "64KiB"  # one chunk resident, the other six streamed from NVMe every step
TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(TESTS)))


class MLP(nn.Module):
    def __init__(self, seed: int = 0, reverse: bool = False, width: int = 64):
        super().__init__()
        torch.manual_seed(seed)
        layers = [("fc1", nn.Linear(32, width)), ("fc2", nn.Linear(width, 64)), ("out", nn.Linear(64, 8))]
        for name, layer in reversed(layers) if reverse else layers:  # reverse: same names, other order
            self.add_module(name, layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.gelu(self.fc2(nn.functional.gelu(self.fc1(x)))))


def train(model: nn.Module, opt, start: int, steps: int, sched=None) -> None:
    for s in range(start, start + steps):  # batch s depends only on s: a resumed run sees the same data
        g = torch.Generator().manual_seed(1000 + s)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def make(model: nn.Module, path, **kw) -> TieredOptimizer:
    kw = {"lr": 1e-2, "weight_decay": 0.1, "chunk_bytes": CHUNK, "host_budget": BUDGET, **kw}
    return TieredOptimizer(model, path, **kw)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), f"{n}: max diff {(a[n] - b[n]).abs().max().item()}"


def state_by_name(opt: TieredOptimizer) -> dict[str, dict[str, torch.Tensor]]:
    sd = opt.state_dict()
    return {opt.param_names[i]: s for i, s in sd["state"].items()}


@pytest.fixture
def trained(tmp_path):
    """An MLP trained 4 steps, with a scheduler, saved to ckpt/step-4; yields (model, opt, sched, path)."""
    model = MLP()
    opt = make(model, tmp_path / "nvme")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    train(model, opt, 0, 4, sched)
    path = opt.save_checkpoint(tmp_path / "ckpt" / "step-4", extra={"epoch": 2, "rng": torch.get_rng_state()},
                               scheduler=sched)  # fmt: skip
    yield model, opt, sched, path
    opt.close()


# ------------------------------------------------------------------------------------------- exactness
def _resume_child(path: str, out: str, threads: int) -> None:
    """Runs in a new process: a differently initialised model, load, train 4 more steps, dump the result."""
    torch.set_num_threads(threads)
    model = MLP(seed=123)
    with make(model, os.path.join(os.path.dirname(out), "nvme-child"), chunk_bytes=CHUNK) as opt:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        info = opt.load_checkpoint(path, scheduler=sched)
        train(model, opt, 4, 4, sched)
        torch.save({"params": params_of(model), "epoch": info["extra"]["epoch"], "step": info["step"],
                    "lr": opt.param_groups[0]["lr"], "steps": opt.stats()["steps"]}, out)  # fmt: skip


def test_resume_in_a_new_process_is_bitwise_exact(trained, tmp_path):
    model, opt, sched, path = trained
    train(model, opt, 4, 4, sched)  # the uninterrupted run: 4 + 4 steps
    out = str(tmp_path / "child.pt")
    code = (f"import sys; sys.path.insert(0, {TESTS!r}); import test_checkpoint as t; "
            f"t._resume_child({path!r}, {out!r}, {torch.get_num_threads()})")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)
    child = torch.load(out)
    assert_bitwise(params_of(model), child["params"])
    assert (child["epoch"], child["step"], child["steps"]) == (2, 4, 8)
    assert child["lr"] == opt.param_groups[0]["lr"] == 1e-2 * 0.5**2  # the scheduler resumed too


@pytest.mark.parametrize(
    "config",
    [
        {"chunk_bytes": "24KiB", "host_budget": "1MiB"},  # larger chunks, everything resident
        {"chunk_bytes": "36KiB", "host_budget": "108KiB"},  # larger still, all streamed from NVMe
        {"chunk_bytes": "12KiB", "host_budget": "40KiB", "prefetch_depth": 0},  # the serial twin
    ],
)
def test_loads_with_other_chunk_size_host_budget_and_path(trained, tmp_path, config):
    model, opt, sched, path = trained
    other = MLP(seed=7)
    with make(other, tmp_path / "elsewhere", **config) as opt2:
        opt2.load_checkpoint(path)
        assert_bitwise(params_of(model), params_of(other))
        for name, s in state_by_name(opt).items():
            for k, v in s.items():
                assert torch.equal(v, state_by_name(opt2)[name][k]), (name, k)
        assert opt2.step_counts == opt.step_counts and opt2.stats()["steps"] == 4
        train(model, opt, 4, 3)
        train(other, opt2, 4, 3)
        # The loaded state above is bitwise the saved one. Training on under another chunking may differ in
        # the last bit: torch's fused kernel rounds a vector body and a scalar tail differently (FMA), and
        # chunk boundaries move the tails. That is the kernel's, not the checkpoint's.
        torch.testing.assert_close(params_of(model), params_of(other), rtol=1e-6, atol=1e-8)


def test_keyed_by_name_not_by_order(trained, tmp_path):
    model, opt, _, path = trained
    other = MLP(seed=5, reverse=True)
    assert [n for n, _ in other.named_parameters()] != [n for n, _ in model.named_parameters()]
    with make(other, tmp_path / "rev", chunk_bytes="24KiB") as opt2:
        opt2.load_checkpoint(path)
        assert_bitwise(params_of(model), params_of(other))
        assert_bitwise(state_by_name(opt)["fc2.weight"], state_by_name(opt2)["fc2.weight"])
        train(model, opt, 4, 2)
        train(other, opt2, 4, 2)
        torch.testing.assert_close(params_of(model), params_of(other), rtol=1e-6, atol=1e-8)  # see above


def test_low_precision_params_keep_their_fp32_masters(tmp_path):
    model = MLP().to(torch.bfloat16)
    with make(model, tmp_path / "a") as opt:
        train_with_dtype(model, opt, 0, torch.bfloat16)
        path = opt.save_checkpoint(tmp_path / "ck")
        masters = masters_of(opt)
        other = MLP(seed=3).to(torch.bfloat16)
        with make(other, tmp_path / "b", chunk_bytes="24KiB") as opt2:
            opt2.load_checkpoint(path)
            assert_bitwise(params_of(model), params_of(other))
            assert_bitwise(masters, masters_of(opt2))
        weights = export_model_state_dict(path)
        assert all(w.dtype == torch.bfloat16 for w in weights.values())
        assert_bitwise(weights, params_of(model))


@pytest.mark.parametrize("first,second", [(True, False), (False, True)], ids=["split-to-full", "full-to-split"])
def test_split_and_full_masters_checkpoint_into_each_other(tmp_path, first, second):
    """A checkpoint holds fp32 masters whatever the layout: save from one, load into the other, then both
    train on bit for bit."""
    model = MLP().to(torch.bfloat16)
    with make(model, tmp_path / "a", split_masters=first) as opt:
        train_with_dtype(model, opt, 0, torch.bfloat16)
        path = opt.save_checkpoint(tmp_path / "ck")
        other = MLP(seed=3).to(torch.bfloat16)
        with make(other, tmp_path / "b", chunk_bytes="24KiB", split_masters=second) as opt2:
            assert (opt.stats()["split_chunks"] > 0) != (opt2.stats()["split_chunks"] > 0)
            opt2.load_checkpoint(path)
            train_with_dtype(model, opt, 3, torch.bfloat16)
            train_with_dtype(other, opt2, 3, torch.bfloat16)
            assert_bitwise(params_of(model), params_of(other))
            assert_bitwise(masters_of(opt), masters_of(opt2))


def test_split_masters_keep_their_low_halves_when_the_loaded_weights_are_written_again(tmp_path):
    """``load_checkpoint`` sets the weights; the model's own weights loaded afterwards (the same values, their
    version counters moved) are no write: the masters are the saved ones. Other values written there win, as any
    write does."""
    model = MLP().to(torch.bfloat16)
    with make(model, tmp_path / "a", split_masters=True) as opt:
        train_with_dtype(model, opt, 0, torch.bfloat16)
        path = opt.save_checkpoint(tmp_path / "ck")
        weights, saved = copy.deepcopy(model.state_dict()), masters_of(opt)
        train_with_dtype(model, opt, 3, torch.bfloat16)
    other = MLP(seed=3).to(torch.bfloat16)
    with make(other, tmp_path / "b", split_masters=True) as opt2:
        opt2.load_checkpoint(path)
        weights["fc2.weight"] = weights["fc2.weight"] * (1 + torch.finfo(torch.bfloat16).eps * 2)  # other values
        other.load_state_dict(weights)  # fc1.weight spans two chunks
        masters = masters_of(opt2)
        assert masters["fc2.weight"].equal(weights["fc2.weight"].float())
        del masters["fc2.weight"], saved["fc2.weight"]
        assert_bitwise(masters, saved)


def masters_of(opt):
    """The fp32 masters of low-precision parameters, by name, as state_dict() hands them out."""
    return {opt.param_names[i]: s["master"] for i, s in opt.state_dict()["state"].items()}


def train_with_dtype(model, opt, start, dtype):
    for s in range(start, start + 3):
        g = torch.Generator().manual_seed(s)
        x = torch.randn(8, 32, generator=g).to(dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


# ------------------------------------------------------------------------------------------ bad input
def test_mismatched_names_and_shapes_are_listed_and_nothing_changes(trained, tmp_path):
    _, _, _, path = trained
    other = MLP(seed=9, width=48)  # fc1 and fc2 change shape
    other.add_module("extra", nn.Linear(2, 2))
    with make(other, tmp_path / "o") as opt2:
        before = params_of(other)
        with pytest.raises(CheckpointMismatchError) as e:
            opt2.load_checkpoint(path)
        msg = str(e.value)
        assert "'fc1.weight': shape [64, 32] in the checkpoint, [48, 32] here" in msg
        assert "'extra.weight' [2, 2]: in this optimizer, not in the checkpoint" in msg
        assert "'fc2.weight'" in msg and "Build the optimizer" in msg
        assert len(e.value.mismatches) == 5  # fc1.weight, fc1.bias, fc2.weight, extra.weight, extra.bias
        assert_bitwise(before, params_of(other))


def test_param_groups_must_match_unless_kept(trained, tmp_path):
    model, _, _, path = trained
    other = MLP(seed=4)
    groups = [{"params": [other.fc1.weight, other.fc2.weight, other.out.weight]},
              {"params": [other.fc1.bias, other.fc2.bias, other.out.bias], "weight_decay": 0.0}]  # fmt: skip
    with TieredOptimizer(groups, tmp_path / "g", lr=0.5, chunk_bytes=CHUNK, host_budget=BUDGET) as opt2:
        with pytest.raises(CheckpointMismatchError, match="(?s)group0.param0.*nn.Module"):
            opt2.load_checkpoint(path)
    with make(other, tmp_path / "k", lr=0.5) as opt3:
        opt3.load_checkpoint(path, hparams="keep")
        assert opt3.param_groups[0]["lr"] == 0.5
        assert_bitwise(params_of(model), params_of(other))


def test_an_empty_last_param_group_loads_with_its_hyperparameters(tmp_path):
    # The usual decay / no-decay split on a model without biases leaves the no-decay group empty; the checkpoint
    # holds both groups, as the optimizer does, and the empty one's hyperparameters come back too.
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 8, bias=False))
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0, "lr": 3e-3}]  # fmt: skip
    with TieredOptimizer(groups, tmp_path / "nvme", lr=1e-2, chunk_bytes=CHUNK, host_budget=BUDGET) as opt:
        train(model, opt, 0, 2)
        path = opt.save_checkpoint(tmp_path / "own")
        opt.param_groups[1]["lr"] = 0.5
        opt.load_checkpoint(path)
        assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-3]
    ref = copy.deepcopy(model)
    torch_groups = [{"params": list(ref.parameters()), "weight_decay": 0.1},
                    {"params": [], "weight_decay": 0.0, "lr": 3e-3}]  # fmt: skip
    torch_opt = torch.optim.AdamW(torch_groups, lr=1e-2)
    train(ref, torch_opt, 2, 1)
    back = import_torch_state_dict(torch_opt.state_dict(), list(ref.parameters()), tmp_path / "from-torch")
    with TieredOptimizer(groups, tmp_path / "o", lr=0.5, chunk_bytes=CHUNK, host_budget=BUDGET) as opt2:
        opt2.load_checkpoint(back)
        assert [g["lr"] for g in opt2.param_groups] == [1e-2, 3e-3]
        assert opt2.step_counts == [1, 1]
        assert_bitwise(params_of(ref), params_of(model))


@pytest.mark.parametrize("case", ["frozen", "zero-size"])
def test_an_optimizer_with_no_state_chunks_loads_its_checkpoint(tmp_path, case):
    # A second optimizer for a backbone frozen for the first epochs (built from a list, it lays out state only once
    # the parameters thaw), or one whose parameters are all zero-size, holds no chunks: the load raised
    # "max() arg is an empty sequence". It loads as load_state_dict does: step count, hyperparameters, scheduler.
    def build(path, lr):
        p = nn.Parameter(torch.ones(4), requires_grad=False) if case == "frozen" else nn.Parameter(torch.zeros(0))
        opt = TieredOptimizer([p], path, lr=lr, chunk_bytes=CHUNK, host_budget=BUDGET)
        return p, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    p, opt, sched = build(tmp_path / "nvme", 1e-2)
    with opt:
        for _ in range(3):
            if case == "zero-size":
                p.grad = torch.zeros(0)
            opt.step()
            sched.step()
        path = opt.save_checkpoint(tmp_path / "ckpt", scheduler=sched)
        saved_sd, saved_sched = opt.state_dict(), sched.state_dict()
    p2, opt2, sched2 = build(tmp_path / "nvme-2", 0.5)
    with opt2:
        assert opt2.load_checkpoint(path, scheduler=sched2)["step"] == 3
        assert opt2.param_groups[0]["lr"] == 1e-2 * 0.5
        assert sched2.state_dict() == saved_sched
        loaded = opt2.state_dict()
        assert loaded["param_groups"] == saved_sd["param_groups"]
        assert loaded["state"].keys() == saved_sd["state"].keys()
        for i, s in saved_sd["state"].items():
            assert all(torch.equal(loaded["state"][i][k], v) for k, v in s.items()), i


def test_errors_for_bad_arguments(trained, tmp_path):
    model, opt, _, path = trained
    with pytest.raises(TypeError, match="extra must be a dict"):
        opt.save_checkpoint(tmp_path / "x", extra=[1])
    with pytest.raises(ValueError, match="keep_last"):
        opt.save_checkpoint(tmp_path / "x", keep_last=0)
    with pytest.raises(ValueError, match="verify must be"):
        opt.load_checkpoint(path, verify="never")
    with pytest.raises(ValueError, match="no scheduler state"):
        opt.save_checkpoint(tmp_path / "nosched")
        opt.load_checkpoint(tmp_path / "nosched", scheduler=torch.optim.lr_scheduler.StepLR(opt, 2))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(CheckpointPathError, match="not a tiered checkpoint"):
        opt.save_checkpoint(tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    with pytest.raises(TypeError, match="TieredOptimizer"):
        save_checkpoint(torch.optim.AdamW(model.parameters()), tmp_path / "y")


def test_an_empty_path_is_refused_by_name_not_taken_for_the_current_folder(trained, tmp_path, monkeypatch, capsys):
    """``""`` is what an unset variable gives ("$CKPT_DIR/..." aside): os.path.abspath takes it for the current
    folder, so a save replaced the folder the process stood in (its cwd then a deleted folder), and a load, an export,
    ``latest_checkpoint`` or the CLI read it. Every way in refuses it by name, before anything is read or written."""
    from tiered import cli as bench_cli

    model, opt, _, path = trained
    monkeypatch.chdir(path)  # the worst case: the current folder is a checkpoint, which a save may replace
    before = {n: os.stat(os.path.join(path, n)).st_mtime_ns for n in os.listdir(path)}
    sd = torch.optim.AdamW(model.parameters()).state_dict()
    calls = {
        "opt.save_checkpoint": lambda: opt.save_checkpoint(""),
        "opt.load_checkpoint": lambda: opt.load_checkpoint(""),
        "save_checkpoint": lambda: save_checkpoint(opt, ""),
        "load_checkpoint": lambda: load_checkpoint(opt, ""),
        "save_checkpoint(chunked_state)": lambda: save_checkpoint(opt.chunked_state, ""),
        "load_checkpoint(chunked_state)": lambda: load_checkpoint(opt.chunked_state, ""),
        "export_torch_state_dict": lambda: export_torch_state_dict(""),
        "export_model_state_dict": lambda: export_model_state_dict(""),
        "import_torch_state_dict": lambda: import_torch_state_dict(sd, model, ""),
        "inspect_checkpoint": lambda: inspect_checkpoint(""),
        "verify_checkpoint": lambda: verify_checkpoint(""),
    }
    for what, call in calls.items():
        with pytest.raises(ValueError, match=r"^checkpoint path is empty: pass a folder, e\.g\. ckpt/step-1000"):
            call()
            pytest.fail(f"{what} took '' for the current folder")
    with pytest.raises(ValueError, match="checkpoint root is empty: pass a folder, e.g. ckpt"):
        latest_checkpoint("")
    for main in (cli_main, bench_cli.main):
        for command in (["verify", ""], ["inspect", ""], ["verify", "", "--json"]):
            assert main(command) == 2, command  # a usage error, as argparse's: one line, no traceback
            out, err = capsys.readouterr()
            assert out == "" and err.count("\n") == 1 and ": error: checkpoint path is empty: pass a folder" in err
    assert os.getcwd() == path and os.path.isdir(path)  # still there, the checkpoint it holds untouched
    assert {n: os.stat(os.path.join(path, n)).st_mtime_ns for n in os.listdir(path)} == before
    assert opt.load_checkpoint(path)["step"] == 4  # nothing was dropped or broken on the way
    train(model, opt, 4, 1)


def test_the_readme_quotes_the_empty_path_errors_as_raised():
    """README's failure table quoted "checkpoint path is empty: ..." for every way in, ``latest_checkpoint`` among
    them, which says "checkpoint root is empty: ..." (it takes a root of checkpoints, not one). Each message, up to
    the parenthesis both end with, is quoted in the table's row."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "..", "README.md")).read().splitlines()
    (row,) = [line for line in readme if line.startswith('| an empty path (`""`')]
    for call in (lambda: inspect_checkpoint(""), lambda: latest_checkpoint("")):
        with pytest.raises(ValueError) as e:
            call()
        said, _, _ = str(e.value).partition(" (an empty path")
        assert f'"{said}"' in row, said


def test_a_misspelled_keyword_names_the_public_method_before_anything_runs(trained, tmp_path):
    """``opt.load_checkpoint(path, schedular=sched)`` raised ``prepare_checkpoint()``'s TypeError, an internal
    function's, after the load had dropped what backward started and followed the param set. The methods take the
    functions' keywords by name, so Python itself refuses any other, naming the method, before anything runs."""
    model, opt, sched, path = trained
    ran = []
    opt._drop_started = lambda *a, **k: ran.append("_drop_started")  # what a load runs first
    opt._follow_param_set = lambda: ran.append("_follow_param_set")
    try:
        with pytest.raises(TypeError, match=r"^TieredOptimizer\.load_checkpoint\(\) got an unexpected keyword argu"):
            opt.load_checkpoint(path, schedular=sched)
        with pytest.raises(TypeError, match=r"^TieredOptimizer\.save_checkpoint\(\) got an unexpected keyword argu"):
            opt.save_checkpoint(tmp_path / "new", keeplast=2)
        with pytest.raises(TypeError, match=r"^load_checkpoint\(\) got an unexpected keyword argument 'schedular'"):
            load_checkpoint(opt, path, schedular=sched)
    finally:
        del opt._drop_started, opt._follow_param_set
    assert ran == [] and not (tmp_path / "new").exists()
    from tiered.checkpoint.sharded import load_sharded, save_sharded

    def keywords(fn) -> dict:
        return {n: p.default for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}

    # One set of options for each, whichever way in: the method, the function, FSDP2's collective forms.
    assert keywords(TieredOptimizer.save_checkpoint) == keywords(save_checkpoint) == keywords(save_sharded)
    assert keywords(TieredOptimizer.load_checkpoint) == keywords(load_checkpoint)
    assert keywords(load_sharded) == {**keywords(load_checkpoint), "lay_out": None}
    assert opt.load_checkpoint(path, scheduler=sched)["step"] == 4
    train(model, opt, 4, 1, sched)


def test_extra_that_needs_pickle_warns_and_loads_only_when_trusted(trained, tmp_path):
    _, opt, _, _ = trained
    with pytest.warns(RuntimeWarning, match="weights_only=False"):
        path = opt.save_checkpoint(tmp_path / "pickled", extra={"when": datetime.date(2024, 5, 1)})
    with pytest.raises(ValueError, match="weights_only=False"):
        opt.load_checkpoint(path)
    assert opt.load_checkpoint(path, weights_only=False)["extra"] == {"when": datetime.date(2024, 5, 1)}


# ---------------------------------------------------------------------------------------------- damage
def flip_byte(path, offset):
    from helpers import flip_byte as flip  # here: a child process imports this file without tests/ on its path

    flip(path, offset)


DAMAGE = {
    "flipped bit": ("exp_avg_sq.bin", lambda p: flip_byte(p, os.path.getsize(p) - 100)),
    "truncated": ("master.bin", lambda p: os.truncate(p, os.path.getsize(p) // 2)),
    "deleted": ("exp_avg.bin", os.unlink),
    "deleted objects": ("objects.pt", os.unlink),
    "manifest bit": ("manifest.json", lambda p: flip_byte(p, os.path.getsize(p) // 2)),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damage_is_reported_by_file_name(trained, tmp_path, kind):
    model, opt, _, path = trained
    good = opt.save_checkpoint(tmp_path / "ckpt" / "step-4b")  # a sibling that stays intact
    name, damage = DAMAGE[kind]
    damage(os.path.join(path, name))
    other = MLP(seed=11)
    with make(other, tmp_path / "o") as opt2:
        before = params_of(other)
        with pytest.raises(CheckpointCorruptError) as e:
            opt2.load_checkpoint(path, verify="first" if kind == "flipped bit" else "stream")
        assert name in str(e.value) and "Load an earlier checkpoint" in str(e.value)
        assert isinstance(e.value, OSError)
        assert_bitwise(before, params_of(other))  # found before the optimizer was touched
        with pytest.raises(CheckpointCorruptError, match=name):
            verify_checkpoint(path)
        assert cli_main(["verify", path]) == 2  # not a usable checkpoint, as for a hostile one
        opt2.load_checkpoint(good)  # the intact one still loads
        assert_bitwise(params_of(model), params_of(other))


def test_streamed_load_names_a_late_bad_segment_and_says_partly_loaded(trained, tmp_path):
    _, _, _, path = trained
    flip_byte(os.path.join(path, "master.bin"), os.path.getsize(os.path.join(path, "master.bin")) - 8)
    with make(MLP(seed=2), tmp_path / "o") as opt2:
        with pytest.raises(CheckpointCorruptError, match="master.bin.*\n.*partly loaded") as e:
            opt2.load_checkpoint(path)
        assert e.value.partial_load is True
        with pytest.raises(OptimizerBrokenError):  # as README's failure table says: no step until a load is whole
            opt2.step()


def test_a_folder_without_manifest_is_never_loaded(trained, tmp_path):
    _, opt, _, path = trained
    os.rename(os.path.join(path, "manifest.json"), os.path.join(path, "manifest.json.bak"))
    with pytest.raises(CheckpointNotFoundError, match="no manifest.json.*never loaded"):
        opt.load_checkpoint(path)
    assert latest_checkpoint(os.path.dirname(path)) is None  # nothing complete to resume from
    with pytest.raises(CheckpointNotFoundError, match="nothing there"):
        opt.load_checkpoint(tmp_path / "missing")
    assert cli_main(["inspect", str(tmp_path / "missing")]) == 2


# ---------------------------------------------------------------------------- overwrite and retention
def test_overwrite_keep_last_and_latest(trained, tmp_path):
    model, opt, sched, _ = trained
    root = tmp_path / "runs"
    best = opt.save_checkpoint(root / "best")
    for step in range(5, 9):
        train(model, opt, step, 1, sched)
        opt.save_checkpoint(root / f"step-{step}", keep_last=2, extra={"step": step})
    assert sorted(os.listdir(root)) == ["best", "step-7", "step-8"]  # "best" is another series
    assert latest_checkpoint(root) == str(root / "step-8")
    train(model, opt, 9, 1, sched)
    opt.save_checkpoint(best)  # overwrite in place
    assert inspect_checkpoint(best)["step"] == 9 and sorted(os.listdir(root)) == ["best", "step-7", "step-8"]
    assert load_checkpoint(opt, best)["step"] == 9


@pytest.mark.filterwarnings("ignore:keep_last=2 pruned nothing")  # seed2's first save: said, conditionally
def test_keep_last_prunes_only_names_that_differ_in_their_last_number(trained, tmp_path):
    # Two runs saving into one folder, their names differing by a seed: the second run's keep_last once deleted
    # every checkpoint of the first (a series was any names that differed only in digits).
    _, opt, _, _ = trained
    root = tmp_path / "runs"
    for name in ("seed1-step-1", "seed1-step-2", "seed2-step-1", "seed2-step-2", "seed2-step-3"):
        opt.save_checkpoint(root / name, keep_last=2)
    assert sorted(os.listdir(root)) == ["seed1-step-1", "seed1-step-2", "seed2-step-2", "seed2-step-3"]
    assert fsops.series_key("lr1e-4-step-100") != fsops.series_key("lr3e-4-step-100")
    assert fsops.series_key("step-100") == fsops.series_key("step-2000") != fsops.series_key("best")


def test_keep_last_says_so_when_a_name_whose_step_is_not_last_would_never_be_pruned(trained, tmp_path):
    # "gpt-step-100-bf16": its last number is 16, so every save is a series of its own and keep_last pruned
    # nothing, ever, without a word, until the disk filled.
    _, opt, _, _ = trained
    root = tmp_path / "runs"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.save_checkpoint(root / "gpt-step-1-bf16", keep_last=2)  # alone: nothing to say
        opt.save_checkpoint(root / "gpt-step-2-bf16", keep_last=2)  # one other: within keep_last
    with pytest.warns(UserWarning, match=r"keep_last=2 pruned nothing.*step last in the name"):
        opt.save_checkpoint(root / "gpt-step-3-bf16", keep_last=2)
    assert len(os.listdir(root)) == 3  # still nothing deleted: it may be another run's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("step-1", "step-2", "step-3"):  # a series that prunes: nothing to say
            opt.save_checkpoint(root / name, keep_last=2)


def test_a_load_reads_the_checkpoint_it_opened_while_another_process_commits_a_new_one_there(trained, tmp_path):
    # An evaluator loading "latest" while the trainer commits a new "latest": the reads after the commit came from
    # the new files, checked against the old manifest's CRCs, so an intact checkpoint was reported damaged.
    model, opt, _, path = trained
    before = export_model_state_dict(path)  # what the checkpoint being loaded holds
    other = MLP(seed=1)
    evaluator = make(other, tmp_path / "nvme-eval")
    install = evaluator.chunked_state.install_chunk_rows
    installed = []

    def commit_meanwhile(chunk, rows):
        installed.append(chunk.key)
        if len(installed) == 1:  # after the first of its 7 chunks: the old checkpoint is swapped out and deleted
            train(model, opt, 4, 1)
            opt.save_checkpoint(path)
        return install(chunk, rows)

    evaluator.chunked_state.install_chunk_rows = commit_meanwhile
    try:
        info = evaluator.load_checkpoint(path)
    except CheckpointCorruptError as e:  # its traceback holds staging buffers freed since: not shown
        pytest.fail(f"an intact checkpoint was reported damaged: {e}", pytrace=False)
    finally:
        del evaluator.chunked_state.install_chunk_rows
    assert info["step"] == 4 and len(installed) == 7 and inspect_checkpoint(path)["step"] == 5
    assert_bitwise(before, params_of(other))  # the old checkpoint whole, none of the new one
    evaluator.close()


@pytest.mark.parametrize("how", ["load_checkpoint", "gather"])
def test_a_load_leaves_the_saved_parameter_names_out_of_the_optimizer_s_groups(tmp_path, how):
    # A checkpoint of TieredOptimizer(model.named_parameters()) holds each group's param_names; a load copied them
    # into a TieredOptimizer(model)'s groups: its state_dict() then named them, and torch's add_param_group refused
    # every unnamed group after ("all optimizer param groups should be with/without names").
    model = MLP()
    with make(model.named_parameters(), tmp_path / "nvme") as named:
        train(model, named, 0, 1)
        assert "param_names" in named.param_groups[0]
        path = named.save_checkpoint(tmp_path / "ckpt" / "step-1")
    other = MLP(seed=1)
    with make(other, tmp_path / "nvme-2") as opt:
        if how == "gather":  # the path of a sharded checkpoint (reshard.py), here of a single-process one
            state = opt.chunked_state
            gather(state, path, whole_layout(state), str(tmp_path)).install()
        else:
            opt.load_checkpoint(path)
        assert_bitwise(params_of(model), params_of(other))
        assert "param_names" not in opt.param_groups[0] and "param_names" not in opt.state_dict()["param_groups"][0]
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))]})
    with make(model.named_parameters(), tmp_path / "nvme-3") as again:  # a named optimizer keeps its own names
        again.load_checkpoint(path)
        assert again.param_groups[0]["param_names"] == [n for n, _ in model.named_parameters()]


@pytest.mark.parametrize("hparams", ["checkpoint", "keep"])
def test_state_of_a_layer_frozen_at_the_save_loads_where_it_is_frozen_and_the_run_resumes_as_adamw(tmp_path, hparams):
    """Staged fine-tuning: fc1 trains, is frozen (its state kept, as torch keeps it), a checkpoint is saved, and the
    run resumes on the same model built with fc1 frozen. The load refused it ("shape [64, 32] in the checkpoint,
    [0] here": the empty stand-in of a frozen parameter); fc1's state is now laid out first, as load_state_dict
    lays it out, and the run goes on, fc1 thawed later, bitwise as torch.optim.AdamW's uninterrupted one."""
    ref, model = MLP(), MLP()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    with make(list(model.named_parameters()), tmp_path / "nvme") as opt:  # a list: it follows freezes and thaws
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, 0, 2)
            m.fc1.requires_grad_(False)
            train(m, o, 2, 1)
        path = opt.save_checkpoint(tmp_path / "ckpt")
    resumed = MLP(seed=1)
    resumed.fc1.requires_grad_(False)
    with make(list(resumed.named_parameters()), tmp_path / "nvme-2") as opt:
        opt.load_checkpoint(path, hparams=hparams)
        assert_bitwise(params_of(model), params_of(resumed))  # fc1's weights too: the checkpoint holds them
        assert opt.step_counts == [2, 2, 3, 3, 3, 3]
        for m, o in ((ref, ref_opt), (resumed, opt)):
            train(m, o, 3, 1)
            m.fc1.requires_grad_(True)
            train(m, o, 4, 2)
        assert_bitwise(params_of(ref), params_of(resumed))
        ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
        assert sorted(ours) == sorted(theirs) == list(range(6))
        for i, s in theirs.items():
            assert float(ours[i]["step"]) == float(s["step"]), i
            assert torch.equal(ours[i]["exp_avg"], s["exp_avg"]) and torch.equal(ours[i]["exp_avg_sq"], s["exp_avg_sq"])


def test_the_function_form_loads_state_for_a_parameter_frozen_here_as_the_method_does(tmp_path):
    """``tiered.checkpoint.load_checkpoint(opt, path)`` refused the checkpoint of a run resumed with a layer frozen
    ("shape [64, 32] in the checkpoint, [0] here (frozen here? load with TieredOptimizer.load_checkpoint)"), which
    the method loads; the function now loads through the method, to the same weights, state and step counts."""
    model = MLP()
    with make(list(model.named_parameters()), tmp_path / "nvme") as opt:
        train(model, opt, 0, 2)
        model.fc1.requires_grad_(False)
        train(model, opt, 2, 1)
        path = opt.save_checkpoint(tmp_path / "ckpt", extra={"epoch": 1})
    loaded = {}
    for how in ("method", "function"):
        resumed = MLP(seed=1)
        resumed.fc1.requires_grad_(False)
        with make(list(resumed.named_parameters()), tmp_path / f"nvme-{how}") as opt:
            info = opt.load_checkpoint(path) if how == "method" else load_checkpoint(opt, path)
            assert info["step"] == 3 and info["extra"] == {"epoch": 1} and opt.step_counts == [2, 2, 3, 3, 3, 3]
            loaded[how] = (params_of(resumed), opt.state_dict()["state"])
    assert_bitwise(loaded["method"][0], loaded["function"][0])
    assert_bitwise(params_of(model), loaded["function"][0])
    ours, theirs = loaded["function"][1], loaded["method"][1]
    assert sorted(ours) == sorted(theirs) == list(range(6))
    for i, s in theirs.items():
        assert all(torch.equal(ours[i][k], v) for k, v in s.items()), i


def test_the_function_form_saves_as_the_method_does(trained, tmp_path):
    """``tiered.checkpoint.save_checkpoint(opt, path)`` saved the state as it lay, past the optimizer: a write
    through ``opt.state[p]`` not yet taken in was left out, and a broken optimizer was saved. It now saves through
    ``opt.save_checkpoint``."""
    model, opt, _, path = trained
    exp_avg = opt.state[model.fc1.weight]["exp_avg"]
    doubled = exp_avg.mul_(2).clone()  # in place: the optimizer takes it in at its next call
    saved = save_checkpoint(opt, tmp_path / "function", extra={"epoch": 2})
    with make(MLP(seed=2), tmp_path / "o") as opt2:
        assert load_checkpoint(opt2, saved)["extra"] == {"epoch": 2}
        assert torch.equal(state_by_name(opt2)["fc1.weight"]["exp_avg"], doubled)
        flip_byte(os.path.join(path, "master.bin"), os.path.getsize(os.path.join(path, "master.bin")) - 8)
        with pytest.raises(CheckpointCorruptError, match="partly loaded"):
            opt2.load_checkpoint(path)
        with pytest.raises(OptimizerBrokenError):  # torn: no checkpoint of it
            save_checkpoint(opt2, tmp_path / "torn")
    assert not os.path.exists(tmp_path / "torn")


@pytest.mark.parametrize("via", ["load_checkpoint", "gather"])
def test_a_parameter_frozen_at_the_save_and_trainable_here_starts_fresh_as_in_adamw(tmp_path, via):
    """Staged unfreezing resumed from a checkpoint of the frozen stage, the layer thawed at build: load_checkpoint
    refused it ("'fc2.weight': shape [0] in the checkpoint, [64, 64] here"), where load_state_dict of the same state
    starts fc2 fresh, as torch's AdamW does. It now loads the same way (also through the gather of sharded loads),
    and the run goes on bitwise as torch.optim.AdamW's."""
    ref, model = MLP(), MLP()
    for m in (ref, model):
        m.fc2.requires_grad_(False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    with make(list(model.named_parameters()), tmp_path / "nvme") as opt:
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, 0, 2)
        path = opt.save_checkpoint(tmp_path / "ckpt")
    resumed = MLP(seed=1)
    resumed.load_state_dict(model.state_dict())  # a frozen layer's weights are the model's, not the checkpoint's
    ref.fc2.requires_grad_(True)
    with make(list(resumed.named_parameters()), tmp_path / "nvme-2") as opt:
        train(resumed, opt, 0, 1)  # state of its own first, which the load replaces (fc2's with fresh state)
        resumed.load_state_dict(model.state_dict())
        if via == "gather":
            gather(opt.chunked_state, path, whole_layout(opt.chunked_state), str(tmp_path)).install()
        else:
            assert opt.load_checkpoint(path)["step"] == 2
        assert_bitwise(params_of(model), params_of(resumed))
        assert opt.step_counts == [2, 2, 0, 0, 2, 2]
        for m, o in ((ref, ref_opt), (resumed, opt)):
            train(m, o, 2, 2)
        assert_bitwise(params_of(ref), params_of(resumed))
        ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
        for i, s in theirs.items():
            assert float(ours[i]["step"]) == float(s["step"]), i
            assert torch.equal(ours[i]["exp_avg"], s["exp_avg"]) and torch.equal(ours[i]["exp_avg_sq"], s["exp_avg_sq"])


def test_a_parameter_frozen_at_the_save_is_left_out_of_the_model_export(tmp_path):
    """An optimizer built from all of a model's parameters, some frozen (as torch.optim.AdamW usually is): the
    model export gave the frozen ones the checkpoint's empty [0] entries, and the documented
    ``model.load_state_dict(export_model_state_dict(path), strict=False)`` failed with a size mismatch. They are
    left out: the model keeps its own weights for them, and gets the trained ones."""
    model = MLP()
    model.fc2.weight.requires_grad_(False)
    with make(list(model.named_parameters()), tmp_path / "nvme") as opt:
        train(model, opt, 0, 2)
        path = opt.save_checkpoint(tmp_path / "ckpt")
    weights = export_model_state_dict(path)
    assert list(weights) == [n for n, p in model.named_parameters() if n != "fc2.weight"]
    fresh = MLP(seed=3)
    own = fresh.fc2.weight.detach().clone()
    assert fresh.load_state_dict(weights, strict=False).missing_keys == ["fc2.weight"]
    assert torch.equal(fresh.fc2.weight, own)
    trained = params_of(model)
    trained["fc2.weight"] = own
    assert_bitwise(params_of(fresh), trained)
    assert sorted(export_torch_state_dict(path)["state"]) == [0, 1, 3, 4, 5]  # nor state for it, as in torch's


@pytest.mark.parametrize("shape", [(0,), (3, 0)])
def test_state_of_a_zero_size_parameter_frozen_here_loads_and_takes_writes_as_load_state_dict_s(tmp_path, shape):
    """A checkpoint's state for a zero-size parameter frozen here was not laid out, as load_state_dict lays it out:
    an in-place write to its opt.state made the next state_dict() raise that it 'was frozen when the state was laid
    out' (the user never assigned opt.state[p]), and of shape (3, 0) the load was refused ('shape [3, 0] in the
    checkpoint, [0] here')."""
    p0, p1 = nn.Parameter(torch.randn(100)), nn.Parameter(torch.zeros(shape))
    kw = {"lr": 1e-2, "chunk_bytes": CHUNK, "host_budget": BUDGET}
    with TieredOptimizer([p0, p1], tmp_path / "a", **kw) as opt:
        p0.grad, p1.grad = torch.randn(100), torch.zeros(shape)
        opt.step()
        path = opt.save_checkpoint(tmp_path / "ckpt")
    p1.requires_grad_(False)
    p1.grad = None
    with TieredOptimizer([p0, p1], tmp_path / "b", **kw) as opt:
        opt.load_checkpoint(path)
        state = opt.state[p1]
        assert float(state["step"]) == 1 and state["exp_avg"].shape == shape
        state["exp_avg"].zero_()  # in place: taken in at the next call, as for any parameter
        assert opt.state_dict()["state"][1]["exp_avg"].shape == shape
        again = opt.save_checkpoint(tmp_path / "again")
    p1.requires_grad_(True)
    with TieredOptimizer([p0, p1], tmp_path / "c", **kw) as opt:
        opt.load_checkpoint(again)
        assert opt.step_counts == [1, 1]


@pytest.mark.parametrize("via", ["load_checkpoint", "gather"])
def test_a_parameter_frozen_here_that_the_checkpoint_never_stepped_gets_no_state_as_in_load_state_dict(tmp_path, via):
    """A parameter trainable when the state was laid out but frozen before any step is saved with its shape and step
    0. Resumed with it frozen, load_checkpoint laid out state for it (12 bytes an element of host memory or disk)
    where load_state_dict of the same state (no entry: step 0) lays out none, and torch's AdamW keeps none."""
    head, body = nn.Parameter(torch.randn(1000)), nn.Parameter(torch.randn(20_000))
    kw = {"lr": 1e-2, "chunk_bytes": CHUNK, "host_budget": "1MiB"}
    with TieredOptimizer([head, body], tmp_path / "a", **kw) as opt:
        body.requires_grad_(False)  # frozen right after the build: never stepped
        for s in range(2):
            head.grad = torch.randn(1000, generator=torch.Generator().manual_seed(s))
            opt.step()
        assert sum(c.numel for c in opt.chunked_state.chunks) == 21_000
        path = opt.save_checkpoint(tmp_path / "ckpt")
        sd = opt.state_dict()
        weights = head.detach().clone()
    head.data.zero_()
    body_now = body.detach().clone()
    with TieredOptimizer([head, body], tmp_path / "b", **kw) as opt:
        if via == "gather":  # the sharded checkpoints' load (reshard.py), here of a single-process one
            state = opt.chunked_state
            gather(state, path, whole_layout(state), str(tmp_path)).install()
        else:
            opt.load_checkpoint(path)
        assert sum(c.numel for c in opt.chunked_state.chunks) == 1000  # as after load_state_dict(sd), below
        assert opt.step_counts == [2, 0] and opt.state[body] == {} and torch.equal(head, weights)
        assert torch.equal(body, body_now)  # a frozen parameter's weights are the model's
        loaded = opt.state_dict()
    with TieredOptimizer([head, body], tmp_path / "c", **kw) as opt:
        opt.load_state_dict(sd)
        assert sum(c.numel for c in opt.chunked_state.chunks) == 1000
        assert sorted(loaded["state"]) == sorted(opt.state_dict()["state"]) == [0]
    body.requires_grad_(True)  # thawed: it starts fresh, as torch's AdamW starts a parameter it holds no state for
    with TieredOptimizer([head, body], tmp_path / "d", **kw) as opt:
        opt.load_checkpoint(path)
        assert opt.step_counts == [2, 0] and torch.equal(head, weights)
    body.requires_grad_(False)
    flip_byte(os.path.join(path, "exp_avg.bin"), 4 * 15_000)  # in body's rows, which the load only checks
    with TieredOptimizer([head, body], tmp_path / "e", **kw) as opt:
        with pytest.raises(CheckpointCorruptError, match="exp_avg.bin") as e:
            opt.load_checkpoint(path)
        assert not e.value.partial_load


@pytest.mark.parametrize("via", ["method", "function"])
def test_a_never_stepped_entry_of_another_shape_than_a_parameter_frozen_here_is_refused_by_name(tmp_path, via):
    """A checkpoint whose never-stepped entry for 'b' has shape [5] loaded silently into an optimizer where 'b' is
    frozen with shape [7] (its empty stand-in took any entry without state), though load_checkpoint restores
    weights and a checkpoint of another model must be refused by name. Into a zero-size 'b' it still loads, as
    torch's AdamW's load_state_dict takes such a state dict (no entry for 'b')."""
    a, b = nn.Parameter(torch.randn(100)), nn.Parameter(torch.randn(5))
    kw = {"lr": 1e-2, "chunk_bytes": CHUNK, "host_budget": BUDGET}
    with TieredOptimizer({"a": a, "b": b}.items(), tmp_path / "a", **kw) as opt:
        for _ in range(2):
            a.grad = torch.randn(100)
            opt.step()
        path = opt.save_checkpoint(tmp_path / "ckpt")
    a2, b2 = nn.Parameter(torch.zeros(100)), nn.Parameter(torch.randn(7), requires_grad=False)
    with TieredOptimizer({"a": a2, "b": b2}.items(), tmp_path / "b", **kw) as opt:
        load = opt.load_checkpoint if via == "method" else lambda p: load_checkpoint(opt, p)
        with pytest.raises(CheckpointMismatchError, match=r"'b': shape \[5\] in the checkpoint, \[7\] here"):
            load(path)
        assert opt.step_counts == [0, 0] and not a2.any()  # nothing loaded
        a2.grad = torch.randn(100)
        opt.step()  # not broken
    b3 = nn.Parameter(torch.empty(3, 0), requires_grad=False)
    with TieredOptimizer({"a": a2, "b": b3}.items(), tmp_path / "c", **kw) as opt:
        assert opt.load_checkpoint(path)["step"] == 2 and opt.step_counts == [2, 0] and opt.state[b3] == {}


def test_a_checkpoint_with_state_for_a_parameter_frozen_here_that_does_not_fit_changes_nothing(tmp_path):
    """The state a checkpoint holds for a parameter frozen here is checked against its real shape before anything is
    laid out: the mismatch is named with that shape, and the optimizer is as it was."""
    model = MLP()
    with make(list(model.named_parameters()), tmp_path / "nvme") as opt:
        train(model, opt, 0, 1)
        model.fc1.requires_grad_(False)
        path = opt.save_checkpoint(tmp_path / "ckpt")
    other = MLP(seed=1, width=48)  # fc1 [48, 32]: another model
    other.fc1.requires_grad_(False)
    with make(list(other.named_parameters()), tmp_path / "nvme-2") as opt:
        train(other, opt, 0, 1)
        before = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
        weights = params_of(other)
        with pytest.raises(
            CheckpointMismatchError, match=r"'fc1.weight': shape \[64, 32\] in the checkpoint, \[48, 32\] here"
        ):
            opt.load_checkpoint(path)
        assert_bitwise(weights, params_of(other))
        after = opt.state_dict()["state"]
        assert sorted(after) == sorted(before) == [2, 3, 4, 5] and opt.step_counts == [0, 0, 1, 1, 1, 1]
        assert all(torch.equal(after[i][k], v) for i, s in before.items() for k, v in s.items())
        train(other, opt, 1, 1)  # not broken


def _frozen_base(seed: int = 0) -> MLP:
    """An MLP whose fc2 is a frozen base weight (peft's LoRA freezes the base model so)."""
    model = MLP(seed)
    model.fc2.requires_grad_(False)
    return model


def _build(model: MLP, form: str, path) -> TieredOptimizer:
    """``TieredOptimizer(model)`` (frozen parameters left out) or ``TieredOptimizer(model.named_parameters())``
    (frozen ones kept as empty stand-ins, followed once thawed)."""
    return make(model if form == "module" else list(model.named_parameters()), path)


def _resumed(path, form: str, via: str, folder) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """A fresh frozen-base model with the optimizer built as ``form``, loaded from ``path`` (``via`` the load or the
    sharded loads' gather), trained 2 steps on: its weights and its state by name (step counts included)."""
    model = _frozen_base(seed=5)
    with _build(model, form, folder / f"nvme-{form}-{via}") as opt:
        if via == "gather":
            gather(opt.chunked_state, path, whole_layout(opt.chunked_state), str(folder)).install()
        else:
            assert opt.load_checkpoint(path)["step"] == 2
        train(model, opt, 2, 2)
        state = state_by_name(opt)
    return params_of(model), state


@pytest.mark.parametrize("via", ["load_checkpoint", "gather"])
@pytest.mark.parametrize("saved,loaded", [("module", "named"), ("named", "module"), ("torch", "module")])
def test_a_checkpoint_loads_into_an_optimizer_over_the_same_model_built_the_other_way(tmp_path, saved, loaded, via):
    """A model with a frozen part: a checkpoint of ``TieredOptimizer(model.named_parameters())`` did not load into
    ``TieredOptimizer(model)``, nor the reverse, nor an import of the usual ``AdamW(model.parameters())``'s state dict
    into ``TieredOptimizer(model)``: each frozen weight, which holds no state, was a mismatch ('in the checkpoint, not
    in this optimizer' or the reverse). Such entries load as no state either way: the resumed run is bitwise the one
    resumed into the optimizer built as the checkpoint's was (for the import: built from the named parameters)."""
    model = _frozen_base()
    if saved == "torch":
        torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        train(model, torch_opt, 0, 2)
        path = import_torch_state_dict(torch_opt.state_dict(), list(model.named_parameters()), tmp_path / "ckpt")
    else:
        with _build(model, saved, tmp_path / "nvme") as opt:
            train(model, opt, 0, 2)
            path = opt.save_checkpoint(tmp_path / "ckpt")
    same = "named" if saved == "torch" else saved
    want_weights, want_state = _resumed(path, same, via, tmp_path)
    got_weights, got_state = _resumed(path, loaded, via, tmp_path)
    assert_bitwise(want_weights, got_weights)
    assert sorted(got_state) == sorted(want_state) == ["fc1.bias", "fc1.weight", "out.bias", "out.weight"]
    for name, s in want_state.items():
        assert s.keys() == got_state[name].keys() and float(s["step"]) == 4, name
        assert all(torch.equal(got_state[name][k], v) for k, v in s.items()), name
    if saved == "torch" and via == "load_checkpoint":  # the rows of an entry no parameter here has are checked too
        flip_byte(os.path.join(path, "exp_avg.bin"), 4 * (2112 + 100))  # in fc2.weight's, after fc1's 2112 elements
        with _build(_frozen_base(), loaded, tmp_path / "nvme-damaged") as opt:
            with pytest.raises(CheckpointCorruptError, match="exp_avg.bin") as e:
                opt.load_checkpoint(path)
            assert not e.value.partial_load


def test_a_trainable_parameter_missing_on_either_side_is_still_a_mismatch(tmp_path):
    """Entries that hold no state are passed over by the name check; a parameter that trains here but that the
    checkpoint lacks, or that the checkpoint holds state for but this optimizer lacks, is still refused by name,
    and the advice no longer says frozen parameters are left out (a list-built optimizer keeps them)."""
    frozen = _frozen_base()
    with make(frozen, tmp_path / "nvme") as opt:
        train(frozen, opt, 0, 1)
        without_fc2 = opt.save_checkpoint(tmp_path / "frozen")
    trainable = MLP()
    with make(trainable, tmp_path / "nvme-2") as opt:
        train(trainable, opt, 0, 1)
        with_fc2 = opt.save_checkpoint(tmp_path / "trainable")
    cases = [  # (model, form, checkpoint, where fc2 is missing)
        (MLP(seed=1), "module", without_fc2, "in this optimizer, not in the checkpoint"),
        (MLP(seed=1), "named", without_fc2, "in this optimizer, not in the checkpoint"),
        (_frozen_base(seed=1), "module", with_fc2, "in the checkpoint, not in this optimizer"),
    ]  # (a named optimizer over the frozen base lays fc2's state out: test_state_of_a_layer_frozen_at_the_save...)
    for k, (model, form, path, where) in enumerate(cases):
        with _build(model, form, tmp_path / f"o{k}") as opt:
            with pytest.raises(CheckpointMismatchError) as e:
                opt.load_checkpoint(path)
            assert e.value.mismatches == [f"'fc2.weight' [64, 64]: {where}", f"'fc2.bias' [64]: {where}"]
            assert "frozen parameters are not part of it" not in str(e.value)
            assert opt.step_counts == [0] * len(opt.step_counts)


@pytest.mark.parametrize("given", ["module", "pairs"])
@pytest.mark.parametrize("built", ["parameters", "trainable"])
def test_the_model_export_of_a_list_built_optimizer_s_checkpoint_takes_the_names_from_the_model(tmp_path, built, given):
    """A checkpoint of ``TieredOptimizer(model.parameters())`` names its parameters by position ('group0.param3'),
    so the documented ``model.load_state_dict(export_model_state_dict(path), strict=False)`` loaded nothing, and
    said nothing. Without names it now warns, saying what to pass; given the model (or the (name, parameter) pairs
    the optimizer was given) it names them as the model does, and the trained weights load."""
    model = _frozen_base()
    params = list(model.parameters()) if built == "parameters" else [p for p in model.parameters() if p.requires_grad]
    with make(params, tmp_path / "nvme") as opt:
        train(model, opt, 0, 2)
        path = opt.save_checkpoint(tmp_path / "ckpt")
    with pytest.warns(UserWarning, match="model_or_named_params=model"):
        assert all(n.startswith("group0.param") for n in export_model_state_dict(path))
    fresh = _frozen_base(seed=3)
    own = params_of(fresh)
    if given == "module":
        names = fresh
    else:
        names = [(n, p) for n, p in fresh.named_parameters() if built == "parameters" or p.requires_grad]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        weights = export_model_state_dict(path, model_or_named_params=names)
    assert list(weights) == ["fc1.weight", "fc1.bias", "out.weight", "out.bias"]
    assert fresh.load_state_dict(weights, strict=False).missing_keys == ["fc2.weight", "fc2.bias"]
    assert_bitwise(params_of(fresh), {**params_of(model), "fc2.weight": own["fc2.weight"], "fc2.bias": own["fc2.bias"]})


def test_a_model_export_refuses_names_that_do_not_fit_the_checkpoint(tmp_path):
    """The names given to a model export are checked against the checkpoint: the count, each shape, and a name the
    checkpoint has already. A wrong mapping would load weights into the wrong parameters."""
    model = MLP()
    with make(list(model.parameters()), tmp_path / "nvme") as opt:
        train(model, opt, 0, 1)
        positional = opt.save_checkpoint(tmp_path / "positional")
    with make(model, tmp_path / "nvme-2") as opt:
        named = opt.save_checkpoint(tmp_path / "named")
    with pytest.raises(ValueError, match="the checkpoint has 6 parameters, model_or_named_params gives 5"):
        export_model_state_dict(positional, model_or_named_params=list(model.named_parameters())[:5])
    with pytest.raises(CheckpointMismatchError, match=r"'fc1.weight': shape \[64, 32\] in the checkpoint, \[48, 32\]"):
        export_model_state_dict(positional, model_or_named_params=MLP(width=48))
    swapped = MLP(reverse=True)  # the same names, another order: its names go to other shapes
    with pytest.raises(CheckpointMismatchError, match="'out.weight'"):
        export_model_state_dict(positional, model_or_named_params=swapped)
    renamed = [(f"m.{n}", p) for n, p in model.named_parameters()]
    with pytest.raises(CheckpointMismatchError, match="'fc1.weight' in the checkpoint, not among the names given"):
        export_model_state_dict(named, model_or_named_params=renamed)
    assert list(export_model_state_dict(named, model_or_named_params=model)) == list(params_of(model))
    with pytest.raises(TypeError, match="model_or_named_params"):
        export_model_state_dict(positional, model_or_named_params=list(model.parameters()))
    first, rest = list(model.named_parameters())[-1:], list(model.named_parameters())[:-1]  # out.bias first
    with make([{"params": [p for _, p in g]} for g in (first, rest)], tmp_path / "nvme-3") as opt:
        two_groups = opt.save_checkpoint(tmp_path / "two-groups")
    with pytest.raises(ValueError, match="several param groups"):  # the model's order is not the groups'
        export_model_state_dict(two_groups, model_or_named_params=model)
    weights = export_model_state_dict(two_groups, model_or_named_params=first + rest)
    assert list(weights) == ["out.bias", *list(params_of(model))[:-1]]
    assert_bitwise(weights, params_of(model))


@pytest.mark.parametrize("given", ["thawed", "frozen-other", "trainable-pairs", "two-groups"])
def test_a_model_export_of_a_named_checkpoint_keeps_its_names_whatever_the_given_model_freezes(tmp_path, given):
    """``export_model_state_dict(path, model_or_named_params=model)``, the call convert.py shows for any checkpoint,
    refused a checkpoint of ``TieredOptimizer(model)`` (already named as the model names them) when the model given
    at export froze other parameters than the one saved (LoRA's frozen base; a fresh model built for the export has
    everything trainable): the count was matched as if the names were positional. The checkpoint's names are kept;
    the given names only have to hold them, with the shapes saved."""
    model = _frozen_base()
    groups = [{"params": [model.out.bias]}, {"params": [model.fc1.weight, model.fc1.bias, model.out.weight]}]
    named = dict(model.named_parameters())
    pairs = [[(n, p) for n, p in named.items() if any(p is q for q in g["params"])] for g in groups]
    built = [{"params": g} for g in pairs] if given == "two-groups" else model
    with make(built, tmp_path / "nvme") as opt:
        train(model, opt, 0, 2)
        path = opt.save_checkpoint(tmp_path / "ckpt")
    plain = export_model_state_dict(path)
    fresh = MLP(seed=3)  # built for the export: nothing frozen
    if given == "frozen-other":
        fresh.fc1.requires_grad_(False)
    names = [(n, p) for n, p in fresh.named_parameters() if n != "fc2.weight"] if given == "trainable-pairs" else fresh
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        weights = export_model_state_dict(path, model_or_named_params=names)
    assert list(weights) == list(plain)
    assert_bitwise(weights, plain)
    assert fresh.load_state_dict(weights, strict=False).missing_keys == ["fc2.weight", "fc2.bias"]
    with pytest.raises(CheckpointMismatchError, match=r"'fc1.weight': shape \[64, 32\] in the checkpoint, \[48, 32\]"):
        export_model_state_dict(path, model_or_named_params=MLP(width=48))
    renamed = [(f"m.{n}", p) for n, p in fresh.named_parameters()]
    with pytest.raises(CheckpointMismatchError, match="'fc1.weight' in the checkpoint, not among the names given"):
        export_model_state_dict(path, model_or_named_params=renamed)


def test_a_load_whose_o_direct_descriptor_is_refused_names_the_file_and_stops_its_engine(trained, tmp_path,
                                                                                       monkeypatch):  # fmt: skip
    # direct="on" where the O_DIRECT reopen of a file held open (through /proc/self/fd) fails, as on ramfs or
    # without /proc: the load raised a raw OSError naming /proc/self/fd/N, and left its engine's threads running.
    path = trained[3]
    real_open = os.open

    def refuse_direct_reopen(file, flags, *args, **kw):
        if str(file).startswith("/proc/self/fd/") and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", file)
        return real_open(file, flags, *args, **kw)

    def engine_threads():
        return sorted(t.ident for t in threading.enumerate() if t.name.startswith("io_engine"))

    with make(MLP(seed=1), tmp_path / "nvme-2") as opt:
        before = engine_threads()
        monkeypatch.setattr(os, "open", refuse_direct_reopen)
        with pytest.raises(DirectIOUnsupportedError, match="direct='auto' or 'off'") as e:
            opt.load_checkpoint(path, io=IOConfig(direct="on"))
        monkeypatch.undo()
        assert os.path.dirname(e.value.filename) == path and "/proc" not in str(e.value)
        assert engine_threads() == before


@pytest.mark.parametrize(
    "hparams",
    [
        {"betas": (torch.tensor(0.9), torch.tensor(0.999))},  # torch's AdamW takes tensors, and so does tiered
        {"eps": torch.tensor(1e-8), "weight_decay": torch.tensor(0.01)},
        {"lr": np.float32(1e-3)},
        {"lr": np.float64(1e-3)},  # a float subclass: what np.sqrt, np.logspace or a numpy-based LambdaLR give
    ],
    ids=["tensor-betas", "tensor-eps-wd", "np-float32-lr", "np-float64-lr"],
)
def test_hyperparameters_the_constructor_takes_are_saved_as_numbers_the_default_load_takes(tmp_path, hparams):
    # They were pickled as they were: the load refused them as "damaged" (or without weights_only=False), and
    # np.float64's save warned of objects "in extra or the scheduler state", where there were none.
    model = MLP()
    with make(model, tmp_path / "nvme", **hparams) as opt:
        train(model, opt, 0, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no weights_only warning
            path = opt.save_checkpoint(tmp_path / "ck")
    with make(MLP(), tmp_path / "nvme2") as fresh:
        assert fresh.load_checkpoint(path)["step"] == 1
        group = fresh.param_groups[0]
        for key in ("lr", "eps", "weight_decay"):
            assert type(group[key]) is float, (key, group[key])
        assert [type(b) for b in group["betas"]] == [float, float]
        assert group["lr"] == pytest.approx(float(hparams.get("lr", 1e-2)))
        assert group["betas"] == pytest.approx((0.9, 0.999))


@pytest.mark.parametrize("how", ["load_checkpoint", "gather"])
def test_a_tensor_lr_and_betas_keep_their_tensors_through_a_checkpoint_and_the_resume_is_bitwise(tmp_path, how):
    # torch's recipe for compiled steps: lr=torch.tensor(...), which the scheduler fill_()s. The load put a float in
    # the tensor's place: the scheduler then computed the lr in float64, the resumed run left the uninterrupted one
    # (by 3e-8 in 6 steps), and the user's tensor no longer drove the lr. The saved number is now filled into it.
    def hparams():
        return {"lr": torch.tensor(1e-2), "betas": (torch.tensor(0.9), torch.tensor(0.999))}

    def scheduler(opt):
        return torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.93)

    ref, model, resumed = MLP(), MLP(), MLP(seed=1)
    with make(ref, tmp_path / "ref", **hparams()) as opt:
        train(ref, opt, 0, 10, scheduler(opt))
    with make(model, tmp_path / "a", **hparams()) as opt:
        sched = scheduler(opt)
        train(model, opt, 0, 4, sched)
        path = opt.save_checkpoint(tmp_path / "ck", scheduler=sched)
        saved_lr = opt.param_groups[0]["lr"].clone()
    mine = hparams()
    with make(resumed, tmp_path / "b", **mine) as opt:
        sched = scheduler(opt)
        if how == "gather":  # the sharded checkpoints' load (reshard.py), here of a single-process one
            state = opt.chunked_state
            gather(state, path, whole_layout(state), str(tmp_path), scheduler=sched).install()
        else:
            opt.load_checkpoint(path, scheduler=sched)
        group = opt.param_groups[0]
        assert group["lr"] is mine["lr"] and group["betas"] is mine["betas"]
        assert torch.equal(mine["lr"], saved_lr) and torch.equal(mine["betas"][0], torch.tensor(0.9))
        train(resumed, opt, 4, 6, sched)
    assert_bitwise(params_of(ref), params_of(resumed))


ARRAY_HPARAMS = [
    ("betas", lambda: torch.tensor([0.8, 0.95])),  # one tensor of two: torch's AdamW and tiered's step take it
    ("betas", lambda: np.array([0.8, 0.95])),
    ("lr", lambda: np.array(1e-2)),  # 0-d
]
ARRAY_IDS = ["tensor-of-two-betas", "ndarray-betas", "0d-ndarray-lr"]


@pytest.mark.parametrize("key, value", ARRAY_HPARAMS, ids=ARRAY_IDS)
def test_array_hyperparameters_the_step_takes_are_saved_as_numbers_and_the_resume_is_bitwise(tmp_path, key, value):
    # A tensor or array of several elements was saved as it was: load_checkpoint refused the checkpoint as damaged
    # (CheckpointFormatError). Its numbers are saved, and the run resumes bitwise the uninterrupted one.
    ref, model, resumed = MLP(), MLP(), MLP(seed=1)
    with make(ref, tmp_path / "ref") as opt:
        opt.param_groups[0][key] = value()
        train(ref, opt, 0, 4)
    with make(model, tmp_path / "a") as opt:
        opt.param_groups[0][key] = value()
        train(model, opt, 0, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no weights_only warning
            path = opt.save_checkpoint(tmp_path / "ck")
    with make(resumed, tmp_path / "b") as opt:
        assert opt.load_checkpoint(path)["step"] == 2
        got, want = opt.param_groups[0][key], value().tolist()
        if key == "betas":
            assert type(got) is tuple and [type(b) for b in got] == [float, float] and list(got) == want, got
        else:
            assert type(got) is float and got == want, got
        train(resumed, opt, 2, 2)
    assert_bitwise(params_of(ref), params_of(resumed))


@pytest.mark.parametrize("betas", [torch.tensor([0.8, 0.95]), np.array([0.8, 0.95])], ids=["tensor", "ndarray"])
def test_a_torch_state_dict_with_betas_in_one_array_imports(tmp_path, betas):
    ref = MLP()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    torch_opt.param_groups[0]["betas"] = betas  # its step takes it; its constructor would have made a tuple of it
    train(ref, torch_opt, 0, 2)
    path = import_torch_state_dict(torch_opt.state_dict(), ref, tmp_path / "from-torch")
    assert export_torch_state_dict(path)["param_groups"][0]["betas"] == tuple(betas.tolist())
    with make(MLP(seed=1), tmp_path / "o") as opt:
        opt.load_checkpoint(path)
        assert opt.param_groups[0]["betas"] == tuple(betas.tolist()) and opt.step_counts == [2] * 6


def test_a_tensor_two_groups_share_is_filled_only_where_the_checkpoint_gives_both_one_number():
    shared, own = torch.tensor(1.0), torch.tensor(2.0)
    groups = [{"params": [0], "lr": shared, "betas": (own, 0.9)}, {"params": [1], "lr": shared, "betas": (0.8, 0.9)}]
    restore_groups(groups, [{"params": [5], "lr": 0.5, "betas": (0.7, 0.99)}, {"params": [6], "lr": 0.5,
                                                                              "betas": (0.6, 0.99)}])  # fmt: skip
    assert groups[0]["lr"] is shared and groups[1]["lr"] is shared and float(shared) == 0.5
    assert groups[0]["betas"][0] is own and groups[0]["betas"][1] == 0.99 and float(own) == pytest.approx(0.7)
    assert groups[0]["params"] == [0] and groups[1]["betas"] == (0.6, 0.99)
    restore_groups(groups, [{"params": [5], "lr": 0.1}, {"params": [6], "lr": 0.2}])  # two numbers for one tensor
    assert (groups[0]["lr"], groups[1]["lr"]) == (0.1, 0.2) and float(shared) == 0.5


def test_the_weights_only_warning_names_what_holds_the_objects(trained, tmp_path):
    _, opt, _, _ = trained
    with pytest.warns(RuntimeWarning, match=r"objects \(in extra\) that torch.load"):
        opt.save_checkpoint(tmp_path / "ck", extra={"when": datetime.date(2024, 1, 1)})


def test_a_save_refuses_a_link_and_a_sweep_removes_a_link_left_behind(trained, tmp_path):
    # A save over latest -> step-1 swapped the link out for a real folder and left it under a hidden name for good:
    # rmtree refuses a link, and its ignore_errors hid that.
    _, opt, _, path = trained
    root = os.path.dirname(path)
    os.symlink(path, os.path.join(root, "latest"))
    with pytest.raises(CheckpointPathError, match="latest is a symbolic link.*remove the link"):
        opt.save_checkpoint(os.path.join(root, "latest"))
    assert os.readlink(os.path.join(root, "latest")) == path and inspect_checkpoint(path)["step"] == 4
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait(timeout=60)  # a process that has ended: its leftovers are the sweep's to remove
    leftover = os.path.join(root, f".latest.tmp-{fsops._HOST}-{gone.pid}-0123abcd")
    os.symlink(path, leftover)  # what an older version's save left
    opt.save_checkpoint(os.path.join(root, "step-5"))
    assert sorted(os.listdir(root)) == ["latest", "step-4", "step-5"] and os.path.isdir(path)


def test_a_save_sweeps_this_processs_ended_temp_folders_and_leaves_one_under_way(trained):
    # A temp folder of this process whose save has ended (a collective save whose peer died left it) stayed for
    # good: sweep left every name of its own pid alone. One of its pid that it did not make (a restarted
    # container's predecessor's, or a live container's beside it with the same host name and pid) stays.
    _, opt, _, path = trained
    root = os.path.dirname(path)
    live = fsops.hidden_name(os.path.join(root, "step-9"), "tmp")  # a save under way (another thread's)
    ended = fsops.hidden_name(os.path.join(root, "step-8"), "tmp")
    reused = os.path.join(root, f".step-7.tmp-{fsops._HOST}-{os.getpid()}-0123abcd")
    for folder in (live, ended, reused):
        os.mkdir(folder)
    fsops.ended(ended)
    try:
        opt.save_checkpoint(os.path.join(root, "step-5"))
        left = [os.path.basename(live), os.path.basename(live) + hidden.LOCK_SUFFIX, os.path.basename(reused)]
        assert sorted(os.listdir(root)) == sorted(["step-4", "step-5", *left])
    finally:
        fsops.ended(live)
        shutil.rmtree(reused)


SAVER = """
import os, sys
from tiered.checkpoint import hidden
temp = hidden.hidden_name(sys.argv[1], sys.argv[2])
os.rename(sys.argv[1], temp) if sys.argv[2] == "old" else os.mkdir(temp)  # commit's move aside, or a temp folder
print(temp, flush=True)
sys.stdin.read()  # a save under way until the test closes stdin; then gone without ending it, as if killed
os._exit(0)
"""


def _left_by(pid: int, path: str, kind: str) -> str:
    """The hidden name a saver of this host with ``pid`` gave ``path`` in a version without lock files."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{kind}-{fsops._HOST}-{pid}-0123abcd")


def _saver_under_way(target: str, kind: str = "tmp") -> tuple[subprocess.Popen, str]:
    """Another process with a save to ``target`` under way, its lock held: its temp folder made, or (``kind``
    "old") the checkpoint at ``target`` moved aside, as a commit on a filesystem without RENAME_EXCHANGE does."""
    p = subprocess.Popen([sys.executable, "-c", SAVER, target, kind], cwd=REPO, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    from helpers import run_bounded as bounded  # as run_bounded below: a child imports this file

    temp = bounded(p.stdout.readline, timeout=120).strip()
    assert temp and os.path.isdir(temp), f"the saver did not start: {temp!r}"
    return p, temp


@pytest.mark.parametrize("kind", ["tmp", "old"], ids=["temp-folder", "moved-aside"])
def test_a_save_leaves_alone_a_live_save_whose_pid_it_cannot_see(trained, monkeypatch, kind):
    # Two jobs on one host name sharing a checkpoint folder, one in a container of its own pid namespace
    # (--network=host): the other's save took its pid for dead and deleted its save under way, which then failed
    # with FileNotFoundError (or put back the checkpoint its commit had just moved aside). Its pid is said dead
    # here, as it is seen from another pid namespace.
    _, opt, _, path = trained
    root = os.path.dirname(path)
    other = os.path.join(root, "other-job")
    if kind == "old":
        shutil.copytree(path, other)
    saver, temp = _saver_under_way(other, kind)
    try:
        monkeypatch.setattr(hidden, "_pid_alive", lambda pid: False)
        run_bounded(lambda: opt.save_checkpoint(os.path.join(root, "step-5")))
        assert os.path.isdir(temp) and os.path.isfile(temp + hidden.LOCK_SUFFIX)
        assert fsops.left_aside(other) is None and not os.path.exists(other)
    finally:
        saver.communicate("", timeout=60)
    # Its process gone, the save's leftovers are the next save's to remove (an aside put back), lock file and all.
    run_bounded(lambda: opt.save_checkpoint(os.path.join(root, "step-6")))
    assert sorted(os.listdir(root)) == sorted(["step-4", "step-5", "step-6", *(["other-job"] if kind == "old" else [])])


def test_a_save_removes_a_dead_saves_folder_whose_pid_another_process_has(trained, monkeypatch):
    # The pid of a saver that was killed is reused by an unrelated live process: its temp folder stayed for good.
    _, opt, _, path = trained
    root = os.path.dirname(path)
    saver, temp = _saver_under_way(os.path.join(root, "step-5"))
    saver.communicate("", timeout=60)  # gone, its save never ended
    monkeypatch.setattr(hidden, "_pid_alive", lambda pid: True)
    assert os.path.isdir(temp)
    run_bounded(lambda: opt.save_checkpoint(os.path.join(root, "step-6")))
    assert sorted(os.listdir(root)) == ["step-4", "step-6"]


def test_a_save_removes_what_a_saver_killed_while_it_made_its_lock_file_left(trained):
    # Killed between making its lock file under a temporary name and linking it into place: the temporary name
    # (``<hidden name>.lock.<random>``, free, its saver's pid gone) stayed for good beside the swept temp folder.
    _, opt, _, path = trained
    root = os.path.dirname(path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    temp = _left_by(int(dead.stdout), os.path.join(root, "step-5"), "tmp")
    os.mkdir(temp)
    with open(temp + ".lock.x1y2z3w4", "w") as f:
        f.write(dead.stdout)
    run_bounded(lambda: opt.save_checkpoint(os.path.join(root, "step-6")))
    assert sorted(os.listdir(root)) == ["step-4", "step-6"]


def test_an_aside_of_this_pid_not_made_here_is_kept_by_a_save_and_put_back_by_a_load(trained):
    # A container restarted with the same host name and pid, after its predecessor was killed between commit's two
    # renames (a filesystem with no RENAME_EXCHANGE): the next save into the folder deleted the aside, the only copy
    # of that checkpoint.
    _, opt, _, path = trained
    root = os.path.dirname(path)
    aside = os.path.join(root, f".{os.path.basename(path)}.old-{fsops._HOST}-{os.getpid()}-0123abcd")
    os.rename(path, aside)
    opt.save_checkpoint(os.path.join(root, "best"))
    assert sorted(os.listdir(root)) == sorted(["best", os.path.basename(aside)])
    with pytest.warns(RuntimeWarning, match="restored the previous checkpoint"):
        opt.load_checkpoint(path)
    assert sorted(os.listdir(root)) == sorted(["best", os.path.basename(path)])


def test_a_save_whose_temp_folder_cannot_be_made_leaves_no_name_behind(trained, monkeypatch):
    # Its hidden name stayed under way for the life of the process, one more at every failed save.
    _, opt, _, path = trained
    real = os.mkdir

    def failing(p, *a, **k):
        if ".tmp-" in os.path.basename(p):
            raise PermissionError(errno.EACCES, "Permission denied", p)
        return real(p, *a, **k)

    before = set(hidden._UNDER_WAY), set(hidden._ENDED_HERE)
    monkeypatch.setattr(os, "mkdir", failing)
    for k in range(3):
        with pytest.raises(PermissionError):
            opt.save_checkpoint(os.path.join(os.path.dirname(path), f"step-{10 + k}"))
    assert (hidden._UNDER_WAY, hidden._ENDED_HERE) == before


def test_a_name_too_long_and_a_file_in_the_path_are_refused_by_name_leaving_nothing(trained, tmp_path):
    # They were an ENAMETOOLONG naming the hidden temp folder, and a raw FileExistsError with no fix.
    _, opt, _, _ = trained
    root = tmp_path / "runs"
    root.mkdir()
    long = root / ("run-" + "x" * 236)  # a valid name of 240 bytes, too long for the temp names beside it
    with pytest.raises(ValueError, match=r"is 240 bytes: a save needs names of at most \d+ bytes.*shorter name"):
        opt.save_checkpoint(long)
    (root / "afile").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match=r"runs/afile/ck: .*runs/afile is a file.*move the file away"):
        opt.save_checkpoint(root / "afile" / "ck")
    assert os.listdir(root) == ["afile"]


def test_overwrite_without_atomic_exchange_and_recovery(trained, tmp_path, monkeypatch):
    model, opt, _, path = trained
    monkeypatch.setattr(fsops, "exchange", lambda a, b: False)  # a filesystem without RENAME_EXCHANGE
    train(model, opt, 4, 1)
    opt.save_checkpoint(path)
    assert inspect_checkpoint(path)["step"] == 5
    assert not [e for e in os.listdir(os.path.dirname(path)) if e.startswith(".")]
    # A kill between the fallback's two renames leaves the old checkpoint aside: it is put back on load.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    os.rename(path, _left_by(dead.pid, path, "old"))
    with pytest.warns(RuntimeWarning, match="restored the previous checkpoint"):
        assert opt.load_checkpoint(path)["step"] == 5


def _overwrite_killed_between_renames(target: str, nvme: str) -> None:
    """Runs in a new process: a save over ``target`` on a filesystem without RENAME_EXCHANGE, SIGKILLed (the test
    hook) between its two renames: the old checkpoint moved aside, the new one not yet in."""
    fsops.exchange = lambda a, b: False
    model = MLP(seed=9)
    opt = make(model, nvme)
    train(model, opt, 0, 1)
    os.environ[fsops.HOOK_ENV] = "kill:moved-aside:1"
    opt.save_checkpoint(target)


def test_latest_checkpoint_finds_what_an_overwrite_killed_between_its_renames_left_aside(trained, tmp_path):
    # On NFS, Lustre or FUSE a save over "latest" renames the old checkpoint aside, then the new one in. Killed between
    # the two, the root held only hidden names: latest_checkpoint skipped them and named an older step (or None), so
    # a resume script started over from there, and its next save over "latest" replaced the newest checkpoint.
    model, opt, sched, older = trained  # ckpt/step-4
    root = os.path.dirname(older)
    train(model, opt, 4, 2, sched)
    latest = opt.save_checkpoint(os.path.join(root, "latest"))  # step 6: the one to resume from
    code = (f"import sys; sys.path.insert(0, {TESTS!r}); import test_checkpoint as t; "
            f"t._overwrite_killed_between_renames({latest!r}, {str(tmp_path / 'nvme-killed')!r})")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != fsops.HOOK_ENV}
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=120, env=env, capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert sorted(e for e in os.listdir(root) if not e.startswith(".")) == ["step-4"]  # "latest" is aside
    with pytest.warns(RuntimeWarning, match="latest: restored the previous checkpoint"):
        assert latest_checkpoint(root) == latest
    assert inspect_checkpoint(latest)["step"] == 6
    # The resume script goes on from step 6, and its next save over "latest" keeps that progress.
    resumed = MLP(seed=3)
    with make(resumed, tmp_path / "nvme-resumed") as opt2:
        assert opt2.load_checkpoint(latest)["step"] == 6
        assert_bitwise(params_of(model), params_of(resumed))
        train(resumed, opt2, 6, 1)
        opt2.save_checkpoint(latest)
    assert inspect_checkpoint(latest)["step"] == 7
    assert sorted(os.listdir(root)) == ["latest", "step-4"]  # the dead saver's temp folder swept


def test_latest_checkpoint_leaves_a_live_saves_aside_alone(trained, monkeypatch):
    # A save in progress (this process, alive) between its two renames: its old checkpoint is not taken back.
    _, opt, _, path = trained
    root = os.path.dirname(path)
    aside = fsops.hidden_name(path, "old")
    os.rename(path, aside)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert latest_checkpoint(root) is None
        assert sorted(os.listdir(root)) == [os.path.basename(aside), os.path.basename(aside) + hidden.LOCK_SUFFIX]
    finally:
        fsops.ended(aside)


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES, errno.EPERM], ids=["EROFS", "EACCES", "EPERM"])
def test_latest_checkpoint_on_a_folder_it_cannot_write_counts_the_aside_where_it_is(trained, tmp_path, monkeypatch,
                                                                                  err):  # fmt: skip
    # An eval job polling a training run's checkpoints on a read-only mount (or as another user) after an overwrite
    # was killed between its renames: latest_checkpoint tried to rename the aside back and raised OSError(EROFS).
    model, opt, _, older = trained  # ckpt/step-4
    root = os.path.dirname(older)
    train(model, opt, 4, 2)
    newest = opt.save_checkpoint(os.path.join(root, "step-6"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    aside = _left_by(dead.pid, newest, "old")
    os.rename(newest, aside)
    before = sorted(os.listdir(root))

    def refused(src, dst, *args, **kw):
        raise OSError(err, os.strerror(err), src, None, dst)

    monkeypatch.setattr(os, "rename", refused)
    with pytest.warns(RuntimeWarning, match=r"left \.step-6\.old-.* aside, which this process cannot rename back"):
        found = latest_checkpoint(root)
    assert found == aside and sorted(os.listdir(root)) == before
    resumed = MLP(seed=3)
    with make(resumed, tmp_path / "nvme-resumed") as opt2:  # it loads from there, the folder still untouched
        assert opt2.load_checkpoint(found)["step"] == 6
        assert_bitwise(params_of(model), params_of(resumed))
    assert sorted(os.listdir(root)) == before
    # An aside older than a visible checkpoint is not the one to resume from.
    monkeypatch.undo()
    train(model, opt, 6, 1)
    seventh = opt.save_checkpoint(os.path.join(root, "step-7"))  # its sweep put step-6 back (the folder writable)
    os.rename(newest, aside)
    monkeypatch.setattr(os, "rename", refused)
    with pytest.warns(RuntimeWarning, match="cannot rename back"):
        assert latest_checkpoint(root) == seventh


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES, errno.EPERM], ids=["EROFS", "EACCES", "EPERM"])
def test_a_load_by_name_on_a_folder_it_cannot_write_reads_the_aside_where_it_is(trained, tmp_path, monkeypatch, err):
    # An eval job on a read-only mount (or another user's run) loading ckpt/step-4 by its name after an overwrite of
    # it was killed between its renames: latest_checkpoint returns the aside, with a warning, but
    # load_checkpoint(ckpt/step-4) tried to rename it back and raised OSError(EROFS). It now reads it in place.
    model, _, _, path = trained
    root = os.path.dirname(path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    aside = _left_by(dead.pid, path, "old")
    os.rename(path, aside)
    before = sorted(os.listdir(root))

    def refused(src, dst, *args, **kw):
        raise OSError(err, os.strerror(err), src, None, dst)

    monkeypatch.setattr(os, "rename", refused)
    stuck = r"left \.step-4\.old-.* aside, which this process cannot rename back"

    def said_once(caught):
        assert len([w for w in caught if "cannot rename back" in str(w.message)]) == 1

    resumed = MLP(seed=3)
    with make(resumed, tmp_path / "nvme-resumed") as opt:
        with pytest.warns(RuntimeWarning, match=stuck) as caught:
            info = opt.load_checkpoint(path)
        said_once(caught)
        assert info["step"] == 4 and info["path"] == aside and info["extra"]["epoch"] == 2
        assert_bitwise(params_of(model), params_of(resumed))
    frozen = MLP(seed=3)  # a run resumed in a stage with fc1 frozen: the checkpoint's shapes are read first
    frozen.fc1.requires_grad_(False)
    with make(list(frozen.named_parameters()), tmp_path / "nvme-frozen") as opt:
        with pytest.warns(RuntimeWarning, match=stuck) as caught:
            assert opt.load_checkpoint(path)["step"] == 4
        said_once(caught)
        assert_bitwise(params_of(model), params_of(frozen))
    with pytest.warns(RuntimeWarning, match=stuck):
        assert inspect_checkpoint(path)["path"] == aside
    with pytest.warns(RuntimeWarning, match=stuck):
        assert verify_checkpoint(path)["ok"]
    assert sorted(os.listdir(root)) == before


def test_ranks_that_find_an_aside_together_all_resume_from_it(trained, monkeypatch):
    # Every rank of a job calls latest_checkpoint (or load_checkpoint) at once after a kill between an overwrite's
    # renames. Each saw the path missing and renamed the aside back; all but the first failed with
    # FileNotFoundError. Here another rank's rename lands just before this one's.
    _, _, _, path = trained
    root = os.path.dirname(path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    aside = _left_by(dead.pid, path, "old")
    os.rename(path, aside)
    rename = os.rename

    def another_rank_first(src, dst, *args, **kw):
        if src == aside and os.path.exists(aside):
            rename(src, dst)  # the other rank's
        return rename(src, dst, *args, **kw)

    monkeypatch.setattr(os, "rename", another_rank_first)
    assert latest_checkpoint(root) == path
    assert os.listdir(root) == ["step-4"] and inspect_checkpoint(path)["step"] == 4


def test_a_sharded_checkpoint_left_aside_is_put_back(tmp_path):
    # recover dated asides by their manifest.json, which a checkpoint sharded across ranks does not have at its top
    # (shards.json): restoring one raised FileNotFoundError, in load_checkpoint and latest_checkpoint alike.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    aside = tmp_path / f".latest.old-{fsops._HOST}-{dead.pid}-0123abcd"
    (aside / fsops.FIRST_PART).mkdir(parents=True)
    (aside / fsops.SHARDS).write_text("{}")
    assert fsops.recover(str(tmp_path / "latest"))
    assert os.listdir(tmp_path) == ["latest"]


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "no-exchange"])
@pytest.mark.parametrize("found", ["nothing", "an-empty-folder"])
def test_two_saves_of_one_new_path_at_once_both_succeed_and_the_later_stays(trained, tmp_path, monkeypatch, found,
                                                                           exchange):  # fmt: skip
    # Every DDP rank saving "step-10" after the same step: the other save's rename landed between this save's look
    # at the path (free) and its own rename, which failed with a raw ENOTEMPTY naming its hidden temp folder. Here
    # the other save's commit is placed in exactly that window.
    model, opt, _, _ = trained
    target = str(tmp_path / "ck" / "step-10")
    other = opt.save_checkpoint(tmp_path / "staged" / "step-10")  # the other save, finished but for its rename
    if found == "an-empty-folder":
        os.makedirs(target)
    if not exchange:
        monkeypatch.setattr(fsops, "exchange", lambda a, b: False)  # a filesystem without RENAME_EXCHANGE
    rename = os.rename

    def other_commits_first(src, dst, *args, **kw):
        if dst == target and os.path.basename(src).startswith(".step-10.tmp-") and os.path.exists(other):
            rename(other, target)
        return rename(src, dst, *args, **kw)

    monkeypatch.setattr(os, "rename", other_commits_first)
    train(model, opt, 4, 1)
    assert opt.save_checkpoint(target) == target
    monkeypatch.undo()
    assert not os.path.exists(other)  # it did land first
    assert inspect_checkpoint(target)["step"] == 5 and verify_checkpoint(target)["ok"]  # the later save, whole
    assert os.listdir(tmp_path / "ck") == ["step-10"]  # the replaced one deleted, no hidden folder left


def test_a_commit_whose_target_vanishes_before_the_exchange_renames_into_place(tmp_path, monkeypatch):
    # The path held a checkpoint when commit looked, and another process deleted it (keep_last, or a commit's
    # cleanup) before the exchange: the exchange finds nothing to swap with, and the rename puts the new one in.
    temp, path = tmp_path / ".new", tmp_path / "ck"
    for folder, text in ((temp, b"new"), (path, b"old")):
        folder.mkdir()
        (folder / "manifest.json").write_bytes(text)
    real = fsops.exchange

    def deleted_first(a, b):
        fsops.remove_tree(b)
        return real(a, b)

    monkeypatch.setattr(fsops, "exchange", deleted_first)
    fsops.commit(str(temp), str(path))
    assert (path / "manifest.json").read_bytes() == b"new" and os.listdir(tmp_path) == ["ck"]


def run_bounded(fn):
    from helpers import run_bounded  # here: a child process imports this file without tests/ on its path

    return run_bounded(fn)


def _never_replaces_folders(monkeypatch):
    # A filesystem (some FUSE and network ones) on which a rename onto an existing folder, even an empty one,
    # always fails with EEXIST; POSIX allows that only for a folder that is not empty.
    rename = os.rename

    def refuse(src, dst, *args, **kw):
        if os.path.isdir(dst):
            raise OSError(errno.EEXIST, "File exists", dst)
        return rename(src, dst, *args, **kw)

    monkeypatch.setattr(os, "rename", refuse)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "no-exchange"])
def test_a_commit_onto_an_empty_folder_a_rename_never_replaces_still_commits(tmp_path, monkeypatch, exchange):
    # It took each EEXIST for another save's commit and renamed again, forever.
    temp, path = tmp_path / ".new", tmp_path / "ck"
    temp.mkdir()
    (temp / "manifest.json").write_bytes(b"new")
    path.mkdir()  # the empty folder made for the checkpoint
    _never_replaces_folders(monkeypatch)
    if not exchange:
        monkeypatch.setattr(fsops, "exchange", lambda a, b: False)  # nor RENAME_EXCHANGE: moved aside
    run_bounded(lambda: fsops.commit(str(temp), str(path)))
    assert (path / "manifest.json").read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["ck"]  # the empty folder it replaced, deleted


def test_a_commit_that_never_finds_the_path_free_fails_naming_it(tmp_path, monkeypatch):
    # Where every rename into place finds a folder there first, commit gives up after a few looks, naming the path.
    temp, path = tmp_path / ".new", tmp_path / "ck"
    temp.mkdir()
    path.mkdir()
    rename = os.rename

    def always_taken(src, dst, *args, **kw):
        if dst == str(path):
            path.mkdir(exist_ok=True)  # as if another save had committed there just before
            raise OSError(errno.EEXIST, "File exists", dst)
        return rename(src, dst, *args, **kw)

    monkeypatch.setattr(os, "rename", always_taken)
    monkeypatch.setattr(fsops, "exchange", lambda a, b: False)
    with pytest.raises(CheckpointPathError, match="could not put the checkpoint in place") as e:
        run_bounded(lambda: fsops.commit(str(temp), str(path)))
    assert isinstance(e.value, OSError) and e.value.filename == str(path) and temp.is_dir()


# ---------------------------------------------------------------------------------------- torch AdamW
def test_an_export_takes_everything_from_the_one_checkpoint_it_opened(trained, monkeypatch):
    """export_torch_state_dict read a checkpoint's groups and steps from one open and its rows from a second: a
    save committed at the path between them gave a state dict of two checkpoints (steps of the one, moments of
    the other). The save lands here right after the first read; the export is the checkpoint it opened."""
    from tiered.checkpoint.reader import CheckpointReader

    model, opt, _, path = trained
    want = export_torch_state_dict(path)
    train(model, opt, 4, 2)
    objects = CheckpointReader.objects

    def then_a_save(reader, **kw):
        monkeypatch.setattr(CheckpointReader, "objects", objects)
        opt.save_checkpoint(path)  # another save at the same path, committed mid-export
        return objects(reader, **kw)

    monkeypatch.setattr(CheckpointReader, "objects", then_a_save)
    got = export_torch_state_dict(path)
    assert got["param_groups"] == want["param_groups"] and got["state"].keys() == want["state"].keys()
    for i, s in want["state"].items():
        for k in s:
            assert torch.equal(got["state"][i][k], s[k]), (i, k)
    assert export_torch_state_dict(path)["state"][0]["step"] == 6  # the new save is there for the next export


def test_round_trip_through_torch_adamw(trained, tmp_path):
    model, opt, _, path = trained
    ref = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1.0, fused=True)
    torch_opt.load_state_dict(export_torch_state_dict(path))  # leave tiered mid-run
    assert torch_opt.param_groups[0]["lr"] == 1e-2 * 0.5  # the hyperparameters came along
    ref.load_state_dict(export_model_state_dict(path))
    train(model, opt, 4, 3)
    train(ref, torch_opt, 4, 3)
    torch.testing.assert_close(params_of(ref), params_of(model), rtol=1e-6, atol=1e-7)

    back = import_torch_state_dict(torch_opt.state_dict(), ref, tmp_path / "from-torch", extra={"epoch": 5})
    other = MLP(seed=8)
    with make(other, tmp_path / "o") as opt2:  # come back to tiered mid-run
        assert opt2.load_checkpoint(back)["extra"] == {"epoch": 5}
        assert_bitwise(params_of(ref), params_of(other))
        train(other, opt2, 7, 2)
        train(ref, torch_opt, 7, 2)
        torch.testing.assert_close(params_of(ref), params_of(other), rtol=1e-6, atol=1e-7)
        assert opt2.step_counts == [9] * 6


def test_import_with_named_groups_and_bad_dicts(tmp_path):
    model = MLP()
    named = list(model.named_parameters())
    decay = [(n, p) for n, p in named if n.endswith("weight")]
    no_decay = [(n, p) for n, p in named if n.endswith("bias")]
    torch_opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    train(model, torch_opt, 0, 2)
    sd = torch_opt.state_dict()
    path = import_torch_state_dict(sd, decay + no_decay, tmp_path / "ck")
    summary = inspect_checkpoint(path)
    assert [p["name"] for p in summary["params"]] == [n for n, _ in decay + no_decay]
    assert [p["group"] for p in summary["params"]] == [0, 0, 0, 1, 1, 1]
    with make(MLP(seed=1), tmp_path / "o") as opt2:
        opt2.load_checkpoint(path, hparams="keep")  # one group here, two in the checkpoint
    with pytest.raises(ValueError, match="amsgrad"):
        bad = copy.deepcopy(sd)
        bad["param_groups"][0]["amsgrad"] = True
        import_torch_state_dict(bad, decay + no_decay, tmp_path / "bad")
    with pytest.raises(ValueError, match="gives 2"):
        import_torch_state_dict(sd, decay[:2], tmp_path / "bad")
    with pytest.raises(CheckpointMismatchError, match="param_names"):
        import_torch_state_dict(sd, list(reversed(decay + no_decay)), tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_a_compiled_model_s_parameters_keep_their_model_names_in_old_and_imported_checkpoints(tmp_path):
    # An earlier tiered keyed a torch.compile'd model's state by "_orig_mod.<name>"; such a checkpoint loads into
    # an optimizer over the model, compiled or not, which names the parameters as the model does.
    model = MLP()
    with make(model, tmp_path / "nvme") as opt:
        train(model, opt, 0, 2)
        names = list(opt.param_names)
        opt.param_names[:] = [f"_orig_mod.{n}" for n in names]  # as the earlier tiered saved them
        old = opt.save_checkpoint(tmp_path / "old")
        opt.param_names[:] = names
        train(model, opt, 2, 2)
    assert [p["name"] for p in inspect_checkpoint(old)["params"]] == names
    for compiled in (False, True):
        other = MLP(seed=3)
        with make(torch.compile(other, backend="eager") if compiled else other, tmp_path / f"o{compiled}") as opt2:
            opt2.load_checkpoint(old)
            train(other, opt2, 2, 2)
        assert_bitwise(params_of(model), params_of(other))
    # torch.optim.AdamW over a compiled model keeps "_orig_mod." param_names: imported with the model uncompiled.
    ref = MLP()
    torch_opt = torch.optim.AdamW(torch.compile(ref, backend="eager").named_parameters(), lr=1e-2)
    train(ref, torch_opt, 0, 2)
    assert torch_opt.state_dict()["param_groups"][0]["param_names"][0] == "_orig_mod.fc1.weight"
    path = import_torch_state_dict(torch_opt.state_dict(), ref, tmp_path / "imported")
    assert [p["name"] for p in inspect_checkpoint(path)["params"]] == names
    with make(MLP(seed=4), tmp_path / "i") as opt3:
        opt3.load_checkpoint(path, hparams="keep")


class KeepsOriginal(nn.Module):
    """A model of its own that keeps a submodule under the attribute torch.compile's wrapper uses, beside a
    parameter named as one of that submodule's (``own=True``)."""

    def __init__(self, seed: int = 0, own: bool = True):
        super().__init__()
        torch.manual_seed(seed)
        self._orig_mod = nn.Linear(32, 8)
        self.weight = nn.Parameter(torch.randn(8, 8)) if own else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._orig_mod(x)
        return y if self.weight is None else y @ self.weight


@pytest.mark.parametrize("own", [True, False], ids=["clashing", "alone"])
def test_a_model_s_own_orig_mod_submodule_keeps_distinct_names_and_its_checkpoints_load(tmp_path, own):
    # Stripping "_orig_mod." by name gave "weight" and "_orig_mod.weight" one name: the checkpoint saved, but
    # never loaded, nor did one saved with the names as the model gives them.
    model = KeepsOriginal(own=own)
    with make(model, tmp_path / "nvme") as opt:
        names = list(opt.param_names)
        assert len(set(names)) == len(names) == (3 if own else 2)
        if own:
            assert names == [n for n, _ in model.named_parameters()]  # as the model names them
        with make(KeepsOriginal(own=own).named_parameters(), tmp_path / "pairs") as named:
            assert named.param_names == names  # (name, tensor) pairs, as torch.optim takes them, named alike
        train(model, opt, 0, 2)
        path = opt.save_checkpoint(tmp_path / "ck")
        train(model, opt, 2, 2)
    assert [p["name"] for p in inspect_checkpoint(path)["params"]] == names
    for compiled in (False, True):
        other = KeepsOriginal(seed=3, own=own)
        with make(torch.compile(other, backend="eager") if compiled else other, tmp_path / f"o{compiled}") as opt2:
            assert opt2.param_names == names  # the compiled wrapper's own "_orig_mod" only is left out
            opt2.load_checkpoint(path)
            train(other, opt2, 2, 2)
        assert_bitwise(params_of(model), params_of(other))


@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled"])
def test_a_torch_state_dict_of_a_model_with_its_own_orig_mod_submodule_imports(tmp_path, compiled):
    # The import stripped "_orig_mod." name by name: "weight" and "_orig_mod.weight" became one name, refused.
    model = KeepsOriginal()
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    train(model, torch_opt, 0, 2)
    given = torch.compile(model, backend="eager") if compiled else model
    path = import_torch_state_dict(torch_opt.state_dict(), given, tmp_path / "ck")
    other = KeepsOriginal(seed=3)
    other.load_state_dict(model.state_dict())
    with make(other, tmp_path / "nvme") as opt:
        opt.load_checkpoint(path)
        assert opt.param_names == [n for n, _ in model.named_parameters()]
        train(other, opt, 2, 2)
    train(model, torch_opt, 2, 2)
    torch.testing.assert_close(params_of(model), params_of(other), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------- segment checks
@pytest.mark.parametrize("seed", range(5))
def test_segments_check_from_pieces_in_any_order_and_split(seed):
    """A loader with another chunk size reads ranges that straddle the saver's segments, in any order."""
    rng = random.Random(seed)
    data = bytearray(rng.randbytes(rng.randint(1, 5000)))
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 6))))
    bounds = [0, *cuts, len(data)]
    segs = [(a, b - a, zlib.crc32(data[a:b])) for a, b in zip(bounds, bounds[1:])]
    entry = FileEntry.from_segments("f.bin", len(data), segs)
    assert entry.crc32 == zlib.crc32(data)  # the segments combine into the whole file's CRC

    def pieces(buf: bytes):
        reads = sorted(set(rng.sample(range(1, len(buf)), min(len(buf) - 1, rng.randint(0, 9)))))
        spans = list(zip([0, *reads], [*reads, len(buf)]))
        rng.shuffle(spans)
        return spans

    with Checksummer(0) as crc:
        good = SegmentChecker("f.bin", entry, crc)
        for a, b in pieces(data):
            good.add(a, memoryview(bytes(data[a:b])))
        assert good.finish() == []
        at = rng.randrange(len(data))
        data[at] ^= 0x01
        bad = SegmentChecker("f.bin", entry, crc)
        for a, b in pieces(data):
            bad.add(a, memoryview(bytes(data[a:b])))
        problems = bad.finish()
        hit = next(i for i, (a, n, _) in enumerate(segs) if a <= at < a + n)
        assert len(problems) == 1 and f"bytes {segs[hit][0]}..{segs[hit][0] + segs[hit][1]}" in problems[0][1]


# ------------------------------------------------------------------------------------------------ CLI
def test_inspect_and_verify_cli(trained, capsys):
    _, _, _, path = trained
    assert cli_main(["inspect", path, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["step"] == 4 and s["num_params"] == 6 and s["extra_keys"] == ["epoch", "rng"] and s["has_scheduler"]
    assert s["files"]["master.bin"]["segments"] == 7 and not s["problems"]
    assert cli_main(["verify", path]) == 0
    assert "all 22 crc32 segments match" in capsys.readouterr().out
    assert cli_main(["inspect", path]) == 0
    assert "fc1.weight  [64, 32]" in capsys.readouterr().out


def test_verify_of_a_damaged_checkpoint_names_the_files_not_itself(trained, capsys, monkeypatch):
    _, _, _, path = trained
    data = os.path.join(path, "master.bin")
    with open(data, "r+b") as f:  # one flipped byte
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 1]))
    assert cli_main(["verify", path]) == 2
    err = capsys.readouterr().err
    assert "master.bin" in err and "verify PATH" not in err  # it was that command: no advice to run it
    monkeypatch.chdir(os.path.dirname(path))
    assert cli_main(["verify", os.path.basename(path), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["path"] == path  # absolute, as on success


def test_cli_plugs_into_tiered_bench_and_argparse():
    from tiered.cli import Command

    commands = [Command(**spec) for spec in command_specs()]  # what tiered/cli.py's register() takes
    assert [c.name for c in commands] == ["inspect", "verify"]
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["verify", "/nowhere", "--json"])
    assert args.json and args.run(args) == 2  # no checkpoint there


# ------------------------------------------------------------------------------------------ full disk
@pytest.fixture
def small_disk(tmp_path):
    """A 160 KiB tmpfs: room for one checkpoint of the MLP (94 KiB in 4 KiB pages), not two."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_is_detected_first_and_the_previous_checkpoint_stays(trained, small_disk, monkeypatch):
    model, opt, _, _ = trained
    io = IOConfig(direct="off")
    first = opt.save_checkpoint(small_disk / "a", io=io)
    train(model, opt, 4, 1)

    def intact():
        assert not [e for e in os.listdir(small_disk) if e.startswith(".")], "a temp folder was left behind"
        assert verify_checkpoint(first)["step"] == 4

    # The message says a previous checkpoint is intact only where there is one: "b" never held any.
    with pytest.raises(InsufficientSpaceError, match="needs .* free.*nothing was saved there$"):
        opt.save_checkpoint(small_disk / "b", io=io)  # the free-space check, before anything is written
    intact()
    with pytest.raises(InsufficientSpaceError, match="the previous checkpoint there is intact$"):
        opt.save_checkpoint(first, io=io)  # overwriting needs room for both until the swap
    intact()
    monkeypatch.setattr("tiered.checkpoint.writer.free_bytes", lambda p: 1 << 40)  # the check misjudges
    with pytest.raises(InsufficientSpaceError, match="filled while writing.*nothing was saved there$"):
        opt.save_checkpoint(small_disk / "b", io=io)  # fallocate finds out
    intact()
    monkeypatch.setattr("tiered.checkpoint.writer.reserve", lambda fd, n: False)  # no fallocate either
    with pytest.raises(InsufficientSpaceError, match="filled while writing"):
        opt.save_checkpoint(small_disk / "b", io=io)  # the data writes find out
    intact()
    assert isinstance(InsufficientSpaceError("x", 1, 0), OSError)


# -------------------------------------------------------------------------------------- host memory
def _memory_child(root: str) -> None:
    import resource

    torch.set_num_threads(1)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])  # 8.4M params: 100 MB of fp32 state
    io = IOConfig(block_size="1MiB", threads=4)
    with TieredOptimizer(model, os.path.join(root, "nvme"), chunk_bytes="768KiB", host_budget="4MiB", io=io) as opt:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        path = opt.save_checkpoint(os.path.join(root, "ck"), io=io)
        opt.load_checkpoint(path, io=io)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"grew_kib": after - before, "state_bytes": opt.state_bytes}))


def test_host_memory_stays_within_budget_plus_a_constant(tmp_path):
    code = f"import sys; sys.path.insert(0, {TESTS!r}); import test_checkpoint as t; t._memory_child({str(tmp_path)!r})"
    r = subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120, capture_output=True, text=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["state_bytes"] > 90e6
    # Peak RSS may grow by the staging buffers (2 chunks), the engines' bounce buffers and the CRC threads'
    # stacks: a few MiB. Holding the state in memory would add 100 MB.
    assert out["grew_kib"] < 24 << 10, out


def test_bench_smoke(tmp_path):
    bench = os.path.join(REPO, "bench", "checkpoint_bench.py")
    cmd = [sys.executable, bench, "--params", "20k", "--dir", str(tmp_path), "--loops", "1"]
    r = subprocess.run(cmd, cwd=REPO, timeout=120, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"save", "load", "raw", "torch"} <= set(out["results"])
    assert not os.listdir(tmp_path), "the benchmark left files behind"
