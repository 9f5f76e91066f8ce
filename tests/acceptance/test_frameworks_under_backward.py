"""update_in_backward inside the frameworks' own loops: HF Trainer, accelerate and Lightning, each with
gradient accumulation and clipping, give bitwise the weights of the same run without it, and keep the
updates backward started wherever the framework's clip did not scale the gradients."""

from __future__ import annotations

import frameworks_common as fc  # first: it takes the HF libraries offline before they load

# isort: split
import pytest
import test_frameworks_accelerate as acc
import test_frameworks_hf as hf
import test_frameworks_lightning as lit
import torch
from transformers import Trainer, get_linear_schedule_with_warmup

from tiered import TieredOptimizer

pytestmark = [pytest.mark.frameworks, *lit.pytestmark[1:]]

PAIR = (False, True)  # update_in_backward off, then on


def early_kwargs(nvme_path, early: bool) -> dict:
    """The update on the "device" (the host, on a CPU model), a budget that holds the state twice."""
    return dict(nvme_path=nvme_path, lr=fc.LR, weight_decay=fc.WEIGHT_DECAY, host_budget="4MiB",
                chunk_bytes=fc.CHUNK_BYTES, update_on="device", update_in_backward=early)  # fmt: skip


def assert_pair(results: dict, what: str) -> None:
    for name, w in results[False].items():
        assert torch.equal(w, results[True][name]), f"{what}: parameter {name} differs with update_in_backward"


@pytest.mark.parametrize("max_grad_norm, kept", [(1e9, True), (0.5, False)])
def test_hf_trainer_accumulating_and_clipping(tmp_path, max_grad_norm, kept):
    """The Trainer clips through accelerate with torch's clip_grad_norm_, which multiplies every gradient,
    by exactly 1 when the norm is under the limit: kept then. Where it scaled them, an update that read
    them before the clip is redone (on CPU the worker may read them after it: then it is kept, rightly)."""
    results, stats, norms = {}, None, []
    for early in PAIR:
        model = fc.tiny_llama()
        opt = TieredOptimizer(model, **early_kwargs(tmp_path / "nvme", early))
        trainer = Trainer(
            model=model,
            args=hf.args(tmp_path / str(early), gradient_accumulation_steps=2, max_grad_norm=max_grad_norm),
            train_dataset=fc.TokenDataset(256),
            optimizers=(opt, get_linear_schedule_with_warmup(opt, hf.WARMUP, hf.STEPS)),
        )
        trainer.train()
        results[early], stats, norms = fc.weights(model), opt.stats()["under_backward"], hf.grad_norms(trainer)
        opt.close()
    assert_pair(results, "HF Trainer")
    assert stats["started"] > 0, stats
    if kept:
        assert stats["kept"] > 0 and set(stats["redone"]) <= {"another backward"}, stats
    else:  # the clip scaled the gradients on some steps
        assert max(norms) > max_grad_norm and set(stats["redone"]) <= {"another backward", "gradients changed"}


def test_accelerate_accumulating_and_clipping(tmp_path):
    results, stats = {}, None
    for early in PAIR:
        accelerator = acc.new_accelerator(gradient_accumulation_steps=2)
        model = fc.tiny_llama()
        opt = TieredOptimizer(model, **early_kwargs(tmp_path / "nvme", early))
        model, popt, dl = accelerator.prepare(model, opt, acc.loader())
        for batch in dl:
            with accelerator.accumulate(model):
                accelerator.backward(model(input_ids=batch, labels=batch).loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1e9)
                popt.step()
                popt.zero_grad()
        results[early], stats = fc.weights(model), opt.stats()["under_backward"]
        opt.close()
    assert_pair(results, "accelerate")
    assert stats["kept"] > 0 and set(stats["redone"]) <= {"another backward", "zero_grad"}, stats


class EarlyModule(lit.LlamaModule):
    def __init__(self, nvme_path, early: bool):
        super().__init__("tiered", nvme_path)
        self.early = early

    def configure_optimizers(self):
        self.opt = TieredOptimizer(self.model, **early_kwargs(self.nvme_path, self.early))
        return self.opt


def test_lightning_accumulating_and_clipping(tmp_path):
    """Lightning steps through ``opt.step(closure)``: the closure's backward, run inside step(), starts the
    updates that same step keeps."""
    results, stats = {}, None
    for early in PAIR:
        module = EarlyModule(tmp_path / "nvme", early)
        lit.trainer(accumulate_grad_batches=2, gradient_clip_val=1e9).fit(module)
        results[early], stats = fc.weights(module.model), module.opt.stats()["under_backward"]
        module.opt.close()
    assert_pair(results, "Lightning")
    assert stats["kept"] > 0 and set(stats["redone"]) <= {"another backward", "zero_grad"}, stats
