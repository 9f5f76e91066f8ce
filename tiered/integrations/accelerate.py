"""``accelerate.Accelerator.load_state`` within the host budget.

``save_state`` writes ``optimizer.bin`` with ``torch.save(optimizer.state_dict())``, which streams
TieredOptimizer's file-backed tensors: flat already. ``load_state`` reads it back with ``torch.load``, into
RAM unless its ``load_kwargs`` ask for ``mmap=True``, which accelerate passes on to that load (and to the
schedulers' and samplers' small files). ``load_state`` here is that call with the keyword set::

    from tiered.integrations.accelerate import load_state

    accelerator.save_state("ckpt")          # as ever
    load_state(accelerator, "ckpt")         # = accelerator.load_state("ckpt", load_kwargs={"mmap": True})

The model's weights load as accelerate loads them (from safetensors); only the optimizer's state is at stake.

Where the keyword reaches: the plain path only (one process, DDP, multi-GPU without FSDP). Under FSDP (1 or 2)
accelerate loads the optimizer in its own ``load_fsdp_optimizer``, which ignores ``load_kwargs``: with
``FULL_STATE_DICT`` it reads ``optimizer.bin`` with a plain ``torch.load``, the whole state in RAM on each rank
that loads it, whatever this call asks; with ``SHARDED_STATE_DICT`` (FSDP2's default) ``torch.distributed.checkpoint``
reads it into the optimizer's own tensors, with no ``torch.load`` to map. DeepSpeed and Megatron-LM load their
own way too. There this call is ``accelerator.load_state`` and nothing more.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["load_state", "LOAD_KWARGS"]

LOAD_KWARGS = {"mmap": True}  # torch.load maps the file: its tensors are the file's pages, not copies in RAM


def load_state(accelerator: Any, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None,
               **load_model_func_kwargs: Any) -> None:  # fmt: skip
    """``accelerator.load_state(input_dir, ...)`` with ``torch.load`` mapping the files it reads; your own
    ``load_kwargs`` win over ours (``{"mmap": False}`` turns it off). Under FSDP, DeepSpeed or Megatron-LM
    accelerate does not pass ``load_kwargs`` to the optimizer's load, so nothing is mapped (module docstring)."""
    from accelerate import Accelerator  # type: ignore[import-untyped]

    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"load_state needs an accelerate.Accelerator, got {type(accelerator).__name__}: pass the "
                        "Accelerator that prepared the optimizer")  # fmt: skip
    return accelerator.load_state(input_dir, load_kwargs={**LOAD_KWARGS, **(load_kwargs or {})},
                                  **load_model_func_kwargs)  # fmt: skip
