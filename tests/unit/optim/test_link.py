"""The optimizer's count of the bytes it moves over the link (optim/link.py), and a step's share of it
(step_stats.StepTimes). The meta device stands in for a GPU: what is counted is which side of the link each
tensor is on, never its data. The counts of a real step on a GPU: tests/gpu/test_gpu.py."""

from __future__ import annotations

import torch

from tiered.optim.link import LinkBytes
from tiered.optim.step_stats import StepTimes
from tiered.telemetry import Wear


def test_a_copy_counts_up_or_down_by_where_its_ends_are():
    link = LinkBytes()
    host, gpu = torch.empty(256, dtype=torch.float32), torch.empty(256, dtype=torch.float32, device="meta")
    link.add(host, gpu)
    assert link.totals() == (1024, 0)
    link.add(gpu, host[:100])  # the destination's bytes
    assert link.totals() == (1024, 400)
    link.add(host, torch.empty(256))  # within one device: not the link's
    link.add(gpu, torch.empty(256, device="meta"))
    assert link.totals() == (1024, 400)


def test_a_cast_counts_the_destinations_dtype():
    """torch casts on the host before a copy goes up (and, queued, on the GPU before it comes down): what
    crosses has the destination's dtype."""
    link = LinkBytes()
    link.add(torch.empty(100, dtype=torch.bfloat16), torch.empty(100, dtype=torch.float32, device="meta"))
    link.add(torch.empty(100, dtype=torch.float32, device="meta"), torch.empty(100, dtype=torch.bfloat16))
    assert link.totals() == (400, 200)


class _Store:
    def stats(self):
        return {"nvme": {"bytes_read": 0, "bytes_written": 0}, "room_wait_s": 0.0}


def test_each_step_gets_the_bytes_moved_since_the_last_one_ended():
    """What moved before the first step (a state load's copies) is not the first step's; what moved between
    two steps (an update under backward's) is the second's."""
    times, store = StepTimes(None, Wear(None, None, 0.5), "device", "cuda"), _Store()
    clock = times.start(store, (100, 50))
    times.finish(clock, store, 0, (400, 250))
    assert (times.last["link_up_bytes"], times.last["link_down_bytes"]) == (300, 200)
    clock = times.start(store, (900, 250))  # 500 up under backward, before step() began
    times.finish(clock, store, 0, (1000, 300))
    assert (times.last["link_up_bytes"], times.last["link_down_bytes"]) == (600, 50)
    assert (times.total["link_up_bytes"], times.total["link_down_bytes"]) == (900, 250)
