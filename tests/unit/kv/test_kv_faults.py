"""TieredCache under misuse and faults, as a scheduler meets them: a swap or free during a forward, a swap or a page
write that fails part-way, a selection emptied, close() from another thread, inference mode, grad mode, deepcopy.

Each ends in the tokens of ``DynamicCache`` or in an error that names the fix, never in silently wrong tokens, a
cache that refuses everything after one error, or a hang. Tiny Llama from a config, nothing downloaded.
"""

from __future__ import annotations

import copy
import errno
import io
import pickle
import warnings

import pytest
import torch
from helpers import run_bounded

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiered.kv import TieredCache, cache_kwargs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
BOUND = 300.0  # seconds: only reached when something hangs, on a loaded machine
PROMPT = torch.randint(1, 96, (1, 21), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def cache_for(model, tmp_path, prefetch: int, **kw) -> TieredCache:
    opts = {"gpu_budget": 1, "host_budget": "64KiB", "page_tokens": 8, **kw}  # pages on NVMe, layers streamed
    return TieredCache(model.config, tmp_path, prefetch=prefetch, **opts)


@torch.no_grad()
def step(model, cache, cur: torch.Tensor) -> torch.Tensor:
    return model(input_ids=cur, **cache_kwargs(model, cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)


def decode(model, cache, steps: int = 8, between=None) -> torch.Tensor:
    """Greedy over PROMPT; ``between(i, cache)`` after step i."""
    toks, cur = [], PROMPT
    for i in range(steps):
        cur = step(model, cache, cur)
        toks.append(cur)
        if between is not None:
            between(i, cache)
    return torch.cat(toks, 1)


@pytest.fixture(scope="module")
def want(model) -> torch.Tensor:
    return decode(model, DynamicCache(config=model.config))


def failing_put(cache: TieredCache, at: int):
    """Make the cache's store put fail once, at its ``at``-th call from now (ENOSPC); returns the undo."""
    real, n = cache._store.put, [0]

    def put(*args, **kwargs):
        n[0] += 1
        if n[0] == at:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(*args, **kwargs)

    cache._store.put = put  # type: ignore[method-assign]
    return lambda: setattr(cache._store, "put", real)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_swap_out_during_the_sequences_forward_is_refused(model, want, tmp_path, prefetch):
    # A scheduler preempting mid-step (here a pre-hook of layer 2): the rest of the pass would append into fresh
    # zero tails, and the sequence decoded wrong tokens after swap_in, with every checksum passing.
    refused = []

    def hook(*_):
        if not refused:
            with pytest.raises(ValueError, match=r"swap_out\(0\): sequence 0 is in a forward pass .* layer 2 of 4"):
                cache.swap_out(0)
            refused.append(True)

    handle = model.model.layers[2].register_forward_pre_hook(hook)
    try:
        with cache_for(model, tmp_path, prefetch) as cache:
            got = run_bounded(lambda: decode(model, cache), BOUND)
    finally:
        handle.remove()
    assert refused and torch.equal(got, want)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_swap_out_that_fails_part_way_leaves_the_sequence_as_it_was(model, want, tmp_path, prefetch):
    # The third layer's tail store fails (a full disk): the layers before had dropped their tails, the sequence was
    # not marked swapped, and decoding it went on with zeros where its last tokens were.
    def preempt(i, cache):
        if i == 2:
            undo = failing_put(cache, 3)
            try:
                with pytest.raises(OSError, match="No space left"):
                    cache.swap_out(0)
            finally:
                undo()
            assert not cache.is_swapped(0)
        if i == 4:  # and a later swap, whole this time, still round-trips
            cache.swap_out(0)
            cache.swap_in(0)

    with cache_for(model, tmp_path, prefetch, gpu_budget=None) as cache:
        got = run_bounded(lambda: decode(model, cache, between=preempt), BOUND)
    assert torch.equal(got, want)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_failed_page_write_raises_once_and_the_forward_runs_again(model, want, tmp_path, prefetch):
    # One page write fails (on the mover thread with prefetch): it raised from every later forward, free, swap and
    # stats for ever. Now once, at the next forward's start, before it appended anything: run it again.
    failures = []

    def run():
        with cache_for(model, tmp_path, prefetch) as cache:
            undo = failing_put(cache, 5)
            toks, cur = [], PROMPT
            while len(toks) < 8:
                try:
                    cur = step(model, cache, cur)
                except OSError as e:
                    failures.append(e)
                    undo()
                    continue
                toks.append(cur)
            assert cache.stats()["swaps"]["out"] == 0  # stats, free and swaps work again
            cache.swap_out(0)
            cache.swap_in(0)
            return torch.cat(toks, 1)

    got = run_bounded(run, BOUND)
    assert len(failures) == 1 and torch.equal(got, want)


def full_disk(cache: TieredCache, calls: int):
    """The cache's store put fails with ENOSPC for its next ``calls`` calls, as on a full disk, and with prefetch a
    write that failed after the first failure reads as still in flight (``done()`` False) until the disk is freed,
    as a write queued behind the first on a slow disk. Returns ``free()``, which frees the disk."""
    real, left, first, freed = cache._store.put, [calls], [], [False]

    def put(key, *args, **kwargs):
        if left[0]:
            left[0] -= 1
            first.append(key)
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(key, *args, **kwargs)

    class Slow:
        def __init__(self, fut, keys):
            self._fut, self._keys = fut, keys

        def done(self):
            if not self._fut.done() or freed[0] or self._fut.exception() is None:
                return self._fut.done()
            return first[0] in self._keys  # the first failure has landed; the later ones are still "writing"

        def exception(self, timeout=None):
            return self._fut.exception(timeout)

        def result(self, timeout=None):
            return self._fut.result(timeout)

    mover = cache._win.mover
    if mover is not None:
        submit = mover.submit

        def slow_submit(fn, *args, **kwargs):
            fut = submit(fn, *args, **kwargs)
            return Slow(fut, {k for k, _ in args[0]}) if getattr(fn, "__name__", "") == "_write" else fut

        mover.submit = slow_submit  # type: ignore[method-assign]
    cache._store.put = put  # type: ignore[method-assign]

    def free():
        cache._store.put, freed[0] = real, True
        if mover is not None:
            mover.submit = submit  # type: ignore[method-assign]

    return free


@pytest.mark.parametrize("prefetch", [0, 2])
def test_after_a_full_disk_is_freed_the_forward_run_again_succeeds(model, want, tmp_path, prefetch):
    # The disk fills during a forward, so every layer's page write fails. The next forward raised the first layer's
    # failure; once the disk was freed, running it again raised a later layer's failure of the same forward, landed
    # only then ("the disk is full" with the disk free), and only the third try went on.
    failures = []

    def run():
        with cache_for(model, tmp_path, prefetch) as cache:
            toks, cur = [], PROMPT
            while len(toks) < 8:
                if len(toks) == 3 and not failures:
                    free = full_disk(cache, calls=4)  # this forward fills a page in each of the 4 layers
                try:
                    cur = step(model, cache, cur)
                except OSError as e:
                    failures.append(e)
                    free()
                    continue
                toks.append(cur)
            cache.swap_out(0)  # every page is in the store now: nothing failed is left to raise
            cache.swap_in(0)
            return torch.cat(toks, 1)

    got = run_bounded(run, BOUND)
    assert [e.errno for e in failures] == [errno.ENOSPC] and torch.equal(got, want)


def test_a_ctrl_c_while_the_next_forward_waits_for_a_page_write_loses_no_page():
    # Once a page write has failed, the next forward's settle waits for the writes still in flight. A Ctrl-C in that
    # wait dropped the awaited page from the writes in flight before it was known to have failed: it was never
    # written again (a swap_out then missed it in the store), and window_bytes no longer counted its device copy.
    import signal
    from concurrent.futures import Future

    from tiered.kv.pages import Page
    from tiered.kv.writes import PageWrites

    class PressedInTheWait(Future):
        pressed = False

        def exception(self, timeout=None):
            if not self.done() and not self.pressed:
                self.pressed = True
                signal.raise_signal(signal.SIGINT)  # Python raises KeyboardInterrupt here, in the main thread's wait
            return super().exception(timeout)

    class Mover:
        def __init__(self):
            self.futs, self.written = [], []

        def event(self):
            return None

        def submit(self, fn, jobs, after=None):
            self.written += [key for key, _ in jobs]
            self.futs.append(PressedInTheWait())
            return self.futs[-1]

    w = PageWrites(None)  # type: ignore[arg-type] # the mover stands in for the store
    w.mover = mover = Mover()  # type: ignore[assignment]
    w.submit([Page(0, "p1", torch.zeros(256))])
    w.submit([Page(1, "p2", torch.zeros(256))])
    mover.futs[0].set_exception(OSError(errno.ENOSPC, "No space left on device (injected)"))
    w.settle(wait=False, check=False)  # stats(): p1's failure landed, kept for the next forward
    with pytest.raises(KeyboardInterrupt):
        w.settle(wait=False)  # the next forward waits for p2's write: Ctrl-C
    assert w.nbytes == 2 * 1024
    mover.futs[1].set_exception(OSError(errno.ENOSPC, "No space left on device (injected)"))
    with pytest.raises(OSError, match="injected"):
        w.settle(wait=False)  # the forward once more: p1's failure, raised once
    mover.written.clear()
    w.settle(wait=False)  # and again, the disk freed: both pages are written again
    assert mover.written == ["p1", "p2"] and w.nbytes == 2 * 1024


def test_a_selection_emptied_by_swaps_refuses_the_next_forward(model, tmp_path):
    # select([1]) then swap_out(1): the selection fell back to "every sequence not swapped out", and a forward
    # meant for sequence 1 appended its token to sequence 0.
    with cache_for(model, tmp_path, 2) as cache:
        cache.select([0])
        step(model, cache, PROMPT)
        cache.select([1])
        step(model, cache, PROMPT)
        cache.swap_out(1)
        length = cache.seq_length(0)
        with pytest.raises(ValueError, match="no sequence is selected"):
            step(model, cache, PROMPT[:, :1])
        assert cache.seq_length(0) == length
        cache.select([0])
        step(model, cache, PROMPT[:, :1])
        assert cache.seq_length(0) == length + 1
        # A forward refused (rows of unequal lengths) leaves no sequence behind for the new id it named.
        cache.select([0, 5])
        with pytest.raises(ValueError, match="equally long"):
            step(model, cache, torch.cat([PROMPT[:, :1]] * 2))
        assert 5 not in cache.sequences and cache.seq_length(0) == length + 1


def test_free_or_close_during_a_forward_stop_it_by_name(model, tmp_path):
    def hook_doing(action):
        def hook(*_):
            if not done:
                done.append(True)
                action()

        return model.model.layers[2].register_forward_pre_hook(hook)

    with cache_for(model, tmp_path, 2) as cache:
        done: list[bool] = []
        handle = hook_doing(lambda: cache.free(0))
        try:
            with pytest.raises(ValueError, match=r"sequences \[0\] were freed during this forward pass, at layer 2"):
                step(model, cache, PROMPT)
        finally:
            handle.remove()
        assert decode(model, cache, steps=2).shape == (1, 2)  # a fresh sequence 0 runs
    cache = cache_for(model, tmp_path, 0)
    done = []
    # close() from another thread (a server shutting down) while the forward runs: it takes its turn between
    # layer updates, and the next update says the cache is closed (it had failed on a record it deleted).
    handle = hook_doing(lambda: run_bounded(cache.close, BOUND))
    try:
        with pytest.raises(RuntimeError, match="is closed"):
            step(model, cache, PROMPT)
    finally:
        handle.remove()
        cache.close()


def test_a_prefill_under_inference_mode_then_generate(model, tmp_path):
    # The cache's tails and blocks were inference tensors, which generate's later in-place writes (under no_grad)
    # refused.
    mask = torch.ones_like(PROMPT)

    def generate(cache):
        with torch.inference_mode():
            model(input_ids=PROMPT, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True)
        nxt = torch.cat([PROMPT, torch.tensor([[5]])], 1)
        return model.generate(nxt, attention_mask=torch.ones_like(nxt), past_key_values=cache, max_new_tokens=6,
                              do_sample=False, pad_token_id=0)  # fmt: skip

    ref = generate(DynamicCache(config=model.config))
    for prefetch in (0, 2):
        with cache_for(model, tmp_path, prefetch) as cache:
            assert torch.equal(run_bounded(lambda c=cache: generate(c), BOUND), ref)


def test_grad_mode_warns_once_that_no_gradient_flows_through(model, tmp_path):
    with cache_for(model, tmp_path, 0) as cache, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cur = PROMPT
        for _ in range(3):
            cur = model(input_ids=cur, **cache_kwargs(model, cache), use_cache=True).logits[:, -1:].argmax(-1)
        mine = [w for w in seen if "no gradient flows through the cache" in str(w.message)]
        assert len(mine) == 1
    with cache_for(model, tmp_path, 0) as cache, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step(model, cache, PROMPT)  # no_grad: nothing to say
        assert not [w for w in seen if "no gradient" in str(w.message)]


def test_deepcopy_and_pickle_are_refused_by_name(model, tmp_path):
    """deepcopy, pickle and torch.save (generate's outputs with return_dict_in_generate hold the cache) all say why
    and what to do, not "cannot pickle '_thread.RLock' object"; the cache goes on."""
    with cache_for(model, tmp_path, 2) as cache:
        out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), past_key_values=cache, max_new_tokens=2,
                             do_sample=False, pad_token_id=0, return_dict_in_generate=True)  # fmt: skip
        assert out.past_key_values is cache
        why = "cannot be pickled or deep-copied.*own sequence.*past_key_values"
        for how in (copy.deepcopy, copy.copy, pickle.dumps, lambda c: torch.save(out, io.BytesIO())):
            with pytest.raises(TypeError, match=why):
                how(cache)
        out["past_key_values"] = None  # as the error says: the rest of the outputs save
        torch.save(out, io.BytesIO())
        assert decode(model, cache, steps=1).shape == (1, 1)


@torch.no_grad()
def logits_of(model, cache, steps: int = 8, fail=None) -> tuple[torch.Tensor, list[Exception]]:
    """Greedy over PROMPT, each step's last logits; ``fail(i, cache)`` before step i may arm a fault. A step
    that raises is run again, as the errors say. Returns the logits and the errors met."""
    out, cur, errors = [], PROMPT, []
    while len(out) < steps:
        if fail is not None:
            fail(len(out), cache)
        try:
            logits = model(input_ids=cur, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
        except (OSError, ValueError, RuntimeError) as e:
            errors.append(e)
            if len(errors) > 3:  # a cache that refuses every retry
                raise
            continue
        out.append(logits)
        cur = logits.argmax(-1, keepdim=True)
    return torch.stack(out), errors


@pytest.fixture(scope="module")
def want_logits(model) -> torch.Tensor:
    return logits_of(model, DynamicCache(config=model.config))[0]


def fail_once(obj, name: str, when, error=lambda: OSError(errno.EIO, "Input/output error (injected)")) -> None:
    """``obj.name`` raises ``error()`` (an EIO) once, at the first call for which ``when(*args)`` is true."""
    real = getattr(obj, name)

    def wrapper(*args, **kwargs):
        if when(*args):
            setattr(obj, name, real)
            raise error()
        return real(*args, **kwargs)

    setattr(obj, name, wrapper)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("at_step", [0, 3, 5])  # the prefill (new sequence), a step that fills a page, one that not
@pytest.mark.parametrize("at_layer", [1, 3])
def test_a_forward_that_fails_part_way_runs_again_exactly(model, want_logits, tmp_path, prefetch, at_step, at_layer):
    # A load fails at layer k (a full disk, a damaged file) after layers 0..k-1 appended the step's tokens. The
    # error says to fix the cause and retry; the retry appended them a second time there, and the logits were
    # silently wrong from then on.
    def fail(i, cache):
        if i == at_step and not armed:
            armed.append(True)
            fail_once(cache._win, "install", lambda layer: layer == at_layer)

    armed: list[bool] = []
    with cache_for(model, tmp_path, prefetch) as cache:
        got, errors = run_bounded(lambda: logits_of(model, cache, fail=fail), BOUND)
        lengths = {s.length for s in cache._slots[0]}
    assert [type(e) for e in errors] == [OSError] and lengths == {PROMPT.shape[1] + 7}
    assert torch.equal(got, want_logits)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_forward_whose_page_read_fails_runs_again_exactly(model, want_logits, tmp_path, prefetch):
    # The same through the store: reading a page of the last layer from NVMe fails once (as an IntegrityError).
    def fail(i, cache):
        if i == 4 and not armed:
            armed.append(True)
            fail_once(cache._store, "pin", lambda key, *_: "/l3/" in key)

    armed: list[bool] = []
    with cache_for(model, tmp_path, prefetch, host_budget="16KiB", page_tokens=4) as cache:
        got, errors = run_bounded(lambda: logits_of(model, cache, fail=fail), BOUND)
        assert cache.stats()["store"]["nvme"]["bytes_read"] > 0  # pages were read from NVMe
    assert [type(e) for e in errors] == [OSError] and torch.equal(got, want_logits)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_forward_that_raises_in_the_model_is_taken_back(model, want_logits, tmp_path, prefetch):
    # The model raises before layer 2 (not in the cache, which cannot see it): the retry, whose positions came from
    # layer 0's length, then holding the broken forward's token, gave wrong logits. Now the next forward takes the
    # broken one back and asks to be run again; the one after is exact.
    def hook(*_):
        if armed == [True]:
            armed.append(True)
            raise RuntimeError("injected")

    def fail(i, cache):
        if i == 3 and not armed:
            armed.append(True)

    armed: list[bool] = []
    handle = model.model.layers[2].register_forward_pre_hook(hook)
    try:
        with cache_for(model, tmp_path, prefetch) as cache:
            got, errors = run_bounded(lambda: logits_of(model, cache, fail=fail), BOUND)
            cache.swap_out(0)  # between forwards again
    finally:
        handle.remove()
    assert [type(e) for e in errors] == [RuntimeError, ValueError]
    assert "stopped after 2 of the 4 layers" in str(errors[1]) and "run it again now" in str(errors[1])
    assert torch.equal(got, want_logits)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_forward_that_raises_after_its_last_layer_keeps_its_tokens(model, tmp_path, prefetch):
    # README promised that every forward that raised in the model is taken back by the next. Not one that raised
    # after its last layer stored its keys and values (here an out-of-memory on the logits, in lm_head): it ran
    # every layer, its tokens stay, as in DynamicCache, and the cache cannot tell that forward run again from the
    # next one (the positions come from its length either way): run again, it stores them twice, unsaid. README
    # now says so, and gives the recovery, free(seq) and recomputing the sequence, which is exact.
    @torch.no_grad()
    def logits(cache, x: torch.Tensor) -> torch.Tensor:
        return model(input_ids=x, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]

    def recompute(cache, ids: torch.Tensor) -> torch.Tensor:  # the whole sequence again, then on greedily
        out = [logits(cache, ids)]
        for _ in range(3):
            out.append(logits(cache, out[-1].argmax(-1, keepdim=True)))
        return torch.stack(out)

    def oom(*_):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    def broken(cache) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        toks = [PROMPT]
        for _ in range(3):
            toks.append(logits(cache, toks[-1]).argmax(-1, keepdim=True))
        handle = model.lm_head.register_forward_hook(oom)
        try:
            with pytest.raises(torch.OutOfMemoryError):
                logits(cache, toks[-1])
        finally:
            handle.remove()
        kept = cache.seq_length(0)
        logits(cache, toks[-1])  # not refused: to the cache it is the next token
        twice = cache.seq_length(0)
        cache.free(0)
        ids = torch.cat(toks, 1)
        return kept, twice, ids, recompute(cache, ids)

    with cache_for(model, tmp_path, prefetch) as cache:
        kept, twice, ids, got = run_bounded(lambda: broken(cache), BOUND)
    assert (kept, twice) == (PROMPT.shape[1] + 3, PROMPT.shape[1] + 4)
    assert torch.equal(got, recompute(DynamicCache(config=model.config), ids))


@pytest.mark.parametrize("failures", [1, 2])
def test_after_a_forward_that_raised_in_the_model_other_sequences_go_on(tmp_path, failures):
    # A forward over sequences 0 and 1 raises in the model; the next runs sequence 2, which it never touched, so
    # its positions are right: it runs, exact, where it was refused ("run it again"). The broken forward is taken
    # back all the same: run again, it gives the logits of a run where it never failed. Twice (sequence 2's
    # forward raises at the same layer too): not taken for a model of fewer layers, as whole passes ran before.
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(1, 96, (3, 9), generator=torch.Generator().manual_seed(3))

    def boom(*_):
        raise RuntimeError("injected")

    def run(fail: bool) -> tuple[torch.Tensor, torch.Tensor]:
        with TieredCache(model.config, tmp_path, gpu_budget=1, host_budget="48KiB", page_tokens=4) as cache:
            fwd = lambda rows, x: model(x, past_key_values=cache, use_cache=True).logits  # noqa: E731
            with torch.no_grad():
                cache.select([0, 1])
                fwd([0, 1], ids[:2])
                cache.select([2])
                fwd([2], ids[2:])
                if fail:
                    handle = model.model.layers[2].register_forward_pre_hook(boom)
                    cache.select([0, 1])
                    with pytest.raises(RuntimeError, match="injected"):
                        fwd([0, 1], ids[:2, :1])
                    if failures == 2:
                        cache.select([2])
                        with pytest.raises(RuntimeError, match="injected"):
                            fwd([2], ids[2:, :1])
                    handle.remove()
                out = {}
                # first the sequences the last failed forward did not run: they go on
                for rows in [[2], [0, 1]] if failures == 1 else [[0, 1], [2]]:
                    cache.select(rows)
                    out[rows[0]] = fwd(rows, ids[rows[0] : rows[-1] + 1, :1])
        return out[2], out[0]

    want, got = run(False), run(True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_model_with_other_layers_than_the_config_is_named(tmp_path):
    # More layers: a bare IndexError from transformers. Fewer: generate ran, and the cache took itself to be in a
    # pass for good (swap_out refused, naming a forward that was not running).
    def llama(layers):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        return LlamaForCausalLM(cfg).eval()

    small, big = llama(2), llama(3)
    with TieredCache(small.config, tmp_path, page_tokens=4) as cache:
        with pytest.raises(ValueError, match=r"updated layer 2, .* config of 2 layers .* TieredCache\(model.config"):
            step(big, cache, PROMPT)
    with TieredCache(big.config, tmp_path, page_tokens=4) as cache:
        cur = step(small, cache, PROMPT)
        with pytest.raises(ValueError, match=r"stopped after 2 of the 3 layers .* If the model has 2 layers"):
            step(small, cache, cur)
        with pytest.raises(ValueError, match=r"keep stopping after 2 of the 3 layers .*: the model has 2 layers"):
            step(small, cache, PROMPT)
            step(small, cache, cur)
    with TieredCache(big.config, tmp_path, page_tokens=4) as cache:  # a server, each forward another request
        for seq in (0, 1):
            cache.select([seq])
            cur = step(small, cache, PROMPT)
        cache.select([0])
        with pytest.raises(ValueError, match=r"keep stopping after 2 of the 3 layers .*: the model has 2 layers"):
            step(small, cache, cur)


def llama_of(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def last_logits(m, cache, x: torch.Tensor) -> torch.Tensor:
    return m(input_ids=x, **cache_kwargs(m, cache), use_cache=True).logits[:, -1]


REFUSED = r"updated layer 2, .* config of 2 layers .* TieredCache\(model.config"  # a model of 3, a config of 2


@pytest.mark.parametrize(("prefetch", "gpu_budget"), [(0, 1), (2, 1), (2, None)])  # streamed, or all resident
def test_a_forward_refused_for_a_config_of_fewer_layers_leaves_the_cache_as_before(tmp_path, prefetch, gpu_budget):
    # A model of 3 layers updates layer 2 of a cache built from a config of 2: refused by name, but after layers 0
    # and 1 had stored the forward's tokens, which were not taken back as every other forward that raises part-way
    # is. Each retry added more, and the third generate failed with an unrelated transformers error (a reshape of 0
    # elements). Now each is refused alike and leaves the cache as it was: empty, or as the last whole forward left
    # it, down to the partial page the refused token filled (the decoding goes on exact).
    def decode(cache, refuse_at=None) -> torch.Tensor:
        out, cur = [], PROMPT
        for i in range(6):
            if i == refuse_at:
                with pytest.raises(ValueError, match=named):
                    last_logits(big, cache, cur)
                assert [s.length for s in cache._slots[0]] == [PROMPT.shape[1] + i - 1] * 2
            out.append(last_logits(small, cache, cur))
            cur = out[-1].argmax(-1, keepdim=True)
        return torch.stack(out)

    small, big = llama_of(2), llama_of(3)
    named = REFUSED
    assert (PROMPT.shape[1] + 2) % 4 == 3  # the refused forward's token fills a page
    with TieredCache(small.config, tmp_path, gpu_budget=gpu_budget, host_budget="64KiB", page_tokens=4,
                     prefetch=prefetch) as cache:  # fmt: skip
        for _ in range(3):
            with pytest.raises(ValueError, match=named):
                run_bounded(lambda: big.generate(PROMPT, past_key_values=cache, max_new_tokens=2, pad_token_id=0),
                            BOUND)  # fmt: skip
            assert cache.sequences == [] and cache.get_seq_length() == 0
        got = run_bounded(lambda: decode(cache, refuse_at=3), BOUND)
    assert torch.equal(got, decode(DynamicCache(config=small.config)))


def press_in_the_take_back(cache) -> None:
    """The cache's next wait for its loads and writes in flight (a take-back's) raises KeyboardInterrupt, as Python
    raises it there."""
    fail_once(cache._win, "settle", lambda *_: True, KeyboardInterrupt)


def run_with_layer_2_hook(small, big, hook, tmp_path, prefetch: int, run):
    """``run(cache)`` over a cache built from ``small``'s 2-layer config, bounded, with ``hook(cache)`` called before
    ``big``'s layer 2 (the one the config lacks: once layers 0 and 1 stored the forward's tokens)."""
    with TieredCache(small.config, tmp_path, gpu_budget=1, host_budget="64KiB", page_tokens=4,
                     prefetch=prefetch) as cache:  # fmt: skip
        handle = big.model.layers[2].register_forward_pre_hook(lambda *_: hook(cache))
        try:
            return run_bounded(lambda: run(cache), BOUND)
        finally:
            handle.remove()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_swap_out_just_before_the_refused_layer_leaves_the_refusal_exact(tmp_path, prefetch):
    # A scheduler thread swaps a sequence out between the config's last layer's update and the refused layer's
    # (here a pre-hook of the model's layer 2). swap_out forgot the refused forward's lengths for every sequence,
    # so the refusal took none of its tokens back and the decoding went on with wrong logits, no error. Now a
    # swap_out leaves only its own sequence out of the take-back, and the error names it if it was a row.
    small, big = llama_of(2), llama_of(3)
    prompts = [PROMPT, PROMPT[:, :13], PROMPT[:, :9]]
    swap: list[int] = []

    def hook(cache):
        if swap:
            cache.swap_out(swap.pop())

    def run(cache) -> list[torch.Tensor]:
        cur = []
        for seq, x in enumerate(prompts):
            cache.select([seq])
            cur.append(last_logits(small, cache, x).argmax(-1, keepdim=True))
        cache.select([0])
        swap.append(2)  # another sequence: the refused forward is taken back whole
        with pytest.raises(ValueError, match=REFUSED) as refused:
            last_logits(big, cache, cur[0])
        assert cache.seq_length(0) == prompts[0].shape[1]
        assert "swapped out" not in str(refused.value)
        cache.select([1])
        swap.append(1)  # the refused forward's row: its token stays, and the error says what to do
        with pytest.raises(ValueError, match=REFUSED + r".* stay in sequences \[1\], swapped out .* free\(\) each"):
            last_logits(big, cache, cur[1])
        assert cache.is_swapped(1) and cache.seq_length(1) == prompts[1].shape[1] + 1
        cache.free(1)  # and recompute it, as the error says
        cache.select([1])
        last_logits(small, cache, prompts[1])
        got = [last_logits(small, cache, cur[1])]
        cache.select([0])
        return got + [last_logits(small, cache, cur[0])]

    got = run_with_layer_2_hook(small, big, hook, tmp_path, prefetch, run)

    def second_step(x: torch.Tensor) -> torch.Tensor:
        ref = DynamicCache(config=small.config)
        return last_logits(small, ref, last_logits(small, ref, x).argmax(-1, keepdim=True))

    assert all(torch.equal(g, second_step(prompts[seq])) for g, seq in zip(got, (1, 0)))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_ctrl_c_while_a_refused_forward_is_taken_back_leaves_it_to_the_next(tmp_path, prefetch):
    # A Ctrl-C while the refusal of a layer the config lacks waits to take the forward back (for the loads and
    # writes in flight: a disk that stalls) left that forward's tokens in the cache for good: the next forward did
    # not try the take-back again, as it does for a layer update that raised, and decoding went on with wrong
    # logits. Now the next forward takes it back and, having taken its positions from the lengths before that,
    # asks to be run again; run again, it is exact.
    small, big = llama_of(2), llama_of(3)

    def run(cache) -> torch.Tensor:
        cur = last_logits(small, cache, PROMPT).argmax(-1, keepdim=True)
        with pytest.raises(KeyboardInterrupt):
            last_logits(big, cache, cur)
        with pytest.raises(ValueError, match=r"refused .* was stopped before .* taken back .* run this forward again"):
            last_logits(small, cache, cur)
        assert [s.length for s in cache._slots[0]] == [PROMPT.shape[1]] * 2
        return last_logits(small, cache, cur)

    got = run_with_layer_2_hook(small, big, press_in_the_take_back, tmp_path, prefetch, run)  # once 0, 1 stored it
    ref = DynamicCache(config=small.config)
    assert torch.equal(got, last_logits(small, ref, last_logits(small, ref, PROMPT).argmax(-1, keepdim=True)))


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("where", ["install", "filled"])  # its page load, or after it appended (its page writes)
def test_a_ctrl_c_while_a_last_layer_that_raised_is_taken_back_leaves_it_to_the_next(tmp_path, prefetch, where):
    # The config's last layer's update raises (a page load or write fails) and a Ctrl-C stops its take-back (in the
    # wait for the loads and writes in flight): the pass no longer counted as under way, so the next forward's
    # layer 0 did not take it back, its tokens stayed in the layers before (and the last, once appended) for good,
    # and decoding went on with wrong logits, no error. Now the next forward takes it back and, having taken its
    # positions from the lengths before that, asks to be run again; run again, it is exact.
    small = llama_of(2)

    def run(cache) -> torch.Tensor:
        cur = last_logits(small, cache, PROMPT).argmax(-1, keepdim=True)
        fail_once(cache._win, where, lambda layer, *_: layer == 1)
        press_in_the_take_back(cache)
        with pytest.raises(KeyboardInterrupt):
            last_logits(small, cache, cur)
        with pytest.raises(ValueError, match=r"raised in its update of layer 1 .* stopped before .* taken back "
                                             r".* run this forward again"):  # fmt: skip
            last_logits(small, cache, cur)
        assert [s.length for s in cache._slots[0]] == [PROMPT.shape[1]] * 2
        return last_logits(small, cache, cur)

    with TieredCache(small.config, tmp_path, gpu_budget=1, host_budget="64KiB", page_tokens=4,
                     prefetch=prefetch) as cache:  # fmt: skip
        got = run_bounded(lambda: run(cache), BOUND)
    ref = DynamicCache(config=small.config)
    assert torch.equal(got, last_logits(small, ref, last_logits(small, ref, PROMPT).argmax(-1, keepdim=True)))


def test_two_forwards_that_raised_at_one_layer_say_nothing_of_a_third_request(model, tmp_path):
    # A fresh server's first two requests both raise in the model at layer 2 (an out-of-memory for two long
    # prompts), before any forward ran whole: the third, over a sequence neither touched, was refused as if the
    # model had 2 layers ("build this TieredCache from the model's own config"), although the config is right. It
    # runs now, exact, and the first two run again as the model's errors ask, exact too.
    prompts = [torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(n)) for n in (30, 26, 5)]

    def oom(*_):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    @torch.no_grad()
    def logits(cache, x):
        return model(input_ids=x, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]

    want = [logits(DynamicCache(config=model.config), x) for x in prompts]
    with TieredCache(model.config, tmp_path, page_tokens=4) as cache:
        handle = model.model.layers[2].register_forward_pre_hook(oom)
        try:
            for seq in (0, 1):
                cache.select([seq])
                with pytest.raises(torch.OutOfMemoryError):
                    logits(cache, prompts[seq])
        finally:
            handle.remove()
        got = {}
        for seq in (2, 0, 1):
            cache.select([seq])
            got[seq] = logits(cache, prompts[seq])
    assert all(torch.equal(got[seq], want[seq]) for seq in range(3))


def unwritten(cache: TieredCache) -> list:
    return [p for slots in cache._slots.values() for s in slots for p in s.pages if p.fresh is not None]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_failed_page_write_is_written_again_once_the_disk_recovers(model, want, tmp_path, prefetch):
    # A page write that failed (a full disk) was never tried again, even after the disk recovered: the page lived
    # on the device only, for the life of its sequence, outside window_bytes (so outside gpu_budget), and
    # swap_out, which is to free the sequence's device memory, left it there.
    full = [True]

    def run():
        with cache_for(model, tmp_path, prefetch) as cache:
            real = cache._store.put

            def put(key, *args, **kwargs):
                if full[0] and "/l1/" in key:
                    raise OSError(errno.ENOSPC, "No space left on device (injected)")
                return real(key, *args, **kwargs)

            cache._store.put = put  # type: ignore[method-assign]
            toks, cur, errors = [], PROMPT, []
            while len(toks) < 8:
                try:
                    cur = step(model, cache, cur)
                except OSError as e:
                    errors.append(e)
                    assert len(errors) == 1, errors
                    stats = cache.stats()  # the failed pages are on the device, and counted there
                    win = cache._win
                    others = sum(t.numel() * t.element_size() for t in win._ring if t is not None)
                    others += sum(t.numel() * t.element_size() for slots in cache._slots.values() for s in slots
                                  for t in (s.tail, s.dev) if t is not None)  # fmt: skip
                    pages = unwritten(cache)
                    assert pages and stats["window_bytes"] - others == len(pages) * win.page_bytes
                    full[0] = False  # the user frees space, and runs the forward again
                    continue
                toks.append(cur)
            assert errors and not unwritten(cache)
            keys = {p.key for s in cache._slots[0] for p in s.pages}
            assert keys <= set(cache._store.keys())
            cache.swap_out(0)  # nothing of it left on the device
            assert all(s.tail is None and s.dev is None for s in cache._slots[0]) and not unwritten(cache)
            cache.swap_in(0)
            return torch.cat(toks, 1)

    assert torch.equal(run_bounded(run, BOUND), want)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_swap_out_writes_a_failed_page_first_or_refuses(model, tmp_path, prefetch):
    # A sequence swapped out with a page whose write had failed kept that page on the device, written nowhere.
    with cache_for(model, tmp_path, prefetch) as cache:
        undo = failing_put(cache, 5)
        step(model, cache, PROMPT)
        cache.stats()
        with pytest.raises(OSError, match="No space left"):  # the failure, raised once
            cache.swap_out(0)
        assert unwritten(cache) and not cache.is_swapped(0)
        cache._store.put = lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "still full (injected)"))
        with pytest.raises(OSError, match="still full"):  # written again first: the disk is still full
            cache.swap_out(0)
        assert unwritten(cache) and not cache.is_swapped(0)
        undo()
        cache.swap_out(0)
        assert cache.is_swapped(0) and not unwritten(cache)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_stats_and_free_leave_a_failed_write_alone(model, tmp_path, prefetch):
    # stats() raised (and so took) the failure meant for the next forward; free(), the way to drop a sequence,
    # raised an earlier write's failure instead of freeing.
    with cache_for(model, tmp_path, prefetch) as cache:
        undo = failing_put(cache, 5)
        cur = step(model, cache, PROMPT)
        cache.stats()  # (waits for the writes, on the mover with prefetch)
        undo()
        with pytest.raises(OSError, match="No space left"):
            step(model, cache, cur)
        cur = step(model, cache, cur)  # run again: its pages written
        cache.stats()  # (waits for the writes)
        assert not unwritten(cache)
        cache.select([1])
        undo = failing_put(cache, 2)
        step(model, cache, PROMPT)
        cache.stats()
        undo()
        assert unwritten(cache)
        cache.free(1)  # its failed page goes with it, and so does the failure
        assert cache.sequences == [0] and not unwritten(cache)
        cache.select(None)
        step(model, cache, cur)


def test_a_plain_cache_for_an_encoder_decoder_model_names_the_fix(tmp_path):
    # Its cross-attention updates layer 0 again within the forward: taken for a pass that stopped short.
    from transformers import BartConfig, BartForConditionalGeneration, EncoderDecoderCache

    torch.manual_seed(0)
    cfg = BartConfig(vocab_size=96, d_model=64, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                     max_position_embeddings=64)  # fmt: skip
    m = BartForConditionalGeneration(cfg).eval()
    kw = dict(max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(PROMPT))
    with TieredCache(m.config, tmp_path, page_tokens=4) as cache:
        with pytest.raises(ValueError, match=r"EncoderDecoderCache\(TieredCache\(...\), DynamicCache\(\)\)"):
            m.generate(PROMPT, past_key_values=cache, **kw)
    with TieredCache(m.config, tmp_path, page_tokens=4) as cache:
        got = m.generate(PROMPT, past_key_values=EncoderDecoderCache(cache, DynamicCache(config=m.config)), **kw)
    assert torch.equal(got, m.generate(PROMPT, **kw))


def test_a_cache_made_on_a_full_disk_names_its_folder_and_leaves_nothing(model, tmp_path, monkeypatch):
    import os

    import tiered.store.lock as lock

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    with monkeypatch.context() as m:
        m.setattr(lock.os, "pwrite", full)  # the first write a new cache makes: its store's lock file
        with pytest.raises(OSError) as ei:
            cache_for(model, tmp_path, 2)
    assert ei.value.errno == errno.ENOSPC and str(tmp_path) in str(ei.value.filename)
    assert "Free space there, or give the store another nvme_path" in str(ei.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_damaged_page_file_names_the_caches_fix(model, want, tmp_path, prefetch):
    # The store's fix for a damaged record (restore the file, or store.delete it) is not one a cache user can
    # apply: the store is the cache's own, and a page gone leaves a hole. The cache's is free the sequence and
    # recompute it; the store's own error, its cause, keeps the store's fix for store users.
    import os

    from tiered.store import IntegrityError

    with cache_for(model, tmp_path, prefetch, host_budget="16KiB", page_tokens=4) as cache:
        cur = step(model, cache, PROMPT)
        cache.stats()  # the page writes landed
        on_disk = [k for k in cache._store.keys() if "/l3/" in k and cache._store.info(k).tier == "nvme"]
        assert on_disk  # the last layer's: not among the layers the last forward read ahead for the next
        path = cache._store._state.recs[on_disk[0]].path
        os.truncate(path, 100)
        with pytest.raises(IntegrityError) as ei:
            step(model, cache, cur)
        message = str(ei.value)
        assert ei.value.filename == path and "truncated" in message, message
        assert "cache.free(0) and recompute" in message and "store.delete" not in message, message
        assert isinstance(ei.value.__cause__, IntegrityError) and "store.delete" in str(ei.value.__cause__)
        cache.free(0)  # the fix it names
        assert torch.equal(decode(model, cache), want)


def test_a_damaged_tail_file_at_swap_in_names_the_caches_fix(model, tmp_path):
    from tiered.store import IntegrityError

    with cache_for(model, tmp_path, 2) as cache:
        decode(model, cache, steps=2)
        cache.swap_out(0)
        real = cache._store.get

        def get(key, *a, **k):  # the swapped tail's record read back damaged
            raise IntegrityError(key, "/nvme/tail.bin", "is missing")

        cache._store.get = get  # type: ignore[method-assign]
        with pytest.raises(IntegrityError) as ei:
            cache.swap_in(0)
        cache._store.get = real  # type: ignore[method-assign]
        message = str(ei.value)
        assert "cache.free(0) and recompute" in message and "store.delete" not in message, message
        assert cache.is_swapped(0)
