"""Gradient accumulation of an offloaded model on a worker thread (tiered/offload/accumulation.py), on the CPU
stand-in: after every backward the gradients are bitwise those of the same micro-batches without offload, the
worker did the sums, a parameter without a gradient in one micro-batch keeps its sum, a block whose parameters
carry post-accumulate-grad hooks is left to FSDP2, and a failure in the worker reaches the caller (no hang).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from helpers import TIMEOUT, run_bounded
from torch import nn

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


class Blocks(nn.Module):
    """Three blocks and a head; block 2 runs only when asked (a parameter without a gradient that micro-batch)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, skip_last: bool = False) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if not (skip_last and i == 2):
                x = layer(x)
        return self.head(x).square().mean()


def micro_batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(8, 16, generator=g).to(torch.bfloat16) for _ in range(n)]


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = None if g is None else (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def backward_all(model: nn.Module, xs: list[torch.Tensor], skips: list[bool]) -> list[dict]:
    """The gradients after each micro-batch's backward."""
    seen = []
    for x, skip in zip(xs, skips):
        model(x, skip_last=skip).backward()
        seen.append(grads(model))
    return seen


def assert_same(a: list[dict], b: list[dict]) -> None:
    for k, (ga, gb) in enumerate(zip(a, b)):
        assert ga.keys() == gb.keys()
        for name in ga:
            if ga[name] is None or gb[name] is None:
                assert ga[name] is None and gb[name] is None, (k, name)
            else:
                assert torch.equal(ga[name], gb[name]), f"micro-batch {k}: {name} differs"


def offloaded(**hooks) -> nn.Module:
    import tiered.offload

    model = Blocks().to(torch.bfloat16)
    tiered.offload.offload_model(model, device="cpu", blocks=list(model.layers))
    for name, hook in hooks.items():  # on the sharded parameters FSDP2 made, which backward's hooks fire on
        dict(model.named_parameters())[name].register_post_accumulate_grad_hook(hook)
    return model


MODES = ["worker", "device", "kept"]


def sum_where(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where later micro-batches' gradients are added: on the worker (the CPU's default), on the reduce's device
    (the GPU's default; here the CPU stands in for it), or there from the copies the backward before kept
    (``SUM_FROM_KEPT``; every backward keeping, as after ``MEASURED_PASSES``)."""
    import tiered.offload.accumulation as acc
    import tiered.offload.kept_sums as kept_sums
    from tiered.optim import resident_grads

    monkeypatch.setattr(acc, "SUM_ON_DEVICE", mode != "worker")
    if mode == "kept":
        monkeypatch.setattr(acc, "SUM_FROM_KEPT", True)
        monkeypatch.setattr(resident_grads, "ENABLED", True)
        monkeypatch.setattr(kept_sums.KeptSums, "measuring", lambda self: False)


def run_pair(skips: list[bool], **hooks) -> tuple[list[dict], list[dict], dict]:
    import tiered.offload

    xs = micro_batches(len(skips))
    plain = backward_all(Blocks().to(torch.bfloat16), xs, skips)
    try:
        model = offloaded(**hooks)
        seen = backward_all(model, xs, skips)
        stats = model.tiered_accumulation.stats()
    finally:
        tiered.offload.close()
    return plain, seen, stats


@pytest.mark.parametrize("mode", MODES)
def test_sums_are_bitwise_the_plain_sums(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Added on the worker, on the reduce's device, or there from the copies the backward before kept: the same
    bits as the plain sums (``sum_where``)."""
    sum_where(mode, monkeypatch)
    on_device = mode != "worker"
    plain, seen, stats = run_bounded(lambda: run_pair([False] * 4), timeout=TIMEOUT)
    assert_same(plain, seen)
    numel = sum(p.numel() for p in Blocks().parameters())
    assert stats["blocks_summed"] == 3 * 4  # three later micro-batches, four units (three blocks, the root)
    assert stats["bytes_summed"] == 3 * 2 * numel
    assert stats["bytes_summed_on_device"] == (3 * 2 * numel if on_device else 0)
    assert stats["bytes_summed_from_kept"] == (3 * 2 * numel if mode == "kept" else 0)  # none copied up again
    assert stats["bytes_held_up"] == (3 * 2 * numel if mode == "device" else 0)  # the link's traffic up for them
    assert stats["bytes_reduced"] == 4 * 2 * numel  # and down: every micro-batch's reduced gradients
    # The first micro-batch's gradients moved into their homes of exact size (offload.pinning.grad_homes).
    assert stats["bytes_homed"] == 2 * numel


@pytest.mark.parametrize("mode", MODES)
def test_a_block_without_a_gradient_in_one_micro_batch_keeps_its_sum(mode: str, monkeypatch) -> None:
    """A block FSDP2 reduced only part of (block 2 skipped: its parameters got no gradient) is summed on the
    worker even where the others are summed on the device; the skipped one keeps its sum (and, kept on the
    device, its copy there, which the third micro-batch adds)."""
    sum_where(mode, monkeypatch)
    on_device = mode != "worker"
    plain, seen, stats = run_bounded(lambda: run_pair([False, True, False]), timeout=TIMEOUT)
    assert seen[1]["layers.2.0.weight"] is not None
    assert_same(plain, seen)
    numel = sum(p.numel() for p in Blocks().parameters())
    block = sum(p.numel() for p in Blocks().layers[2].parameters())
    # Micro-batch 1 reduced all but block 2, micro-batch 2 all of them: block 2 was held over micro-batch 1.
    assert stats["bytes_summed"] == 2 * (2 * numel - block)
    assert stats["bytes_summed_on_device"] == (stats["bytes_summed"] if on_device else 0)
    assert stats["bytes_summed_from_kept"] == (stats["bytes_summed"] if mode == "kept" else 0)


def test_a_sum_changed_in_place_between_micro_batches_is_added_as_the_host_holds_it(monkeypatch) -> None:
    """With the sums added from the copies kept on the device (``SUM_FROM_KEPT``), a gradient scaled in place
    after a backward (a user's own clip, say) no longer equals its copy: the next micro-batch adds the host's
    value, as FSDP2 would, not the stale copy."""
    import tiered.offload

    sum_where("kept", monkeypatch)
    xs = micro_batches(3)

    def go(model: nn.Module) -> list[dict]:
        seen = []
        for k, x in enumerate(xs):
            model(x).backward()
            if k == 0:
                for p in model.parameters():
                    (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).mul_(2)
            seen.append(grads(model))
        return seen

    plain = go(Blocks().to(torch.bfloat16))
    try:
        model = offloaded()
        seen = run_bounded(lambda: go(model), timeout=TIMEOUT)
        stats = model.tiered_accumulation.stats()
    finally:
        tiered.offload.close()
    assert_same(plain, seen)
    numel = sum(p.numel() for p in Blocks().parameters())
    # Micro-batch 1 copied every scaled sum up again; micro-batch 2 added micro-batch 1's copies.
    assert stats["bytes_summed_on_device"] == 2 * 2 * numel and stats["bytes_summed_from_kept"] == 2 * numel


def test_sums_kept_for_the_next_micro_batch_outlive_its_forward_and_go_at_zero_grad(monkeypatch) -> None:
    """With ``SUM_FROM_KEPT`` the copies a backward kept stay through the next forward, for its backward to add;
    a ``zero_grad`` (a new step's gradients come next) lets them go."""
    import tiered.offload
    from tiered.optim import resident_grads

    sum_where("kept", monkeypatch)
    x = micro_batches(1)[0]

    def go() -> None:
        try:
            model = offloaded()
            owner = model.tiered_accumulation
            model(x).backward()
            kept = resident_grads.held_bytes(owner)
            assert kept == 2 * sum(p.numel() for p in model.parameters())
            model(x)
            assert resident_grads.held_bytes(owner) == kept
            model.zero_grad()
            assert resident_grads.held_bytes(owner) == 0
        finally:
            tiered.offload.close()

    run_bounded(go, timeout=TIMEOUT)


def test_a_block_with_post_accumulate_grad_hooks_is_left_to_fsdp2() -> None:
    calls = []

    def hook(p: torch.Tensor) -> None:
        calls.append(p.grad.full_tensor().clone())

    plain, seen, stats = run_bounded(lambda: run_pair([False] * 3, **{"layers.1.0.weight": hook}), timeout=TIMEOUT)
    assert_same(plain, seen)
    assert stats["blocks_summed"] == 2 * 3  # the hooked block is not among them
    assert [torch.equal(c, s["layers.1.0.weight"]) for c, s in zip(calls, seen)] == [True] * 3  # the hook saw sums


def test_a_failing_sum_reaches_the_caller_and_the_next_backward_works(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiered.offload
    from tiered.offload.accumulation import HostAccumulation

    real = HostAccumulation._sum
    fail = {"left": 1}

    def flaky(self, job) -> None:
        if fail["left"] and any(pair.held is not None for pair in job.pairs):  # the first sum, not a first move
            fail["left"] -= 1
            raise OSError("injected")
        real(self, job)

    monkeypatch.setattr(HostAccumulation, "_sum", flaky)
    xs = micro_batches(3)

    def go() -> None:
        try:
            model = offloaded()
            model(xs[0]).backward()
            with pytest.raises(RuntimeError, match="summing an offloaded model's gradients failed.*injected"):
                model(xs[1]).backward()
            model.zero_grad()
            model(xs[2]).backward()
            model(xs[0]).backward()  # sums again, on the worker that survived
            assert model.tiered_accumulation.stats()["blocks_summed"] >= 4
        finally:
            tiered.offload.close()

    run_bounded(go, timeout=TIMEOUT)


class Boom(torch.autograd.Function):
    """Identity forward; its backward raises when armed: a backward that fails part-way (out of memory, say)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if Boom.armed:
            raise RuntimeError("injected backward failure")
        return g


class Failing(Blocks):
    """Blocks whose backward can fail between block 1 and block 0, after blocks 2, 1 and the head reduced."""

    def forward(self, x: torch.Tensor, skip_last: bool = False) -> torch.Tensor:
        x = Boom.apply(self.layers[0](x))
        for layer in self.layers[1:]:
            x = layer(x)
        return self.head(x).square().mean()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("then", ["forward", "step", "zero_grad", "model_zero_grad"])
def test_a_backward_that_raises_part_way_leaves_the_gradients_fsdp2_would(then: str, mode: str,
                                                                         monkeypatch) -> None:  # fmt: skip
    """After a failed backward, then a forward, a step (which reads the sums), or the optimizer's or the model's
    zero_grad, and another micro-batch, the weights and gradients are those FSDP2's own accumulation leaves (its
    state after a failed backward is its own: it differs from a model without FSDP2); the sums made on the
    worker, on the reduce's device or from the copies kept there alike."""
    import tempfile

    import tiered.offload
    from tiered import TieredOptimizer

    sum_where(mode, monkeypatch)

    xs = micro_batches(3)

    def go(model: nn.Module, opt: Any) -> list[dict]:
        seen = []
        model(xs[0]).backward()
        Boom.armed = True
        try:
            with pytest.raises(RuntimeError, match="injected"):
                model(xs[1]).backward()
        finally:
            Boom.armed = False
        if then == "step":  # the step reads the sums, the failed micro-batch's reduced blocks included
            opt.step()
            seen.append({n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                         for n, p in model.named_parameters()})  # fmt: skip
        elif then == "zero_grad":
            opt.zero_grad()
        elif then == "model_zero_grad":
            model.zero_grad()
        if then != "forward":
            seen.append(grads(model))
        model(xs[2]).backward()
        seen.append(grads(model))
        return seen

    def run(tmp: str) -> list[dict]:
        model = Failing().to(torch.bfloat16)
        tiered.offload.offload_model(model, device="cpu", blocks=list(model.layers))
        opt = TieredOptimizer(model, nvme_path=tmp, lr=0.1)
        try:
            return go(model, opt)
        finally:
            opt.close()
            tiered.offload.close()

    with tempfile.TemporaryDirectory() as tmp:
        ours = run_bounded(lambda: run(tmp), timeout=TIMEOUT)
        from torch.distributed.fsdp import FSDPModule

        monkeypatch.setattr(FSDPModule, "set_all_reduce_hook", lambda self, hook, stream=None: None)
        fsdp2 = run_bounded(lambda: run(tmp), timeout=TIMEOUT)  # FSDP2 summing on backward's thread itself
    assert_same(fsdp2, ours)


def test_after_the_worker_stops_the_sums_are_made_on_backwards_thread() -> None:
    """A stopped worker (the interpreter ending) takes no jobs: the sums are made where they are handed over,
    with the same bits, and nothing waits for a worker that is gone."""
    import tiered.offload

    xs = micro_batches(3)
    plain = backward_all(Blocks().to(torch.bfloat16), xs, [False] * 3)

    def go() -> list[dict]:
        try:
            model = offloaded()
            model.tiered_accumulation.stop()
            return backward_all(model, xs, [False] * 3)
        finally:
            tiered.offload.close()

    assert_same(plain, run_bounded(go, timeout=TIMEOUT))


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        x = torch.tanh(self.first(x))
        return x if skip else torch.tanh(self.second(x))


class PartlyUsed(nn.Module):
    """Two blocks of two layers; each block's second layer runs only when asked, so FSDP2 reduces part of it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.layers = nn.ModuleList(TwoLayers() for _ in range(2))

    def forward(self, x: torch.Tensor, skip_last: bool = False) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, skip_last)
        return x.square().mean()


def test_a_block_reduced_in_part_is_summed_on_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where FSDP2 reduced only some of a block's parameters, its flat layout is not the block's: the device
    leaves that block to the worker (every sum still the plain bits), and sums the whole blocks itself."""
    import tiered.offload
    import tiered.offload.accumulation as acc

    monkeypatch.setattr(acc, "SUM_ON_DEVICE", True)
    xs, skips = micro_batches(3), [False, True, False]
    plain = backward_all(PartlyUsed().to(torch.bfloat16), xs, skips)

    def go() -> tuple[list[dict], dict]:
        try:
            model = PartlyUsed().to(torch.bfloat16)
            tiered.offload.offload_model(model, device="cpu", blocks=list(model.layers))
            return backward_all(model, xs, skips), model.tiered_accumulation.stats()
        finally:
            tiered.offload.close()

    seen, stats = run_bounded(go, timeout=TIMEOUT)
    assert_same(plain, seen)
    per_block = 2 * sum(p.numel() for p in PartlyUsed().layers[0].parameters())
    # Micro-batch 1 reduced each block's first layer only: both blocks held over and summed on the worker;
    # micro-batch 2 reduced both whole blocks: summed on the device.
    assert stats["bytes_summed"] == 4 * per_block
    assert stats["bytes_summed_on_device"] == 2 * per_block


def test_the_sums_made_on_the_device_are_offered_to_the_clip_until_the_next_forward(monkeypatch) -> None:
    """With tiered.optim.resident_grads switched on, each gradient summed on the device stays there beside its
    home once the worker has written it: taken back, it is bitwise the host's gradient; a gradient changed in
    place since is not handed back; the next forward drops what was not taken."""
    import tiered.offload
    import tiered.offload.accumulation as acc
    import tiered.offload.kept_sums as kept_sums
    from tiered.optim import resident_grads

    monkeypatch.setattr(acc, "SUM_ON_DEVICE", True)
    monkeypatch.setattr(resident_grads, "ENABLED", True)
    monkeypatch.setattr(kept_sums.KeptSums, "measuring", lambda self: False)  # as after MEASURED_PASSES
    xs = micro_batches(3)

    def go() -> None:
        try:
            model = offloaded()
            owner = model.tiered_accumulation
            for x in xs[:2]:
                model(x).backward()
            assert resident_grads.held_bytes(owner) == 2 * sum(p.numel() for p in model.parameters())
            params = dict(model.named_parameters())
            host = {n: p.grad.to_local() for n, p in params.items()}
            host["head.bias"].mul_(2)  # a gradient scaled in place after backward (a user's own clip, say)
            for name, g in host.items():
                copy = resident_grads.take(g)
                if name == "head.bias":
                    assert copy is None
                else:
                    assert copy is not None and torch.equal(copy, g), name
            model(xs[2]).backward()
            assert resident_grads.held_bytes(owner) > 0
            model(xs[0])  # the next forward: the copies not taken go
            assert resident_grads.held_bytes(owner) == 0
        finally:
            tiered.offload.close()

    run_bounded(go, timeout=TIMEOUT)


def test_no_room_on_the_device_for_the_held_gradients_adds_none_of_them():
    """A block's held gradients all go up before any is added: where one finds no GPU memory (out of memory beside
    backward) the reduced gradients are left as FSDP2 made them, and the worker sums the block instead (an addition
    made before the failure would be counted twice)."""
    import tiered.offload.accumulation as acc

    class NoRoom(torch.Tensor):
        def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            raise torch.OutOfMemoryError("CUDA out of memory (a test's stand-in)")

    a, b = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4))
    reduce_output = torch.arange(8, dtype=torch.float32)
    views = {id(a): reduce_output[:4], id(b): reduce_output[4:]}
    before = reduce_output.clone()
    assert not acc.add_on_device(views, reduce_output, [(a, torch.ones(4)), (b, torch.ones(4).as_subclass(NoRoom))])
    assert torch.equal(reduce_output, before)
    assert acc.add_on_device(views, reduce_output, [(a, torch.ones(4)), (b, torch.full((4,), 2.0))])
    assert torch.equal(reduce_output, before + torch.tensor([1.0] * 4 + [2.0] * 4))


@pytest.mark.parametrize("clip", [None, 1e-3])
def test_the_step_gives_back_the_sums_its_clip_did_not_take(tmp_path, monkeypatch, clip) -> None:
    """The sums backward left on the GPU (resident_grads) wait for the optimizer's clip; what no clip takes (no clip,
    or, as on this CPU stand-in, a clip that takes its norm where the gradients lie) the step forgets before its
    update, rather than holding that memory until the next forward. (tests/gpu: a clip on the GPU takes them.)"""
    import tiered.offload
    import tiered.offload.accumulation as acc
    import tiered.offload.kept_sums as kept_sums
    from tiered import TieredOptimizer
    from tiered.optim import resident_grads

    monkeypatch.setattr(acc, "SUM_ON_DEVICE", True)
    monkeypatch.setattr(resident_grads, "ENABLED", True)
    monkeypatch.setattr(kept_sums.KeptSums, "measuring", lambda self: False)  # as after MEASURED_PASSES
    xs = micro_batches(2)

    def go() -> None:
        try:
            model = offloaded()
            owner = model.tiered_accumulation
            with TieredOptimizer(model, nvme_path=tmp_path, max_grad_norm=clip) as opt:
                for x in xs:
                    model(x).backward()
                assert resident_grads.held_bytes(owner) > 0
                opt.step()
                assert resident_grads.held_bytes(owner) == 0
        finally:
            tiered.offload.close()

    run_bounded(go, timeout=TIMEOUT)


def test_backward_keeps_no_more_sums_than_its_room_while_the_worker_lags(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sums chosen to keep on the device (resident_grads) count against the room until the worker offers them:
    with the worker held back, backward has chosen every unit's sums before the first is offered, and still
    keeps no more than the room (two blocks' here, of three blocks and a head)."""
    import tiered.offload.accumulation as acc
    import tiered.offload.kept_sums as kept_sums

    block = 2 * (16 * 16 + 16)  # a block's bf16 weight and bias
    monkeypatch.setattr(acc, "SUM_ON_DEVICE", True)
    monkeypatch.setattr(kept_sums, "CPU_ROOM", 2 * block)
    sum_pairs = acc.HostAccumulation._sum_pairs

    def lagging(self: Any, job: Any) -> None:
        time.sleep(0.1)
        sum_pairs(self, job)

    monkeypatch.setattr(acc.HostAccumulation, "_sum_pairs", lagging)

    kept = run_bounded(lambda: kept_after_each([False] * 5), timeout=TIMEOUT)
    assert kept[:2] == [0, 0] and all(0 < k <= 2 * block for k in kept[2:]), kept  # two passes measured first


def test_a_block_whose_sums_do_not_all_fit_keeps_none_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept sum is a view of its block's reduced gradients and keeps all of them from going back: with room for
    one block and a bias, the next block's bias alone, kept, would hold that block's weight too. Backward keeps a
    block's sums all or none, and what it keeps (counted by storage, resident_grads.held_bytes) stays within the
    room."""
    import tiered.offload.accumulation as acc
    import tiered.offload.kept_sums as kept_sums

    block = 2 * (16 * 16 + 16)  # a block's bf16 weight and bias
    monkeypatch.setattr(acc, "SUM_ON_DEVICE", True)
    monkeypatch.setattr(kept_sums, "CPU_ROOM", block + 2 * 16)
    kept = run_bounded(lambda: kept_after_each([False] * 4), timeout=TIMEOUT)
    assert kept[:2] == [0, 0] and all(k == block for k in kept[2:]), kept


def kept_after_each(zero_grad_before: list[bool]) -> list[int]:
    """Bytes of sums an offloaded model keeps on the device (resident_grads) after each micro-batch's backward,
    with ``model.zero_grad()`` before the micro-batches flagged (a new step: nothing held, nothing added)."""
    import tiered.offload
    from tiered.optim import resident_grads

    kept = []
    try:
        model = offloaded()
        for x, zero in zip(micro_batches(len(zero_grad_before)), zero_grad_before):
            if zero:
                model.zero_grad()
            model(x).backward()
            kept.append(resident_grads.held_bytes(model.tiered_accumulation))
    finally:
        tiered.offload.close()
    return kept


@pytest.mark.parametrize(
    "zero_grad_before, keeps",
    [
        ([True] * 4, [False, False, True, True]),  # a micro-batch a step: two backwards measured
        ([False] * 4, [False, False, True, True]),  # accumulation: the second, measured, added held sums
        ([False, True, False, False, False], [False, False, False, True, True]),  # a probe, then a step of three
    ],
    ids=["one-a-step", "accumulating", "probe-first"],
)
def test_backwards_keep_sums_only_once_two_and_one_that_added_held_sums_were_measured(
    zero_grad_before: list[bool], keeps: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a backward takes is measured where it keeps no sums (offload.kept_sums.MEASURED_PASSES: the
    first two backwards, whose first runs without the optimizer's buffers and blocks copied ahead; and the first
    that adds held sums on the device, which copies them up): a probe's pass, or a micro-batch's after a
    zero_grad, adds none, so the first micro-batch after them that accumulates is measured too."""
    import tiered.offload.accumulation as acc

    monkeypatch.setattr(acc, "SUM_ON_DEVICE", True)
    kept = run_bounded(lambda: kept_after_each(zero_grad_before), timeout=TIMEOUT)
    assert [k > 0 for k in kept] == keeps, kept


# ------------------------------------------------------------------------------------------------- a fork
FORK_SCRIPT = """
import os, signal, sys, threading, torch
from torch import nn
import tiered.offload
from tiered import TieredOptimizer
from tiered.optim import resident_grads
torch.set_num_threads(1)  # tiny ops never start OpenMP's pool, which does not survive a fork: the child's own hang
root = {root!r}
def blocks():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))).to(torch.bfloat16)
xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16) for s in range(2)]
plain = blocks()
for x in xs:
    plain(x).square().mean().backward()
model = blocks()
tiered.offload.offload_model(model, device="cpu", blocks=list(model))
opt = TieredOptimizer(model, os.path.join(root, "run"), lr=0.1)
acc = model.tiered_accumulation
model(xs[0]).square().mean().backward()
busy, go = threading.Event(), threading.Event()
sum_job = acc._sum
def slow_sum(job):  # the worker inside a sum at the fork, backward's end waiting for it
    if any(pair.held is not None for pair in job.pairs):
        busy.set()
        go.wait()
    sum_job(job)
def hold(lock):  # a thread of the parent inside the lock at the fork
    with lock:
        busy.set()
        go.wait()
if {case!r} == "worker-busy":
    acc._sum = slow_sum
    threads = [threading.Thread(target=lambda: model(xs[1]).square().mean().backward())]
else:  # the locks a fresh optimizer's step went through: the sums', the prefetch's, the device sums'
    locks = [acc._lock, model.tiered_prefetch._lock, resident_grads._lock]
    threads = [threading.Thread(target=hold, args=(lock,)) for lock in locks]
for t in threads:
    busy.clear()
    t.start()
    busy.wait()
pid = os.fork()
if pid == 0:
    signal.alarm(60)  # a call that waits for ever is killed by SIGALRM
    fresh = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    before = [p.detach().clone() for p in fresh.parameters()]
    with TieredOptimizer(fresh, os.path.join(root, "child"), lr=0.1) as fopt:
        for step in range(2):
            fresh(torch.randn(8, 16)).square().mean().backward()
            fopt.step()
            fopt.zero_grad()
        sgd = torch.optim.SGD(fresh.parameters(), lr=0.1)
        fresh(torch.randn(8, 16)).square().mean().backward()
        sgd.step()
        sgd.zero_grad()
    print("child: fresh model trained", not any(torch.equal(p, b) for p, b in zip(fresh.parameters(), before)),
          flush=True)
    calls = {{"forward": lambda: model(xs[0]), "model.zero_grad": model.zero_grad, "stats": acc.stats,
             "step over it": lambda: torch.optim.SGD(model.parameters(), lr=0.1).step(),
             "state_dict": model.state_dict, "a block's state_dict": model[0].state_dict,
             "load_state_dict": lambda: model.load_state_dict(plain.state_dict())}}
    for name, call in calls.items():
        try:
            call()
            print("child:", name, "returned", flush=True)
        except RuntimeError as e:
            print("child:", name, "raised", "before a fork" in str(e) and "offloaded model" in str(e), flush=True)
    sys.exit(0)  # the usual way out: the exit's hooks and finalizers run in the child too
go.set()
for t in threads:
    t.join()
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
if {case!r} == "locks-held":
    model(xs[1]).square().mean().backward()
same = all(torch.equal(p.grad.full_tensor(), q.grad) for p, q in zip(model.parameters(), plain.parameters()))
print("parent sums", same, flush=True)
opt.step()
opt.zero_grad()
model(xs[0]).square().mean().backward()
opt.step()
opt.close()
tiered.offload.close()
print("parent done", flush=True)
"""


@pytest.mark.parametrize("case", ["worker-busy", "locks-held"])
def test_a_forked_child_trains_its_own_model_and_refuses_the_parents(tmp_path, case: str) -> None:
    """A child forked while the parent's gradient-summing worker was busy (a backward's end waiting for it) or
    while a parent's thread held the sums' lock hung in a fresh optimizer's ``step()`` and ``zero_grad()`` (every
    offloaded model's sums were settled, and the parent's worker and the lock's holder do not exist there). The
    child now trains its own model without touching the parent's sums, a call on the parent's offloaded model
    raises by name at once, the child's exit does not wait for the parent's worker, and the parent goes on. Its
    state dict too: the weights are the parent's host memory, shared with the child, which a load there would
    write (a state dict the parent took is saved whole by a child: test_offload_params.py)."""
    from helpers import run_script

    proc = run_script(FORK_SCRIPT.format(root=str(tmp_path), case=case), timeout=600)  # a hang, loaded
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in ("child: fresh model trained True", "child exit 0", "parent sums True", "parent done"):
        assert line in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("raised True") == 7 and "returned" not in proc.stdout, proc.stdout
