"""Loads are all or nothing, as a step is: load_checkpoint and load_state_dict replace the state chunk by chunk, and
a Ctrl-C or an error part-way must never leave a torn state that step() and save_checkpoint() then accept.

Real SIGINTs, sent from inside the load (a chunk's install), as in test_optimizer_lifecycle.py's step tests."""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch
from torch import nn

from tiered import TieredOptimizer
from tiered.optimizer import OptimizerBrokenError

KW = dict(lr=1e-2, host_budget="60KiB", chunk_bytes="12KiB", prefetch_depth=2)  # 7 chunks, most on disk


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))


def train(model, opt, seeds) -> None:
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        model(torch.randn(16, 32, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def state_of(opt) -> list[torch.Tensor]:
    sd = opt.state_dict()["state"]
    return [t.clone() for i in sorted(sd) for t in (sd[i]["exp_avg"], sd[i]["exp_avg_sq"])]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def interrupt_at(monkeypatch, opt, chunk: int, presses: int = 1, error: BaseException | None = None) -> list[int]:
    """Before the state's ``chunk``-th chunk (from 1) is written by a load: ``presses`` Ctrl-Cs, or ``error``
    raised there (a failed write). Returns the count of chunks the loads began to write."""
    store = opt.chunked_state.store
    calls: list[int] = []

    def hit() -> None:
        calls.append(1)
        if len(calls) == chunk:
            if error is not None:
                raise error
            for _ in range(presses):
                os.kill(os.getpid(), signal.SIGINT)

    real_put, real_dirty = store.put, store.mark_dirty  # load_checkpoint puts rows; load_state_dict writes in place
    monkeypatch.setattr(store, "put", lambda *a, **k: (hit(), real_put(*a, **k))[1])
    monkeypatch.setattr(store, "mark_dirty", lambda *a, **k: (hit(), real_dirty(*a, **k))[1])
    return calls


def trained(tmp_path):
    """An optimizer after 3 steps, with a checkpoint and a state dict of step 1, and what a whole load of each gives."""
    model = mlp()
    opt = TieredOptimizer(model, tmp_path / "nvme", **KW)
    train(model, opt, range(1))
    ck = opt.save_checkpoint(tmp_path / "ck")
    sd = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy(model.state_dict())
    loaded = state_of(opt)
    train(model, opt, range(1, 3))
    return model, opt, ck, sd, weights, loaded


@pytest.mark.parametrize("how", ["load_checkpoint", "load_state_dict"])
def test_ctrl_c_during_a_load_is_delivered_after_it_the_state_whole(tmp_path, monkeypatch, how):
    model, opt, ck, sd, weights, loaded = trained(tmp_path)
    with opt:
        calls = interrupt_at(monkeypatch, opt, 3)
        with pytest.raises(KeyboardInterrupt):
            opt.load_checkpoint(ck) if how == "load_checkpoint" else opt.load_state_dict(sd)
        assert len(calls) == len(opt.chunks), "the load ran to its end before the interrupt"
        monkeypatch.undo()
        assert same(state_of(opt), loaded) and opt.step_counts == [1] * 6
        if how == "load_checkpoint":
            assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
        train(model, opt, range(3, 4))  # and it goes on


def test_ctrl_c_before_a_load_changed_anything_stops_it_there_unchanged(tmp_path, monkeypatch):
    model, opt, ck, sd, weights, loaded = trained(tmp_path)
    with opt:
        before = state_of(opt)
        opt.register_load_state_dict_pre_hook(lambda o, s: os.kill(os.getpid(), signal.SIGINT))
        with pytest.raises(KeyboardInterrupt):
            opt.load_state_dict(sd)
        assert same(state_of(opt), before) and opt.step_counts == [3] * 6
        train(model, opt, range(3, 4))


@pytest.mark.parametrize("how", ["load_checkpoint", "load_state_dict"])
@pytest.mark.parametrize("stop", ["second Ctrl-C", "OSError"])
def test_a_load_stopped_part_way_breaks_the_optimizer_until_a_load_ends_whole(tmp_path, monkeypatch, how, stop):
    model, opt, ck, sd, weights, loaded = trained(tmp_path)
    with opt:
        error = OSError(28, "No space left on device") if stop == "OSError" else None
        interrupt_at(monkeypatch, opt, 3, presses=2, error=error)
        with pytest.raises(KeyboardInterrupt if error is None else OSError):
            opt.load_checkpoint(ck) if how == "load_checkpoint" else opt.load_state_dict(sd)
        monkeypatch.undo()
        # Some chunks loaded, the others as they were: every way on refuses, by name, saying how to recover.
        why = f"{how}\\(\\) (was stopped|failed) part-way .*load_checkpoint\\(\\) or load_state_dict\\(\\)"
        for call in (lambda: train(model, opt, range(3, 4)), opt.state_dict,
                     lambda: opt.save_checkpoint(tmp_path / "torn")):  # fmt: skip
            with pytest.raises(OptimizerBrokenError, match=why):
                call()
        assert not (tmp_path / "torn").exists()
        opt.zero_grad()
        opt.load_checkpoint(ck) if how == "load_checkpoint" else opt.load_state_dict(sd)
        assert same(state_of(opt), loaded)
        train(model, opt, range(3, 4))


@pytest.mark.parametrize("how", ["load_checkpoint", "load_state_dict"])
def test_a_load_a_ctrl_c_let_finish_still_forgets_the_dicts_read_before_it(tmp_path, monkeypatch, how):
    # The Ctrl-C is raised as the load ends: a dict opt.state[p] handed out before it must hold none of the loaded
    # state all the same, so a write to it changes nothing (it zeroed the loaded moments).
    model, opt, ck, sd, weights, loaded = trained(tmp_path)
    with opt:
        held = opt.state[next(model.parameters())]
        interrupt_at(monkeypatch, opt, 3)
        with pytest.raises(KeyboardInterrupt):
            opt.load_checkpoint(ck) if how == "load_checkpoint" else opt.load_state_dict(sd)
        monkeypatch.undo()
        held["exp_avg"].zero_()
        assert same(state_of(opt), loaded)
