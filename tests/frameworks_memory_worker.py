"""One framework's save and resume of a TieredOptimizer, with the process's anonymous memory sampled around
each: run by tests/acceptance/test_frameworks_memory.py in a fresh process (``python frameworks_memory_worker.py
FRAMEWORK on|off OUT_DIR``), which prints one JSON line: the growth of RssAnon over each phase, in bytes.

Why anonymous memory: the state dict's tensors and a mapped checkpoint are file pages (the page cache,
which the kernel reclaims under pressure), while what ``torch.load`` or an in-memory buffer copies is
anonymous RAM that stays until it is freed: the memory a host budget is about.

``on`` uses the integration (tiered.integrations), ``off`` the framework's default path, the problem's
control. Both train the same sized Llama (``SIZES``) for a step, save, and resume in a new optimizer.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings

import frameworks_common as fc  # first: it takes the HF libraries offline before they load
import torch

from io_engine import parse_size
from tiered import TieredOptimizer

HOST_BUDGET = "8MiB"
CHUNK_BYTES = "1MiB"
SIZES = dict(hidden=384, layers=2)  # 9.9M parameters: 76 MiB of moments in the state dict, 9.4x HOST_BUDGET
STEPS = 1
BATCH, SEQ = 2, 16


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class Peak:
    """The largest RssAnon seen since ``start()``, less its value then, sampled every millisecond by a thread.
    Sampling can miss a peak shorter than the period, never invent one: a growth it reports was there."""

    def __init__(self) -> None:
        self.base = self.peak = 0
        self._on = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._on:
                self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def start(self) -> None:
        self.base = self.peak = rss_anon()
        self._on = True

    def stop(self) -> int:
        self.peak = max(self.peak, rss_anon())
        self._on = False
        return self.peak - self.base

    def measure(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, its result and the growth it caused."""
        self.start()
        try:
            out = fn(*args, **kwargs)
        finally:
            grew = self.stop()
        return out, grew


def moments(model: torch.nn.Module) -> int:
    """The bytes of exp_avg and exp_avg_sq in the state dict (fp32 parameters)."""
    return 2 * 4 * sum(p.numel() for p in model.parameters())


def opt_kwargs(nvme: str) -> dict:
    return dict(nvme_path=nvme, lr=fc.LR, weight_decay=fc.WEIGHT_DECAY, host_budget=HOST_BUDGET,
                chunk_bytes=CHUNK_BYTES)  # fmt: skip


def hf(on: bool, out: str, peak: Peak) -> dict:
    from transformers import Trainer, TrainingArguments

    from tiered.integrations.hf import TieredTrainer

    cls = TieredTrainer if on else Trainer
    res: dict = {}

    def trainer(model):
        args = TrainingArguments(output_dir=os.path.join(out, "hf"), max_steps=STEPS, save_strategy="steps",
                                 save_steps=STEPS, per_device_train_batch_size=BATCH, report_to=[], use_cpu=True,
                                 disable_tqdm=True, seed=0, dataloader_num_workers=0, learning_rate=fc.LR,
                                 save_only_model=False)  # fmt: skip
        t = cls(model=model, args=args, train_dataset=fc.TokenDataset(16, SEQ),
                optimizer_cls_and_kwargs=(TieredOptimizer, opt_kwargs(os.path.join(out, "nvme"))))  # fmt: skip
        # Only the optimizer's part of each: the model's weights save and load as transformers does them.
        save, load = t._save_optimizer_and_scheduler, t._load_optimizer_and_scheduler
        t._save_optimizer_and_scheduler = lambda d: res.__setitem__("save", peak.measure(save, d)[1])
        t._load_optimizer_and_scheduler = lambda c: res.__setitem__("resume", peak.measure(load, c)[1])
        return t

    t = trainer(fc.sized_llama(**SIZES))
    t.train()
    t.optimizer.optimizer.close()
    res["state_bytes"], res["moments"] = t.optimizer.optimizer.state_bytes, moments(t.model)
    t = trainer(fc.sized_llama(seed=1, **SIZES))
    t.train(resume_from_checkpoint=os.path.join(out, "hf", f"checkpoint-{STEPS}"))
    res["resumed_step"] = fc.step_count(t.optimizer)
    t.optimizer.optimizer.close()
    return res


def accelerate(on: bool, out: str, peak: Peak) -> dict:
    from accelerate import Accelerator

    from tiered.integrations.accelerate import load_state

    res: dict = {}
    ckpt = os.path.join(out, "acc")

    def prepared(seed: int):
        acc = Accelerator(cpu=True)
        model = fc.sized_llama(seed, **SIZES)
        return (acc, *acc.prepare(model, TieredOptimizer(model, **opt_kwargs(os.path.join(out, "nvme")))))

    acc, model, opt = prepared(0)
    x = fc.tokens(BATCH, SEQ)
    for _ in range(STEPS):
        acc.backward(model(input_ids=x, labels=x).loss)
        opt.step()
        opt.zero_grad()
    _, res["save"] = peak.measure(acc.save_state, ckpt)
    res["state_bytes"], res["moments"] = opt.optimizer.state_bytes, moments(model)
    opt.optimizer.close()
    del acc, model, opt
    acc, model, opt = prepared(1)
    _, res["resume"] = peak.measure(load_state if on else Accelerator.load_state, acc, ckpt)
    res["resumed_step"] = fc.step_count(opt)
    opt.optimizer.close()
    return res


def lightning(on: bool, out: str, peak: Peak) -> dict:
    import lightning.pytorch as pl

    from tiered.integrations.lightning import TieredCheckpointIO

    class Module(pl.LightningModule):
        def __init__(self, seed: int):
            super().__init__()
            self.model = fc.sized_llama(seed, **SIZES)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def train_dataloader(self):
            return torch.utils.data.DataLoader(fc.tokens(4 * BATCH, SEQ), batch_size=BATCH)

        def configure_optimizers(self):
            self.opt = TieredOptimizer(self.model, **opt_kwargs(os.path.join(out, "nvme")))
            return self.opt

    def trainer():
        return pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                          plugins=[TieredCheckpointIO()] if on else [])  # fmt: skip

    res: dict = {}
    ckpt = os.path.join(out, "pl", "last.ckpt")
    t, module = trainer(), Module(0)
    t.fit(module)
    _, res["save"] = peak.measure(t.save_checkpoint, ckpt)
    res["state_bytes"], res["moments"] = module.opt.state_bytes, moments(module.model)
    module.opt.close()
    del t, module
    t, module = trainer(), Module(1)
    # The whole resume: configure_optimizers builds the optimizer (its host tier), then the checkpoint loads.
    _, res["resume"] = peak.measure(t.fit, module, ckpt_path=ckpt)
    res["resumed_step"] = fc.step_count(module.opt)
    module.opt.close()
    return res


def main() -> None:
    framework, on, out = sys.argv[1], sys.argv[2] == "on", sys.argv[3]
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    peak = Peak()
    res = {"hf": hf, "accelerate": accelerate, "lightning": lightning}[framework](on, out, peak)
    res["budget"] = parse_size(HOST_BUDGET)

    print(json.dumps(res))


if __name__ == "__main__":
    main()
