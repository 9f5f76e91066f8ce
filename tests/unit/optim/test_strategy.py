"""The update-strategy contract (tiered/optim/strategy.py): the pipeline calls a strategy's hooks in the order its
docstring numbers, serial twin or not, and only the pipeline decides which chunk is staged when; and the step's
``StepClock`` sums its phases."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tiered.interrupts import Sigint
from tiered.layout.chunking import Chunk, Piece
from tiered.layout.sizes import ROW_ALIGN
from tiered.optim.device_update import DeviceUpdate
from tiered.optim.groups import Groups
from tiered.optim.host_update import HostUpdate
from tiered.optim.pipeline import StepPipeline
from tiered.optim.step_stats import PHASES, StepClock
from tiered.optim.strategy import UpdateStrategy
from tiered.optim.transfer import Work
from tiered.store import TieredStore

N = 6  # chunks
NUMEL = ROW_ALIGN  # elements a chunk


class Recording(UpdateStrategy):
    """A strategy that records the hooks called, and adds 1 to each master it updates."""

    def __init__(self, slots: int, fail_at: int | None = None):
        super().__init__([torch.zeros(N * NUMEL)], [{}], updater=None)
        self.slots, self.fail_at = slots, fail_at
        self.calls: list[tuple[Any, ...]] = []
        self.staged: set[int] = set()

    def stage_ahead(self, work: Work, j: int) -> None:
        self.calls.append(("stage_ahead", j))
        self.staged.add(j)

    def update(self, work: Work, i: int, state: torch.Tensor, clock: StepClock) -> Any:
        assert i in self.staged, "updated before it was staged"
        self.calls.append(("update", i))
        if i == self.fail_at:
            raise OSError("the update failed")
        state[0] += 1
        clock.add("update_s", 1.0)
        return None

    def update_resident(self, chunk: Chunk, js: list[int], state: torch.Tensor) -> None:
        self.calls.append(("update_resident", chunk.key))

    def push_params(self, chunk: Chunk, master: torch.Tensor, pieces: list[int]) -> Any:
        self.calls.append(("push_params", chunk.key))

    def begin_step(self) -> None:
        self.calls.append(("begin_step",))

    def end_step(self) -> None:
        self.calls.append(("end_step",))

    def close(self) -> None:
        self.calls.append(("close",))


def documented(n: int, slots: int) -> list[tuple[Any, ...]]:
    """The order the strategy's docstring numbers, for n streamed chunks and no chunk in HBM."""
    calls: list[tuple[Any, ...]] = [("begin_step",)]  # 2. before any copy reads a gradient
    calls += [("stage_ahead", j) for j in range(min(slots, n))]  # 3.
    for i in range(n):  # 4.
        calls.append(("update", i))
        if i + slots < n:
            calls.append(("stage_ahead", i + slots))
    return [*calls, ("end_step",)]  # 5.


@pytest.fixture
def store(tmp_path):
    # Room for a few records only: the others stream from NVMe, read ahead and written back.
    s = TieredStore(tmp_path / "store", host_budget=4 * NUMEL * 12, policy="scan", stream_reserve=2 * NUMEL * 12)
    work: Work = []
    for i in range(N):
        chunk = Chunk(f"c{i}", 0, NUMEL, (Piece(0, i * NUMEL, 0, NUMEL),))
        s.put(chunk.key, torch.full((3, NUMEL), float(i)))
        work.append((chunk, [0]))
    yield s, work
    s.close()


@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("slots", [1, 2, 4, N + 2])
def test_the_pipeline_calls_a_strategys_hooks_in_the_documented_order(store, depth, slots):
    """Serial twin (depth 0) or pipelined, every slot count (more slots than chunks too): the documented order,
    each chunk staged ``slots`` ahead of its update and never twice; every record updated once, in the store."""
    s, work = store
    strategy = Recording(slots)
    clock = StepClock()
    StepPipeline(s, strategy, depth).run(work, clock, Sigint()).next_step()
    assert strategy.calls == documented(N, slots)
    assert clock.as_dict()["update_s"] == N  # the strategy's own phases add up on the clock it was handed
    s.flush()
    for i, (chunk, _) in enumerate(work):
        assert torch.equal(s.get(chunk.key)[0], torch.full((NUMEL,), i + 1.0)), chunk.key


@pytest.mark.parametrize("depth", [0, 2])
def test_a_failed_update_still_ends_the_step_and_unpins(store, depth):
    """A failure part-way: no later hook runs but ``end_step``, and nothing stays pinned (a pinned record cannot
    be deleted)."""
    s, work = store
    strategy = Recording(slots=2, fail_at=3)
    with pytest.raises(OSError, match="the update failed"):
        StepPipeline(s, strategy, depth).run(work, StepClock(), Sigint())
    expected = documented(N, 2)
    cut = expected.index(("update", 3)) + 1
    assert strategy.calls == [*expected[:cut], ("end_step",)]
    for chunk, _ in work:
        s.delete(chunk.key)


def test_an_empty_step_only_orders_the_streams(store):
    s, _ = store
    strategy = Recording(slots=2)
    StepPipeline(s, strategy, 2).run([], StepClock(), Sigint())
    assert strategy.calls == [("begin_step",), ("end_step",)]


def test_both_strategies_implement_the_contract_and_it_cannot_be_left_half_done():
    assert issubclass(HostUpdate, UpdateStrategy) and issubclass(DeviceUpdate, UpdateStrategy)
    assert not HostUpdate.on_device and DeviceUpdate.on_device

    class Half(UpdateStrategy):
        def update(self, work: Work, i: int, state: torch.Tensor, clock: StepClock) -> Any:
            return None

    with pytest.raises(TypeError, match="abstract"):
        Half([torch.zeros(1)], [{}], None)  # type: ignore[abstract]


def test_a_cpu_host_strategy_has_nothing_to_stage_and_reads_the_gradients_where_they_are():
    p = torch.zeros(NUMEL, requires_grad=True)
    p.grad = torch.ones(NUMEL)
    host = HostUpdate([p], Groups([{}]), None, NUMEL, slots=2, pool=None)
    chunk = Chunk("c", 0, NUMEL, (Piece(0, 0, 0, NUMEL),))
    host.stage_ahead([(chunk, [0])], 0)
    assert [g.data_ptr() for g in host.grads(chunk, 0, [0])] == [p.grad.data_ptr()]


# ----------------------------------------------------------------------------------------------- StepClock
def test_step_clock_sums_each_phase_and_names_every_one():
    clock = StepClock()
    clock.add("read_wait_s", 0.25)
    clock.add("read_wait_s", 0.5)
    clock.add("under_backward_bytes", 4096)
    sums = clock.as_dict()
    assert list(sums) == list(PHASES)
    assert sums["read_wait_s"] == 0.75 and sums["under_backward_bytes"] == 4096
    assert all(v == 0.0 for k, v in sums.items() if k not in ("read_wait_s", "under_backward_bytes"))
    sums["read_wait_s"] = 9.0  # a copy: the clock is not changed through it
    assert clock.as_dict()["read_wait_s"] == 0.75


def test_step_clock_times_blocks_and_counts_a_block_that_raised():
    clock = StepClock()
    with clock.timed("h2d_s"):
        time.sleep(0.2)
    with pytest.raises(ValueError), clock.timed("h2d_s"):
        time.sleep(0.2)
        raise ValueError
    with clock.timed("update_s"):
        pass
    sums = clock.as_dict()
    assert sums["h2d_s"] >= 0.4, sums  # both blocks, the one that raised too
    # The empty block, charged none of the others' sleep (a loaded machine may still pause it for a while).
    assert 0.0 <= sums["update_s"] < 0.2, sums


def test_step_clock_refuses_a_phase_nobody_reads():
    clock = StepClock()
    with pytest.raises(KeyError):
        clock.add("h2d", 1.0)
    with pytest.raises(KeyError), clock.timed("update"):
        pass


@pytest.mark.parametrize("in_flight", [2, 3])
def test_the_pipeline_keeps_as_many_chunks_open_as_the_device_update_has_in_flight(tmp_path, monkeypatch, in_flight):
    """shares.CHUNKS_IN_FLIGHT sets the device update's records and the pipeline's window alike; at either width, with
    some chunks on disk and reads running ahead, three steps are bitwise the serial twin's (prefetch_depth=0,
    one chunk open)."""
    import tiered.optim.pipeline as pipeline
    import tiered.shares as shares
    from tiered import TieredOptimizer

    monkeypatch.setattr(shares, "CHUNKS_IN_FLIGHT", in_flight)
    widths: list[int] = []
    windowed = pipeline.windowed

    def spy(n: int, width: int, *args: Any, **kw: Any) -> Any:
        widths.append(width)
        return windowed(n, width, *args, **kw)

    monkeypatch.setattr(pipeline, "windowed", spy)

    def train(depth: int) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.GELU(), torch.nn.Linear(64, 48))
        opt = TieredOptimizer(model, nvme_path=str(tmp_path / f"depth{depth}"), update_on="device", lr=1e-2,
                              prefetch_depth=depth, chunk_bytes="8KiB", host_budget="48KiB")  # fmt: skip
        try:
            for step in range(3):
                x = torch.randn(8, 48, generator=torch.Generator().manual_seed(step))
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            opt.close()
        return [p.detach().clone() for p in model.parameters()]

    overlapped, serial = train(2), train(0)
    assert widths == [in_flight] * 3 + [1] * 3
    assert all(torch.equal(a, b) for a, b in zip(overlapped, serial))


@pytest.mark.parametrize("update_on", ["host", "device"])
@pytest.mark.parametrize("budget_chunks, depth", [(3, 1), (4, 2), (8, 8)])
def test_a_step_reads_each_streamed_chunk_from_nvme_once_whatever_the_window(tmp_path, update_on, budget_chunks, depth):
    """The host budget leaves the read-ahead room beside the chunks the strategy keeps open (the device update's
    three): when it counted two for every strategy, the device's third open chunk took a read-ahead's room, the
    store evicted chunks read ahead but not yet updated, and a step read up to 1.8x the streamed state from NVMe."""
    from tiered import TieredOptimizer

    numel, nchunks = 4096, 16
    chunk = 12 * numel  # fp32 moments, whole masters: 12 bytes a parameter
    p = torch.nn.Parameter(torch.randn(nchunks * numel, generator=torch.Generator().manual_seed(0)))
    opt = TieredOptimizer([p], nvme_path=str(tmp_path), lr=1e-3, host_budget=budget_chunks * chunk, chunk_bytes=chunk,
                          prefetch_depth=depth, update_on=update_on, update_in_backward=False)  # fmt: skip
    try:
        for step in range(3):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            # The last step's reads counted alone: a chunk whose write-back of the step before is still in flight
            # as it begins is updated from host memory, unread (one of 16 was, on a loaded machine)
            opt.store._state.settle()
            opt.step()
        stats = opt.stats()
    finally:
        opt.close()
    streamed = stats["store"]["policy"]["streaming_records"]
    assert streamed > 0 and stats["last_step"]["nvme_read_bytes"] == streamed * chunk


@pytest.mark.parametrize("update_on", ["host", "device"])
def test_a_load_orders_its_parameter_writes_after_the_compute_stream(tmp_path, update_on):
    """Outside a step (a checkpoint load, which restores the model's weights too; ``load_state_dict`` leaves them as
    torch's does) the parameters are written on the strategy's side stream: each write first has that stream wait
    for the compute stream (``begin_step``), so that a forward or a user's write queued there before the load reads
    or writes them first."""
    from tiered import TieredOptimizer

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = TieredOptimizer(model, nvme_path=tmp_path, chunk_bytes="12KiB", host_budget="1MiB", update_on=update_on)
    try:
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        calls: list[str] = []
        strategy = opt._chunked.strategy
        begin, push = strategy.begin_step, strategy.push_params
        strategy.begin_step = lambda: (calls.append("begin"), begin())[1]
        strategy.push_params = lambda *a: (calls.append("push"), push(*a))[1]
        opt.load_checkpoint(opt.save_checkpoint(tmp_path / "ckpt"))
        assert "push" in calls
        assert all(calls[i - 1] == "begin" for i, c in enumerate(calls) if c == "push"), calls
    finally:
        opt.close()
