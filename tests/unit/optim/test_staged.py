"""The state visits the "device" around the step (under_backward/staged.py): records staged under backward,
the math at step(), the new records written back into the same pinned buffers after it.

Every test trains twins, with staging and with update_in_backward=False (the streamed step, itself held to
torch's AdamW in test_optimizer_parity.py), and asserts bitwise equal weights (and state where it says so). On
CPU the "device" is the host and nothing is in flight, so the schedule runs as its own serial twin; a budget of
bytes stands in for the GPU's room (``stage``). tests/gpu/test_staged_cuda.py runs the same on CUDA streams.
"""

from __future__ import annotations

import pytest
import torch
from test_under_backward import assert_same_weights, backward, batch, make, model, train_steps
from torch import nn

from tiered.optim.under_backward.staged import StageRoom


def stage(opt, budget: int = 1 << 30) -> None:
    """Give a CPU optimizer's update under backward ``budget`` bytes of "device" room to stage records in."""
    opt._under_backward.staging.room = StageRoom(torch.device("cpu"), budget=budget)


def twins(tmp_path, steps: int, *, budget: int = 1 << 30, accumulate: int = 1, between=None, dtype=torch.float32,
          **kw):  # fmt: skip
    """Train staged and unstaged twins; ``between(m, opt, s)`` runs after backward, before step(), on both.
    Returns the staged optimizer's stats (taken before it closes) and the two final state dicts."""
    out = []
    for early in (True, False):
        m = model(dtype=dtype)
        opt = make(m, tmp_path / str(early), early, **kw)
        if early:
            stage(opt, budget)
        train_steps(m, opt, steps, between=between, accumulate=accumulate, dtype=dtype)
        out.append((m, opt.stats(), opt.state_dict()))
        opt.close()
    (a, stats, sd), (b, _, plain_sd) = out
    assert_same_weights(a, b)
    assert_same_state(sd, plain_sd)
    return stats, sd


def assert_same_state(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for i, s in a["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][i][k])), (i, k)


@pytest.mark.parametrize(
    "dtype, kw",
    [(torch.float32, {}), (torch.bfloat16, {"split_masters": True}), (torch.float32, {"moments_dtype": "int8"})],
    ids=["fp32", "bf16-split", "int8-moments"],
)
def test_staged_steps_equal_the_plain_step(tmp_path, dtype, kw):
    stats, _ = twins(tmp_path, 4, dtype=dtype, **kw)
    ub, chunks = stats["under_backward"], stats["chunks"]
    assert ub["staged"]["updated"] == 4 * chunks, ub  # every chunk, every step: nothing went the other ways
    assert ub["started"] == 0 and ub["redone"] == {} and ub["staged"]["unused"] == 0, ub
    assert stats["total"]["under_backward_bytes"] == 4 * stats["state_bytes"]


def test_the_optimizers_clip_active_every_step_is_exact_and_staged(tmp_path):
    """A clip that scales every step redoes every update started into a spare buffer; the staged chunks are
    updated after the clip, so all of them count, every step."""
    stats, _ = twins(tmp_path, 4, max_grad_norm=1e-3)
    ub = stats["under_backward"]
    assert ub["staged"]["updated"] == 4 * stats["chunks"] and ub["redone"] == {}, ub


def test_a_users_clip_grad_scaler_and_writes_through_data_between_backward_and_step(tmp_path):
    """What the user does to gradients and parameters after backward is seen by the staged math, which
    reads them at step(), as the plain step does."""

    def between(m, opt, s):
        opt.stats()  # the worker has staged what it was handed
        nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
        if s == 1:
            m[0].weight.data.mul_(0.5)
        if s == 2:
            m[2].weight.data = m[2].weight.data * 0.9
        if s == 3:
            opt.param_groups[0]["lr"] *= 0.5

    stats, _ = twins(tmp_path, 4, between=between)
    assert stats["under_backward"]["staged"]["updated"] == 4 * stats["chunks"], stats["under_backward"]


def test_grad_scaler_skipping_a_step_drops_the_staged_records(tmp_path):
    out = []
    for early in (True, False):
        m = model()
        opt = make(m, tmp_path / str(early), early)
        if early:
            stage(opt)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for i in range(4):
            x, y = batch(i)
            scaler.scale(nn.functional.mse_loss(m(x), y)).backward()
            if i == 1:
                m[0].weight.grad[0, 0] = float("inf")  # the scaler skips this step
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        out.append((m, opt.stats()))
        opt.close()
    (a, stats), (b, _) = out
    assert_same_weights(a, b)
    staged = stats["under_backward"]["staged"]
    assert staged["updated"] == 3 * stats["chunks"] and staged["unused"] == stats["chunks"], staged


def test_gradient_accumulation_stages_once_a_step(tmp_path):
    stats, _ = twins(tmp_path, 3, accumulate=3)
    staged = stats["under_backward"]["staged"]
    assert staged["updated"] == 3 * stats["chunks"] and staged["staged"] == staged["updated"], staged


def test_room_for_part_of_the_state_stages_that_part_in_backward_order(tmp_path):
    """A budget of about two chunks: those whose gradients backward makes final first are staged, in that order,
    until one does not fit; the rest stream in step() (or start into spare host memory, as the switch says):
    exact either way."""
    m = model()
    probe = make(m, tmp_path / "probe", True, chunk_bytes="12KiB")
    two, chunks = sum(c.nbytes for c in probe.chunks[-2:]), len(probe.chunks)
    probe.close()
    assert chunks > 2
    stats, _ = twins(tmp_path, 3, budget=two, chunk_bytes="12KiB")
    staged = stats["under_backward"]["staged"]
    assert 3 <= staged["updated"] <= 3 * 2 and staged["no_room"] >= 3, staged
    assert stats["under_backward"]["kept"] > 0, stats["under_backward"]  # the others: into spare host memory


def test_records_come_down_in_the_order_the_next_backward_stages_them(tmp_path):
    """A step's downloads go in the order its backward made the chunks' gradients final (last layers first), the
    order the next backward stages them in: its first upload waits for the first download, not the last. Each
    download is queued once its chunk's math is, and the result is the plain step's (``twins``)."""
    m = model()
    opt = make(m, tmp_path / "order", True, chunk_bytes="12KiB")
    stage(opt)
    hbm = opt._under_backward.staging
    staged: list[str] = []
    down: list[str] = []
    stage_one, download = hbm._stage, hbm._download
    hbm._stage = lambda c: (staged.append(c.key), stage_one(c))[1]
    hbm._download = lambda s: (down.append(s.chunk.key), download(s))[1]
    steps, chunks = 4, [c.key for c in opt.chunks]
    for s in range(steps):
        backward(m, s)
        opt.step()
        opt.zero_grad()
    opt.close()
    n = len(chunks)
    assert n > 2 and len(staged) == len(down) == steps * n, (staged, down)
    assert staged[:n] == chunks[::-1]  # the last layer's gradients are final first
    for k in range(steps - 1):
        assert down[k * n : (k + 1) * n] == staged[(k + 1) * n : (k + 2) * n], k
    twins(tmp_path / "twins", steps, chunk_bytes="12KiB")


def test_state_dicts_and_checkpoints_between_backward_and_step_see_the_state_before_it(tmp_path):
    from tiered import TieredOptimizer

    m = model()
    opt = make(m, tmp_path, True)
    stage(opt)
    backward(m, 0)
    opt.step()
    opt.zero_grad()
    before = opt.state_dict()
    backward(m, 1)
    assert opt.stats()["under_backward"]["staged"]["staged"] == 2 * len(opt.chunks)
    assert_same_state(opt.state_dict(), before)  # the staged copies are not the state yet
    opt.save_checkpoint(tmp_path / "ckpt")
    opt.step()
    opt.zero_grad()
    after = opt.state_dict()
    # A fresh optimizer loads the checkpoint taken between backward and step, and takes the same step.
    m2 = model()
    m2.load_state_dict(m.state_dict())
    with TieredOptimizer(m2, nvme_path=tmp_path / "b", lr=1e-2, update_on="device", host_budget="8MiB",
                         chunk_bytes="48KiB") as opt2:  # fmt: skip
        opt2.load_checkpoint(tmp_path / "ckpt")
        assert_same_state(opt2.state_dict(), before)
    assert not all(torch.equal(after["state"][0][k], before["state"][0][k]) for k in ("exp_avg", "exp_avg_sq"))
    opt.close()


class _Event:
    """Stands in for a download's CUDA event: it has ended only once waited for."""

    waits: list[str] = []

    def __init__(self, key: str) -> None:
        self.key = key

    def synchronize(self) -> None:
        _Event.waits.append(self.key)


@pytest.mark.parametrize("reader", ["step", "state_dict", "save_checkpoint", "opt.state", "load_state_dict", "close"])
def test_every_reader_of_the_state_waits_for_the_downloads_first(tmp_path, monkeypatch, reader):
    """Downloads into the pinned records run on after step(): anything that reads or writes those records
    waits for them first, and their pins go back then."""
    from tiered.optim.under_backward import staged

    m = model()
    opt = make(m, tmp_path, True)
    stage(opt)
    real = staged.HbmStage._download
    monkeypatch.setattr(staged.HbmStage, "_download", lambda self, s: (real(self, s), _Event(s.chunk.key))[1])
    _Event.waits = []
    backward(m, 0)
    opt.step()
    opt.zero_grad()  # does not wait: the downloads go on under the next forward
    assert _Event.waits == [] and len(opt._under_backward.staging.landing) == len(opt.chunks)
    if reader == "step":
        backward(m, 1)  # stages again: each upload waits for its own download (on the GPU; no host wait)
        opt._under_backward.drain()  # the worker stages on its own thread: what step() waits for first
        assert _Event.waits == [] and not opt._under_backward.staging.landing
        opt.step()
        assert _Event.waits == []  # this step's own downloads are in flight
    elif reader == "state_dict":
        opt.state_dict()
    elif reader == "save_checkpoint":
        opt.save_checkpoint(tmp_path / "ckpt")
    elif reader == "opt.state":
        opt.state[next(m.parameters())]
    elif reader == "load_state_dict":
        opt.load_state_dict(opt.state_dict())
    else:
        opt.close()
    if reader != "step":
        assert sorted(_Event.waits) == sorted(c.key for c in opt.chunks) and not opt._under_backward.staging.landing
    opt.close()


def test_a_reader_between_the_next_backward_and_step_waits_for_the_records_staged_again(tmp_path, monkeypatch):
    """The next backward stages each record again while its download may still be writing the pinned record (the
    upload waits for it on the GPU, the host does not): a state dict read then waits for those uploads, which
    the GPU ran after the downloads, before it reads the pinned records."""
    from tiered.optim.under_backward import staged

    m = model()
    opt = make(m, tmp_path, True)
    stage(opt)
    real = staged.HbmStage._upload

    def upload(self, state, after):  # an upload's event stands in as a download's does
        return real(self, state, after)[0], _Event(f"up:{id(state)}")

    monkeypatch.setattr(staged.HbmStage, "_upload", upload)
    backward(m, 0)
    opt.step()
    opt.zero_grad()
    backward(m, 1)
    opt._under_backward.drain()
    staged_now = list(opt._under_backward.staging.staged.values())
    assert staged_now and not opt._under_backward.staging.landing
    _Event.waits = []
    opt.state_dict()
    assert {f"up:{id(s.state)}" for s in staged_now} <= set(_Event.waits)
    opt.close()
