"""update_in_backward on CUDA: the early updates run on side streams while backward goes on, and their new
weights wait in rows on the GPU (``AsideUpdate.weights_row``). Each test trains twins, with and without the
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


def no_staging(opt: TieredOptimizer) -> None:
    """These tests are of updates started under backward into spare host memory (aside.py): the GPU gets no
    room to stage records in (staged.py, tested in test_staged_cuda.py), so every chunk goes that way."""
    from tiered.optim.under_backward.staged import StageRoom

    if opt._under_backward is not None:
        opt._under_backward.staging.room = StageRoom(opt._under_backward.strategy.device, budget=0)


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
        no_staging(opt)
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
        no_staging(opt)
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
            take = opt._under_backward.aside.weights_row
            opt._under_backward.aside.weights_row = lambda n: (freed.wait(10), take(n))[1]
        sizes = sorted({c.numel for c in opt.chunks})
        h = _Spoil.apply(nn.Sequential(*layers[:3])(x), sizes, freed)  # its backward: after the last 3 layers'
        _loss(layers[3:], h).backward()

    stats = cuda_twins(tmp_path, 512, 6, backward, chunk_bytes="1MiB", host_budget="64MiB")
    assert stats["weights_on_gpu"] == stats["kept"] > 0, stats


@pytest.mark.gpu
def test_cuda_without_room_on_the_gpu_the_weights_wait_in_host_memory(tmp_path, monkeypatch):
    """Where a row would leave too little of the GPU free, the new weights come down to pinned memory: the
    same weights as the plain step."""
    from tiered.optim.under_backward import aside

    monkeypatch.setattr(aside, "_ROW_MARGIN", 1)  # a row must leave all the memory free: never
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
    a decision; records are staged from the second step on, whatever it decided; the weights equal those of
    update_in_backward=False."""
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
    assert stats["staged"]["updated"] == 5 * len(opt.chunks) and stats["redone"] == {}, stats
    assert_same_weights(a, b)


def _write(layers, s: int, ema: list[torch.Tensor]) -> None:
    """A write no version counter sees, between backward and step(): through ``.data`` in place, a new tensor
    (new storage), an EMA swap of every parameter; in turn by step."""
    p = layers[-1].weight
    if s % 4 == 0:
        g = torch.Generator(device="cuda").manual_seed(50 + s)
        p.data.copy_(torch.randn(p.shape, device="cuda", generator=g).to(p.dtype) * 0.05)
    elif s % 4 == 1:
        p.data.mul_(0.9)
    elif s % 4 == 2:
        p.data = p.data * 0.9
    else:
        for q, e in zip((q for layer in layers for q in layer.parameters()), ema):
            q.data, e.data = e.data, q.data


@pytest.mark.gpu
@pytest.mark.parametrize("wait", [True, False], ids=["after-the-updates", "racing-them"])
@pytest.mark.parametrize(
    "dtype, split_masters",
    [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, False)],
    ids=["fp32", "bf16-split", "bf16"],
)
def test_cuda_a_write_through_data_between_backward_and_step_is_kept(tmp_path, dtype, split_masters, wait):
    """The GPU twin of test_under_backward_writes.py: the early updates read the parameters on the work stream,
    the write runs on the compute stream; step() compares their fingerprints there after the compute stream's
    work and redoes what changed, so the weights equal the plain step's. ``wait``: the updates have run before
    the write (then exactly the chunks written are redone); else the write races them (exact either way)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    results = []
    for early in (True, False):
        torch.manual_seed(0)
        layers = [nn.Linear(256, 256) for _ in range(6)]
        m = nn.Sequential(*layers).cuda().to(dtype)
        ema = [(p.detach() * 0.5).clone() for p in m.parameters()]
        opt = TieredOptimizer(m, nvme_path=tmp_path / str(early), lr=1e-2, chunk_bytes="256KiB",
                              host_budget="64MiB", update_in_backward=early, split_masters=split_masters)  # fmt: skip
        no_staging(opt)
        g = torch.Generator(device="cuda").manual_seed(1)
        for s in range(8):
            m(torch.randn(64, 256, device="cuda", generator=g).to(dtype)).float().square().mean().backward()
            if wait and early:
                opt.stats()  # the worker has queued every update backward handed it
                torch.cuda.synchronize()  # and the GPU has run them
            _write(layers, s, ema)
            opt.step()
            opt.zero_grad()
        results.append((m, opt.stats()))
        opt.close()
    (a, stats), (b, _) = results
    assert_same_weights(a, b)
    assert stats["split_chunks"] == (stats["chunks"] if dtype == torch.bfloat16 and split_masters is None else 0)
    ub = stats["under_backward"]
    assert ub["started"] > 0 and set(ub["redone"]) <= {"parameters' bits changed"}, ub
    if wait:  # 6 steps write one layer's weight, 2 steps every parameter: some chunks kept, the written redone
        assert ub["kept"] > 0 and ub["redone"]["parameters' bits changed"] >= 6 + 2 * stats["chunks"], ub


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 4095, 4096, 4097, 100_003])
def test_cuda_fingerprint_kernel_of_a_bf16_row_matches_the_torch_sums(n):
    """The parameters' fingerprint of a split chunk is of its bf16 bits (int16, sign-extended): the Triton
    kernel gives the torch sums, alone or beside an fp32 row (a chunk's gradients and parameters in one
    launch), and one changed bit changes it."""
    from tiered.layout import split_kernels
    from tiered.optim.under_backward.aside import grad_fingerprint

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(n)
    bits = torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int32).to(torch.int16)
    bits[: min(n, 3)] = torch.tensor([-(2**15), 2**15 - 1, 0], dtype=torch.int16)[: min(n, 3)]
    row = bits.view(torch.bfloat16).cuda()
    positions = torch.arange(n, dtype=torch.int32, device="cuda") % split_kernels.WEIGHTS + 1
    printed = split_kernels.fingerprint(row)
    assert torch.equal(printed, grad_fingerprint(row, positions))
    grads = torch.randn(n, generator=g).cuda()
    both = torch.cat([grad_fingerprint(grads, positions), printed])
    assert torch.equal(split_kernels.fingerprint(grads, row), both)
    out = torch.zeros(4, dtype=torch.int64, device="cuda")
    assert split_kernels.fingerprint(grads, grads.clone(), out) is out
    assert torch.equal(out, grad_fingerprint(grads, positions).repeat(2))
    flipped = row.clone()
    flipped.view(torch.int16)[n // 2] ^= 1
    assert not torch.equal(split_kernels.fingerprint(flipped), printed)
