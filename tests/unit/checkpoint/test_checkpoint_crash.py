"""kill -9 while saving: the previous checkpoint always loads, the new one is complete or absent.

A driver subprocess imports torch once and forks one saver per kill point (a fork is ~10 ms; a fresh
interpreter with torch ~2 s). Each saver builds an optimizer, loads the previous checkpoint, steps once
and saves; the test hook (TIERED_CHECKPOINT_TEST_HOOK) makes it SIGKILL itself at the N-th pass through
a named point, or pause at every point while the driver kills it at a random moment. This test then
checks every case folder in its own process (latest_checkpoint names the checkpoint to resume from, and it
loads), and that the next save sweeps the leftovers away.

A kill -9 loses no page cache, so this proves the protocol (what is visible under which name, when), not
fsync durability across a power cut; that rests on the fsync of every file and folder before each rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from tiered import TieredOptimizer
from tiered.checkpoint import export_model_state_dict, latest_checkpoint, load_checkpoint, verify_checkpoint
from tiered.checkpoint.fsops import HOOK_ENV

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(TESTS)))

# target, previous checkpoint, keep_last, and whether renameat2(RENAME_EXCHANGE) is available
SCENARIOS = {
    "new": ("ckpt/step-3", "ckpt/step-2", 1, True),  # a new folder; keep_last=1 then prunes step-2
    "overwrite": ("ckpt/latest", "ckpt/latest", None, True),  # replace in place: atomic exchange
    "fallback": ("ckpt/latest", "ckpt/latest", None, False),  # replace in place: rename aside, rename in
}
BEFORE_COMMIT = {"start", "objects", "reserved", "chunk", "data", "manifest", "moved-aside"}
RANDOM_KILLS = 4  # per scenario


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 40))  # 2.8k params: 3 chunks of 1024


def _steps(model: nn.Module, opt, start: int, n: int) -> None:
    for s in range(start, start + n):
        g = torch.Generator().manual_seed(s)
        model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _saver(case: str, scenario: str, hook: str | None, ready_fd: int | None, template: bool) -> None:
    """In a forked child. Template: train steps 0-1, save the previous checkpoint (step 2). Saver: load it,
    train step 2, save the new one (step 3) over the scenario's target with the hook armed."""
    from tiered.checkpoint import fsops

    target, prev, keep_last, exchange = SCENARIOS[scenario]
    if not exchange:
        fsops.exchange = lambda a, b: False
    model = _model()
    opt = TieredOptimizer(model, os.path.join(case, f"nvme-{os.getpid()}"), lr=1e-2, chunk_bytes="12KiB",
                          host_budget="40KiB")  # fmt: skip
    if template:
        _steps(model, opt, 0, 2)
        opt.save_checkpoint(os.path.join(case, prev))
        os._exit(0)
    opt.load_checkpoint(os.path.join(case, prev))
    _steps(model, opt, 2, 1)
    if hook:
        os.environ[HOOK_ENV] = hook
    if ready_fd is not None:
        os.write(ready_fd, b"s")
    opt.save_checkpoint(os.path.join(case, target), keep_last=keep_last)
    os._exit(0)


def _fork(case: str, scenario: str, hook: str | None = None, ready_fd: int | None = None, template=False) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            _saver(case, scenario, hook, ready_fd, template)
        finally:
            os._exit(3)  # an exception: the parent sees exit code 3
    return pid


def _status(pid: int) -> str:
    _, st = os.waitpid(pid, 0)
    if os.WIFSIGNALED(st):
        return f"signal {os.WTERMSIG(st)}"
    return f"exit {os.WEXITSTATUS(st)}"


def _driver(root: str) -> None:
    """Builds every case folder under ``root``; writes root/cases.json."""
    torch.set_num_threads(1)  # no OpenMP pool in the parent: forked children start clean
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # its first use imports torch._dynamo (2 s): once, here
    cases = []
    rng = random.Random(7)
    for scenario in SCENARIOS:
        template = os.path.join(root, f"template-{scenario}")
        os.makedirs(template)
        if _status(_fork(template, scenario, template=True)) != "exit 0":
            raise RuntimeError("building the template failed")
        ref = os.path.join(root, f"ref-{scenario}")
        shutil.copytree(template, ref, symlinks=True)
        trace = os.path.join(root, f"trace-{scenario}.txt")
        if _status(_fork(ref, scenario, f"trace:{trace}")) != "exit 0":
            raise RuntimeError("the reference save failed")
        with open(trace) as f:
            points = f.read().split()
        kills = []
        for point in dict.fromkeys(points):
            n = points.count(point)
            kills += [(point, k) for k in sorted({1, (n + 1) // 2, n})]
        for point, k in kills:
            case = os.path.join(root, f"case-{scenario}-{point}-{k}")
            shutil.copytree(template, case, symlinks=True)
            status = _status(_fork(case, scenario, f"kill:{point}:{k}"))
            cases.append({"scenario": scenario, "case": case, "point": point, "status": status})
        for i in range(RANDOM_KILLS):
            case = os.path.join(root, f"case-{scenario}-random-{i}")
            shutil.copytree(template, case, symlinks=True)
            r, w = os.pipe()
            pid = _fork(case, scenario, "pause:0.003", w)
            os.close(w)
            os.read(r, 1)  # the saver is about to save
            os.close(r)
            time.sleep(rng.uniform(0, 0.06))
            os.kill(pid, signal.SIGKILL)
            cases.append({"scenario": scenario, "case": case, "point": "random", "status": _status(pid)})
        cases.append({"scenario": scenario, "case": ref, "point": "none", "status": "exit 0", "ref": True})
    with open(os.path.join(root, "cases.json"), "w") as f:
        json.dump(cases, f)


@pytest.fixture(scope="module")
def crash_cases(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("crash"))
    code = f"import sys; sys.path.insert(0, {TESTS!r}); import test_checkpoint_crash as t; t._driver({root!r})"
    env = {k: v for k, v in os.environ.items() if k != HOOK_ENV}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=300, env=env)
    with open(os.path.join(root, "cases.json")) as f:
        return root, json.load(f)


def _weights(path: str) -> dict[str, torch.Tensor]:
    verify_checkpoint(path)  # every byte checks out
    return export_model_state_dict(path)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_kill_point_was_reached(crash_cases):
    _, cases = crash_cases
    deterministic = [c for c in cases if c["point"] not in ("random", "none")]
    points = {(c["scenario"], c["point"]) for c in deterministic}
    assert {("new", "chunk"), ("new", "renamed"), ("new", "pruning"), ("overwrite", "exchanged"),
            ("fallback", "moved-aside")} <= points  # fmt: skip
    assert len(deterministic) >= 30
    bad = [c for c in deterministic if c["status"] != f"signal {int(signal.SIGKILL)}"]
    assert not bad, f"these savers were not killed where asked: {bad}"


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_after_a_kill_the_previous_loads_and_the_new_is_complete_or_absent(crash_cases, tmp_path, scenario):
    root, cases = crash_cases
    target, prev, _, _ = SCENARIOS[scenario]
    old = _weights(os.path.join(root, f"template-{scenario}", prev))  # step 2
    new = _weights(os.path.join(root, f"ref-{scenario}", target))  # step 3
    assert not _same(old, new)
    model = _model()
    with TieredOptimizer(model, tmp_path / "nvme", chunk_bytes="24KiB", host_budget="1MiB") as opt:
        for c in (c for c in cases if c["scenario"] == scenario):
            where = f"{scenario} killed at {c['point']} ({c['status']})"
            folder = os.path.join(c["case"], "ckpt")
            if scenario == "new":
                names = sorted(e for e in os.listdir(folder) if not e.startswith("."))
                assert names in (["step-2"], ["step-2", "step-3"], ["step-3"]), where
                if "step-3" in names:
                    assert _same(_weights(os.path.join(folder, "step-3")), new), where
                if "step-2" in names:
                    assert _same(_weights(os.path.join(folder, "step-2")), old), where
                if c["point"] in BEFORE_COMMIT:
                    assert names == ["step-2"], where
                assert latest_checkpoint(folder) == os.path.join(folder, names[-1]), where
                loaded = load_checkpoint(opt, os.path.join(folder, names[-1]))["step"]
                assert loaded == (3 if "step-3" in names else 2), where
            else:
                # The fallback killed between its renames leaves latest missing: the resume script's
                # latest_checkpoint puts it back, as loading it would.
                restored = pytest.warns(RuntimeWarning, match="restored the previous")
                with restored if c["point"] == "moved-aside" else contextlib.nullcontext():
                    assert latest_checkpoint(folder) == os.path.join(folder, "latest"), where
                loaded = load_checkpoint(opt, os.path.join(folder, "latest"))["step"]
                assert _same(_weights(os.path.join(folder, "latest")), new if loaded == 3 else old), where
                if c["point"] in BEFORE_COMMIT:
                    assert loaded == 2, where
                elif c["point"] != "random":
                    assert loaded == 3, where
            # The next save completes and sweeps away what the killed saver left behind.
            opt.save_checkpoint(os.path.join(c["case"], target), keep_last=SCENARIOS[scenario][2])
            assert not [e for e in os.listdir(folder) if e.startswith(".")], where
            assert load_checkpoint(opt, os.path.join(c["case"], target))["step"] == loaded, where
