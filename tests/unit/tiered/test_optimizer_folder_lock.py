"""An optimizer's private folder is locked for its whole life, against siblings starting on the same root.

A sibling (another rank, another run of a sweep) starting on the root deletes the folders whose lock it can
take, as dead runs'. The lock was the store's: free while the optimizer measured the disk before its first
store, and while it laid its state out again (the old store closed, the disk measured, the new one opened).
A sibling starting then deleted the live folder, and the optimizer closed itself with its trained state lost;
a run killed while measuring left a folder with no lock file, which nothing ever reclaimed. The lock is now
taken right after the folder is made and released only once it is removed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
from helpers import run_bounded
from torch import nn

from tiered import TieredOptimizer
from tiered.optim import assembly
from tiered.telemetry import CALIBRATE_NAME

KW = dict(lr=1e-2, host_budget="60KiB", chunk_bytes="12KiB", prefetch_depth=2)  # 7 chunks, most on disk


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        g = torch.Generator().manual_seed(s)
        model(torch.randn(16, 32, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def copied(state: dict) -> dict:
    return {i: {k: v.clone() for k, v in s.items()} for i, s in state.items()}


def test_a_sibling_starting_while_the_state_is_laid_out_again_leaves_the_live_folder(tmp_path, monkeypatch):
    root = str(tmp_path)
    model = mlp()
    opt = TieredOptimizer(model, root, **KW)
    try:
        train(model, opt, range(3))
        before = copied(opt.state_dict()["state"])
        real, siblings = assembly.disk_rate, []

        def disk_rate(folder, io):  # the new layout measures the disk: a sibling starts on the root right then
            if folder == opt.workdir and not siblings:
                with TieredOptimizer(nn.Linear(4, 4), root, lr=1e-2) as sibling:
                    siblings.append(sibling.workdir)
                assert os.path.isdir(opt.workdir), "the sibling took the live folder for a dead run's"
            return real(folder, io)

        monkeypatch.setattr(assembly, "disk_rate", disk_rate)
        # The parameters made anew, as accelerate's FSDP2 prepare does: the state is laid out again over them
        params = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
        opt.param_groups[0]["params"] = params
        after = run_bounded(lambda: copied(opt.state_dict()["state"]))
        assert siblings and siblings[0] != opt.workdir, "the state was not laid out again"
        assert after.keys() == before.keys()
        for i in before:
            for k in before[i]:
                torch.testing.assert_close(after[i][k], before[i][k], rtol=0, atol=0, msg=f"{i} {k}")
        for p in params:
            p.grad = torch.ones_like(p)
        run_bounded(opt.step)
        assert os.path.isdir(opt.workdir)
    finally:
        opt.close()
    assert os.listdir(root) == []


KILLED_WHILE_MEASURING = textwrap.dedent(
    """
    import os, sys, threading, torch
    from tiered import TieredOptimizer, calibration

    def calibrate(folder, io):  # its file written, then held there, as a long measurement is, until killed
        with open(os.path.join(folder, calibration.CALIBRATE_NAME), "wb") as f:
            f.write(bytes(1 << 16))
        print(folder, flush=True)
        threading.Event().wait()

    calibration.calibrate = calibrate
    TieredOptimizer(torch.nn.Linear(256, 256), sys.argv[1], host_budget="256KiB", chunk_bytes="64KiB")
    """
)


def test_a_run_killed_while_it_measures_the_disk_leaves_a_folder_the_next_optimizer_reclaims(tmp_path):
    root, cache = str(tmp_path / "root"), str(tmp_path / "cache")  # no figure cached: the disk is measured
    env = {**os.environ, "TIERED_CACHE_DIR": cache}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WHILE_MEASURING, root], stdout=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip
    try:
        folder = run_bounded(proc.stdout.readline, timeout=120).strip()  # the measurement under way
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()
    assert folder.startswith(root) and CALIBRATE_NAME in os.listdir(folder), folder
    model = nn.Linear(8, 8)
    with TieredOptimizer(model, root, lr=1e-2) as opt:
        assert not os.path.exists(folder), f"the dead run's folder was left: {os.listdir(folder)}"
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
    assert os.listdir(root) == []
