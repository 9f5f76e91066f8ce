"""An offloaded model inside HF ``Trainer``, accelerate and Lightning on CUDA (skipped without it): a 0.27B bf16
Llama (test_offload_params.py's "wide") trains under a GPU memory cap below its weights and gradients, its losses
equal, to rounding, those of the same framework's run with the model on an uncapped GPU, and the GPU's peak stays
below the weights and gradients that the run without offload holds there.

Each framework moves the model to the GPU (``.to(device)``): offload_model keeps the parameters on the host
(tests/acceptance/test_offload_frameworks.py checks the mechanism on the CPU). Both runs update on the GPU
(``update_on="device"``), as test_offload_params_cuda.py explains. The losses agree to rounding, not bitwise: the
frameworks clip by the norm of the gradients where they lie, on the GPU for the run without offload and on the
host for the offloaded one, and the two devices round that norm differently.
"""

from __future__ import annotations

import gc
import warnings

import frameworks_common  # noqa: F401  (first: it takes the HF libraries offline before they load)

# isort: split
import pytest
import torch
from helpers import TIMEOUT, run_bounded
from test_offload_params import SEQ, SHAPES, llama

import tiered.offload
from tiered import TieredOptimizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.frameworks,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

# A whole framework run of a Llama on the GPU (model built, trained, checkpointed): only reached when it hangs.
RUN_TIMEOUT = 20 * TIMEOUT
STEPS, BATCH, CLIP = 4, 2, 0.5
VOCAB = SHAPES["wide"][3]
OPT_KW = dict(lr=1e-3, weight_decay=0.01, update_on="device", split_masters=True, host_budget="3GiB",
              chunk_bytes="64MiB")  # fmt: skip


class Tokens(torch.utils.data.Dataset):
    """Two sequences repeated: the loss falls as the model learns them."""

    def __init__(self, n: int = STEPS * BATCH):
        self.x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i % 2], "labels": self.x[i % 2]}


def prepared(offload: bool):
    """The model (on the host), and the GPU cap for the offloaded run: 3/4 of the weights and gradients."""
    model = llama(torch.bfloat16, "wide")
    whole = 4 * sum(p.numel() for p in model.parameters())  # bf16 weights + bf16 gradients
    if offload:  # streamed for backward too: the cap set below is under what keeping the weights would take
        tiered.offload.offload_model(model, device="cuda", keep_for_backward=False)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the previous run's cached blocks would count against the cap
    torch.cuda.reset_peak_memory_stats()
    if offload:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(0.75 * whole / total)
    return model, whole


def hf(model, nvme, out) -> list[float]:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=BATCH,
                             learning_rate=OPT_KW["lr"], weight_decay=0.01, max_grad_norm=CLIP, seed=0, report_to=[],
                             disable_tqdm=True, save_strategy="no", logging_steps=1,
                             dataloader_num_workers=0)  # fmt: skip
    kw = {k: v for k, v in OPT_KW.items() if k not in ("lr", "weight_decay")}
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                      optimizer_cls_and_kwargs=(TieredOptimizer, dict(nvme_path=str(nvme), **kw)))  # fmt: skip
    trainer.train()
    getattr(trainer.optimizer, "optimizer", trainer.optimizer).close()  # accelerate may wrap it
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def accelerate(model, nvme, out) -> list[float]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator()
    model = accelerator.prepare(model)  # first: without offload it moves the model, which the optimizer must see
    opt = TieredOptimizer(model, nvme_path=str(nvme), **OPT_KW)
    dl = torch.utils.data.DataLoader(Tokens(), batch_size=BATCH, shuffle=False)
    popt, dl = accelerator.prepare(opt, dl)
    losses = []
    for batch in dl:
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), CLIP)
        popt.step()
        popt.zero_grad()
        losses.append(loss.item())
    accelerator.save_state(str(out / "state"))
    opt.close()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return losses


def lightning(model, nvme, out) -> list[float]:
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.losses, self.opt = model, [], None

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch, batch_idx):  # Lightning's sanity check runs it under inference_mode
            self.log("val_loss", self.model(**batch).loss)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Tokens(), batch_size=BATCH, shuffle=False)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(Tokens(), batch_size=BATCH, shuffle=False)

        def configure_optimizers(self):
            self.opt = TieredOptimizer(self.model, nvme_path=str(nvme), **OPT_KW)
            return self.opt

    module = Module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(accelerator="gpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                   gradient_clip_val=CLIP, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=1, limit_val_batches=1).fit(module)  # fmt: skip
    module.opt.close()
    return module.losses


def run(tmp_path, framework, offload: bool) -> dict:
    name = f"{framework.__name__}-{'off' if offload else 'plain'}"

    def body():
        model, whole = prepared(offload)
        try:
            losses = framework(model, tmp_path / f"{name}-nvme", tmp_path / name)
            on_host = all(p.device.type == "cpu" for p in model.parameters())
            return {"losses": losses, "peak": torch.cuda.max_memory_allocated(), "whole": whole, "on_host": on_host}
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
            tiered.offload.close()

    return run_bounded(body, timeout=RUN_TIMEOUT)


@pytest.mark.parametrize("framework", [hf, accelerate, lightning], ids=["hf-trainer", "accelerate", "lightning"])
def test_offloaded_model_trains_in_the_framework_under_a_gpu_cap(tmp_path, framework):
    plain = run(tmp_path, framework, offload=False)
    off = run(tmp_path, framework, offload=True)
    assert off["on_host"], "the framework moved the offloaded parameters to the GPU"
    assert len(off["losses"]) == STEPS and off["losses"][-1] < off["losses"][0], off["losses"]
    assert off["losses"] == pytest.approx(plain["losses"], rel=1e-2), (off["losses"], plain["losses"])
    assert plain["peak"] > plain["whole"], plain  # the yardstick: without offload the model takes all of it
    assert off["peak"] < off["whole"], (off["peak"], off["whole"])  # a window of layers, not the model
