"""TieredOptimizer under ``accelerate.Accelerator`` and ``torch.amp.GradScaler``: the same training as with
``torch.optim.AdamW``, to float rounding, including accumulation, save_state/load_state and skipped fp16
overflow steps."""

from __future__ import annotations

import gc
from collections import defaultdict

import frameworks_common as fc  # first: it takes the HF libraries offline before they load

# isort: split
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader

pytestmark = pytest.mark.frameworks

BATCHES = 16


def reset_accelerate() -> None:
    """accelerate keeps its state in process-wide singletons (its own tests reset them the same way)."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    yield
    reset_accelerate()  # leave no accumulation steps or scaler to the next test


def new_accelerator(**kw) -> Accelerator:
    """A fresh Accelerator on the CPU: each run of a pair starts from scratch."""
    reset_accelerate()
    return Accelerator(cpu=True, **kw)


def loader() -> DataLoader:
    return DataLoader(fc.tokens(BATCHES * fc.BATCH), batch_size=fc.BATCH, shuffle=False)


def schedule(opt, total: int):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / total))


def train(accelerator, model, opt, sched, dl) -> int:
    """The accelerate loop; returns how many optimizer steps were taken (not skipped)."""
    taken = 0
    for batch in dl:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            taken += accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped
    return taken


def test_accelerate_accumulate(tmp_path):
    """``prepare`` + ``accumulate`` with gradient_accumulation_steps=2: 8 optimizer steps from 16 batches."""
    results, opts = {}, {}
    for kind in fc.KINDS:
        accelerator = new_accelerator(gradient_accumulation_steps=2)
        model = fc.tiny_llama()
        before = fc.weights(model)
        opt = fc.make_optimizer(kind, model, tmp_path / "nvme")
        model, popt, dl, sched = accelerator.prepare(model, opt, loader(), schedule(opt, BATCHES // 2))
        assert train(accelerator, model, popt, sched, dl) == BATCHES // 2
        results[kind], opts[kind] = fc.weights(model), opt
        fc.assert_trained(before, results[kind])
    fc.assert_same_weights(results["adamw"], results["tiered"], "accelerate accumulate: tiered vs AdamW")
    assert fc.step_count(opts["tiered"]) == fc.step_count(opts["adamw"]) == BATCHES // 2
    assert opts["tiered"].param_groups[0]["lr"] == pytest.approx(opts["adamw"].param_groups[0]["lr"])
    fc.assert_used_disk(opts["tiered"])
    fc.close(opts["tiered"])


def test_accelerate_save_state_load_state_resume(tmp_path):
    """Half the steps, ``save_state``; a new Accelerator, model and optimizer; ``load_state`` and the rest of
    the steps (``skip_first_batches``): the weights equal an uninterrupted run's."""
    half = BATCHES // 2
    final, resumed = {}, {}
    for kind in fc.KINDS:
        nvme = tmp_path / "nvme"
        accelerator = new_accelerator()
        model = fc.tiny_llama()
        opt = fc.make_optimizer(kind, model, nvme)
        model, popt, dl, sched = accelerator.prepare(model, opt, loader(), schedule(opt, BATCHES))
        for i, batch in enumerate(dl):
            accelerator.backward(model(input_ids=batch, labels=batch).loss)
            popt.step()
            sched.step()
            popt.zero_grad()
            if i + 1 == half:
                accelerator.save_state(str(tmp_path / kind / "state"))
        final[kind] = fc.weights(model)
        if kind == "tiered":
            fc.assert_used_disk(opt)
        fc.close(opt)  # the first run ends, as its process would
        del accelerator, model, opt, popt, dl, sched
        gc.collect()

        accelerator = new_accelerator()
        model = fc.tiny_llama(seed=1)  # other weights: load_state must bring the saved ones back
        opt = fc.make_optimizer(kind, model, nvme)
        model, popt, dl, sched = accelerator.prepare(model, opt, loader(), schedule(opt, BATCHES))
        accelerator.load_state(str(tmp_path / kind / "state"))
        assert fc.step_count(opt) == half
        for batch in accelerator.skip_first_batches(dl, half):
            accelerator.backward(model(input_ids=batch, labels=batch).loss)
            popt.step()
            sched.step()
            popt.zero_grad()
        assert fc.step_count(opt) == BATCHES
        resumed[kind] = fc.weights(model)
        fc.close(opt)
    fc.assert_same_weights(final["adamw"], resumed["adamw"], "AdamW: resumed vs uninterrupted (the test's control)")
    fc.assert_same_weights(final["adamw"], final["tiered"], "uninterrupted: tiered vs AdamW")
    fc.assert_same_weights(final["tiered"], resumed["tiered"], "tiered: resumed vs uninterrupted")


INF_STEP = 3


def test_accelerate_fp16_overflow_is_skipped(tmp_path):
    """A loss scaler (fp16 training) and an overflowing gradient on one step: the Accelerator reports the
    step as skipped, the LR scheduler does not advance on it, and the state is untouched, as with AdamW.

    accelerate makes its GradScaler only for fp16 on an accelerator (``native_amp``); on this CPU-only
    machine the test hands it the one that it would make (``torch.amp.GradScaler``, here on "cpu"), so that
    ``backward``, ``AcceleratedOptimizer.step`` and ``optimizer_step_was_skipped`` run their fp16 code.

    The AdamW side is torch's default (foreach) kernel: accelerate learns that a step was skipped only when
    the scaler does not call the optimizer's ``step``, and GradScaler calls it anyway for an optimizer that
    sets ``_step_supports_amp_scaling`` (torch's fused AdamW does; a drop-in for AdamW must not)."""
    steps = 8
    results, opts, skipped, lrs, scales = {}, {}, {}, {}, {}
    for kind in fc.KINDS:
        accelerator = new_accelerator()
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        model = fc.tiny_llama()
        opt = fc.make_optimizer(kind, model, tmp_path / "nvme", fused=False)
        model, popt, sched = accelerator.prepare(model, opt, schedule(opt, steps))
        assert popt.scaler is accelerator.scaler
        skipped[kind], lrs[kind] = [], []
        for i, batch in enumerate(fc.tokens(steps * fc.BATCH).split(fc.BATCH)):
            accelerator.backward(model(input_ids=batch, labels=batch).loss)
            if i == INF_STEP:
                model.model.layers[1].mlp.up_proj.weight.grad[3, 5] = float("inf")
            popt.step()
            sched.step()
            popt.zero_grad()
            skipped[kind].append(accelerator.optimizer_step_was_skipped)
            lrs[kind].append(sched.get_last_lr()[0])
        results[kind], opts[kind], scales[kind] = fc.weights(model), opt, accelerator.scaler.get_scale()
    assert skipped["adamw"] == [i == INF_STEP for i in range(steps)]  # the test's control
    assert skipped["tiered"] == skipped["adamw"], "the overflow step was not reported as skipped"
    assert lrs["tiered"] == pytest.approx(lrs["adamw"])
    assert lrs["tiered"][INF_STEP] == lrs["tiered"][INF_STEP - 1], "the scheduler advanced on the skipped step"
    assert scales["tiered"] == scales["adamw"] == 2.0**11
    assert fc.step_count(opts["tiered"]) == fc.step_count(opts["adamw"]) == steps - 1
    fc.assert_same_weights(
        results["adamw"],
        results["tiered"],
        "accelerate fp16 overflow: tiered vs AdamW",
        fc.FOREACH_RTOL,
        fc.FOREACH_ATOL,
    )
    fc.assert_used_disk(opts["tiered"])
    fc.close(opts["tiered"])


def test_grad_scaler_after_a_plain_step(tmp_path):
    """Plain torch: one ``opt.step()`` without a scaler, then ``GradScaler`` steps, one of them with an inf
    gradient, which the scaler skips exactly as with AdamW (torch's default kernel, as in the test above)."""
    steps = 6
    results, opts, scale_history, scales = {}, {}, {}, {}
    for kind in fc.KINDS:
        model = fc.tiny_llama()
        opt = fc.make_optimizer(kind, model, tmp_path / "nvme", fused=False)
        data = fc.tokens((steps + 1) * fc.BATCH).split(fc.BATCH)
        model(input_ids=data[0], labels=data[0]).loss.backward()
        opt.step()  # no scaler yet
        opt.zero_grad()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        scale_history[kind] = []
        for i, batch in enumerate(data[1:]):
            scaler.scale(model(input_ids=batch, labels=batch).loss).backward()
            if i == INF_STEP:
                model.lm_head.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scale_history[kind].append(scaler.get_scale())
        results[kind], opts[kind], scales[kind] = fc.weights(model), opt, scaler.get_scale()
    assert scale_history["tiered"] == scale_history["adamw"]  # the scale halved on the inf step, as with AdamW
    assert scales["adamw"] < 2.0**12
    assert fc.step_count(opts["tiered"]) == fc.step_count(opts["adamw"]) == steps  # 1 plain + 6 scaled - 1 skipped
    fc.assert_same_weights(
        results["adamw"],
        results["tiered"],
        "GradScaler after a plain step: tiered vs AdamW",
        fc.FOREACH_RTOL,
        fc.FOREACH_ATOL,
    )
    fc.assert_used_disk(opts["tiered"])
    fc.close(opts["tiered"])


def test_accelerate_optimizer_state_reset(tmp_path):
    """``popt.state = defaultdict(dict)`` and ``popt.state.clear()`` on accelerate's ``AcceleratedOptimizer`` (its
    ``state`` passes both through to the optimizer it wraps) start every parameter afresh, as AdamW's. Once, on a
    TieredOptimizer, neither did anything."""
    results, opts = {}, {}
    for kind in fc.KINDS:
        accelerator = new_accelerator()
        model = fc.tiny_llama()
        opt = fc.make_optimizer(kind, model, tmp_path / "nvme")
        model, popt, dl = accelerator.prepare(model, opt, loader())
        for i, batch in enumerate(dl):
            accelerator.backward(model(input_ids=batch, labels=batch).loss)
            popt.step()
            popt.zero_grad()
            if i == 4:
                popt.state = defaultdict(dict)
            elif i == 9:
                popt.state.clear()
        results[kind], opts[kind] = fc.weights(model), opt
    fc.assert_same_weights(results["adamw"], results["tiered"], "accelerate state reset: tiered vs AdamW")
    assert fc.step_count(opts["tiered"]) == fc.step_count(opts["adamw"]) == BATCHES - 10
    fc.assert_used_disk(opts["tiered"])
    fc.close(opts["tiered"])
