"""TieredOptimizer on IOConfig(submit="aio"): the state streams from disk through kernel AIO, and training gives
the same bits as through the engine's threads. Skipped where kernel AIO or O_DIRECT is refused here."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from io_engine import IOConfig
from io_engine.kernel_aio import unavailable_reason
from tiered import TieredOptimizer, calibration

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def train(folder, submit: str, steps: int = 4) -> tuple[list[torch.Tensor], dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))
    io = IOConfig(submit=submit, threads=4, block_size="16KiB")
    # 64 KiB chunks under a 192 KiB budget: most of the state lives on disk, read and written every step.
    with TieredOptimizer(model, folder, lr=1e-3, chunk_bytes="64KiB", host_budget="192KiB", io=io) as opt:
        for step in range(steps):
            torch.manual_seed(100 + step)
            model(torch.randn(8, 256)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        last = opt.stats()["last_step"]
    return [p.detach().clone() for p in model.parameters()], last


def test_training_through_kernel_aio_is_bitwise_the_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "CALIBRATE_BYTES", 32 << 20)  # each IOConfig measures the disk once: briefly
    monkeypatch.setattr(calibration, "REQUEST_BYTES", 8 << 20)
    probe = tmp_path / ".probe"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        pytest.skip("this folder refuses O_DIRECT: nothing would reach kernel AIO")
    threads, _ = train(tmp_path / "threads", "threads")
    aio, last = train(tmp_path / "aio", "aio")
    assert last["nvme_read_bytes"] > 0 and last["nvme_write_bytes"] > 0  # the state did cross the disk
    assert all(torch.equal(a, b) for a, b in zip(threads, aio, strict=True))
