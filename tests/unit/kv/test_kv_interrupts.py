"""TieredCache under Ctrl-C, as a scheduler meets it: a press during ``swap_out``, ``swap_in`` or ``free``.

Each press is a real SIGINT (Python raises ``KeyboardInterrupt`` in the main thread), made at a fixed point of the
call: while it waits for the store (nothing changed yet: the press stops it there) or while it changes the sequence
(the press comes once the change is whole). Either way the call raises ``KeyboardInterrupt``, the sequence is
either as it was or as the call makes it, and decoding on gives ``DynamicCache``'s logits bit for bit; no record is
left behind and a freed id can be used again. Tiny Llama from a config, nothing downloaded.
"""

from __future__ import annotations

import signal

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiered.kv import TieredCache, cache_kwargs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
PROMPT = torch.randint(1, 96, (1, 21), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def cache_for(model, tmp_path, prefetch: int, **kw) -> TieredCache:
    opts = {"gpu_budget": 1, "host_budget": "64KiB", "page_tokens": 8, **kw}  # layers streamed
    return TieredCache(model.config, tmp_path, prefetch=prefetch, **opts)


@torch.no_grad()
def logits_of(model, cache, seq: int | None = None, steps: int = 8, between=None) -> torch.Tensor:
    """Greedy over PROMPT in sequence ``seq`` (``select``ed each step; None: the cache's batch), each step's last
    logits; ``between(i, cache)`` after step i."""
    out, cur = [], PROMPT
    for i in range(steps):
        if seq is not None:
            cache.select([seq])
        logits = model(input_ids=cur, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
        out.append(logits)
        cur = logits.argmax(-1, keepdim=True)
        if between is not None:
            between(i, cache)
    return torch.stack(out)


@pytest.fixture(scope="module")
def want(model) -> torch.Tensor:
    return logits_of(model, DynamicCache(config=model.config))


def press() -> None:
    signal.raise_signal(signal.SIGINT)  # Python raises KeyboardInterrupt at the next bytecode, in this thread


def press_at(obj, name: str, *, after: bool, nth: int = 1):
    """A Ctrl-C at the ``nth`` call of ``obj.name`` from now, before it runs or once it has run; returns the undo."""
    real, n = getattr(obj, name), [0]

    def wrapper(*args, **kwargs):
        n[0] += 1
        if n[0] == nth and not after:
            press()
        out = real(*args, **kwargs)
        if n[0] == nth and after:
            press()
        return out

    setattr(obj, name, wrapper)
    return lambda: delattr(obj, name)


class PressedSet(set):
    """The cache's set of swapped-out sequences, a Ctrl-C pressed as it is changed: in the middle of the call's
    change to the sequence."""

    def add(self, seq) -> None:
        press()
        super().add(seq)

    def discard(self, seq) -> None:
        press()
        super().discard(seq)


def pressed_in_the_change(cache: TieredCache):
    cache._swapped = PressedSet(cache._swapped)
    return lambda: setattr(cache, "_swapped", set(cache._swapped))


def page_keys(cache: TieredCache) -> set[str]:
    """The records a cache whose sequences are all on the device holds: their full pages."""
    return {p.key for slots in cache._slots.values() for s in slots for p in s.pages}


# (call, where the Ctrl-C lands, whether the call then took effect)
SWAPS = [
    ("swap_out", "as the second tail is stored", False),  # waiting for the store: stops the call there
    ("swap_out", "as it is marked swapped out", True),  # the tails dropped: they were dropped, the sequence unmarked
    ("swap_in", "as the first tail is read", False),  # reading (NVMe, a disk that stalls): stops the call there
    ("swap_in", "as the first tail's record is deleted", True),  # the sequence was lost: marked swapped, tails gone
    ("swap_in", "as it is marked back", True),  # the same, one step later
]


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("call, where, done", SWAPS, ids=[f"{c} {w}" for c, w, _ in SWAPS])
def test_a_ctrl_c_during_a_swap_leaves_the_sequence_swapped_or_not_never_between(model, want, tmp_path, prefetch,
                                                                                  call, where, done):  # fmt: skip
    points = {
        "as the second tail is stored": lambda c: press_at(c._store, "put", after=False, nth=2),
        "as the first tail is read": lambda c: press_at(c._store, "get", after=False),
        "as the first tail's record is deleted": lambda c: press_at(c._store, "delete", after=True),
    }

    def preempt(i, cache):
        if i != 2:
            return
        if call == "swap_in":
            cache.swap_out(0)
        undo = points.get(where, pressed_in_the_change)(cache)
        try:
            with pytest.raises(KeyboardInterrupt):
                getattr(cache, call)(0)
        finally:
            undo()
        assert cache.is_swapped(0) == ((call == "swap_out") == done)
        if cache.is_swapped(0):  # the scheduler's way on
            cache.swap_in(0)

    with cache_for(model, tmp_path, prefetch) as cache:
        got = logits_of(model, cache, between=preempt)
        cache.stats()  # the page writes in flight landed
        assert set(cache._store.keys()) == page_keys(cache)  # no tail record left behind
    assert torch.equal(got, want)


FREES = [
    ("as the window settles", False),  # waiting for loads and writes in flight: stops the call there
    ("as its pages are forgotten", True),  # its records stayed for good, and a swapped-out id could not be reused
    ("as its first record is deleted", True),
    ("as it is unmarked", True),
]


@pytest.mark.parametrize("swapped", [False, True])
@pytest.mark.parametrize("where, done", FREES, ids=[w for w, _ in FREES])
def test_a_ctrl_c_during_free_forgets_the_sequence_whole_or_not_at_all(model, want, tmp_path, swapped, where, done):
    with cache_for(model, tmp_path, 2) as cache:
        logits_of(model, cache, seq=0, steps=3)
        if swapped:
            cache.swap_out(0)
        undo = {
            "as the window settles": lambda c: press_at(c._win, "settle", after=False),
            "as its pages are forgotten": lambda c: press_at(c._win.writes, "forget", after=True),
            "as its first record is deleted": lambda c: press_at(c._store, "delete", after=True),
            "as it is unmarked": pressed_in_the_change,
        }[where](cache)
        try:
            with pytest.raises(KeyboardInterrupt):
                cache.free(0)
        finally:
            undo()
        assert (0 in cache.sequences) != done
        if not done:
            assert cache.is_swapped(0) == swapped
            cache.free(0)
        logits_of(model, cache, seq=5, steps=1)  # another request goes on
        assert not [k for k in cache._store.keys() if k.startswith("kv/s0/")]  # nothing of sequence 0 is left
        got = logits_of(model, cache, seq=0)  # and its id serves a new request
    assert torch.equal(got, want)


class PressedInTheWait:
    """A load's future whose first wait is where the user presses Ctrl-C (its pages read from a disk that stalls)."""

    def __init__(self, fut) -> None:
        self.fut, self.pressed = fut, False

    def result(self, timeout=None):
        if not self.pressed:
            self.pressed = True
            press()
        return self.fut.result(timeout)

    def done(self) -> bool:
        return self.fut.done()

    def exception(self, timeout=None):
        return self.fut.exception(timeout)


def press_in_a_loads_wait(cache: TieredCache) -> None:
    """A Ctrl-C in the first wait for one of the loads the last forward issued ahead for the next one's first
    layers, of pages read through the store (on the mover)."""
    loads = [ld for ld in cache._win._pending.values() if ld.future is not None]
    assert loads, "no load through the store is under way: the test would prove nothing"
    loads[0].future = PressedInTheWait(loads[0].future)


def streaming(model, tmp_path) -> TieredCache:
    return cache_for(model, tmp_path, 2, host_budget="16KiB", page_tokens=4)  # pages read from NVMe, ahead


def test_a_ctrl_c_while_a_swap_waits_for_a_load_nobody_uses_reaches_the_caller(model, want, tmp_path):
    # swap_out first drops the loads issued ahead, waiting for their copies: a Ctrl-C in that wait (a disk that
    # stalls) was swallowed, the call going on as if nothing had been pressed. Now it stops the call, which has
    # changed nothing; the load stays under way until the next call waits for it.
    def preempt(i, cache):
        if i == 2:
            press_in_a_loads_wait(cache)
            with pytest.raises(KeyboardInterrupt):
                cache.swap_out(0)
            assert not cache.is_swapped(0)
            cache.swap_out(0)
            cache.swap_in(0)

    with streaming(model, tmp_path) as cache:
        got = logits_of(model, cache, seq=0, between=preempt)
    assert torch.equal(got, want)


def test_a_ctrl_c_while_a_forward_drops_the_loads_issued_for_another_batch_reaches_the_caller(model, want, tmp_path):
    # A scheduler's next forward runs other sequences: its first layer drops the loads issued for the last batch,
    # waiting for them. A Ctrl-C there was swallowed too; now the forward raises it, taken back, and runs again.
    def other_request(i, cache):
        if i == 2:
            press_in_a_loads_wait(cache)
            cache.select([1])
            with pytest.raises(KeyboardInterrupt), torch.no_grad():
                model(input_ids=PROMPT, past_key_values=cache, use_cache=True)
            assert cache.sequences == [0]
            assert torch.equal(logits_of(model, cache, seq=1, steps=1), want[:1])

    with streaming(model, tmp_path) as cache:
        got = logits_of(model, cache, seq=0, between=other_request)
    assert torch.equal(got, want)


def test_a_ctrl_c_while_a_layer_waits_for_its_load_stops_the_forward_which_runs_again(model, want, tmp_path):
    # The next forward's first layer waits for the load issued for it: a Ctrl-C there stops the forward, which is
    # taken back; the load stays known until waited for (its copies write into the block the layer reads).
    def pressed_step(i, cache):
        if i == 2:
            press_in_a_loads_wait(cache)
            with pytest.raises(KeyboardInterrupt), torch.no_grad():
                model(input_ids=want[i].argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
            assert cache.seq_length(0) == PROMPT.shape[1] + i

    with streaming(model, tmp_path) as cache:
        got = logits_of(model, cache, seq=0, between=pressed_step)
    assert torch.equal(got, want)


def test_a_ctrl_c_while_the_cache_holds_hundreds_of_pages_raises_keyboard_interrupt(model, tmp_path):
    # The cache holds each full page the store keeps in host memory pinned while it is open (a pin block each, its
    # handler installed on the last one's): with some hundreds of them (512 for one 4K-token request on an 8B Llama)
    # a Ctrl-C between two calls raised RecursionError, not KeyboardInterrupt.
    prompt = torch.randint(1, 96, (1, 160), generator=torch.Generator().manual_seed(5))
    with cache_for(model, tmp_path, 0, page_tokens=1, host_budget="16MiB") as cache, torch.no_grad():
        model(input_ids=prompt, **cache_kwargs(model, cache), use_cache=True)
        cache.stats()  # the writes landed: their pages held
        held = sum(p.hold is not None for slots in cache._slots.values() for s in slots for p in s.pages)
        assert held >= 600
        with pytest.raises(KeyboardInterrupt):
            press()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
