"""Resetting the whole state as torch.optim.AdamW users do: ``opt.state.clear()`` and ``opt.state = defaultdict(dict)``
(after a loss spike, between curriculum stages, as a fallback when a load fails). torch's next step starts every
parameter afresh: step 0, zero moments. Here as there, bitwise, with the state on NVMe (tiered/optim/state_view.py).

Once, both did nothing and said nothing: ``clear()`` is ``MutableMapping``'s, a loop over an iterator that is empty
by design, and the assignment replaced the attribute while the steps went on with the state in the tiers."""

from __future__ import annotations

import copy
import os
import signal
from collections import defaultdict

import pytest
import torch
from test_state_view import assert_same
from torch import nn

from tiered import TieredOptimizer
from tiered.optim.state_view import LazyState
from tiered.optimizer import OptimizerBrokenError

# State on NVMe (a budget of three chunks' records), several chunks, parameters across chunk boundaries.
KW = dict(lr=1e-2, weight_decay=0.1, host_budget="36KiB", chunk_bytes="12KiB", prefetch_depth=2)


def mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(dtype)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        g = torch.Generator().manual_seed(100 + s)
        dtype = next(model.parameters()).dtype
        x, y = torch.randn(16, 32, generator=g).to(dtype), torch.randn(16, 8, generator=g)
        nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()


def pair(tmp_path, **kw):
    ref, model = mlp(), mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    return ref, ref_opt, model, TieredOptimizer(model, tmp_path, **{**KW, **kw})


def _clear(o: torch.optim.Optimizer) -> None:
    o.state.clear()


def _defaultdict(o: torch.optim.Optimizer) -> None:
    o.state = defaultdict(dict)


def _empty_dict(o: torch.optim.Optimizer) -> None:
    o.state = {}  # (torch's AdamW then raises KeyError at its next step: it needs a defaultdict)


RESETS = [_clear, _defaultdict, _empty_dict]
IDS = [r.__name__.strip("_") for r in RESETS]


@pytest.mark.parametrize("reset", RESETS, ids=IDS)
def test_a_reset_starts_every_parameter_afresh_as_torchs(tmp_path, reset):
    ref, ref_opt, model, opt = pair(tmp_path)
    with opt:
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(3))
        ref_opt.state.clear()
        reset(opt)
        assert not opt.state and opt.step_counts == [0] * 4
        assert all(p not in opt.state and opt.state[p] == {} for p in model.parameters())
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(3, 5))
        assert_same(ref, ref_opt, model, opt)
        assert opt.step_counts == [2] * 4
        opt.state = opt.state  # its own state put back (torch.optim.swap_in_optimizer_params_and_state): nothing


@pytest.mark.parametrize(
    "dtype, kw",
    [(torch.bfloat16, dict(split_masters=True)), (torch.bfloat16, dict(split_masters=False)),
     (torch.float32, dict(moments_dtype="int8")), (torch.float32, dict(moments_dtype=torch.bfloat16))],
    ids=["split", "bf16-masters", "int8", "bf16-moments"],
)  # fmt: skip
@pytest.mark.parametrize("reset", RESETS, ids=IDS)
def test_a_reset_is_del_of_every_parameters_state_in_every_record_format(tmp_path, dtype, kw, reset):
    """torch keeps no master and no narrow moments: the reference is ``del opt.state[p]`` for every ``p``, which
    starts a parameter afresh as torch's (tests/unit/optim/test_state_view.py), its master from the parameter."""
    a, b = mlp(dtype), mlp(dtype)
    opt_a, opt_b = (TieredOptimizer(m, tmp_path / n, **KW, **kw) for m, n in ((a, "a"), (b, "b")))
    with opt_a, opt_b:
        for m, o in ((a, opt_a), (b, opt_b)):
            train(m, o, range(3))
            with torch.no_grad():
                m[0].weight.mul_(0.5)  # a write to a parameter since the step: its fresh master is the write
        reset(opt_a)
        for p in b.parameters():
            del opt_b.state[p]
        for m, o in ((a, opt_a), (b, opt_b)):
            train(m, o, range(3, 5))
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
        sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
        assert sorted(sa) == sorted(sb) == [0, 1, 2, 3]
        assert all(torch.equal(v, sb[i][k]) for i, s in sa.items() for k, v in s.items())


def test_a_reset_drops_what_opt_state_handed_out_before_it_as_torchs(tmp_path):
    """torch's reset lets go of the live dicts: a write to one read before it (even after a step, which here is
    otherwise refused at the next call) changes nothing. Moments loaded with step counts of 0 are reset too."""
    ref, ref_opt, model, opt = pair(tmp_path)
    with opt:
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(2))
            stale = o.state[m[0].weight]
            train(m, o, range(2, 3))
            w = m[0].weight  # alone in its chunks, all of whose moments torch's next step would use
            o.state[w] = {**copy.deepcopy(o.state[w]), "step": torch.tensor(0.0)}
            pending = o.state[m[2].weight]
            stale["exp_avg"].add_(1.0)
            pending["exp_avg_sq"].mul_(4.0)
            o.state.clear()
            stale["exp_avg"].add_(1.0)
            pending["exp_avg_sq"].mul_(4.0)
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(3, 5))
        assert_same(ref, ref_opt, model, opt)


def test_assigning_a_state_with_entries_is_refused_by_name_and_changes_nothing(tmp_path):
    model, other = mlp(), mlp()
    with TieredOptimizer(model, tmp_path / "a", **KW) as opt, TieredOptimizer(other, tmp_path / "b", **KW) as o2:
        train(model, opt, range(2))
        before = copy.deepcopy(opt.state_dict())
        entries = {p: copy.deepcopy(opt.state[p]) for p in model.parameters()}
        for value in (entries, defaultdict(dict, entries), o2.state, None, [], before):
            with pytest.raises(TypeError, match=r"load_state_dict\(\).*opt\.state\[p\] = \{\.\.\.\}.*clear\(\)"):
                opt.state = value
        assert isinstance(opt.state, LazyState)
        after = opt.state_dict()
        for i, s in before["state"].items():
            assert all(torch.equal(v, after["state"][i][k]) for k, v in s.items())
        assert opt.step_counts == [2] * 4


def test_a_reset_makes_a_broken_optimizer_whole_as_a_load_does(tmp_path, monkeypatch):
    """A reset is a whole state: the fallback after a load that failed part-way (as load_state_dict() is)."""
    ref, ref_opt, model, opt = pair(tmp_path)
    with opt:
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(2))
        sd = copy.deepcopy(opt.state_dict())
        store, calls = opt.chunked_state.store, []
        real = store.mark_dirty

        def fail_third(*a, **k):
            calls.append(1)
            if len(calls) == 3:
                raise OSError(28, "No space left on device")
            return real(*a, **k)

        monkeypatch.setattr(store, "mark_dirty", fail_third)
        with pytest.raises(OSError):
            opt.load_state_dict(sd)
        monkeypatch.undo()
        with pytest.raises(OptimizerBrokenError):
            opt.state_dict()
        opt.state = defaultdict(dict)
        ref_opt.state = defaultdict(dict)
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(2, 4))
        assert_same(ref, ref_opt, model, opt)


def test_a_ctrl_c_during_a_reset_is_delivered_after_it_the_reset_whole(tmp_path, monkeypatch):
    """A reset runs as a load: a Ctrl-C pressed while it rewrites the chunks is raised once all are rewritten."""
    ref, ref_opt, model, opt = pair(tmp_path)
    with opt:
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(2))
        store, calls = opt.chunked_state.store, []
        real = store.mark_dirty

        def press_at_second(*a, **k):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGINT)
            return real(*a, **k)

        monkeypatch.setattr(store, "mark_dirty", press_at_second)
        with pytest.raises(KeyboardInterrupt):
            opt.state.clear()
        monkeypatch.undo()
        assert len(calls) == len(opt.chunks) and opt.step_counts == [0] * 4
        ref_opt.state.clear()
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, range(2, 4))
        assert_same(ref, ref_opt, model, opt)
