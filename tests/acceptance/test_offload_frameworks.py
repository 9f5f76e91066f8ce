"""An offloaded model (tiered.offload_model: FSDP2's CPU offload over a one-rank group) inside HF ``Trainer``,
accelerate and Lightning, on the CPU stand-in: each framework trains it, clips, checkpoints and resumes, and the
weights are bitwise those of the same framework's run without offload.

Bitwise, not to rounding: at world size 1 FSDP2 copies the gradients without reducing them, the frameworks'
clips (``clip_grad_norm_`` over DTensor gradients on a one-rank mesh) compute torch's own norm, and both sides
run the same TieredOptimizer on the same CPU, so no arithmetic differs.

What the user sets: nothing for the Trainer and accelerate (each sees an initialized group of one rank and no
launcher, so it neither wraps the model in DDP nor shards it again, and its ``.to(device)`` leaves the
parameters on the host). Lightning resumes through ``torch.load`` with a callable ``map_location``, which torch
cannot apply to the DTensors of the optimizer's state dict: the module converts them in
``on_save_checkpoint`` with ``tiered.offload.plain_tensors``.
"""

from __future__ import annotations

import gc
import warnings

import frameworks_common as fc  # first: it takes the HF libraries offline before they load

# isort: split
import pytest
import torch
from helpers import TIMEOUT, run_bounded

import tiered.offload

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed"),
    pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's advice for real runs; FSDP2's notes
]

# A whole framework run (model built, trained, checkpointed); each takes a few seconds: only reached when it hangs.
RUN_TIMEOUT = 10 * TIMEOUT
STEPS, HALF = 6, 3
CLIP = 0.5  # below the tiny Llama's gradient norms (about 1.1): every step clips


def full(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def assert_bitwise(expected: dict, actual: dict, what: str) -> None:
    assert expected.keys() == actual.keys()
    differ = [n for n in expected if not torch.equal(expected[n], actual[n])]
    assert not differ, f"{what}: weights differ in {differ}"


def bounded(fn):
    try:
        return run_bounded(fn, timeout=RUN_TIMEOUT)
    finally:
        tiered.offload.close()  # the group offload_model made; nothing if it made none


def model(offload: bool, seed: int = 0, keep: bool = False):
    m = fc.tiny_llama(seed)
    if offload:
        tiered.offload.offload_model(m, device="cpu", keep_for_backward=keep)
        assert type(next(m.parameters())).__name__ == "DTensor"
    return m


# ------------------------------------------------------------------------------------------------ HF Trainer
def hf_run(tmp_path, offload: bool, seed: int = 0, resume: str | None = None, keep: bool = False,
           evaluate_first: bool = False, **more) -> dict:  # fmt: skip
    from transformers import Trainer, TrainingArguments

    out = tmp_path / ("off" if offload else "plain")
    args = TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=fc.BATCH, learning_rate=fc.LR,
        weight_decay=fc.WEIGHT_DECAY, max_grad_norm=CLIP, seed=0, report_to=[], use_cpu=True, disable_tqdm=True,
        save_strategy="steps", save_steps=HALF, logging_steps=1, dataloader_num_workers=0, **more,
    )  # fmt: skip
    m = model(offload, seed, keep)
    evals = fc.TokenDataset(8) if more.get("eval_strategy") or evaluate_first else None
    trainer = Trainer(model=m, args=args, train_dataset=fc.TokenDataset(64), eval_dataset=evals,
                      optimizer_cls_and_kwargs=fc.optimizer_kwargs("tiered", tmp_path / "nvme"))  # fmt: skip
    first = trainer.evaluate()["eval_loss"] if evaluate_first else None  # before the optimizer exists
    trainer.train(resume_from_checkpoint=resume)
    assert trainer.model is m, type(trainer.model)  # not wrapped (DDP, FSDP) by the Trainer
    assert trainer.state.global_step == STEPS and fc.step_count(trainer.optimizer) == STEPS
    fc.assert_used_disk(trainer.optimizer)
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    fc.close(trainer.optimizer)
    return {"weights": full(m), "norms": norms, "losses": losses, "evals": evals, "out": out, "first": first}


def test_hf_trainer_trains_an_offloaded_model_as_without_and_resumes(tmp_path):
    from transformers import LlamaForCausalLM

    plain = bounded(lambda: hf_run(tmp_path, False))
    off = bounded(lambda: hf_run(tmp_path, True))
    assert min(plain["norms"]) > CLIP, "the test must clip to test clipping: lower CLIP"
    assert off["norms"] == plain["norms"] and off["losses"] == plain["losses"]
    assert_bitwise(plain["weights"], off["weights"], "HF Trainer: offloaded vs without offload")
    ckpt = off["out"] / f"checkpoint-{HALF}"
    resumed = bounded(lambda: hf_run(tmp_path, True, seed=1, resume=str(ckpt)))
    assert_bitwise(plain["weights"], resumed["weights"], "HF Trainer: offloaded, resumed vs straight")
    # The checkpoint is an ordinary one: a model without offload loads it (safetensors of plain tensors).
    loaded = LlamaForCausalLM.from_pretrained(str(off["out"] / f"checkpoint-{STEPS}"))
    assert_bitwise(plain["weights"], full(loaded), "HF Trainer: offloaded checkpoint loaded without offload")


def test_hf_trainer_with_weights_kept_for_backward_trains_and_evaluates_as_without(tmp_path):
    """keep_for_backward=True under the Trainer's gradient checkpointing, accumulation and an evaluation every
    step (forwards under no_grad, whose weights stay on the device until the next step drops them)."""
    more = dict(gradient_accumulation_steps=2, gradient_checkpointing=True, eval_strategy="steps", eval_steps=1,
                gradient_checkpointing_kwargs={"use_reentrant": False})  # fmt: skip
    plain = bounded(lambda: hf_run(tmp_path, False, **more))
    kept = bounded(lambda: hf_run(tmp_path, True, keep=True, **more))
    assert len(plain["evals"]) == STEPS and min(plain["norms"]) > CLIP
    assert (kept["norms"], kept["losses"], kept["evals"]) == (plain["norms"], plain["losses"], plain["evals"])
    assert_bitwise(plain["weights"], kept["weights"], "HF Trainer: weights kept for backward vs without offload")


@pytest.mark.parametrize("keep", [False, True])
def test_hf_trainer_evaluating_before_training_trains_the_offloaded_model_as_without(tmp_path, keep):
    """``trainer.evaluate()`` before ``train()``: its forwards under no_grad leave the gathered weights (the root
    unit's; with keep_for_backward every block's) as the model's parameters until they are dropped, and the
    optimizer the Trainer then builds would hold those copies (it refused a mix of shards and copies, or with
    every block kept trained copies nobody reads)."""
    plain = bounded(lambda: hf_run(tmp_path, False, evaluate_first=True))
    off = bounded(lambda: hf_run(tmp_path, True, keep=keep, evaluate_first=True))
    assert off["first"] == plain["first"] and off["losses"] == plain["losses"]
    assert_bitwise(plain["weights"], off["weights"], "HF Trainer: evaluate() before train(), offloaded vs without")


# ------------------------------------------------------------------------------------------------ accelerate
def hf_full_eval_after_train(tmp_path, offload: bool) -> dict:
    """``Trainer(bf16_full_eval=True)``: ``train()``, then ``evaluate()``, which (outside train) casts the model with
    ``model.to(dtype=torch.bfloat16, device=args.device)`` first; with the flag off it evaluates in the dtype
    trained, before that and after a refusal."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path / ("off" if offload else "plain")), max_steps=2, per_device_train_batch_size=fc.BATCH,
        learning_rate=fc.LR, seed=0, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
        dataloader_num_workers=0, bf16_full_eval=True,
    )  # fmt: skip
    m = model(offload)
    trainer = Trainer(model=m, args=args, train_dataset=fc.TokenDataset(16), eval_dataset=fc.TokenDataset(8),
                      optimizer_cls_and_kwargs=fc.optimizer_kwargs("tiered", tmp_path / "nvme"))  # fmt: skip
    trainer.train()
    trainer.args.bf16_full_eval = False
    out: dict = {"eval_fp32": trainer.evaluate()["eval_loss"]}
    trainer.args.bf16_full_eval = True
    try:
        out["eval"] = trainer.evaluate()["eval_loss"]
    except TypeError as e:
        out["refused"] = str(e)
        out["dtypes"] = {p.dtype for p in m.parameters()}
        trainer.args.bf16_full_eval = False
        out["eval_fp32_after"] = trainer.evaluate()["eval_loss"]
    out["dtype_after"] = next(m.parameters()).dtype
    fc.close(trainer.optimizer)
    return out


def test_hf_trainer_bf16_full_eval_after_training_an_offloaded_model_is_refused_by_name(tmp_path):
    """The Trainer's ``bf16_full_eval`` casts the model at an ``evaluate()`` after ``train()``, after FSDP2 fixed its
    dtypes at the first forward: the tiny Llama then evaluated in fp32 (token ids in, the gathered weights still
    fp32) while it said bf16, silently, a loss unlike the model without offload's. Refused by name before the
    cast; the model stays fp32 and evaluates with the flag off."""
    plain = bounded(lambda: hf_full_eval_after_train(tmp_path, False))
    off = bounded(lambda: hf_full_eval_after_train(tmp_path, True))
    assert "refused" not in plain and plain["dtype_after"] == torch.bfloat16  # without offload: cast, evaluated
    assert "before the first forward" in off["refused"] and "bf16_full_eval" in off["refused"], off
    assert off["dtypes"] == {torch.float32} and off["dtype_after"] == torch.float32
    assert off["eval_fp32"] == plain["eval_fp32"] == off["eval_fp32_after"]  # unchanged by the refused cast


def acc_run(tmp_path, offload: bool, seed: int = 0, load: str | None = None, save: str | None = None) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedType
    from torch.utils.data import DataLoader

    AcceleratorState._reset_state(True)  # accelerate's singletons: each run starts from scratch
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    m = model(offload, seed)
    opt = fc.make_optimizer("tiered", m, tmp_path / "nvme")
    dl = DataLoader(fc.tokens(2 * HALF * fc.BATCH), batch_size=fc.BATCH, shuffle=False)
    pm, popt, dl = accelerator.prepare(m, opt, dl)
    assert pm is m and accelerator.distributed_type == DistributedType.NO
    if load:
        accelerator.load_state(load)
        dl = accelerator.skip_first_batches(dl, HALF)
    losses, norms = [], []
    for i, batch in enumerate(dl):
        loss = pm(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(pm.parameters(), CLIP)))
        popt.step()
        popt.zero_grad()
        losses.append(loss.item())
        if save and i + 1 == HALF:
            accelerator.save_state(save)
    assert fc.step_count(opt) == 2 * HALF
    fc.assert_used_disk(opt)
    fc.close(opt)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return {"weights": full(m), "losses": losses, "norms": norms}


def test_accelerate_trains_an_offloaded_model_as_without_and_resumes(tmp_path):
    state = str(tmp_path / "state")
    plain = bounded(lambda: acc_run(tmp_path, False))
    off = bounded(lambda: acc_run(tmp_path, True, save=state))
    assert min(plain["norms"]) > CLIP, "the test must clip to test clipping: lower CLIP"
    assert off["losses"] == plain["losses"] and off["norms"] == plain["norms"]
    assert_bitwise(plain["weights"], off["weights"], "accelerate: offloaded vs without offload")
    resumed = bounded(lambda: acc_run(tmp_path, True, seed=1, load=state))
    assert resumed["losses"] == plain["losses"][HALF:]
    assert_bitwise(plain["weights"], resumed["weights"], "accelerate: offloaded, resumed vs straight")


# ------------------------------------------------------------------------------------------------- Lightning
def lightning_module(offload: bool, nvme, seed: int = 0, plain_optimizer_state: bool = True):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model(offload, seed)  # offloaded here: Lightning moves it later with .to(), a no-op
            self.losses: list[float] = []
            self.norms: list[float] = []  # before clipping
            self.opt = None

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer):  # Lightning clips after this hook
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            self.norms.append(float(torch.nn.utils.get_total_norm(grads)))

        def on_save_checkpoint(self, checkpoint):
            if plain_optimizer_state:  # what the user adds: see the module doc
                checkpoint["optimizer_states"] = tiered.offload.plain_tensors(checkpoint["optimizer_states"])

        def train_dataloader(self):
            return DataLoader(fc.tokens(HALF * fc.BATCH), batch_size=fc.BATCH, shuffle=False)

        def configure_optimizers(self):
            self.opt = fc.make_optimizer("tiered", self.model, nvme)
            return self.opt

    return Module()


def pl_run(tmp_path, offload: bool, seed: int = 0, ckpt: str | None = None, plain_optimizer_state: bool = True):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = lightning_module(offload, tmp_path / "nvme", seed, plain_optimizer_state)
    folder = tmp_path / ("off" if offload else "plain")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=STEPS, logger=False, gradient_clip_val=CLIP,
            callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=HALF, save_top_k=-1)],
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        )  # fmt: skip
        try:
            trainer.fit(module, ckpt_path=ckpt)
            assert trainer.global_step == STEPS and fc.step_count(module.opt) == STEPS
            fc.assert_used_disk(module.opt)
        finally:
            fc.close(module.opt)
    return {"weights": full(module.model), "losses": module.losses, "norms": module.norms,
            "ckpt": str(folder / f"epoch=0-step={HALF}.ckpt")}  # fmt: skip


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_lightning_trains_an_offloaded_model_as_without_and_resumes(tmp_path):
    plain = bounded(lambda: pl_run(tmp_path, False))
    off = bounded(lambda: pl_run(tmp_path, True))
    assert min(plain["norms"]) > CLIP, "the test must clip to test clipping: lower CLIP"
    assert off["losses"] == plain["losses"] and off["norms"] == plain["norms"]
    assert_bitwise(plain["weights"], off["weights"], "Lightning: offloaded vs without offload")
    gc.collect()
    resumed = bounded(lambda: pl_run(tmp_path, True, seed=1, ckpt=off["ckpt"]))
    assert resumed["losses"] == plain["losses"][HALF:]
    assert_bitwise(plain["weights"], resumed["weights"], "Lightning: offloaded, resumed vs straight")


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_lightning_resume_without_plain_tensors_fails_as_documented(tmp_path):
    """The limit the module doc names (torch's, not ours): without ``plain_tensors`` in ``on_save_checkpoint``
    Lightning's resume cannot load the DTensors of the optimizer's state. If Lightning or torch lifts it, this
    fails, and docs/offload.md's advice can go."""
    off = bounded(lambda: pl_run(tmp_path, True, plain_optimizer_state=False))
    with pytest.raises(RuntimeError, match="map_location"):
        bounded(lambda: pl_run(tmp_path, True, seed=1, ckpt=off["ckpt"], plain_optimizer_state=False))


def _accelerate_on_two_ranks(rank: int, world: int) -> tuple[str, str]:
    from accelerate import Accelerator

    m = model(True)  # sharded over the two ranks' group (run_ranks made it)
    with pytest.raises(ValueError, match="over 2 ranks is a shard"):  # a shard is no whole tensor to save
        tiered.offload.plain_tensors({"w": next(m.parameters())})
    accelerator = Accelerator(cpu=True)
    try:
        accelerator.prepare(m)
    except Exception as e:  # noqa: BLE001 - handed back to the test
        return str(accelerator.distributed_type), f"{type(e).__name__}: {e}"
    return str(accelerator.distributed_type), ""


def test_accelerate_on_several_ranks_refuses_an_offloaded_model_as_documented():
    """The limit docs/offload.md names: with more than one process accelerate wraps the model in DDP, which
    cannot take FSDP2's DTensor parameters; there the fix is accelerate's own FSDP2 (its plugin's
    ``cpu_offload``), not offload_model. If accelerate learns to leave such a model alone, this fails."""
    from distributed_common import run_ranks

    for distributed_type, error in run_ranks(_accelerate_on_two_ranks, 2):
        assert distributed_type == "DistributedType.MULTI_CPU"
        assert "DTensor" in error, error


# ---------------------------------------------------------------------------- what offload_model fixes for them
def test_state_dict_of_an_offloaded_model_is_the_plain_one_both_ways(tmp_path):
    """At world size 1 ``state_dict()`` gives plain tensors (safetensors, as ``save_pretrained`` and accelerate's
    ``save_state`` write them, cannot read a DTensor's storage) and ``load_state_dict`` takes them."""
    from safetensors.torch import load_file, save_file

    def body():
        ref = fc.tiny_llama(seed=1).state_dict()
        m = model(True)
        sd = m.state_dict()
        assert sd.keys() == ref.keys()
        assert all(type(v) is torch.Tensor for v in sd.values()), {k: type(v) for k, v in sd.items()}
        save_file(sd, str(tmp_path / "m.safetensors"))
        m.load_state_dict(ref)  # other weights (seed 1) than the model's own
        assert all(type(p).__name__ == "DTensor" for p in m.parameters())  # still offloaded
        assert_bitwise(ref, full(m), "a plain state dict loaded into the offloaded model")
        assert_bitwise(load_file(str(tmp_path / "m.safetensors")), fc.tiny_llama(seed=0).state_dict(), "saved")

    bounded(body)


def test_moving_an_offloaded_model_leaves_its_parameters_on_the_host():
    """HF Trainer, accelerate and Lightning call ``model.to(device)`` (a GPU on the GPU machine): the parameters
    stay where FSDP2's CPU offload keeps them. Here "meta" stands in for the GPU: a move off the host."""

    def body():
        m = model(True)
        parent = torch.nn.Sequential(m)  # as a LightningModule holds it: the move recurses into it
        parent.to("meta")
        assert all(p.device.type == "cpu" and p.to_local().device.type == "cpu" for p in m.parameters())
        assert all(b.device.type == "meta" for b in m.buffers())  # buffers move, as FSDP2 moves them
        plain = model(False).to("meta")  # the control: without offload the move happens
        assert all(p.device.type == "meta" for p in plain.parameters())

    bounded(body)


def test_plain_tensors_unwraps_one_rank_dtensors_in_nests():
    def body():
        m = model(True)
        p = next(m.parameters())
        out = tiered.offload.plain_tensors({"a": [p, (p, 3)], "b": "x", "c": torch.ones(2)})
        assert type(out["a"][0]) is torch.Tensor and torch.equal(out["a"][0], p.to_local())
        assert isinstance(out["a"][1], tuple) and out["a"][1][1] == 3 and out["b"] == "x"

    bounded(body)
