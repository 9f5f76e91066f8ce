"""TieredOptimizer returned from a LightningModule's ``configure_optimizers``: the same training as with
``torch.optim.AdamW``, to float rounding, including clipping, accumulation, checkpoint resumption, a
second ``fit()`` in the same process, and ``BaseFinetuning``'s staged thaw resumed (bitwise)."""

from __future__ import annotations

import gc
import warnings

import frameworks_common as fc  # first: it takes the HF libraries offline before they load
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BaseFinetuning, EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader

from tiered.integrations.lightning import TieredCheckpointIO

pytestmark = [
    pytest.mark.frameworks,
    # Lightning's advice for real runs (num_workers, logging, ...), and its own use of a deprecated torch API.
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated"),
]

BATCHES = 4  # batches an epoch
STEPS = 8


class LlamaModule(pl.LightningModule):
    """The tiny Llama, its optimizer (``kind``) and a per-step linear LR decay over ``STEPS`` steps."""

    def __init__(self, kind: str, nvme_path, seed: int = 0):
        super().__init__()
        self.model = fc.tiny_llama(seed)
        self.kind, self.nvme_path = kind, nvme_path
        self.opt: torch.optim.Optimizer | None = None  # the latest optimizer configure_optimizers made
        self.lrs: list[float] = []
        self.grad_norms: list[float] = []  # before clipping

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def on_before_optimizer_step(self, optimizer):  # Lightning clips after this hook
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.lrs.append(self.opt.param_groups[0]["lr"])

    def train_dataloader(self):
        return DataLoader(fc.tokens(BATCHES * fc.BATCH), batch_size=fc.BATCH, shuffle=False)

    def configure_optimizers(self):
        self.opt = fc.make_optimizer(self.kind, self.model, self.nvme_path)
        sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: max(0.0, 1.0 - s / STEPS))
        return {"optimizer": self.opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(max_steps: int = STEPS, callbacks=(), **kw) -> pl.Trainer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=max_steps,
            logger=False,
            enable_checkpointing=bool(callbacks),
            callbacks=list(callbacks),
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            **kw,
        )


def checkpoint(folder) -> ModelCheckpoint:
    """Every epoch's last batch: resumed from there, Lightning starts the next epoch (a checkpoint saved in
    ``on_train_epoch_end`` makes it replay one batch, AdamW or not)."""
    return ModelCheckpoint(dirpath=folder, every_n_train_steps=BATCHES, save_top_k=-1)


VARIANTS = {
    "plain": dict(),
    "clip": dict(gradient_clip_val=1.0),
    "accumulate": dict(accumulate_grad_batches=2),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lightning_fit_matches_adamw(tmp_path, variant):
    """``configure_optimizers`` returns the optimizer and a step-wise LR scheduler; 8 optimizer steps."""
    results, modules = {}, {}
    for kind in fc.KINDS:
        module = LlamaModule(kind, tmp_path / "nvme")
        before = fc.weights(module.model)
        t = trainer(**VARIANTS[variant])
        t.fit(module)
        assert t.global_step == STEPS
        results[kind], modules[kind] = fc.weights(module.model), module
        fc.assert_trained(before, results[kind])
    fc.assert_same_weights(results["adamw"], results["tiered"], f"Lightning ({variant}): tiered vs AdamW")
    assert modules["tiered"].lrs == pytest.approx(modules["adamw"].lrs)
    assert modules["tiered"].grad_norms == pytest.approx(modules["adamw"].grad_norms, rel=1e-4)
    if variant == "clip":  # the clipping was exercised: the norm before clipping exceeded the limit
        assert max(modules["adamw"].grad_norms) > 1.0
    assert fc.step_count(modules["tiered"].opt) == fc.step_count(modules["adamw"].opt) == STEPS
    fc.assert_used_disk(modules["tiered"].opt)
    fc.close(modules["tiered"].opt)


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # resumed: same folder
@pytest.mark.parametrize("plugin", [None, TieredCheckpointIO], ids=["TorchCheckpointIO", "TieredCheckpointIO"])
def test_lightning_checkpoint_resume(tmp_path, plugin):
    """A ModelCheckpoint saved after the first epoch's last batch; ``fit(ckpt_path=...)`` of a new module in a
    new Trainer ends where the uninterrupted run ended. ``TieredCheckpointIO`` streams the save and maps the
    load (tests/acceptance/test_frameworks_memory.py measures it), to the same result."""
    final, resumed = {}, {}
    plugins = dict(plugins=[plugin()]) if plugin else {}
    for kind in fc.KINDS:
        ckpts = tmp_path / kind
        module = LlamaModule(kind, tmp_path / "nvme")
        trainer(callbacks=[checkpoint(ckpts)], **plugins).fit(module)
        final[kind] = fc.weights(module.model)
        if kind == "tiered":
            fc.assert_used_disk(module.opt)
        fc.close(module.opt)  # the first run ends, as its process would
        del module
        gc.collect()

        first_epoch = sorted(ckpts.glob(f"epoch=0-step={BATCHES}.ckpt"))
        assert len(first_epoch) == 1, sorted(ckpts.iterdir())
        module = LlamaModule(kind, tmp_path / "nvme", seed=1)  # other weights: the checkpoint brings them
        t = trainer(callbacks=[checkpoint(ckpts)], **plugins)  # the same callbacks, as Lightning asks
        t.fit(module, ckpt_path=str(first_epoch[0]))
        assert t.global_step == STEPS
        assert fc.step_count(module.opt) == STEPS
        resumed[kind] = fc.weights(module.model)
        fc.close(module.opt)
    fc.assert_same_weights(final["adamw"], resumed["adamw"], "AdamW: resumed vs uninterrupted (the test's control)")
    fc.assert_same_weights(final["adamw"], final["tiered"], "uninterrupted: tiered vs AdamW")
    fc.assert_same_weights(final["tiered"], resumed["tiered"], "tiered: resumed vs uninterrupted")


class TwoOptimizers(pl.LightningModule):
    """A TieredOptimizer for the body and torch's AdamW for the head (a GAN's second optimizer, a small head),
    stepped by hand, the loss logged for ``EarlyStopping``."""

    def __init__(self, nvme_path, seed: int = 0):
        super().__init__()
        self.model = fc.tiny_llama(seed)
        self.nvme_path = nvme_path
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizers = self.optimizers()
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss)
        for opt in optimizers:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in optimizers:
            opt.step()

    def train_dataloader(self):
        return DataLoader(fc.tokens(BATCHES * fc.BATCH), batch_size=fc.BATCH, shuffle=False)

    def configure_optimizers(self):
        cls, kw = fc.optimizer_kwargs("tiered", self.nvme_path)
        self.opts = [cls(list(self.model.model.parameters()), **kw),
                     torch.optim.AdamW(self.model.lm_head.parameters(), lr=fc.LR)]  # fmt: skip
        return self.opts


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_lightning_resume_leaves_no_checkpoint_mapped(tmp_path):
    """``fit(ckpt_path="last")`` with TieredCheckpointIO, a TieredOptimizer beside torch's AdamW, and
    ``EarlyStopping``: AdamW's state and EarlyStopping's best score were the loaded file's pages, so the whole
    file stayed mapped, its disk space held for the rest of the run once ModelCheckpoint replaced it."""
    ckpts = tmp_path / "ckpts"

    def fit(module, max_steps, **kw):
        callbacks = [ModelCheckpoint(dirpath=ckpts, every_n_train_steps=2, save_last=True),
                     EarlyStopping(monitor="loss", patience=100, check_on_train_epoch_end=True)]  # fmt: skip
        trainer(max_steps=max_steps, callbacks=callbacks, plugins=[TieredCheckpointIO()]).fit(module, **kw)
        for opt in module.opts:
            fc.close(opt)

    fit(TwoOptimizers(tmp_path / "nvme"), 2 * BATCHES)
    module = TwoOptimizers(tmp_path / "nvme", seed=1)
    fit(module, 4 * BATCHES, ckpt_path="last")
    assert fc.step_count(module.opts[1]) == 2 * BATCHES  # both optimizers step each batch: two steps a batch
    gc.collect()
    with open("/proc/self/maps") as f:
        held = [line.split(maxsplit=5)[5].strip() for line in f if str(ckpts) in line]
    assert held == [], f"checkpoints still mapped after the resumed fit: {held}"


def test_lightning_second_fit_in_same_process(tmp_path):
    """``fit()`` twice on the same module in one process: the second ``configure_optimizers`` builds a new
    optimizer on the same ``nvme_path`` while the first may still be alive, from the trained weights."""
    results, firsts, seconds = {}, {}, {}
    for kind in fc.KINDS:
        module = LlamaModule(kind, tmp_path / "nvme")
        trainer(max_steps=STEPS // 2).fit(module)
        firsts[kind] = module.opt
        trainer(max_steps=STEPS // 2).fit(module)
        seconds[kind] = module.opt
        assert seconds[kind] is not firsts[kind]
        results[kind] = fc.weights(module.model)
    fc.assert_same_weights(results["adamw"], results["tiered"], "Lightning second fit: tiered vs AdamW")
    assert fc.step_count(seconds["tiered"]) == fc.step_count(seconds["adamw"]) == STEPS // 2
    fc.assert_used_disk(seconds["tiered"])
    fc.close(seconds["tiered"])
    fc.close(firsts["tiered"])


# ------------------------------------------------------------------------------------------ BaseFinetuning
class ThawAtEpoch(BaseFinetuning):
    """The first decoder layer frozen, thawed into a group of its own at epoch ``at`` (never: ``None``), or at
    the first epoch a resumed run starts after it, as Lightning's docs show the callback. On resume
    ``BaseFinetuning`` assigns the optimizer its saved groups (``optimizer.param_groups = [...]``: new dicts; two
    groups once the layer was thawed)."""

    def __init__(self, at: int | None):
        super().__init__()
        self.at = at

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.model.model.layers[0])

    def finetune_function(self, pl_module, current_epoch, optimizer):
        layer = pl_module.model.model.layers[0]
        if self.at is None or current_epoch < self.at:
            return
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if any(id(p) not in held for p in layer.parameters()):
            self.unfreeze_and_add_param_group(layer, optimizer, train_bn=True)
        else:  # resumed after the thaw: its group restored, the layer frozen again by freeze_before_training
            self.make_trainable(layer)


class FinetunedModule(LlamaModule):
    """AdamW over the parameters that require grad (the frozen layer goes in by ``add_param_group``, as for
    TieredOptimizer(model), which leaves it out); a per-step LR schedule where no group is added (torch's
    schedulers refuse a group added after them)."""

    def __init__(self, kind: str, nvme_path, seed: int = 0, schedule: bool = True):
        super().__init__(kind, nvme_path, seed)
        self.schedule = schedule

    def configure_optimizers(self):
        cls, kw = fc.optimizer_kwargs(self.kind, self.nvme_path)
        self.opt = cls([p for p in self.model.parameters() if p.requires_grad] if self.kind == "adamw" else self.model,
                       **kw)  # fmt: skip
        if not self.schedule:
            return self.opt
        sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: max(0.0, 1.0 - s / (3 * BATCHES)))
        return {"optimizer": self.opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


FINETUNING = {  # (thawed at epoch, resumed from the end of epoch, LR schedule)
    "frozen, LR schedule": (None, 0, True),
    "resumed after the thaw": (1, 1, False),
    "resumed before the thaw": (1, 0, False),
}


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
@pytest.mark.parametrize("case", list(FINETUNING))
def test_lightning_base_finetuning_resumes_as_adamw(tmp_path, case):
    """Three epochs under ``BaseFinetuning``, checkpointed each epoch, then resumed in a new Trainer from one:
    tiered and AdamW reach the same weights, bitwise, uninterrupted and resumed (the assigned groups were ignored:
    a resumed LR schedule lost, or the resume refused or crashed in ``add_param_group``)."""
    at, epoch, schedule = FINETUNING[case]
    final, resumed = {}, {}
    for kind in fc.KINDS:
        ckpts = tmp_path / kind
        module = FinetunedModule(kind, tmp_path / "nvme", schedule=schedule)
        trainer(max_steps=3 * BATCHES, callbacks=[ThawAtEpoch(at), checkpoint(ckpts)]).fit(module)
        final[kind] = fc.weights(module.model)
        fc.close(module.opt)
        del module
        gc.collect()
        module = FinetunedModule(kind, tmp_path / "nvme", seed=1, schedule=schedule)
        t = trainer(max_steps=3 * BATCHES, callbacks=[ThawAtEpoch(at), checkpoint(ckpts)])
        t.fit(module, ckpt_path=str(ckpts / f"epoch={epoch}-step={(epoch + 1) * BATCHES}.ckpt"))
        resumed[kind] = fc.weights(module.model)
        if kind == "tiered":
            assert len(module.opt.param_groups) == (1 if at is None else 2)
            if at is not None:  # the frozen layer's state aside, the rest fits in host memory
                fc.assert_used_disk(module.opt)
        fc.close(module.opt)
        del module
        gc.collect()
    fc.assert_same_weights(final["adamw"], final["tiered"], f"{case}, uninterrupted: tiered vs AdamW", rtol=0, atol=0)
    fc.assert_same_weights(resumed["adamw"], resumed["tiered"], f"{case}, resumed: tiered vs AdamW", rtol=0, atol=0)
