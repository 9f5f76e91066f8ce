"""The state visits HBM around the step, on CUDA (under_backward/staged.py): records go up on a side stream under
backward, into memory backward freed; step() runs the math after its clip; the new records come down into the
same pinned buffers on another side stream, under the next forward. Each test trains twins, staged and with
update_in_backward=False, and asserts bitwise equal weights (test_staged.py has the CPU twins). They carry the
``gpu`` marker and skip without CUDA.
"""

from __future__ import annotations

import threading

import pytest
import torch
from test_under_backward import assert_same_weights
from test_under_backward_cuda import _Spoil
from torch import nn

from tiered import TieredOptimizer


def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _run(tmp_path, early, steps: int, dtype=torch.bfloat16, accumulate: int = 2, **kw):
    """A stack of Linear(256, 256) on CUDA trained ``steps`` steps of ``accumulate`` micro-batches. Returns the
    model, the stats and the last state dict."""
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]).cuda().to(dtype)
    kw = {"chunk_bytes": "256KiB", "host_budget": "8MiB", **kw}
    opt = TieredOptimizer(m, nvme_path=tmp_path / str(early), lr=1e-2, update_in_backward=early, **kw)
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(steps):
        for _ in range(accumulate):
            m(torch.randn(64, 256, device="cuda", generator=g).to(dtype)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    out = (m, opt.stats(), opt.state_dict())  # state_dict waits for the last step's downloads
    opt.close()
    return out


def _twins(tmp_path, steps: int = 6, **kw):
    _needs_cuda()
    (a, stats, sd), (b, _, plain) = (_run(tmp_path, e, steps, **kw) for e in (True, False))
    assert_same_weights(a, b)
    for i, s in sd["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(plain["state"][i][k])), (i, k)
    return stats


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-split"])
@pytest.mark.parametrize("clip", [None, 1e-3], ids=["no-clip", "clip-every-step"])
def test_cuda_staged_steps_equal_the_plain_step(tmp_path, dtype, clip):
    """The first step learns the room and stages nothing; from the second on every chunk is staged in the last
    of two micro-batches, clipped or not, and the state is the plain step's bit for bit."""
    stats = _twins(tmp_path, dtype=dtype, max_grad_norm=clip)
    ub = stats["under_backward"]
    assert ub["staged"]["updated"] == 5 * stats["chunks"], ub
    assert ub["staged"]["room"]["reserve"] > 0, ub


@pytest.mark.gpu
def test_cuda_a_users_clip_grad_scaler_and_writes_through_data(tmp_path):
    """GradScaler unscales in place, the user clips, writes a weight through ``.data``, and the scaler skips a
    step (its staged records are dropped): the staged math reads it all at step(), as the plain step does."""
    _needs_cuda()
    results = []
    for early in (True, False):
        torch.manual_seed(0)
        m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]).cuda()
        opt = TieredOptimizer(m, nvme_path=tmp_path / str(early), lr=1e-2, chunk_bytes="256KiB",
                              host_budget="8MiB", update_in_backward=early)  # fmt: skip
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8)
        g = torch.Generator(device="cuda").manual_seed(1)
        for s in range(6):
            scaler.scale(m(torch.randn(64, 256, device="cuda", generator=g)).square().mean()).backward()
            if s == 3:
                m[1].weight.grad[0, 0] = float("inf")  # the scaler skips this step
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
            if s == 2:
                m[0].weight.data.mul_(0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        results.append((m, opt.stats()["under_backward"]))
        opt.close()
    (a, stats), (b, _) = results
    assert_same_weights(a, b)
    assert stats["staged"]["updated"] > 0 and stats["staged"]["unused"] > 0, stats  # the skipped step's


@pytest.mark.gpu
def test_cuda_staged_records_never_take_memory_backward_is_still_writing(tmp_path):
    """Staged records come from the cache of the stream backward runs on. Here they are taken just after
    backward freed blocks of their size that kernels queued behind a sleep are still filling (_Spoil): each
    upload waits for an event recorded after its allocation, so the state is still the plain step's."""
    _needs_cuda()
    results = []
    for early in (True, False):
        torch.manual_seed(0)
        m = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]).cuda().to(torch.bfloat16)
        opt = TieredOptimizer(m, nvme_path=tmp_path / str(early), lr=1e-2, chunk_bytes="1MiB",
                              host_budget="64MiB", update_in_backward=early)  # fmt: skip
        freed = threading.Event()
        sizes = sorted({c.nbytes // 2 for c in opt.chunks})  # bf16 blocks of each record's size
        if early:  # the stage pass waits until backward has freed the blocks still being filled
            stage = opt._under_backward.staging
            upload = stage._upload
            stage._upload = lambda state, after, f=freed, up=upload: (f.wait(10), up(state, after))[1]
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(4):
            freed.clear()
            x = torch.randn(64, 512, device="cuda", generator=g, dtype=torch.bfloat16)
            h = _Spoil.apply(m[:3](x), sizes, freed)  # its backward: after the last three layers'
            m[3:](h).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        results.append((m, opt.stats()["under_backward"], len(opt.chunks)))
        opt.close()
    (a, stats, chunks), (b, _, _) = results
    assert_same_weights(a, b)
    assert stats["staged"]["updated"] == 3 * chunks, stats


@pytest.mark.gpu
def test_cuda_state_dict_right_after_a_step_waits_for_the_downloads(tmp_path):
    """The downloads run on after step() (here each behind a sleep on its stream): a state_dict taken at once,
    and the next step, see the state the step wrote, the same as the plain step's."""
    _needs_cuda()
    out = []
    for early in (True, False):
        torch.manual_seed(0)
        m = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]).cuda()
        opt = TieredOptimizer(m, nvme_path=tmp_path / str(early), lr=1e-2, chunk_bytes="4MiB",
                              host_budget="64MiB", update_in_backward=early)  # fmt: skip
        if early:  # each download starts behind tens of milliseconds of GPU time: still in flight below
            stage = opt._under_backward.staging
            download = stage._download

            def slow(s, stage=stage, download=download):
                with torch.cuda.stream(stage.down):
                    torch.cuda._sleep(20_000_000)
                return download(s)

            stage._download = slow
        sds = []
        for _ in range(4):
            m(torch.ones(256, 1024, device="cuda")).square().mean().backward()
            opt.step()
            state = opt.state_dict()["state"]
            sds.append({i: {k: torch.as_tensor(v).clone() for k, v in s.items()} for i, s in state.items()})
            opt.zero_grad()
        out.append((m, sds, opt.stats()["under_backward"]))
        opt.close()
    (a, sds, stats), (b, plain, _) = out
    assert_same_weights(a, b)
    for got, want in zip(sds, plain):
        for i in want:
            for k in want[i]:
                assert torch.equal(got[i][k], want[i][k]), (i, k)
    assert stats["staged"]["updated"] > 0, stats


@pytest.mark.gpu
def test_cuda_room_for_part_of_the_state(tmp_path, monkeypatch):
    """Where the GPU has room for two chunks only, those are staged and the rest go the other ways: exact."""
    from tiered.optim.under_backward import staged

    monkeypatch.setattr(staged.StageRoom, "free", lambda self, live: 2 * (1 << 20) + 4096 - live)
    stats = _twins(tmp_path, chunk_bytes="1MiB", host_budget="64MiB")
    ub = stats["under_backward"]
    assert 0 < ub["staged"]["updated"] < 5 * stats["chunks"] and ub["staged"]["no_room"] > 0, ub


@pytest.mark.gpu
def test_cuda_a_small_copy_down_goes_between_the_steps_downloads(tmp_path):
    """A step queues its records' downloads (here 1.6 GB, ~30 ms of PCIe) to run under the next forward. A
    ``loss.item()`` made right after the step goes down between two of them, not after all of them: the host
    queues the next forward while they still run (staged.py, ``HbmStage._yield``)."""
    _needs_cuda()
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(8)]).cuda()  # fp32: 12 B a parameter
    opt = TieredOptimizer(m, nvme_path=tmp_path, lr=1e-4, chunk_bytes="64MiB", host_budget="2GiB",
                          update_in_backward=True)  # fmt: skip
    stage = opt._under_backward.staging
    x = torch.randn(64, 4096, device="cuda")
    checked = 0
    try:
        for _ in range(4):
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.current_stream().synchronize()  # the step's math is done: its downloads have just begun
            with stage._lock:
                lands = list(stage.landing.values())  # in the order they were queued
            loss.item()
            if len(lands) > 2:  # the first step stages nothing (it learns the room)
                assert not lands[-1].event.query(), "loss.item() waited for every download of the step"
                checked += 1
    finally:
        opt.close()
    assert checked >= 2, checked
