"""update_in_backward on CUDA: the early updates run on side streams while backward goes on, and their new
weights wait in rows on the GPU (``DeviceUpdate.weights_row``). Each test trains twins, with and without the
update under backward, and asserts bitwise equal weights (test_under_backward.py has the CPU tests). They
carry the ``gpu`` marker and skip without CUDA.
"""

from __future__ import annotations

import threading

import pytest
import torch
from test_under_backward import assert_same_weights
from torch import nn

from tiered import TieredOptimizer


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_under_backward_equals_the_plain_step(tmp_path, dtype):
    """On the GPU the early updates run on side streams while backward goes on: the same weights as the
    plain step, through accumulation, the optimizer's clip and a user's clip."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    results = []
    for early in (True, False):
        torch.manual_seed(0)
        m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]).cuda().to(dtype)
        opt = TieredOptimizer(m, nvme_path=tmp_path / str(early), lr=1e-2, chunk_bytes="256KiB",
                              host_budget="64MiB", update_in_backward=early, max_grad_norm=5.0)  # fmt: skip
        g = torch.Generator(device="cuda").manual_seed(1)
        for s in range(6):
            for _ in range(1 + s % 2):  # steps of one and of two micro-batches
                x = torch.randn(64, 256, device="cuda", generator=g).to(dtype)
                m(x).float().square().mean().backward()
            if s == 3:
                nn.utils.clip_grad_norm_(m.parameters(), 1e-3)  # scales: every early update redone
            opt.step()
            opt.zero_grad()
        results.append((m, opt.stats()["under_backward"]))
        opt.close()
    (a, stats), (b, _) = results
    assert stats["kept"] > 0 and stats["redone"], stats
    # bf16 parameters have split masters: their new weights waited on the GPU, not in host memory.
    assert (stats["weights_on_gpu"] > 0) == (dtype == torch.bfloat16), stats
    assert_same_weights(a, b)


class _Spoil(torch.autograd.Function):
    """Identity. Its backward frees, on the compute stream, blocks of each chunk's row size that kernels
    queued behind a sleep go on filling, then lets the weights' rows be taken (``freed``): a row carved from
    one of those blocks would be overwritten after the update wrote the new weights into it."""

    @staticmethod
    def forward(ctx, x, sizes, freed):
        ctx.sizes, ctx.freed = sizes, freed
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        for n in ctx.sizes:
            t = torch.empty(n, dtype=torch.bfloat16, device=g.device)
            torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time before the fill
            t.fill_(7.0)
            del t  # back to the compute stream's cache, the fill still queued
        ctx.freed.set()
        return g, None, None


def cuda_twins(tmp_path, width: int, depth: int, backward, built=None, **kw) -> dict:
    """Train a bf16 stack of ``depth`` Linear(width, width) on CUDA twice, with and without the update under
    backward, 3 steps of 64 rows: ``backward(layers, opt, x, early)`` runs a step's backward, ``built(opt)``
    looks at each new optimizer. Asserts equal weights; returns the early optimizer's stats."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    results = []
    for early in (True, False):
        torch.manual_seed(0)
        layers = [nn.Linear(width, width) for _ in range(depth)]
        m = nn.Sequential(*layers).cuda().to(torch.bfloat16)
        opt = TieredOptimizer(m, nvme_path=tmp_path / str(early), lr=1e-2, update_in_backward=early, **kw)
        if built is not None:
            built(opt)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(3):
            backward(layers, opt, torch.randn(64, width, device="cuda", generator=g, dtype=torch.bfloat16), early)
            opt.step()
            opt.zero_grad()
        results.append((m, opt.stats()["under_backward"]))
        opt.close()
    (a, stats), (b, _) = results
    assert_same_weights(a, b)
    return stats


def _loss(layers, x) -> torch.Tensor:
    return nn.Sequential(*layers)(x).float().square().mean()


@pytest.mark.gpu
def test_cuda_weights_rows_never_take_memory_backward_is_still_writing(tmp_path):
    """The rows for new weights are taken (each after backward freed blocks still being filled, see _Spoil)
    while backward goes on: the weights still equal the plain step's. bench/race_test_control.py shows that
    rows from the compute stream's cache fail here."""

    def backward(layers, opt, x, early):
        freed = threading.Event()
        if early:
            take = opt._early.strategy.weights_row
            opt._early.strategy.weights_row = lambda n: (freed.wait(10), take(n))[1]
        sizes = sorted({c.numel for c in opt.chunks})
        h = _Spoil.apply(nn.Sequential(*layers[:3])(x), sizes, freed)  # its backward: after the last 3 layers'
        _loss(layers[3:], h).backward()

    stats = cuda_twins(tmp_path, 512, 6, backward, chunk_bytes="1MiB", host_budget="64MiB")
    assert stats["weights_on_gpu"] == stats["kept"] > 0, stats


@pytest.mark.gpu
def test_cuda_without_room_on_the_gpu_the_weights_wait_in_host_memory(tmp_path, monkeypatch):
    """Where a row would leave too little of the GPU free, the new weights come down to pinned memory: the
    same weights as the plain step."""
    import tiered.device_update

    monkeypatch.setattr(tiered.device_update, "_ROW_MARGIN", 1)  # a row must leave all the memory free: never
    stats = cuda_twins(tmp_path, 256, 6, lambda layers, opt, x, early: _loss(layers, x).backward(),
                       chunk_bytes="256KiB", host_budget="64MiB")  # fmt: skip
    assert stats["kept"] > 0 and stats["weights_on_gpu"] == 0, stats


class _Slow(torch.autograd.Function):
    """Identity whose backward holds the host up: the early reads from NVMe end while backward goes on."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        import time

        time.sleep(0.2)
        return g


@pytest.mark.gpu
def test_cuda_chunks_on_nvme_are_read_and_updated_under_backward(tmp_path):
    """With no chunk resident, the early updates on the GPU first read their chunks from NVMe: the same
    weights as the plain step, and the chunks read are kept."""

    def built(opt):
        assert not any(opt.store.is_resident(c.key) for c in opt.chunks)

    def backward(layers, opt, x, early):
        h = _Slow.apply(nn.Sequential(*layers[:2])(x))  # its backward runs after the last two layers'
        _loss(layers[2:], h).backward()

    stats = cuda_twins(tmp_path, 256, 4, backward, built, chunk_bytes="256KiB", host_budget="1MiB")
    assert stats["read"] > 0 and stats["kept"] > 0 and stats["redone"] == {}, stats


@pytest.mark.gpu
def test_cuda_default_is_auto_and_decides_on_gpu_time(tmp_path):
    """On CUDA parameters the default is "auto": three steps timed by CUDA events (a window > 0 each), then
    a decision; the weights equal those of update_in_backward=False, whatever it decided."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    results = []
    for kw in ({}, {"update_in_backward": False}):
        torch.manual_seed(0)
        m = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda()
        opt = TieredOptimizer(m, nvme_path=tmp_path / str(len(kw)), lr=1e-3, chunk_bytes="4MiB", **kw)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(6):
            m(torch.randn(4096, 1024, device="cuda", generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        results.append((m, opt.config.update_in_backward, opt.stats()["under_backward"]))
        opt.close()
    (a, setting, stats), (b, _, off) = results
    assert setting == "auto" and off is None
    switch = stats["switch"]
    assert switch["decided"].startswith(("on:", "off:")) and len(switch["measured"]) == 3, switch
    assert all(r["window_s"] > 0 for r in switch["measured"]), switch
    assert (stats["started"] > 0) == switch["engaged"], stats
    assert_same_weights(a, b)
