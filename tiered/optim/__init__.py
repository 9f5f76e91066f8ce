"""What ``TieredOptimizer`` runs on, below its ``torch.optim`` face (``tiered.optimizer``).

- ``assembly``: building the chunks, the store and the strategies from the knobs; ``budget``: how
  ``host_budget`` is spent; ``param_set``: the tensors in ``param_groups`` against those the state is laid
  out on; ``shards``: FSDP2's DTensors, their local shards and a clip's global norm; ``rank_agreement``: the
  ranks' optimizers compared when built;
- the step: ``step`` (its work in order: counts, clip, the updates kept from under backward, the rest streamed),
  ``pipeline`` (the schedule over the chunks), ``strategy`` (what the schedule asks of where the
  update runs: ``host_update`` or ``device_update``), ``update`` and ``adamw_kernel`` (the one AdamW),
  ``transfer`` (copies between rows and parameters);
- ``under_backward``: the update under backward (hooks, the updates started there, the "auto" switch);
- ``state_chunks``: the state as one object (``StateChunks``), all that checkpoints, state dicts, a layout
  carried over and the update under backward see of the optimizer; ``state_dicts``: the state as
  ``torch.optim``'s state dicts; ``state_view``: ``opt.state``, one parameter's state read and written;
  ``step_stats``: each step's times and bytes (its ``StepClock``).
"""
