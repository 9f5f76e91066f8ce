"""tiered: AdamW state tiered across GPU HBM, pinned host memory and NVMe.

from tiered import TieredOptimizer
opt = TieredOptimizer(model, nvme_path="/mnt/nvme/run1", lr=1e-4, host_budget="8GiB")
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from ._version import __version__

__all__ = [
    "TieredOptimizer",
    "TieredStore",
    "TieredCache",
    "TieredLoadPlanner",
    "gather_stats",
    "offload_model",
    "__version__",
]

if TYPE_CHECKING:
    from .kv import TieredCache
    from .offload import offload_model
    from .optim.dcp_planner import TieredLoadPlanner
    from .optim.step_stats import gather_stats
    from .optimizer import TieredOptimizer
    from .store import TieredStore


def __getattr__(name: str) -> Any:
    # Lazy, so that `import tiered` stays cheap and `tiered-bench --help` starts fast.
    if name == "TieredOptimizer":
        from .optimizer import TieredOptimizer

        return TieredOptimizer
    if name == "TieredStore":
        from .store import TieredStore

        return TieredStore
    if name == "TieredCache":  # needs transformers, which only inference users have
        from .kv import TieredCache

        return TieredCache
    if name == "offload_model":
        from .offload import offload_model

        return offload_model
    if name == "TieredLoadPlanner":  # imports torch.distributed.checkpoint, which only DCP users need
        from .optim.dcp_planner import TieredLoadPlanner

        return TieredLoadPlanner
    if name == "gather_stats":
        from .optim.step_stats import gather_stats

        return gather_stats
    # A submodule the docs name as an attribute (``tiered.offload.GPU_SHARE``, ``tiered.checkpoint``), as after
    # ``import tiered.offload``: imported on first use.
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'tiered' has no attribute {name!r}")
