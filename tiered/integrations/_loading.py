"""What the framework integrations share: finding the user's optimizer inside a framework's wrapper, and
making ``torch.load`` map the file it reads instead of copying it into RAM."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from ..optimizer import TieredOptimizer

__all__ = ["is_tiered", "mmap_loads"]
_log = logging.getLogger("tiered")


def is_tiered(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a TieredOptimizer, or wraps one (accelerate's ``AcceleratedOptimizer`` keeps
    it in ``.optimizer``, Lightning's ``LightningOptimizer`` in ``._optimizer``)."""
    for _ in range(4):  # wrappers nest at most a few deep; a cycle of attributes must not loop
        if isinstance(optimizer, TieredOptimizer):
            return True
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if optimizer is None:
            return False
    return False


@contextlib.contextmanager
def mmap_loads(enabled: bool = True) -> Iterator[None]:
    """Inside it, a ``torch.load`` that does not say ``mmap=`` maps its file (torch's own default switch).

    The tensors of the loaded dict are then pages of the checkpoint file, read as ``load_state_dict``
    streams them into the tiers chunk by chunk, and dropped with the dict. ``TieredOptimizer.load_state_dict``
    copies out of the dict and keeps nothing of it. Not for other optimizers: torch's keep the loaded
    tensors as their state, and would then update the file's private pages, which turn into RAM anyway."""
    if not enabled:
        yield
        return
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch < 2.5 has no such switch
        _log.warning("tiered: this torch has no torch.utils.serialization.config, so a framework's resume loads "
                     "the optimizer state into RAM; torch >= 2.5 maps it instead")  # fmt: skip
        yield
        return
    with config.patch({"load.mmap": True}):  # type: ignore[attr-defined]  # added by install_config_module
        yield
