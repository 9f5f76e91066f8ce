"""Random put/get/evict/prefetch/delete/pin/retire/flush/reopen sequences against a plain dict.

After every operation the store must hold what the dict holds, and no budget may ever have been
exceeded (the peak counters, not just the current use). Runs on the threaded IOEngine with small I/O
blocks so that records split over several tasks and moves overlap, and on both policies.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from io_engine import IOConfig
from tiered.store import TieredStore

PAGE = 4096
BUDGET = 4 * PAGE
KEYS = ["a", "b", "c"]  # few keys, so that sequences revisit them
CFG = IOConfig(threads=2, block_size="4KiB")
# float32 numels: empty, tiny, just under / at one page, three pages, larger than the host budget.
NUMELS = [0, 1, 1000, 1024, 3000, 5000]
TIERS = [None, "host", "nvme"]

key = st.sampled_from(KEYS)
ops = st.one_of(
    st.tuples(st.just("put"), key, st.sampled_from(NUMELS), st.integers(-9, 9), st.sampled_from(TIERS)),
    st.tuples(st.just("get"), key),
    st.tuples(st.just("pin"), key, st.sampled_from([None, "host"])),
    st.tuples(st.just("evict"), key, st.sampled_from(["host", "nvme"])),
    st.tuples(st.just("prefetch"), st.lists(key, max_size=4, unique=True), st.booleans()),
    st.tuples(st.just("retire"), key),
    st.tuples(st.just("delete"), key),
    st.tuples(
        st.just("flush"),
    ),
    st.tuples(
        st.just("reopen"),
    ),
)


def footprint(numel: int) -> int:
    return max(PAGE, -(-numel * 4 // PAGE) * PAGE)


def check_budget(store: TieredStore) -> None:
    host = store.stats()["host"]
    assert host["in_use"] <= BUDGET and host["peak"] <= BUDGET, host


@pytest.mark.parametrize("policy", ["lru", "scan"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=st.lists(ops, max_size=25))
def test_store_matches_dict(policy, program):
    folder = tempfile.mkdtemp(prefix="tiered-prop-")
    model: dict[str, torch.Tensor] = {}
    open_store = lambda: TieredStore(folder, host_budget=BUDGET, io=CFG, policy=policy, stream_reserve=PAGE)
    s = open_store()
    try:
        for op in program:
            name, args = op[0], op[1:]
            if name == "put":
                k, numel, fill, tier = args
                t = torch.arange(numel, dtype=torch.float32) + fill
                if tier == "host" and footprint(numel) > BUDGET:
                    with pytest.raises(ValueError, match="exceeds host_budget"):
                        s.put(k, t, tier=tier)
                else:
                    s.put(k, t, tier=tier)
                    model[k] = t.clone()
            elif name in ("get", "pin", "evict", "retire", "delete") and args[0] not in model:
                call = (lambda k: s.pin(k).__enter__()) if name == "pin" else getattr(s, name)  # noqa: B023
                with pytest.raises(KeyError):
                    call(args[0])
            elif name == "get":
                assert torch.equal(s.get(args[0]), model[args[0]])
            elif name == "pin":
                k, tier = args
                if footprint(model[k].numel()) > BUDGET:
                    with pytest.raises(ValueError, match="larger than host_budget"):
                        with s.pin(k, tier=tier):
                            pass
                else:
                    with s.pin(k, tier=tier) as t:
                        assert torch.equal(t, model[k])
                        t.mul_(2).add_(1)
                        s.mark_dirty(k)
                    model[k] = model[k] * 2 + 1
            elif name == "evict":
                s.evict(*args).result()
                assert s.info(args[0]).tier in (("host", "nvme") if args[1] == "host" else ("nvme",))
            elif name == "prefetch":
                keys, wait = args
                if all(k in model for k in keys):
                    futs = s.prefetch(keys)
                    assert len(futs) <= len(keys)
                    if wait:
                        for f in futs:
                            f.result()
                else:
                    with pytest.raises(KeyError):
                        s.prefetch(keys)
            elif name == "retire":
                fut = s.retire(args[0])
                if fut is not None:
                    fut.result()
            elif name == "delete":
                s.delete(args[0])
                del model[args[0]]
            elif name == "flush":
                s.flush()
                assert not any(s.info(k).dirty for k in model)
            elif name == "reopen":
                s.close()
                s = open_store()
            check_budget(s)
            assert sorted(s.keys()) == sorted(model)
        for k, v in model.items():
            assert torch.equal(s.get(k), v), k
        check_budget(s)
    finally:
        s.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("policy", ["lru", "scan"])
def test_threads_on_disjoint_keys_share_one_budget(tmp_path, policy):
    """Four threads drive their own keys at once: the shared budget, queue and mover must stay consistent."""
    import random
    import threading

    budget = 6 * PAGE
    s = TieredStore(tmp_path, host_budget=budget, io=CFG, policy=policy, stream_reserve=2 * PAGE)
    errors: list[BaseException] = []
    models: list[dict[str, torch.Tensor]] = [{} for _ in range(4)]

    def worker(w: int) -> None:
        rng = random.Random(w)
        keys, model = [f"w{w}.{i}" for i in range(3)], models[w]
        try:
            for _ in range(60):
                k, op = rng.choice(keys), rng.random()
                if op < 0.2 or k not in model:
                    model[k] = torch.arange(rng.choice([1, 1024, 2000]), dtype=torch.float32) + rng.random()
                    s.put(k, model[k], tier=rng.choice(TIERS))
                elif op < 0.45:
                    with s.pin(k) as t:
                        t.add_(1)
                        s.mark_dirty(k)
                    model[k] = model[k] + 1
                    s.retire(k)
                elif op < 0.6:
                    s.prefetch([k for k in keys if k in model])
                elif op < 0.75:
                    s.evict(k)
                elif op < 0.9:
                    assert torch.equal(s.get(k), model[k]), k
                else:
                    s.delete(k)
                    del model[k]
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        assert not any(t.is_alive() for t in threads), "a worker hangs: deadlock"
        assert not errors, errors
        assert s.stats()["host"]["peak"] <= budget
        s.flush()
        for model in models:
            for k, v in model.items():
                assert torch.equal(s.get(k), v), k
    finally:
        s.close()
