"""update_in_backward: chunks update while backward runs, and step() keeps only what is still exact.

Every test trains the same model twice, with the update under backward and without, and asserts bitwise
equal weights (the plain step is itself checked against torch.optim.AdamW in test_optimizer_parity.py);
then what was kept or redone, and why. On CPU the "device" update runs on the host, synchronously inside
the gradient hooks: the same code as on a GPU, without the overlap.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tiered import TieredOptimizer
from tiered.optim.under_backward.aside import AsideUpdate

CHUNK = "48KiB"  # a few thousand elements a chunk: the model below spans several chunks


def model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).to(dtype)


def batch(i: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 32, generator=g).to(dtype), torch.randn(16, 8, generator=g).to(dtype)


def make(m: nn.Module, tmp_path, early: bool, **kw) -> TieredOptimizer:
    kw.setdefault("host_budget", "8MiB")
    kw.setdefault("chunk_bytes", CHUNK)
    return TieredOptimizer(m, nvme_path=tmp_path / ("early" if early else "plain"), lr=1e-2, update_on="device",
                           update_in_backward=early, **kw)  # fmt: skip


def backward(m: nn.Module, i: int, dtype: torch.dtype = torch.float32) -> None:
    x, y = batch(i, dtype)
    nn.functional.mse_loss(m(x).float(), y.float()).backward()


def train_pair(tmp_path, steps: int, between=None, accumulate: int = 1, dtype=torch.float32, **kw):
    """Train two copies, with and without the update under backward; ``between(m, opt, step)`` runs after
    backward, before step(), on both. Returns the models and the early optimizer's stats."""
    out = []
    for early in (True, False):
        m = model(dtype=dtype)
        opt = make(m, tmp_path, early, **kw)
        train_steps(m, opt, steps, between=between, accumulate=accumulate, dtype=dtype)
        stats = opt.stats()["under_backward"]
        opt.close()
        out.append((m, stats))
    (a, stats), (b, _) = out
    assert_same_weights(a, b)
    return stats


def train_steps(m: nn.Module, opt, steps: int, *, between=None, accumulate: int = 1, dtype=torch.float32) -> None:
    """``steps`` steps of ``accumulate`` backwards each; ``between(m, opt, step)`` after backward, before step()."""
    for s in range(steps):
        for a in range(accumulate):
            backward(m, s * accumulate + a, dtype)
        if between is not None:
            between(m, opt, s)
        opt.step()
        opt.zero_grad()


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    """``a`` (trained with the update under backward) has exactly ``b``'s (without it) weights."""
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), f"{name} differs from the plain step's"


def test_kept_updates_equal_the_plain_step(tmp_path):
    stats = train_pair(tmp_path, steps=4)
    assert stats["started"] > 0 and stats["kept"] == stats["started"], stats
    assert stats["redone"] == {} and stats["skipped"] == {}


def test_bf16_parameters_with_split_masters(tmp_path):
    stats = train_pair(tmp_path, steps=3, dtype=torch.bfloat16, split_masters=True)
    assert stats["kept"] == stats["started"] > 0, stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-split"])
def test_int8_moments(tmp_path, dtype):
    """8-bit moments are decoded and encoded inside the update, so the update under backward keeps them too."""
    stats = train_pair(tmp_path, steps=3, dtype=dtype, moments_dtype="int8")
    assert stats["kept"] == stats["started"] > 0, stats


def test_the_optimizers_own_clip_keeps_when_it_does_not_scale_and_redoes_when_it_does(tmp_path):
    stats = train_pair(tmp_path, steps=3, max_grad_norm=1e6)
    assert stats["kept"] == stats["started"] > 0, stats
    stats = train_pair(tmp_path / "b", steps=3, max_grad_norm=1e-3)
    assert stats["kept"] == 0 and stats["redone"].get("clipped") == stats["started"] > 0, stats


@pytest.mark.parametrize("max_norm, kept", [(1e6, True), (1e-3, False)])
def test_a_users_clip_between_backward_and_step(tmp_path, max_norm, kept):
    """HF Trainer, accelerate and Lightning clip with torch.nn.utils.clip_grad_norm_, which multiplies every
    gradient even by 1: kept when the gradients' bits are unchanged, redone when the clip scaled them."""

    def between(m, opt, s):
        opt.stats()  # the updates backward handed over have started (on CPU they read the gradients then)
        nn.utils.clip_grad_norm_(m.parameters(), max_norm)

    stats = train_pair(tmp_path, steps=3, between=between)
    if kept:
        assert stats["kept"] == stats["started"] > 0, stats
    else:
        assert stats["kept"] == 0 and stats["redone"].get("gradients changed") == stats["started"] > 0, stats


def test_gradient_accumulation_starts_only_in_the_last_backward(tmp_path):
    stats = train_pair(tmp_path, steps=4, accumulate=3)
    # The first step does not know the count yet: its first two backwards start updates the third redoes.
    assert stats["redone"] == {"another backward": 2 * stats["kept"] // 4}, stats
    assert stats["kept"] == stats["started"] - 2 * stats["kept"] // 4 > 0, stats


def test_changes_between_backward_and_step_redo_what_they_touch(tmp_path):
    def between(m, opt, s):
        opt.stats()  # the updates backward handed over have started
        if s == 1:
            opt.param_groups[0]["lr"] *= 0.5  # every chunk: redone
        if s == 2:
            with torch.no_grad():
                m[0].weight.mul_(0.9)  # the chunks holding it: redone; the others kept
        if s == 3:
            m[4].bias.grad.add_(1.0)  # a gradient changed in place

    stats = train_pair(tmp_path, steps=4, between=between)
    redone = stats["redone"]
    assert redone.get("parameters or hyperparameters changed", 0) > 0, stats
    assert redone.get("gradients changed", 0) >= 1, stats
    assert stats["kept"] > 0, stats


def test_a_tensor_lr_changed_in_place_between_backward_and_step_redoes_the_update(tmp_path):
    """A tensor lr (torch's recipe for compiled steps) that a scheduler or the user fill_()s stays the same object:
    the update started under backward with the old value is redone, not kept."""

    def between(m, opt, s):
        opt.stats()  # the updates backward handed over have started
        if s == 0:
            opt.param_groups[0]["lr"] = torch.tensor(1e-2)  # one each: train_pair builds two optimizers
        if s == 2:
            opt.param_groups[0]["lr"].mul_(0.5)  # the same tensor, another value: every chunk redone

    stats = train_pair(tmp_path, steps=4, between=between)
    assert stats["redone"].get("parameters or hyperparameters changed", 0) > 0, stats
    assert stats["kept"] > 0, stats


def test_tensor_betas_changed_in_place_between_backward_and_step_redo_the_update(tmp_path):
    """Tensor betas (torch's AdamW takes them) sit in a tuple, which compared the same tensors by identity: a beta
    fill_()ed in place was missed and the update under backward kept with the old one."""

    def between(m, opt, s):
        opt.stats()  # the updates backward handed over have started
        if s == 0:
            opt.param_groups[0]["betas"] = (torch.tensor(0.9), torch.tensor(0.999))  # one pair each optimizer
        if s == 2:
            opt.param_groups[0]["betas"][0].fill_(0.5)  # the same tuple and tensors, another value

    stats = train_pair(tmp_path, steps=4, between=between)
    assert stats["redone"].get("parameters or hyperparameters changed", 0) > 0, stats
    assert stats["kept"] > 0, stats


def test_betas_as_one_tensor_of_two_under_backward(tmp_path):
    """torch's AdamW, and the plain step, take betas as one tensor of two: the update under backward read it as one
    number, which raised in step() after its step counts had moved. Now read as a pair; changed in place, redone."""

    def between(m, opt, s):
        opt.stats()  # the updates backward handed over have started
        if s == 0:
            opt.param_groups[0]["betas"] = torch.tensor([0.8, 0.99])  # one each: train_pair builds two optimizers
        if s == 2:
            opt.param_groups[0]["betas"][0] = 0.5  # the same tensor, another value: every chunk redone

    stats = train_pair(tmp_path, steps=4, between=between)
    assert stats["redone"].get("parameters or hyperparameters changed", 0) > 0, stats
    assert stats["kept"] > 0 and stats["skipped"] == {}, stats


class PausedUpdate:
    """Holds the worker inside the updates it starts once ``arm``ed (the nth ones since), each after it has read
    the group and the parameters and before it returns, until ``release``d: a write from the main thread lands
    mid-update, every time."""

    def __init__(self, monkeypatch):
        self.n, self.pauses = 0, {}
        real = AsideUpdate.update

        def update(aside, *a, **k):
            out = real(aside, *a, **k)
            self.n += 1
            if (pause := self.pauses.get(self.n)) is not None:
                pause[0].set()
                pause[1].wait(timeout=60)
            return out

        monkeypatch.setattr(AsideUpdate, "update", update)

    def arm(self, *nth: int) -> None:
        """Pause the ``nth`` updates the worker starts from now on (default: the first)."""
        self.n, self.pauses = 0, {n: (threading.Event(), threading.Event()) for n in nth or (1,)}

    def wait_inside(self, nth: int = 1) -> None:
        assert self.pauses[nth][0].wait(timeout=60), f"no update {nth} started under backward"

    def release(self, nth: int | None = None) -> None:
        for n, (_, go) in self.pauses.items():
            if nth in (None, n):
                go.set()


def change_mid_update(m, opt, ref, ref_opt, pause: PausedUpdate, change) -> dict:
    """Three steps of each optimizer, ``change(o, s)`` made between backward and step: on ``opt`` while its worker is
    held inside a chunk's update, on ``ref_opt`` plainly. Returns ``opt``'s under-backward stats."""
    try:
        for s in range(3):
            pause.arm()
            backward(m, s)
            pause.wait_inside()
            change(opt, s)
            pause.release()
            opt.step()
            opt.zero_grad()
            backward(ref, s)
            change(ref_opt, s)
            ref_opt.step()
            ref_opt.zero_grad()
    finally:
        pause.release()
    return opt.stats()["under_backward"]


@pytest.mark.parametrize(
    "key, value",
    [
        ("lr", lambda s: 1e-2 * (s + 1) / 4),  # a manual warmup
        ("eps", lambda s: 10.0 ** -(3 + s)),
        ("weight_decay", lambda s: 0.1 * (s + 1)),
        ("betas", lambda s: (0.8 - 0.1 * s, 0.99 - 0.01 * s)),
    ],
)
def test_a_hyperparameter_set_while_an_update_under_backward_runs_is_the_steps(tmp_path, monkeypatch, key, value):
    """``loss.backward(); group[key] = warmup(s); opt.step()`` while the worker is inside a chunk's update, which
    read the old value: that update was judged by the group as it was after the update, the new value, and kept
    with the old one. It is judged by what it read: redone, and the weights are torch's fused AdamW's, bitwise."""
    m, ref = model(), model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    pause = PausedUpdate(monkeypatch)
    with make(m, tmp_path, True) as opt:

        def change(o: torch.optim.Optimizer, s: int) -> None:
            o.param_groups[0][key] = value(s)

        stats = change_mid_update(m, opt, ref, ref_opt, pause, change)
    assert_same_weights(m, ref)
    assert stats["redone"].get("parameters or hyperparameters changed", 0) >= 3, stats  # the paused ones
    assert stats["kept"] > 0, stats  # those started after the write read the new value


@pytest.mark.parametrize("change", ["replaced", "changed in place"])
def test_numpy_betas_set_while_an_update_under_backward_runs_are_the_steps(tmp_path, monkeypatch, change):
    """Betas in a numpy array (torch's fused AdamW steps with them) were kept as the very array by the update's
    record: another array made step() raise ("truth value of an array ... is ambiguous") after its step counts
    had moved, leaving the optimizer broken for good; the same array changed in place compared equal to itself
    and the update was kept with the old betas. The record holds their values: redone, torch's weights bitwise."""
    m, ref = model(), model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    pause = PausedUpdate(monkeypatch)
    with make(m, tmp_path, True) as opt:
        for o in (opt, ref_opt):
            o.param_groups[0]["betas"] = np.array([0.9, 0.999])  # one each

        def change_betas(o: torch.optim.Optimizer, s: int) -> None:
            if change == "replaced":
                o.param_groups[0]["betas"] = np.array([0.8 - 0.1 * s, 0.99 - 0.01 * s])
            else:
                o.param_groups[0]["betas"][0] = 0.8 - 0.1 * s

        stats = change_mid_update(m, opt, ref, ref_opt, pause, change_betas)
    assert_same_weights(m, ref)
    assert stats["redone"].get("parameters or hyperparameters changed", 0) >= 3, stats  # the paused ones
    assert stats["kept"] > 0 and stats["skipped"] == {}, stats


def test_a_numpy_lr_changed_in_place_between_backward_and_step_redoes_the_update(tmp_path):
    """A 0-d numpy lr (the constructor and the step take it) was kept as the very array by the update's record, so
    one changed in place compared equal to itself: the update under backward was kept with the old lr."""

    def between(m, opt, s):
        opt.stats()  # the updates backward handed over have started
        if s == 0:
            opt.param_groups[0]["lr"] = np.array(1e-2)  # one each: train_pair builds two optimizers
        if s == 2:
            opt.param_groups[0]["lr"][()] = 5e-3  # the same array, another value: every chunk redone

    stats = train_pair(tmp_path, steps=4, between=between)
    assert stats["redone"].get("parameters or hyperparameters changed", 0) > 0, stats
    assert stats["kept"] > 0 and stats["skipped"] == {}, stats


def test_a_malformed_hyperparameter_under_backward_is_refused_at_step_and_the_run_goes_on_once_fixed(tmp_path):
    """A group's lr set to None before backward: the updates backward starts fail (each is left to step()), and
    step() refused it by name only after its step counts had moved, leaving the optimizer broken for good. It is
    refused before anything changes; fixed, the run goes on as the plain step's, which met the same group."""
    out = []
    for early in (True, False):
        m = model()
        opt = make(m, tmp_path, early)
        train_steps(m, opt, 2)
        opt.param_groups[0]["lr"] = None  # a scheduler's bug
        backward(m, 2)
        opt.stats()  # the updates backward handed over have started (and failed), however loaded the machine
        with pytest.raises(TypeError, match=r"param_groups\[0\]: 'lr' must be a number, got None"):
            opt.step()
        assert opt.step_counts == [2] * len(opt.step_counts)
        opt.param_groups[0]["lr"] = 1e-2
        opt.step()
        opt.zero_grad()
        train_steps(m, opt, 2)
        stats = opt.stats()["under_backward"]
        opt.close()
        out.append((m, stats))
    (a, stats), (b, _) = out
    assert_same_weights(a, b)
    assert any("'lr' must be a number" in why for why in stats["skipped"]), stats
    assert stats["kept"] > 0, stats


def test_without_spare_host_memory_the_step_updates_what_did_not_start(tmp_path, caplog):
    """A host budget that holds the state (81 KB) but not a second copy of it: one of the two chunks finds a
    spare buffer, the other updates in step(), and one warning says how much more budget would do."""
    with caplog.at_level("WARNING", logger="tiered"):
        stats = train_pair(tmp_path, steps=2, host_budget="128KiB")
    assert stats["kept"] == stats["started"] == 2, stats
    assert stats["skipped"] == {"no spare host memory": 2}, stats
    told = [r.getMessage() for r in caplog.records if "no spare host memory" in r.getMessage()]
    assert len(told) == 1 and "host_budget about" in told[0] and "larger" in told[0], told


def test_push_rows_puts_every_chunks_row_into_its_parameters(tmp_path):
    """``push_rows`` (how step() keeps the new weights that waited on the GPU) copies many chunks' rows at once:
    each parameter ends up with its pieces' values, whatever the chunks they lie in."""
    m = model(dtype=torch.bfloat16)
    opt = make(m, tmp_path, True, chunk_bytes="12KiB")
    assert len(opt.chunks) > 2 and any(len(c.pieces) > 1 for c in opt.chunks)
    g = torch.Generator().manual_seed(7)
    rows = [(c, torch.randn(c.numel, generator=g).to(torch.bfloat16), list(range(len(c.pieces)))) for c in opt.chunks]
    AsideUpdate(opt._strategy).push_rows(rows)
    params = list(m.parameters())
    for chunk, row, _ in rows:
        for pc in chunk.pieces:
            got = params[pc.param].detach().reshape(-1)[pc.param_start : pc.param_start + pc.numel]
            assert torch.equal(got, row[pc.chunk_start : pc.chunk_start + pc.numel])
    opt.close()


def test_chunks_on_nvme_are_read_and_updated_under_backward(tmp_path, caplog):
    """No chunk is resident: each is read from NVMe without waiting, then updated once in host memory, if
    the spare budget allows; reads that end after step() began are left to it. Exact either way."""
    import time

    results = []
    caplog.set_level("WARNING", logger="tiered")
    for early in (True, False):
        m = model()
        m[0].weight.register_hook(lambda _: time.sleep(0.2))  # a long backward: the reads end under it
        opt = make(m, tmp_path / str(early), early, host_budget="64KiB", chunk_bytes="12KiB")
        assert not any(opt.store.is_resident(c.key) for c in opt.chunks)
        for s in range(4):
            backward(m, s)
            opt.step()
            opt.zero_grad()
        results.append((m, opt.stats()))
        opt.close()
    (a, stats), (b, plain) = results
    assert_same_weights(a, b)
    ub = stats["under_backward"]
    assert ub["read"] > 0 and ub["kept"] > 0 and ub["redone"] == {}, ub
    assert stats["total"]["under_backward_bytes"] > 0
    assert plain["total"]["nvme_read_bytes"] > 0  # the plain twin streams every chunk from disk
    # The reads fill the spare room: some chunks found none, told once, and not to raise a budget the state takes.
    assert ub["skipped"].get("no spare host memory", 0) > 0, ub
    told = [r.getMessage() for r in caplog.records if "no spare host memory" in r.getMessage()]
    assert len(told) == 1 and "lives on NVMe" in told[0], told


def test_a_failed_read_under_backward_is_the_steps_to_report(tmp_path):
    """A chunk on NVMe whose file is damaged: its early read fails on the store's threads, the worker skips
    it, and step() meets the error itself, naming the record, without waiting on the worker; close() works."""
    import time

    from tiered.store.records import IntegrityError

    m = model()
    m[0].weight.register_hook(lambda _: time.sleep(0.2))  # a long backward: the reads end under it
    opt = make(m, tmp_path, True, host_budget="64KiB", chunk_bytes="12KiB")
    backward(m, 0)
    opt.step()
    opt.zero_grad()
    on_disk = [c.key for c in opt.chunks if opt.store.info(c.key).tier == "nvme"]
    assert on_disk
    path = opt.store._state.recs[on_disk[-1]].path
    os.truncate(path, 1000)
    backward(m, 1)
    failed: list[BaseException] = []
    stepper = threading.Thread(target=lambda: failed.append(pytest.raises(IntegrityError, opt.step).value))
    stepper.start()
    stepper.join(120)
    assert not stepper.is_alive(), "step() hung on a failed read"
    assert failed and on_disk[-1] in str(failed[0]) and "truncated" in str(failed[0]), failed
    stats = opt.stats()["under_backward"]
    # The damaged chunk is never updated early: its read fails under backward, or, on a loaded machine where the
    # other chunks' reads still hold the 64 KiB budget when its turn comes, it is skipped for want of host memory
    # and step() reads it itself; either way step() meets the damage, as asserted above.
    skipped = stats["skipped"]
    reasons = {"evicted or failed to read before its update", "no host memory to read into", "no spare host memory"}
    assert stats["read"] > 0 and reasons & set(skipped), stats
    opt.close()
    assert not os.path.exists(opt.workdir)


def test_zero_grad_without_a_step_drops_everything_and_frees_the_memory(tmp_path):
    """As when GradScaler skips a step: backward started updates, step() never came."""
    m = model()
    opt = make(m, tmp_path, True)
    in_use = opt.store.stats()["host"]["in_use_bytes"] if "in_use_bytes" in opt.store.stats()["host"] else None
    before = {k: v.clone() for k, v in m.state_dict().items()}
    backward(m, 0)
    assert opt.stats()["under_backward"]["started"] > 0
    opt.zero_grad()
    assert opt.stats()["under_backward"]["redone"] == {"zero_grad": opt.stats()["under_backward"]["started"]}
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k])
    if in_use is not None:
        assert opt.store.stats()["host"]["in_use_bytes"] == in_use
    assert opt.state_dict()["state"] == {} or all(
        torch.count_nonzero(s["exp_avg"]) == 0 for s in opt.state_dict()["state"].values()
    )
    opt.close()


def test_a_closure_backward_is_the_steps_own(tmp_path):
    out = []
    for early in (True, False):
        m = model()
        opt = make(m, tmp_path / str(early), early)
        for s in range(3):

            def closure(s=s, m=m, opt=opt):
                opt.zero_grad()
                backward(m, s)
                return 0.0

            opt.step(closure)
        out.append((m, opt.stats()["under_backward"]))
        opt.close()
    (a, stats), (b, _) = out
    assert stats["kept"] == stats["started"] > 0, stats  # the closure's backward ran under step()'s lock
    assert_same_weights(a, b)


def test_close_with_updates_started_releases_everything(tmp_path):
    m = model()
    opt = make(m, tmp_path, True)
    backward(m, 0)
    assert opt.stats()["under_backward"]["started"] > 0
    workdir = opt.workdir
    opt.close()
    assert not os.path.exists(workdir)
    backward(m, 1)  # the hooks are gone with the optimizer


def test_auto_is_off_on_cpu_and_true_is_refused_on_the_host(tmp_path):
    m = model()
    for update_on in ("device", "auto", "host"):  # "auto" on CPU parameters: nothing to hide the update under
        with TieredOptimizer(m, nvme_path=tmp_path / update_on, update_on=update_on) as opt:
            assert opt.config.update_in_backward is False and opt.stats()["under_backward"] is None
    with pytest.raises(ValueError, match="update_in_backward=True needs"):
        TieredOptimizer(m, nvme_path=tmp_path / "b", update_on="host", update_in_backward=True)
    with pytest.raises(ValueError, match="update_in_backward=True needs"):
        TieredOptimizer(m, nvme_path=tmp_path / "c", update_in_backward=True)  # CPU: "auto" is the host
    with pytest.raises(TypeError, match="True, False or 'auto'"):
        TieredOptimizer(m, nvme_path=tmp_path / "d", update_in_backward="on")


def _auto(opt: TieredOptimizer) -> None:
    """Give a CPU optimizer built with update_in_backward=True the "auto" switch a GPU one gets."""
    from tiered.optim.under_backward.switch import UnderBackwardSwitch

    opt._under_backward.switch = UnderBackwardSwitch("auto", cuda=False)


@pytest.mark.parametrize("slow", ["backward", "step"])
def test_auto_turns_on_where_backward_outlasts_the_step(tmp_path, slow):
    """The "auto" switch times its first three steps: backward's window (from the first final gradient to its end)
    against the step's own time; on only if the window is the longer. The weights equal the plain step's
    either way."""
    import time

    results = []
    for early in (True, False):
        m = model()
        if slow == "backward":  # the first layer's gradients are made last: backward's window grows
            m[0].weight.register_hook(lambda _: time.sleep(0.2))
        opt = make(m, tmp_path, early)
        if early:
            _auto(opt)
            if slow == "step":  # the step is slower than backward's window
                began = opt._under_backward.step_began
                opt._under_backward.step_began = lambda clock, f=began: (f(clock), time.sleep(0.05))[0]
        for s in range(6):
            backward(m, s)
            if early and s == 3:
                decided = opt.stats()["under_backward"]["switch"]
            opt.step()
            opt.zero_grad()
        results.append((m, opt.stats()["under_backward"]))
        opt.close()
    (a, stats), (b, _) = results
    assert_same_weights(a, b)
    assert len(decided["measured"]) == 3, decided
    if slow == "backward":
        assert decided["engaged"] and decided["decided"].startswith("on:"), decided
        assert stats["started"] > 0 and stats["kept"] == stats["started"], stats  # steps 4 and 5 started early
    else:
        assert not decided["engaged"] and decided["decided"].startswith("off:"), decided
        assert stats["started"] == 0, stats


def test_auto_turns_off_after_two_steps_that_redo_more_than_they_keep(tmp_path):
    """A clip that scales every step redoes every early update: "auto" stops starting them after two such
    steps, while update_in_backward=True goes on (and stays exact)."""
    import time

    for setting in ("auto", True):
        m = model()
        m[0].weight.register_hook(lambda _: time.sleep(0.2))  # backward outlasts the step: "auto" is on
        opt = make(m, tmp_path / str(setting), True, max_grad_norm=1e-3)
        if setting == "auto":
            _auto(opt)
        for s in range(8):
            backward(m, s)
            opt.step()
            opt.zero_grad()
        stats = opt.stats()["under_backward"]
        opt.close()
        chunks = len(opt.chunks)
        assert stats["kept"] == 0 and stats["redone"] == {"clipped": stats["started"]}, stats
        if setting == "auto":  # on after step 2; steps 3 and 4 redid everything: off from step 5
            assert not stats["switch"]["engaged"] and "redid more" in stats["switch"]["decided"], stats
            assert stats["started"] == 2 * chunks, stats
        else:
            assert stats["switch"]["engaged"] and stats["started"] == 8 * chunks, stats


def test_a_collected_optimizer_unhooks_the_model(tmp_path):
    import gc

    m = model()
    opt = make(m, tmp_path, True)
    workdir = opt.workdir
    del opt
    gc.collect()
    assert not os.path.exists(workdir)  # the hooks did not keep it alive
    backward(m, 0)


def test_grad_scaler_unscaling_in_place_is_seen(tmp_path):
    """GradScaler unscales the gradients in place without bumping their version counters: the fingerprints
    see it, so every early update is redone, and a step the scaler skips drops them."""
    out = []
    for early in (True, False):
        m = model()
        opt = make(m, tmp_path, early)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for i in range(4):
            x, y = batch(i)
            scaler.scale(nn.functional.mse_loss(m(x), y)).backward()
            opt.stats()  # the updates backward handed over have read the scaled gradients
            if i == 0:
                m[0].weight.grad[0, 0] = float("inf")  # the scaler skips this step
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        out.append((m, opt.stats()["under_backward"]))
        opt.close()
    (a, stats), (b, _) = out
    assert stats["kept"] == 0 and set(stats["redone"]) == {"zero_grad", "gradients changed"}, stats
    assert_same_weights(a, b)


def _fsdp2_pair(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = []
    for early in (True, False):
        m = model()
        mesh = init_device_mesh("cpu", (world,))
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        opt = make(m, Path(root) / str(rank), early, max_grad_norm=1e6)
        for s in range(3):
            for a in range(2):  # accumulation: FSDP2 reduce-scatters, then runs the hooks, each backward
                x, y = batch(10 * s + a + world * rank)
                nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
        out.append(([p.full_tensor() for p in m.parameters()], opt.stats()["under_backward"]))
        opt.close()
    (a, stats), (b, _) = out
    return dict(same=all(torch.equal(x, y) for x, y in zip(a, b)), stats=stats)


def test_fsdp2_runs_the_updates_after_its_reduce_scatter(tmp_path):
    from distributed_common import run_ranks

    for r in run_ranks(_fsdp2_pair, 2, str(tmp_path)):
        assert r["same"]
        assert r["stats"]["kept"] > 0 and set(r["stats"]["redone"]) <= {"another backward"}, r["stats"]


def test_saves_and_state_dicts_between_backward_and_step_see_the_state_before_the_step(tmp_path):
    """An update started under backward changes nothing a save or state_dict() reads until step() keeps it."""
    m = model()
    with make(m, tmp_path, True) as opt:
        backward(m, 0)
        opt.step()
        opt.zero_grad()
        before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
        backward(m, 1)
        assert opt.stats()["under_backward"]["started"] > 2
        during = opt.state_dict()["state"][0]
        for k, v in before.items():
            assert torch.equal(v, during[k]), k
        opt.save_checkpoint(tmp_path / "ckpt")
        opt.step()  # still kept: nothing the early updates read has changed
        assert opt.stats()["under_backward"]["last_step"]["redone"] == 0
        assert not torch.equal(opt.state_dict()["state"][0]["exp_avg"], before["exp_avg"])


def _five_chunks() -> nn.Module:
    """Five 32x32 layers, one 12 KiB chunk of state each, and a frozen head (no state) to thaw."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(5):
        layers += [nn.Linear(32, 32, bias=False), nn.Tanh()]
    m = nn.Sequential(*layers, nn.Linear(32, 8))
    m[10].requires_grad_(False)
    return m


def _thaw(m: nn.Module, *_) -> None:
    m[10].requires_grad_(True)


def _load_state_dict(tmp_path, opt, ref_opt, saved) -> None:
    opt.load_state_dict(saved["tiered"])
    ref_opt.load_state_dict(saved["adamw"])


def _load_checkpoint(tmp_path, opt, ref_opt, saved) -> None:
    opt.load_checkpoint(tmp_path / "ckpt")  # the parameters too, from the masters saved
    ref_opt.load_state_dict(saved["adamw"])
    saved["ref"][0].load_state_dict(saved["weights"])


# What runs between backward and step() (after a thaw, or not); (tmp_path, opt, ref_opt, saved) -> None.
_READS = {
    "state_dict": lambda tmp_path, opt, *_: opt.state_dict(),
    "opt.state[p]": lambda tmp_path, opt, *_: dict(opt.state[opt.param_groups[0]["params"][4]]),
    "save_checkpoint": lambda tmp_path, opt, *_: opt.save_checkpoint(tmp_path / "during"),
    "load_state_dict": _load_state_dict,
    "load_checkpoint": _load_checkpoint,
}


@pytest.mark.parametrize(
    "thaw, read",
    [(True, None), (False, "state_dict"), (False, "opt.state[p]"), (False, "save_checkpoint"),
     (True, "state_dict"), (True, "load_state_dict"), (True, "load_checkpoint")],
)  # fmt: skip
def test_reads_and_layouts_again_between_backward_and_step_with_the_state_partly_on_nvme(tmp_path, thaw, read):
    """The two resident chunks (the last layers, whose gradients backward makes final first) start their
    updates into the whole stream reserve (24 KiB), pinned, while the other three wait on NVMe. A thaw, which lays
    the state out again over the thawed head at the next call, and a read of the state before step() must read
    those three from NVMe: they waited for ever for the room the started updates held. Those are dropped now, and
    step() updates their chunks itself, once: the weights stay torch's AdamW's, bit for bit."""
    import copy

    from helpers import run_bounded

    def order(m: nn.Module) -> list[torch.Tensor]:  # chunk i holds layer 4 - i
        return [m[i].weight for i in (8, 6, 4, 2, 0)] + list(m[10].parameters())

    m, ref = _five_chunks(), _five_chunks()
    ref_opt = torch.optim.AdamW(order(ref), lr=1e-2, fused=True)
    opt = TieredOptimizer(order(m), nvme_path=tmp_path / "nvme", lr=1e-2, chunk_bytes="12KiB", host_budget="48KiB",
                          prefetch_depth=0, update_on="device", update_in_backward=True)  # fmt: skip
    assert [opt.store.is_resident(c.key) for c in opt.chunks] == [True, True, False, False, False]
    saved: dict = {"ref": [ref]}

    def train() -> None:
        for s in range(4):
            if s == 2 and thaw:
                _thaw(m), _thaw(ref)
            opt.store.flush()  # no write-back of the last step still holds room when backward starts updates
            backward(m, s), backward(ref, s)
            started = opt.stats()["under_backward"]["started"]  # once the worker has started what it was handed
            if s == 2:
                assert started - saved["started"] == 2  # both resident chunks: the pool is full
                if read is not None:
                    _READS[read](tmp_path, opt, ref_opt, saved)
            saved["started"] = started
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
            if s == 0:
                saved.update(tiered=opt.state_dict(), adamw=copy.deepcopy(ref_opt.state_dict()))
                saved["weights"] = copy.deepcopy(ref.state_dict())
                opt.save_checkpoint(tmp_path / "ckpt")

    run_bounded(train, timeout=60)
    for (name, a), b in zip(m.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), f"{name} differs from torch's AdamW"
    opt.close()


def test_an_added_param_group_is_hooked_too(tmp_path):
    out = []
    for early in (True, False):
        m = model()
        opt = make(m, tmp_path / str(early), early, host_budget="16MiB")
        extra = nn.Linear(8, 8)
        torch.manual_seed(3)
        nn.init.normal_(extra.weight)
        opt.add_param_group({"params": list(extra.parameters()), "lr": 5e-3})
        for s in range(3):
            x, y = batch(s)
            nn.functional.mse_loss(extra(m(x)), y).backward()
            opt.step()
            opt.zero_grad()
        out.append(([p.detach().clone() for p in [*m.parameters(), *extra.parameters()]], opt.stats()))
        opt.close()
    (a, stats), (b, _) = out
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert stats["under_backward"]["kept"] > 0 and not stats["under_backward"]["redone"], stats["under_backward"]


def test_a_failure_while_keeping_leaves_nothing_pinned(tmp_path, monkeypatch):
    """A step that fails while it keeps the early updates is torn like any step failing part-way; every
    record it had pinned and every spare buffer goes back, so the optimizer still closes cleanly."""
    from tiered.optimizer import OptimizerBrokenError

    m = model()
    opt = make(m, tmp_path, True)
    backward(m, 0)
    assert opt.stats()["under_backward"]["started"] >= 2
    calls = []

    def exchange(key, buf, real=opt.store.exchange):
        calls.append(key)
        if len(calls) == 2:
            raise OSError("injected")
        return real(key, buf)

    monkeypatch.setattr(opt.store, "exchange", exchange)
    in_use = opt.store.stats()["host"]["in_use"]
    with pytest.raises(OSError, match="injected"):
        opt.step()
    with pytest.raises(OptimizerBrokenError):
        opt.step()
    assert opt.store.stats()["host"]["in_use"] < in_use  # the spare buffers went back
    workdir = opt.workdir
    opt.close()
    assert not os.path.exists(workdir)


EXIT_WITH_UPDATES_IN_FLIGHT = """
import sys, torch
from tiered import TieredOptimizer
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
opt = TieredOptimizer(model, sys.argv[1] if len(sys.argv) > 1 else {root!r}, host_budget="4MiB",
                      chunk_bytes="64KiB", update_on="device", update_in_backward=True)
model(torch.randn(8, 64)).pow(2).mean().backward()
opt.step()
model(torch.randn(8, 64)).pow(2).mean().backward()  # early updates started, and no step() to keep them
print("started", opt.stats()["under_backward"]["started"], flush=True)
"""


def test_exit_without_close_with_updates_started_is_prompt_and_clean(tmp_path):
    """No close(), a worker thread and pinned early updates alive: the process still exits at once, and the
    state files and the private folder are gone."""
    from helpers import run_script

    root = tmp_path / "nvme"
    for _ in range(3):
        out = run_script(EXIT_WITH_UPDATES_IN_FLIGHT.format(root=str(root)), timeout=60)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout.split()[-1]) > 0, out.stdout
        assert "terminate called" not in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert os.listdir(root) == []


def test_a_backward_that_raised_leaves_the_next_ones_accumulation_seen_as_before(tmp_path):
    """A backward that raised part-way never runs its end-of-backward callback: the next backwards must still be
    told apart (a flag left set made every later micro-batch the last: each started every chunk's early update
    and the next backward threw them away, for the rest of the run). Skipped with zero_grad, the run goes on as a
    healthy one does, update for update, and bitwise the plain step."""

    def boom(*_):
        raise RuntimeError("out of memory, say")

    def run(early: bool, fail: bool, name: str) -> tuple[nn.Module, dict]:
        m = model()
        with make(m, tmp_path / name, early) as opt:
            for s in range(4):
                if fail and s == 1:
                    hook = m[0].register_full_backward_pre_hook(boom)
                    x, y = batch(999)
                    with pytest.raises(RuntimeError, match="out of memory"):
                        nn.functional.mse_loss(m(x), y).backward()
                    hook.remove()
                    opt.zero_grad()  # the batch skipped
                for a in range(2):
                    x, y = batch(s * 2 + a)
                    nn.functional.mse_loss(m(x), y).backward()
                opt.step()
                opt.zero_grad()
            stats = opt.stats()["under_backward"] or {}
            return m, {k: stats.get(k) for k in ("kept", "redone")}

    healthy = run(True, False, "healthy")[1]
    failed, counts = run(True, True, "failed")
    assert counts == healthy
    assert_same_weights(failed, run(False, True, "plain")[0])
