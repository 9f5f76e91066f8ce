"""host_budget="auto" and gpu_budget="auto" (tiered/auto_budget.py): the library's own values, read off the
machine's RAM and the GPU under its per-process cap, accepted by TieredOptimizer itself."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tiered import auto_budget
from tiered.auto_budget import RAM_RESERVE, auto_gpu_budget, auto_host_budget, resolve_auto

GiB = 1 << 30


def test_auto_host_budget_leaves_the_reserve_and_the_gradients_to_come():
    # At most 90 % of RAM, never more than is available now, less the reserve and the offloaded gradients.
    assert auto_host_budget(available=100 * GiB, total=125 * GiB, grads=0) == 100 * GiB - RAM_RESERVE
    assert auto_host_budget(available=124 * GiB, total=125 * GiB, grads=0) == int(112.5 * GiB) - RAM_RESERVE
    assert auto_host_budget(available=100 * GiB, total=125 * GiB, grads=20 * GiB) == 80 * GiB - RAM_RESERVE
    assert auto_host_budget(available=4 * GiB, total=8 * GiB, grads=0) == 0  # nothing left: the optimizer refuses
    assert auto_host_budget(available=10 * GiB + 12345, total=125 * GiB, grads=0) % (1 << 20) == 0  # whole MiB


def test_an_offloaded_model_counts_while_it_lives():
    import gc

    gc.collect()  # models offloaded by other tests and no longer referenced
    model = nn.Linear(4, 4)
    before = auto_budget.offloaded_bytes()
    auto_budget.note_offloaded(model, 1 << 30)
    assert auto_budget.offloaded_bytes() == before + (1 << 30)
    del model
    gc.collect()
    assert auto_budget.offloaded_bytes() == before


def test_auto_gpu_budget_is_the_share_of_the_cap_less_what_is_held_offloaded_models_too(monkeypatch):
    # A 24 GB cap with 2 GiB held: 60 % of it less the 2 GiB, in whole GiB. An offloaded model changes nothing:
    # its update runs on the GPU it is streamed to, so its state chunks can live there too.
    monkeypatch.setattr(auto_budget, "gpu_limit", lambda device=None: 24 * 10**9)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * GiB)
    expected = (int(auto_budget.GPU_SHARE * 24 * 10**9) - 2 * GiB) // GiB * GiB
    assert auto_gpu_budget() == expected == 11 * GiB
    model = nn.Linear(4, 4)
    auto_budget.note_offloaded(model, 1 << 30)
    assert auto_gpu_budget() == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only answer")
def test_auto_gpu_budget_is_zero_without_cuda():
    assert auto_gpu_budget() == 0 and auto_budget.gpu_limit() == 0


def test_resolve_auto_passes_sizes_through_and_refuses_auto_elsewhere():
    assert resolve_auto("host_budget", "8GiB") == "8GiB"
    assert resolve_auto("gpu_budget", 0) == 0
    with pytest.raises(ValueError, match="chunk_bytes takes no 'auto'"):
        resolve_auto("chunk_bytes", "auto")


def test_tiered_optimizer_takes_auto_budgets(tmp_path, monkeypatch):
    from tiered import TieredOptimizer

    monkeypatch.setattr(auto_budget, "auto_host_budget", lambda: 3 << 20)  # a small machine, deterministic
    model = nn.Linear(64, 64)
    with TieredOptimizer(model, nvme_path=tmp_path, host_budget="auto", gpu_budget="auto") as opt:
        assert opt.host_budget == 3 << 20
        assert opt.gpu_budget == (auto_gpu_budget() if torch.cuda.is_available() else 0)
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
    with pytest.raises(ValueError, match="chunk_bytes takes no 'auto'"):
        TieredOptimizer(model, nvme_path=tmp_path, chunk_bytes="auto")


def available_ram(monkeypatch, available: int) -> None:
    """psutil reports ``available`` bytes of RAM available now, of this machine's real total, and no model that
    offload_model keeps on the host takes any of it (an earlier test's, still alive in this process, would)."""
    import collections

    import psutil

    import tiered.auto_budget

    mem, real = collections.namedtuple("Mem", "total available"), psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: mem(real.total, available))
    monkeypatch.setattr(tiered.auto_budget, "offloaded_bytes", lambda: 0)


def test_an_auto_host_budget_of_nothing_says_what_auto_read_and_to_give_a_size(tmp_path, monkeypatch):
    # 6 GiB available is under the 8 GiB reserve: "auto" takes 0 B. The refusal named "host_budget 0 B", a value
    # never given, and advised lowering chunk_bytes, which cannot help.
    from tiered import TieredOptimizer

    available_ram(monkeypatch, 6 * GiB)
    with pytest.raises(ValueError) as info:
        TieredOptimizer(nn.Linear(64, 64), nvme_path=tmp_path, host_budget="auto")
    msg = str(info.value)
    assert msg.startswith("host_budget='auto' took 0 B"), msg
    assert "6.00 GiB of RAM available" in msg and "8.00 GiB" in msg and "give host_budget a size" in msg, msg
    assert "chunk_bytes" not in msg, msg


def test_an_auto_host_budget_under_one_chunk_names_auto_and_both_fixes(tmp_path, monkeypatch):
    from tiered import TieredOptimizer

    available_ram(monkeypatch, RAM_RESERVE + (1 << 20))  # "auto": 1 MiB; the layer's state is 3 MiB
    with pytest.raises(ValueError, match=r"host_budget='auto' took 1.00 MiB: .* or lower chunk_bytes"):
        TieredOptimizer(nn.Linear(512, 512), nvme_path=tmp_path, host_budget="auto", chunk_bytes="8MiB")
    with TieredOptimizer(nn.Linear(512, 512), nvme_path=tmp_path, host_budget="auto", chunk_bytes="256KiB") as opt:
        assert opt.host_budget == 1 << 20  # as the refusal says: smaller chunks fit


def two_gpus(monkeypatch) -> dict[int, int]:
    """torch.cuda's queries as on a box of two GPUs (none is needed): cuda:0 of 80 GiB, free; cuda:1 of 24 GiB
    capped to half, 4 GiB of it held (a model's weights). The current device is cuda:0. Returns what each holds."""
    total, share, held = {0: 80 * GiB, 1: 24 * GiB}, {0: 1.0, 1: 0.5}, {0: 0, 1: 4 * GiB}

    def index(d=None) -> int:
        return 0 if d is None else d if isinstance(d, int) else torch.device(d).index or 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=total[index(d)]))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: share[index(d)])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: held[index(d)])
    return held


def planned_on(device: str, gpu_budget):
    """plan_layout of a 64 x 64 weight on ``device`` (a FakeTensor there: its device without its memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tiered.config import TierConfig
    from tiered.optim.assembly import plan_layout
    from tiered.optim.shards import Shards

    with FakeTensorMode():
        w = nn.Parameter(torch.empty(64, 64, device=device))
    config = TierConfig(gpu_budget=gpu_budget)
    return config, plan_layout(["w"], Shards([w]), [{"params": [w]}], config)


def test_gpu_budget_auto_is_read_on_the_parameters_gpu_not_the_current_one(monkeypatch):
    # cuda:1: 60 % of its 12 GiB cap less the 4 GiB held, whole GiB: 3 GiB. TierConfig read "auto" on the
    # current device, cuda:0 (48 GiB), before it knew where the parameters are.
    held = two_gpus(monkeypatch)
    assert auto_gpu_budget("cuda:1") == 3 * GiB and auto_gpu_budget() == 48 * GiB
    config, planned = planned_on("cuda:1", "auto")
    assert planned.device == torch.device("cuda", 1) and planned.hbm
    assert planned.config.gpu_budget == 3 * GiB
    # A layout again over other tensors (param_set.py) keeps the budget read when the optimizer was built, not
    # one read while the old layout still holds its chunks there.
    held[1] += 2 * GiB
    settled = config.settled(planned.config)
    assert settled.gpu_budget == 3 * GiB and settled.resolve(cuda=True, device=planned.device).gpu_budget == 3 * GiB
    assert planned_on("cuda:1", "2GiB")[1].config.gpu_budget == 2 * GiB  # a size is a size, on any device


def test_gpu_budget_auto_for_cpu_parameters_is_still_the_current_gpus_which_the_optimizer_ignores(monkeypatch):
    # As before: the current device's budget, which the optimizer warns it ignores (no state in HBM for them).
    two_gpus(monkeypatch)
    _, planned = planned_on("cpu", "auto")
    assert planned.config.gpu_budget == 48 * GiB and not planned.hbm


@pytest.mark.gpu
def test_auto_gpu_limit_follows_the_per_process_cap():
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.cuda.set_per_process_memory_fraction(0.25, 0)
        assert auto_budget.gpu_limit(0) == int(total * 0.25)
        assert auto_gpu_budget(0) <= int(0.6 * total * 0.25)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)


def test_backward_keeps_aside_only_what_fits_above_a_pass_peak(monkeypatch):
    """backward_room: what a backward may keep (gradient sums for the clip) is the limit less the peak of a pass
    that kept nothing, less what is kept already and grad_room's margin; never below zero. The memory allocated
    between two blocks does not enter it: the next block takes again what the last one let go."""
    GiB = 1 << 30
    limit = 24 * GiB
    monkeypatch.setattr(auto_budget, "gpu_limit", lambda device=None: limit)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * GiB)  # between two blocks
    margin = GiB + limit // 16
    cuda = torch.device("cuda", 0)
    assert auto_budget.backward_room(cuda, pass_peak=7 * GiB, kept=0) == limit - 7 * GiB - margin
    assert auto_budget.backward_room(cuda, pass_peak=7 * GiB, kept=5 * GiB) == limit - 12 * GiB - margin
    assert auto_budget.backward_room(cuda, pass_peak=23 * GiB, kept=0) == 0
    assert auto_budget.grad_room(cuda) == limit - 3 * GiB - margin  # the step's: from what is allocated then
