"""``accelerate.Accelerator.load_state`` within the host budget.

``save_state`` writes each optimizer's state dict with ``torch.save(optimizer.state_dict())`` (``optimizer.bin``,
``optimizer_1.bin``, ...), which streams TieredOptimizer's file-backed tensors: flat already. ``load_state``
reads each back with ``torch.load``, into RAM. ``load_state`` here is that call with ``torch.load`` mapping the
files of the TieredOptimizers (``_loading.mmap_loads``), so their state is pages of the file until
``load_state_dict`` has streamed it into the tiers, and loading them onto the CPU where accelerate would load
them onto this rank's GPU (``"on_device"``, its choice on several GPUs)::

    from tiered.integrations.accelerate import load_state

    accelerator.save_state("ckpt")          # as ever
    load_state(accelerator, "ckpt")         # = accelerator.load_state("ckpt"), TieredOptimizers' files mapped

Other optimizers' files, and the schedulers', samplers' and custom objects', load as accelerate loads them: a
torch optimizer keeps the loaded tensors as its state, so a mapped file would stay mapped, its disk space held
after the checkpoint is deleted, for the rest of the run. The model's weights load as accelerate loads them
(from safetensors); only the optimizer's state is at stake.

Where it reaches: the plain path only (one process, DDP, multi-GPU without FSDP). Under FSDP (1 or 2)
accelerate loads the optimizer in its own ``load_fsdp_optimizer``: with ``FULL_STATE_DICT`` it reads
``optimizer.bin`` with a plain ``torch.load``, the whole state in RAM on each rank that loads it, whatever this
call asks; with ``SHARDED_STATE_DICT`` (FSDP2's default) ``torch.distributed.checkpoint`` reads it into the
optimizer's own tensors, with no ``torch.load`` to map. DeepSpeed and Megatron-LM load their own way too.
There this call is ``accelerator.load_state`` and nothing more.
"""

from __future__ import annotations

import os
from typing import Any

from ._loading import is_tiered, mmap_loads

__all__ = ["load_state"]


def load_state(accelerator: Any, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None,
               **load_model_func_kwargs: Any) -> None:  # fmt: skip
    """``accelerator.load_state(input_dir, load_kwargs, ...)`` with ``torch.load`` mapping the files of the
    TieredOptimizers it prepared; an ``"mmap"`` of your own in ``load_kwargs`` wins (``{"mmap": False}`` turns
    it off, and accelerate passes it to every optimizer's load). Under FSDP, DeepSpeed or Megatron-LM nothing is
    mapped (module docstring)."""
    from accelerate import Accelerator  # type: ignore[import-untyped]

    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"load_state needs an accelerate.Accelerator, got {type(accelerator).__name__}: pass the "
                        "Accelerator that prepared the optimizer")  # fmt: skip
    with mmap_loads(_tiered_files(accelerator)):
        return accelerator.load_state(input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)


def _tiered_files(accelerator: Any) -> set[str]:
    """The names ``save_state`` gives the TieredOptimizers' files (accelerate's ``save_accelerator_state``: the
    i-th prepared optimizer's is ``optimizer.bin``, then ``optimizer_{i}.bin``), where ``load_state`` reads them
    with ``torch.load``: none under FSDP, DeepSpeed and Megatron-LM, which load the optimizer their own way."""
    from accelerate.utils import OPTIMIZER_NAME, DistributedType  # type: ignore[import-untyped]

    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        return set()
    return {f"{OPTIMIZER_NAME}.bin" if i == 0 else f"{OPTIMIZER_NAME}_{i}.bin"
            for i, optimizer in enumerate(accelerator._optimizers) if is_tiered(optimizer)}  # fmt: skip
