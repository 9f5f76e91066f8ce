"""TieredOptimizer inside the Hugging Face ``transformers.Trainer``: the same training as with
``torch.optim.AdamW``, to float rounding, including gradient accumulation, clipping and resumption."""

from __future__ import annotations

import gc

import frameworks_common as fc  # first: it takes the HF libraries offline before they load
import pytest
import torch
from transformers import Trainer, TrainingArguments, get_linear_schedule_with_warmup

from tiered.integrations.hf import TieredTrainer

pytestmark = pytest.mark.frameworks

STEPS = 20
WARMUP = 2


def args(out, **kw) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=fc.BATCH,
        learning_rate=fc.LR,
        weight_decay=fc.WEIGHT_DECAY,
        lr_scheduler_type="linear",
        warmup_steps=WARMUP,
        max_grad_norm=0.0,  # off unless a test turns it on (the Trainer's default is 1.0)
        seed=0,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


def grad_norms(trainer: Trainer) -> list[float]:
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


VARIANTS = {
    "plain": dict(),
    "accumulate": dict(gradient_accumulation_steps=2),
    "clip": dict(max_grad_norm=1.0),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_trainer_matches_adamw(tmp_path, variant):
    """``Trainer(optimizers=(opt, scheduler))``: 20 optimizer steps, with accumulation or clipping."""
    results, opts, trainers = {}, {}, {}
    for kind in fc.KINDS:
        model = fc.tiny_llama()
        before = fc.weights(model)
        opt = fc.make_optimizer(kind, model, tmp_path / "nvme")
        sched = get_linear_schedule_with_warmup(opt, WARMUP, STEPS)
        trainer = Trainer(
            model=model,
            args=args(tmp_path / kind, **VARIANTS[variant]),
            train_dataset=fc.TokenDataset(256),
            optimizers=(opt, sched),
        )
        trainer.train()
        results[kind], opts[kind], trainers[kind] = fc.weights(model), opt, trainer
        fc.assert_trained(before, results[kind])
        assert trainer.state.global_step == STEPS
    fc.assert_same_weights(results["adamw"], results["tiered"], f"HF Trainer ({variant}): tiered vs AdamW")
    assert fc.step_count(opts["tiered"]) == fc.step_count(opts["adamw"]) == STEPS
    assert opts["tiered"].param_groups[0]["lr"] == pytest.approx(opts["adamw"].param_groups[0]["lr"])
    if variant == "clip":  # the clipping was exercised: the norm before clipping exceeded the limit
        assert max(grad_norms(trainers["adamw"])) > 1.0
        assert grad_norms(trainers["tiered"]) == pytest.approx(grad_norms(trainers["adamw"]), rel=1e-4)
    fc.assert_used_disk(opts["tiered"])
    fc.close(opts["tiered"])


@pytest.mark.parametrize("trainer_cls", [Trainer, TieredTrainer], ids=["Trainer", "TieredTrainer"])
def test_trainer_resume_from_checkpoint_in_new_trainer(tmp_path, trainer_cls):
    """``save_steps`` then ``resume_from_checkpoint`` in a new Trainer (and a new optimizer that the Trainer
    builds, through ``optimizer_cls_and_kwargs``) ends where the uninterrupted run ended. ``TieredTrainer``
    resumes with optimizer.pt mapped (tests/acceptance/test_frameworks_memory.py measures it), to the same result."""
    final, resumed = {}, {}
    for kind in fc.KINDS:
        out = tmp_path / kind
        trainer = trainer_cls(
            model=fc.tiny_llama(),
            args=args(out, save_strategy="steps", save_steps=STEPS // 2),
            train_dataset=fc.TokenDataset(256),
            optimizer_cls_and_kwargs=fc.optimizer_kwargs(kind, tmp_path / "nvme"),
        )
        trainer.train()
        final[kind] = fc.weights(trainer.model)
        if kind == "tiered":
            fc.assert_used_disk(trainer.optimizer)
        # The run ends, as its process would: the optimizer is closed and dropped.
        fc.close(trainer.optimizer)
        del trainer
        gc.collect()

        model = fc.tiny_llama(seed=1)  # other weights: the checkpoint must bring the trained ones back
        trainer = trainer_cls(
            model=model,
            args=args(out, save_strategy="steps", save_steps=STEPS // 2),
            train_dataset=fc.TokenDataset(256),
            optimizer_cls_and_kwargs=fc.optimizer_kwargs(kind, tmp_path / "nvme"),
        )
        trainer.train(resume_from_checkpoint=str(out / f"checkpoint-{STEPS // 2}"))
        assert trainer.state.global_step == STEPS
        assert fc.step_count(trainer.optimizer) == STEPS
        resumed[kind] = fc.weights(model)
        fc.close(trainer.optimizer)
    fc.assert_same_weights(final["adamw"], resumed["adamw"], "AdamW: resumed vs uninterrupted (the test's control)")
    fc.assert_same_weights(final["adamw"], final["tiered"], "uninterrupted: tiered vs AdamW")
    fc.assert_same_weights(final["tiered"], resumed["tiered"], "tiered: resumed vs uninterrupted")


@pytest.mark.parametrize("kind", fc.KINDS)
def test_tiered_trainer_resume_on_gpus_loads_the_tiered_state_onto_the_cpu(tmp_path, monkeypatch, kind):
    """With a world size above 1 on GPUs the Trainer loads optimizer.pt onto this rank's GPU: the whole
    TieredOptimizer state went to the GPU before load_state_dict took it back to the host, out of GPU memory for a
    state larger than the GPU. Here rank 0 of two GPUs as the Trainer sees it, on the CPU, with torch.load spied;
    AdamW's state keeps the Trainer's choice."""

    trainer = TieredTrainer(
        model=fc.tiny_llama(),
        args=args(tmp_path / "out", max_steps=2, save_strategy="steps", save_steps=2),
        train_dataset=fc.TokenDataset(16),
        optimizer_cls_and_kwargs=fc.optimizer_kwargs(kind, tmp_path / "nvme"),
    )
    trainer.train()
    loads = fc.spy_loads(monkeypatch)
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    monkeypatch.setattr(TrainingArguments, "device", property(lambda self: torch.device("cuda", 0)))
    if kind == "tiered":
        trainer._load_optimizer_and_scheduler(str(tmp_path / "out" / "checkpoint-2"))
        expected = [("optimizer.pt", "cpu", True), ("scheduler.pt", None, None)]
    else:
        with pytest.raises(fc.LoadOntoGPU):
            trainer._load_optimizer_and_scheduler(str(tmp_path / "out" / "checkpoint-2"))
        expected = [("optimizer.pt", torch.device("cuda", 0), None)]
    monkeypatch.undo()
    assert loads == expected
    fc.close(trainer.optimizer)


def test_trainer_resume_in_same_process(tmp_path):
    """A second Trainer resumes from the first one's checkpoint in the same process, while the first
    Trainer and its optimizer are still alive, on the same ``nvme_path``."""
    final, resumed = {}, {}
    alive = []
    for kind in fc.KINDS:
        out = tmp_path / kind
        model = fc.tiny_llama()
        opt = fc.make_optimizer(kind, model, tmp_path / "nvme")
        first = Trainer(
            model=model,
            args=args(out, save_strategy="steps", save_steps=STEPS // 2),
            train_dataset=fc.TokenDataset(256),
            optimizers=(opt, get_linear_schedule_with_warmup(opt, WARMUP, STEPS)),
        )
        first.train()
        final[kind] = fc.weights(model)
        alive.append(first)  # keeps the first optimizer open while the second one works

        model2 = fc.tiny_llama(seed=1)
        opt2 = fc.make_optimizer(kind, model2, tmp_path / "nvme")
        second = Trainer(
            model=model2,
            args=args(out, save_strategy="steps", save_steps=STEPS // 2),
            train_dataset=fc.TokenDataset(256),
            optimizers=(opt2, get_linear_schedule_with_warmup(opt2, WARMUP, STEPS)),
        )
        second.train(resume_from_checkpoint=str(out / f"checkpoint-{STEPS // 2}"))
        assert fc.step_count(opt2) == STEPS
        resumed[kind] = fc.weights(model2)
        if kind == "tiered":
            fc.assert_used_disk(opt2)
            # The first optimizer still works after the second one ran (and its state is its own).
            assert fc.step_count(opt) == STEPS
            fc.close(opt2)
            fc.close(opt)
    fc.assert_same_weights(final["adamw"], resumed["adamw"], "AdamW: resumed vs uninterrupted (the test's control)")
    fc.assert_same_weights(final["adamw"], final["tiered"], "uninterrupted: tiered vs AdamW")
    fc.assert_same_weights(final["tiered"], resumed["tiered"], "tiered: resumed vs uninterrupted")
