"""``transformers.Trainer`` resumes within the host budget.

The Trainer saves the optimizer with ``torch.save(optimizer.state_dict(), ".../optimizer.pt")``, which
streams TieredOptimizer's file-backed tensors: flat already. It resumes, in the private
``Trainer._load_optimizer_and_scheduler``, with ``torch.load(".../optimizer.pt")``, which reads the whole
state into RAM before ``load_state_dict`` sees it. No ``TrainerCallback`` runs around that load, so the
mixin overrides that one method to run the Trainer's own code with ``torch.load`` mapping the file
(``_loading.mmap_loads``), onto the CPU where the Trainer would load it onto this rank's GPU (its world size
above 1). Everything else, FSDP and DeepSpeed branches included, stays the Trainer's::

    from tiered.integrations.hf import TieredTrainer   # a transformers.Trainer

    trainer = TieredTrainer(model=model, args=args, train_dataset=ds,
                            optimizer_cls_and_kwargs=(TieredOptimizer, dict(nvme_path="/mnt/nvme")))
    trainer.train(resume_from_checkpoint=True)

``class MyTrainer(TieredTrainerMixin, MyBaseTrainer)`` does the same for a Trainer of your own.
"""

from __future__ import annotations

import warnings
from typing import Any

from transformers import Trainer
from transformers.trainer import OPTIMIZER_NAME, OPTIMIZER_NAME_BIN

from ._loading import is_tiered, mmap_loads

__all__ = ["TieredTrainerMixin", "TieredTrainer"]

_HOOK = "_load_optimizer_and_scheduler"


class TieredTrainerMixin:
    """Put before ``transformers.Trainer`` (or a subclass of it) in the bases: a resume maps ``optimizer.pt``
    instead of reading it into RAM, when the optimizer is a TieredOptimizer (others load as before)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not callable(getattr(super(), _HOOK, None)):  # a transformers that renamed it: say so, do not guess
            warnings.warn(f"tiered: this transformers Trainer has no {_HOOK}(), so resuming reads optimizer.pt "
                          "into RAM; TieredTrainer was written against transformers 4.x-5.x", stacklevel=2)  # fmt: skip

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # optimizer.pt, or optimizer.bin for an FSDP full state dict (accelerate's load_fsdp_optimizer)
        with mmap_loads((OPTIMIZER_NAME, OPTIMIZER_NAME_BIN) if is_tiered(getattr(self, "optimizer", None)) else ()):
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]


class TieredTrainer(TieredTrainerMixin, Trainer):
    """``transformers.Trainer`` whose resume keeps a TieredOptimizer's state off RAM (see the module doc)."""
