"""Framework checkpoints within the host budget: HF Trainer, accelerate and Lightning.

``TieredOptimizer.state_dict()`` returns file-backed tensors, so a framework's ``torch.save`` of it streams
from disk. What breaks the budget is the framework around it: a ``torch.load`` that reads the whole state
into RAM on resume (HF Trainer, accelerate), or a save that serializes the whole checkpoint into a buffer
first (Lightning). Each module here plugs into its framework's own extension point so that both go
through files instead:

- ``tiered.integrations.hf``: ``TieredTrainer`` (or ``TieredTrainerMixin``) for ``transformers.Trainer``;
- ``tiered.integrations.accelerate``: ``load_state(accelerator, ...)``, ``Accelerator.load_state`` with
  ``mmap``;
- ``tiered.integrations.lightning``: ``TieredCheckpointIO``, a ``CheckpointIO`` plugin.

Each imports its framework when it is imported, never before: ``import tiered`` needs none of them.
"""
