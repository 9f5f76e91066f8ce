"""A store whose reads and writes go through two engines (io_engine.DuplexEngine) holds the same records."""

from __future__ import annotations

import torch

from io_engine import DuplexEngine, IOConfig, IOEngine, SerialEngine
from tiered.store import TieredStore


def test_a_store_streams_through_it_as_through_one_engine(tmp_path):
    records = {f"r{i}": torch.randn(1000 + 37 * i) for i in range(6)}
    outs = []
    for name, io in (("one", SerialEngine()), ("two", DuplexEngine(IOEngine(IOConfig(threads=4)),
                                                                  IOEngine(IOConfig(threads=2))))):  # fmt: skip
        with io, TieredStore(str(tmp_path / name), host_budget="16KiB", io=io) as store:
            for k, t in records.items():
                store.put(k, t)
            store.flush()
            outs.append({k: store.get(k).clone() for k in records})
    for k, t in records.items():
        assert torch.equal(outs[0][k], t) and torch.equal(outs[1][k], t)
