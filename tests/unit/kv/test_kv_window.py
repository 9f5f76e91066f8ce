"""The window under ``gpu_budget`` (tiered/kv/window.py): what it holds stays within the budget, never below the
tails and the ring a pass needs, and the tokens stay ``DynamicCache``'s.

The ring goes, or shrinks, once the long sequence that needed it is freed; the device copies of pages whose
writes are in flight count against the budget. Tiny Llama from a config, nothing downloaded.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import run_bounded

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiered.kv import TieredCache  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
BOUND = 300.0  # seconds: only reached when something hangs, on a loaded machine
PAGE = 8 * 2 * 2 * 16 * 4  # bytes of a page: 8 tokens x keys and values x 2 kv heads x 16 x fp32


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, cache, new):
    return run_bounded(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                              max_new_tokens=new, do_sample=False, pad_token_id=0), BOUND)  # fmt: skip


def floor(cache: TieredCache, length: int) -> int:
    """What the window holds at least, whatever the budget, for one sequence of ``length`` tokens that streams:
    its tails and a ring sized for it."""
    lay = cache.layout
    return (lay.layers + (cache.prefetch_layers + 1) * lay.pages(lay.room(length))) * PAGE


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("short", [20, 100])  # fits the budget alone / streams alone, through a smaller ring
def test_the_ring_goes_once_the_long_sequence_it_was_sized_for_is_freed(model, tmp_path, prefetch, short):
    """A long request streams through the ring, finishes and is freed; a short one decodes on alone. Its window
    was 2.8x to 7.6x gpu_budget for good: the ring kept the long one's size until every sequence was swapped out.
    Now the ring goes at the next pass where no layer streams, and shrinks where a smaller one will do, without
    being made again from token to token."""
    budget = 80000  # 39 pages: the short one alone fits it (20 tokens) or streams (100)
    b = prompt(short, 2)
    ref = greedy(model, b, DynamicCache(config=model.config), new=11)
    with TieredCache(model.config, tmp_path, page_tokens=8, host_budget="4MiB", gpu_budget=budget,
                     prefetch=prefetch) as cache:  # fmt: skip
        cache.select([1])
        out = greedy(model, b, cache, new=2)
        cache.select([0])
        greedy(model, prompt(600, 1), cache, new=2)  # the long one streams, through blocks of 94 pages
        assert max(t.shape[1] for t in cache._win._ring if t is not None) > 90
        cache.free(0)
        cache.select([1])
        rings, windows = [], []
        for _ in range(3):
            out = greedy(model, out, cache, new=3)
            rings.append([t for t in cache._win._ring if t is not None])
            windows.append(cache.stats()["window_bytes"])
        assert torch.equal(out, ref)
        length = cache.seq_length(1)
        assert max(windows) <= max(budget, floor(cache, length)), windows
        if short == 20:
            assert rings == [[], [], []] and cache.stats()["resident"] == 4
        else:
            assert len(rings[0]) == prefetch + 1
            assert all(t.shape[1] <= cache.layout.pages(cache.layout.room(length)) for t in rings[-1])
            assert all(a is b for a, b in zip(rings[0], rings[-1]))  # made once, not from token to token


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("place", ["resident", "streaming"])
def test_page_writes_in_flight_stay_within_gpu_budget(model, tmp_path, prefetch, place):
    """With prefetch, each filled page's device copy waited for its write until the next forward began: a
    600-token prefill peaked at 1.73x a budget sized to hold every layer. The copies now count against the budget
    (the oldest write waited for past it), and those whose writes finished go during the pass, but for the two
    layers' pages the writes keep in flight whatever the budget. The writes are slowed here so that they are still
    in flight when the pass moves on."""
    ids = prompt(300, 3)
    ref = greedy(model, ids, DynamicCache(config=model.config), new=6)
    with TieredCache(model.config, tmp_path, page_tokens=8, host_budget="4MiB", prefetch=prefetch) as probe:
        budget = probe.layout.window_bytes([306], 4) if place == "resident" else 64 * PAGE
        least = floor(probe, 306)
    writes = 2 * (300 // 8) * PAGE  # the floor of the writes in flight: the pages two layers' updates fill
    with TieredCache(model.config, tmp_path, page_tokens=8, host_budget="4MiB", gpu_budget=budget,
                     prefetch=prefetch) as cache:  # fmt: skip
        real_put, real_consumed, held = cache._store.put, cache._win.consumed, []

        def put(*args, **kwargs):
            time.sleep(0.002)
            return real_put(*args, **kwargs)

        def consumed():  # after each layer's update: its pages filled and submitted
            real_consumed()
            held.append(cache._win.bytes_held())

        cache._store.put = put  # type: ignore[method-assign]
        cache._win.consumed = consumed  # type: ignore[method-assign]
        out = greedy(model, ids, cache, new=6)
        st = cache.stats()
    assert torch.equal(out, ref)
    assert (st["resident"] == 4) == (place == "resident")
    assert max(held) <= max(budget, least) + writes, (max(held), budget)
    assert st["window_peak"] <= max(budget, least) + writes


def test_page_writes_stay_in_flight_under_a_budget_that_only_streams(model, tmp_path):
    """gpu_budget=0 (every layer streams: tiered-bench kv's default) left the writes in flight no room at all, so
    each layer's page writes were waited for as they were submitted, on the caller's thread, and never overlapped
    the forward. They now keep the floor the window documents: the pages two layers' updates fill, so a layer's
    writes run during the next layer's compute, and the caller waits for a layer's writes only two layers on. The
    store writes here only the pages the caller waits for, so what stays in flight does not depend on timing."""
    ids = prompt(100, 4)  # 12 pages a layer
    ref = greedy(model, ids, DynamicCache(config=model.config), new=4)
    go = threading.Semaphore(0)  # a page write each
    with TieredCache(model.config, tmp_path, page_tokens=8, host_budget="4MiB", gpu_budget=0, prefetch=2) as cache:
        w = cache._win.writes
        real_put, real_cap, real_submit, real_consumed = cache._store.put, w._cap, w.submit, cache._win.consumed
        flight, waits, held = [], [], []

        def put(*args, **kwargs):
            assert go.acquire(timeout=BOUND)
            return real_put(*args, **kwargs)

        def cap():
            if w._in_flight > w.limit and w._writes:
                waits.append(w._in_flight)
                over, batches = w._in_flight - w.limit, []  # the writes of a layer share one future
                for page in w._writes:
                    if over <= 0 and page.write is not batches[-1]:
                        break
                    over -= page.fresh.numel() * page.fresh.element_size()
                    batches.append(page.write)
                go.release(len(batches))
            real_cap()

        def submit(pages):
            real_submit(pages)
            flight.append(w._in_flight)

        def consumed():
            real_consumed()
            held.append(cache._win.bytes_held())

        cache._store.put = put  # type: ignore[method-assign]
        w._cap, w.submit, cache._win.consumed = cap, submit, consumed  # type: ignore[method-assign]
        out = greedy(model, ids, cache, new=1)  # the prefill alone
        go.release(10**6)
        w._cap = real_cap  # type: ignore[method-assign]
        out = greedy(model, out, cache, new=3)
        least = floor(cache, 104)
    assert torch.equal(out, ref)
    layer = 12 * PAGE
    assert flight == [layer, 2 * layer, 2 * layer, 2 * layer], flight
    assert waits == [3 * layer, 3 * layer], waits  # layers 2 and 3 waited for layer 0's and 1's writes
    assert max(held) <= least + 2 * layer, (max(held), least)
