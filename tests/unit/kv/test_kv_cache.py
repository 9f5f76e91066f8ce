"""TieredCache (tiered.kv): greedy decoding equals DynamicCache's, with the KV in the window, spilled to host
memory and spilled to NVMe; a hand-written decode loop; swaps at random points; errors; the folder's lifecycle.

Tiny models from configs (nothing downloaded): a Llama with grouped-query attention and a Qwen2.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from helpers import run_bounded

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from tiered.kv import TieredCache, cache_kwargs  # noqa: E402
from tiered.store.records import IntegrityError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
BOUND = 600.0  # seconds: only reached when something hangs, on a loaded machine


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512)  # fmt: skip
    return Qwen2ForCausalLM(cfg).eval()


MODELS = {"llama-gqa": llama, "qwen2": qwen2}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


def kv_bytes(model, tokens: int, rows: int = 1) -> int:
    cfg = model.config
    return 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4 * tokens * rows


def greedy(model, ids, cache, new=24):
    mask = torch.ones_like(ids)
    return run_bounded(lambda: model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
                                              do_sample=False, pad_token_id=0), BOUND)  # fmt: skip


# Budgets: the whole KV in the window; the window holds two layers at most and the pages fit host memory; and
# the host budget holds a few pages only, so most pages live on NVMe.
PLACES = {
    "window": dict(gpu_budget=None, host_budget="64MiB"),
    "host": dict(gpu_budget=1, host_budget="64MiB"),
    "nvme": dict(gpu_budget=1, host_budget="48KiB"),
}


@pytest.mark.parametrize("place", sorted(PLACES))
def test_generate_equals_dynamic_cache(model, place, tmp_path):
    ids = torch.randint(1, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(3))
    ref = greedy(model, ids, DynamicCache(config=model.config))
    with TieredCache(model.config, tmp_path, page_tokens=8, **PLACES[place]) as cache:
        out = greedy(model, ids, cache)
        st = cache.stats()
        assert cache.get_seq_length() == out.shape[1] - 1  # the last token is never fed back
    assert torch.equal(out, ref)
    nvme = st["store"]["nvme"]
    if place == "window":
        assert st["resident"] == model.config.num_hidden_layers and st["loaded_bytes"] == 0 and not nvme["reads"]
    else:
        assert st["resident"] == 0 and st["loaded_bytes"] > kv_bytes(model, 19, 2)
        # appending writes each token about once: never whole layers again
        total = kv_bytes(model, out.shape[1], 2) * model.config.num_hidden_layers
        assert st["written_bytes"] <= total
        # every decode pass's loads were started ahead, while the layer before computed (the next pass's first
        # layer during the last one's); none had to wait to start
        loads = st["loads"]
        assert loads["waited"] == 0 and loads["prefetched"] == 2 * model.config.num_hidden_layers * 23
    if place == "host":
        assert nvme["reads"] == 0
    if place == "nvme":
        assert nvme["reads"] > 0 and nvme["bytes_read"] > 0


def test_generate_left_padded_batch(tmp_path):
    """A batch of prompts of different lengths, left-padded as generate expects: the same tokens per row."""
    m = llama()
    ids = torch.randint(1, 96, (2, 15), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    ids[1, :6], mask[1, :6] = 0, 0  # row 1 is a 9-token prompt

    def run(cache):
        return run_bounded(lambda: m.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                                              do_sample=False, pad_token_id=0), BOUND)  # fmt: skip

    ref = run(DynamicCache(config=m.config))
    with TieredCache(m.config, tmp_path, page_tokens=4, **PLACES["nvme"]) as cache:
        assert torch.equal(run(cache), ref)


def test_window_between_all_and_nothing(tmp_path):
    """A budget for some layers keeps the leading ones resident and streams the rest, still exactly."""
    m = llama()
    ids = torch.randint(1, 96, (1, 30), generator=torch.Generator().manual_seed(5))
    ref = greedy(m, ids, DynamicCache(config=m.config), new=30)
    # Pages of 8 tokens at 2 * 2 heads * 16 * 4 = 256 bytes a token: 2 KiB. The window holds a tail page a layer
    # (8 KiB), a ring of prefetch + 1 = 2 blocks and the resident blocks, each with room for n + max(a page, n / 4)
    # tokens. Up to 50 tokens all four layers fit 72 KiB; at the last pass (60 tokens: 10 pages, 20 KiB a block)
    # one layer stays resident beside the ring: 8 + 2 * 20 + 20 = 68 KiB.
    with TieredCache(m.config, tmp_path, page_tokens=8, gpu_budget="72KiB", host_budget="64MiB", prefetch=1) as cache:
        out = greedy(m, ids, cache, new=30)
        st = cache.stats()
        assert st["resident"] == 1 and st["loaded_bytes"] > 0
        assert st["window_peak"] <= 72 << 10  # the pages whose writes are in flight included
    assert torch.equal(out, ref)


@torch.no_grad()  # grad mode is per thread: run_bounded's included
def decode(model, ids, cache, steps):
    """A hand-written greedy loop over one sequence; returns the tokens and the last logits."""
    toks, logits = [], None
    cur = ids
    for _ in range(steps):
        out = model(input_ids=cur, **cache_kwargs(model, cache), use_cache=True)
        logits = out.logits[:, -1]
        cur = logits.argmax(-1, keepdim=True)
        toks.append(cur)
    return torch.cat(toks, 1), logits


@pytest.mark.parametrize("place", ["host", "nvme"])
def test_hand_written_loop_bitwise(model, place, tmp_path):
    ids = torch.randint(1, model.config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref, ref_logits = run_bounded(lambda: decode(model, ids, DynamicCache(config=model.config), 17), BOUND)
        with TieredCache(model.config, tmp_path, page_tokens=4, **PLACES[place]) as cache:
            got, logits = run_bounded(lambda: decode(model, ids, cache, 17), BOUND)
    assert torch.equal(got, ref)
    assert torch.equal(logits, ref_logits)  # the same bits, not just the same argmax


def alone(model, prompt, steps):
    with torch.no_grad():
        return decode(model, prompt, DynamicCache(config=model.config), steps)[0]


@pytest.mark.parametrize("place", ["window", "nvme"])
def test_swaps_at_random_points(model, place, tmp_path):
    """Three sequences take turns in one cache, each swapped out and in at random steps, many times; each
    one's tokens equal those of that sequence run alone."""
    rng = random.Random(11)
    prompts = [torch.randint(1, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
               for n in (5, 9, 14)]  # fmt: skip
    steps = 14
    want = [alone(model, p, steps) for p in prompts]
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    nxt = list(prompts)
    swaps = 0

    def run():
        nonlocal swaps
        with torch.no_grad(), TieredCache(model.config, tmp_path, page_tokens=4, **PLACES[place]) as cache:
            while any(len(g) < steps for g in got):
                s = rng.choice([i for i in range(len(prompts)) if len(got[i]) < steps])
                if s in cache.sequences and cache.is_swapped(s):
                    cache.swap_in(s)
                cache.select([s])
                out = model(input_ids=nxt[s], **cache_kwargs(model, cache), use_cache=True)
                nxt[s] = out.logits[:, -1].argmax(-1, keepdim=True)
                got[s].append(nxt[s])
                for other in cache.sequences:  # preempt at random, including the one that just ran
                    if not cache.is_swapped(other) and rng.random() < 0.5:
                        cache.swap_out(other)
                        swaps += 1
            assert cache.stats()["swaps"]["out"] == swaps

    run_bounded(run, BOUND)
    assert swaps >= 10
    for s in range(len(prompts)):
        assert torch.equal(torch.cat(got[s], 1), want[s]), f"sequence {s}"


def test_generate_resumes_after_swap(tmp_path):
    """generate() on a cache whose sequence was swapped out and in continues as if nothing happened."""
    m = llama()
    ids = torch.randint(1, 96, (1, 11), generator=torch.Generator().manual_seed(2))
    ref = greedy(m, ids, DynamicCache(config=m.config), new=16)
    with TieredCache(m.config, tmp_path, page_tokens=4, **PLACES["nvme"]) as cache:
        first = greedy(m, ids, cache, new=6)
        cache.swap_out(0)
        assert cache.stats()["window_bytes"] == 0  # its window buffers are freed
        cache.swap_in(0)
        rest = greedy(m, first, cache, new=10)
    assert torch.equal(rest, ref)


def test_swap_in_deletes_the_tail_records_swap_out_stored(tmp_path):
    """Each layer's partial last page, stored by swap_out, lives on the device again after swap_in: its record is
    deleted, rather than hold host memory (or NVMe) until the page fills. A swap_in whose read fails leaves them,
    and the next one brings the sequence back exactly."""
    m = llama()
    ids = torch.randint(1, 96, (1, 11), generator=torch.Generator().manual_seed(2))
    ref = greedy(m, ids, DynamicCache(config=m.config), new=16)
    with TieredCache(m.config, tmp_path, page_tokens=4, gpu_budget=None, host_budget="1MiB") as cache:
        first = greedy(m, ids, cache, new=6)  # 16 tokens: 4 pages a layer; one more makes a partial page
        first = greedy(m, first, cache, new=1)
        keys, in_use = sorted(cache._store.keys()), cache._store.stats()["host"]["in_use"]
        cache.swap_out(0)
        assert len(cache._store.keys()) == len(keys) + 4  # a tail record a layer
        real, calls = cache._store.get, [0]

        def get(key, *args, **kwargs):  # the third layer's tail cannot be read, once
            calls[0] += 1
            if calls[0] == 3:
                raise OSError(5, "Input/output error (injected)")
            return real(key, *args, **kwargs)

        cache._store.get = get  # type: ignore[method-assign]
        with pytest.raises(OSError, match="injected"):
            cache.swap_in(0)
        assert cache.is_swapped(0) and len(cache._store.keys()) == len(keys) + 4
        cache.swap_in(0)
        cache._store.get = real  # type: ignore[method-assign]
        assert sorted(cache._store.keys()) == keys
        assert cache._store.stats()["host"]["in_use"] == in_use
        rest = greedy(m, first, cache, new=9)
    assert torch.equal(rest, ref)


def test_swap_in_detects_changed_pages(tmp_path):
    m = llama()
    ids = torch.randint(1, 96, (1, 9), generator=torch.Generator().manual_seed(4))
    with TieredCache(m.config, tmp_path, page_tokens=4, gpu_budget=None, host_budget="64MiB") as cache:
        greedy(m, ids, cache, new=3)
        cache.swap_out(0)
        key = "kv/s0/l2/p1"
        with cache._store.pin(key, tier="host") as t:  # a bit flips while the sequence is out
            t.view(torch.uint8)[0, 0, 0, 0] ^= 1
            cache._store.mark_dirty(key)
        with pytest.raises(IntegrityError, match="layer 2"):
            cache.swap_in(0)
        assert cache.is_swapped(0)


def test_host_budget_none_is_refused_by_name(tmp_path):
    # gpu_budget=None means no limit, so users try host_budget=None too: it was read as 0 bytes and refused as too
    # small to hold a page. Pinned host memory has no "no limit": the error names None and asks for a byte count.
    m = llama()
    with pytest.raises(TypeError, match=r'host_budget must be a byte count such as "32GiB".*got None'):
        TieredCache(m.config, tmp_path, host_budget=None)
    assert os.listdir(tmp_path) == []
    with TieredCache(m.config, tmp_path, host_budget="1MiB", gpu_budget=None) as cache:
        assert cache.gpu_budget is None


def test_a_sliding_window_that_is_a_config_field_is_refused_with_the_way_to_turn_it_off(tmp_path):
    # A stock MistralConfig has sliding_window=4096: refused like any sliding-window model, but its window is one
    # field, and with it off the outputs within the window are the same. Gemma2's layers are listed: no such hint.
    torch.manual_seed(2)
    cfg = transformers.MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    m = transformers.MistralForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match=r"window of 4096 tokens.*model\.config\.sliding_window = None") as ei:
        TieredCache(m.config, tmp_path)
    assert "DynamicCache" in str(ei.value)
    ids = torch.randint(1, 96, (1, 9), generator=torch.Generator().manual_seed(5))
    want = greedy(m, ids, DynamicCache(config=m.config), new=6)
    m.config.sliding_window = None  # the fix it names
    with TieredCache(m.config, tmp_path, page_tokens=4) as cache:
        assert torch.equal(greedy(m, ids, cache, new=6), want)
    gemma = transformers.Gemma2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    with pytest.raises(ValueError, match="sliding_attention") as ei:
        TieredCache(gemma, tmp_path)
    assert "sliding_window = None" not in str(ei.value)
    assert os.listdir(tmp_path) == []


def test_an_empty_nvme_path_is_refused_not_taken_for_the_current_folder(tmp_path, monkeypatch):
    """``""`` (an unset variable) named the current folder, where the cache's store then put its files."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="^nvme_path is empty: pass a folder, e.g. /mnt/nvme"):
        TieredCache(llama().config, "")
    assert os.listdir(tmp_path) == []


def test_errors(tmp_path):
    m = llama()
    with pytest.raises(TypeError, match="config"):
        TieredCache(object(), tmp_path)
    with pytest.raises(ValueError, match="page_tokens"):
        TieredCache(m.config, tmp_path, page_tokens=0)
    with pytest.raises(ValueError, match="gpu_budget"):
        TieredCache(m.config, tmp_path, gpu_budget="lots")
    with pytest.raises(TypeError, match="nvme_path"):
        TieredCache(m.config, 3)
    sliding = transformers.MistralConfig(num_hidden_layers=2, sliding_window=16, hidden_size=64,
                                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    with pytest.raises(ValueError, match="sliding_attention"):
        TieredCache(sliding, tmp_path)
    # A host budget that holds no page: at construction below a bf16 page (256 tokens x 2 kv heads x 16 x 2 x 2
    # bytes: 32 KiB), at the first forward below a page in the dtype the keys come in (fp32 here: 64 KiB).
    with pytest.raises(ValueError, match="cannot hold one page .*32768 bytes"):
        TieredCache(m.config, tmp_path, host_budget="16KiB")
    assert os.listdir(tmp_path) == []  # nothing left behind by a refused construction
    ids = torch.randint(1, 96, (2, 6))
    with TieredCache(m.config, tmp_path, host_budget="48KiB") as cache:
        with pytest.raises(ValueError, match="cannot hold one page .*65536 bytes"), torch.no_grad():
            m(input_ids=ids, **cache_kwargs(m, cache), use_cache=True)
    with TieredCache(m.config, tmp_path) as cache:
        with pytest.raises(ValueError, match="no sequence 0"):
            cache.swap_out(0)  # no forward yet: no sequences
        with pytest.raises(NotImplementedError, match="beam"):
            run_bounded(lambda: m.generate(ids, past_key_values=cache, max_new_tokens=2, num_beams=2,
                                           pad_token_id=0), BOUND)  # fmt: skip
    with TieredCache(m.config, tmp_path) as cache:
        with torch.no_grad():
            m(input_ids=ids, **cache_kwargs(m, cache), use_cache=True)
        with pytest.raises(ValueError, match="no sequence 7"):
            cache.swap_out(7)
        with pytest.raises(ValueError, match="not swapped out"):
            cache.swap_in(1)
        cache.swap_out(1)
        with pytest.raises(ValueError, match="already swapped out"):
            cache.swap_out(1)
        with pytest.raises(ValueError, match="swap_in"):
            cache.select([0, 1])
        with pytest.raises(ValueError, match="ints >= 0"):
            cache.select([-1])
        with pytest.raises(ValueError, match="batch rows"), torch.no_grad():
            m(input_ids=ids[:, :1], **cache_kwargs(m, cache), use_cache=True)  # 2 rows, 1 sequence in the batch
        cache.select([0, 5])  # 5 is new and empty, 0 holds 6 tokens
        with pytest.raises(ValueError, match="equally long"), torch.no_grad():
            m(input_ids=ids[:, :1], **cache_kwargs(m, cache), use_cache=True)
    with pytest.raises(RuntimeError, match="closed"):
        cache.swap_out(0)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_budget_of_one_resident_page_and_a_half_streams(prefetch, tmp_path):
    # 12-token fp32 pages are 3 KiB, 4 KiB as the pinned pool charges them. A 6 KiB budget's quarter (1.5 KiB)
    # held no page beside the one it kept resident (pinned by the cache for good): every NVMe load waited for
    # room nothing would free, for ever on the mover thread (prefetch 2), BudgetError in the serial twin. The
    # cache's streaming reserve now holds at least one page.
    m = llama()
    ids = torch.randint(1, 96, (2, 40), generator=torch.Generator().manual_seed(5))
    ref = greedy(m, ids, DynamicCache(config=m.config), new=8)

    def generate():  # the cache's close too under the bound: it waits for the mover
        with TieredCache(m.config, tmp_path, host_budget=6144, gpu_budget=1, page_tokens=12,
                         prefetch=prefetch) as cache:  # fmt: skip
            ids_out = m.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=8,
                                 do_sample=False, pad_token_id=0)  # fmt: skip
            return ids_out, cache.stats()

    out, st = run_bounded(generate, 120)
    assert torch.equal(out, ref)
    assert st["store"]["nvme"]["reads"] > 0  # pages did stream from NVMe


def test_a_budget_of_one_fp32_page_is_enough_for_fp32_keys(tmp_path):
    # As README states it: the streaming reserve is a quarter of host_budget but at least one fp32 page (the
    # whole budget when smaller), so fp32 keys take a budget of one page, not four. 12-token fp32 pages are 3 KiB,
    # 4 KiB as the pinned pool charges them: a 4 KiB budget (its quarter 1 KiB) is accepted and streams.
    m = llama()
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(6))
    ref = greedy(m, ids, DynamicCache(config=m.config), new=4)

    def generate():
        with TieredCache(m.config, tmp_path, host_budget=4096, gpu_budget=1, page_tokens=12) as cache:
            out = m.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=4,
                             do_sample=False, pad_token_id=0)  # fmt: skip
            return out, cache.stats()

    out, st = run_bounded(generate, 120)
    assert torch.equal(out, ref)
    assert st["store"]["nvme"]["reads"] > 0
    with pytest.raises(ValueError, match="cannot hold one page .*at least 4096 bytes"):
        TieredCache(m.config, tmp_path, host_budget=4095, page_tokens=12)  # less than a page is refused


def test_a_budget_whose_quarter_holds_no_wide_page_is_refused(tmp_path):
    # fp64 keys: a 16-token page is 8 KiB. 16 KiB holds two, but the streaming quarter (at least an fp32 page, 4
    # KiB) holds none: refused at the first forward, before anything is written, naming the budget that works.
    m = llama().double()
    ids = torch.randint(1, 96, (1, 6))
    with TieredCache(m.config, tmp_path, host_budget="16KiB", page_tokens=16) as cache:
        with pytest.raises(ValueError, match="in its quarter for pages streamed .* at least 32768 bytes"):
            with torch.no_grad():
                m(input_ids=ids, **cache_kwargs(m, cache), use_cache=True)


def test_sampling_several_return_sequences_is_exact_and_beam_search_names_what_works(tmp_path):
    """generate repeats the prompt before the first forward, so sampling num_return_sequences > 1 needs nothing of
    the cache: exact. Beam search's refusal says so rather than ask for num_return_sequences=1."""
    m = llama()
    ids = torch.randint(1, 96, (2, 7), generator=torch.Generator().manual_seed(6))

    def sample(cache):
        torch.manual_seed(5)
        return run_bounded(lambda: m.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                              max_new_tokens=6, do_sample=True, num_return_sequences=3,
                                              pad_token_id=0), BOUND)  # fmt: skip

    ref = sample(DynamicCache(config=m.config))
    with TieredCache(m.config, tmp_path, page_tokens=4, **PLACES["nvme"]) as cache:
        assert torch.equal(sample(cache), ref) and ref.shape[0] == 6
        cache.reset()
        with pytest.raises(NotImplementedError, match="beam search") as refused:
            run_bounded(lambda: m.generate(ids, past_key_values=cache, max_new_tokens=2, num_beams=2,
                                           pad_token_id=0), BOUND)  # fmt: skip
        assert "num_return_sequences=1" not in str(refused.value) and "any num_return_sequences" in str(refused.value)


def test_prompt_lookup_is_refused_by_transformers_and_after_reset_the_cache_is_exact(tmp_path):
    """The cache offers no cropping, so transformers refuses prompt lookup (and assisted decoding) itself, as README
    says: after the first forward, which the cache then holds; reset() brings back a fresh cache's logits."""
    m = llama()
    ids = torch.randint(1, 96, (1, 9), generator=torch.Generator().manual_seed(8))
    with TieredCache(m.config, tmp_path, page_tokens=4) as cache:
        with pytest.raises(ValueError, match="cropped"):
            run_bounded(lambda: m.generate(ids, past_key_values=cache, max_new_tokens=3, prompt_lookup_num_tokens=2,
                                           pad_token_id=0), BOUND)  # fmt: skip
        assert cache.get_seq_length() > 0  # the first forward ran: what README tells users to reset()
        cache.reset()
        assert torch.equal(greedy(m, ids, cache, new=4), greedy(m, ids, DynamicCache(config=m.config), new=4))


def test_free_and_reset(tmp_path):
    m = llama()
    with TieredCache(m.config, tmp_path, gpu_budget=1, page_tokens=4) as cache:
        greedy(m, torch.randint(1, 96, (2, 10)), cache, new=3)
        assert cache.sequences == [0, 1] and cache.seq_length(0) == 12
        pages = len(cache._store.keys())
        cache.free(1)
        assert cache.sequences == [0] and 0 < len(cache._store.keys()) < pages
        cache.reset()
        assert cache.sequences == [] and cache._store.keys() == [] and cache.get_seq_length() == 0
        ids = torch.randint(1, 96, (1, 7), generator=torch.Generator().manual_seed(9))
        assert torch.equal(greedy(m, ids, cache, new=5), greedy(m, ids, DynamicCache(config=m.config), new=5))


def test_close_removes_folder_and_is_idempotent(tmp_path):
    m = llama()
    cache = TieredCache(m.config, tmp_path, gpu_budget=1, host_budget="48KiB", page_tokens=4)
    (folder,) = os.listdir(tmp_path)
    assert folder.startswith("tiered-") and os.path.join(tmp_path, folder) == cache.workdir
    greedy(m, torch.randint(1, 96, (1, 20)), cache, new=8)
    assert cache.stats()["store"]["nvme"]["writes"] > 0  # files were on disk
    run_bounded(cache.close, BOUND)
    cache.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("interrupt", ["Ctrl-C", "SystemExit"])
def test_an_interrupt_inside_close_still_releases_everything(tmp_path, monkeypatch, interrupt):
    # close() runs once (the cache reads closed from its start): a Ctrl-C while it deleted the pages left the store
    # open, its ~33 threads and folder lock for good, and the exit hook failing to flush into the removed folder.
    import signal
    import threading

    m = llama()
    before = set(threading.enumerate())
    cache = TieredCache(m.config, tmp_path, gpu_budget=1, host_budget="48KiB", page_tokens=4)
    greedy(m, torch.randint(1, 96, (1, 20)), cache, new=8)
    store, real, hit = cache._store, cache._store.delete, []

    def delete(key):
        if not hit:
            hit.append(key)
            if interrupt == "Ctrl-C":
                os.kill(os.getpid(), signal.SIGINT)
            else:
                raise SystemExit(143)  # a SIGTERM handler's
        return real(key)

    monkeypatch.setattr(store, "delete", delete)
    with pytest.raises(KeyboardInterrupt if interrupt == "Ctrl-C" else SystemExit):
        cache.close()
    assert hit and store._closed and os.listdir(tmp_path) == []
    assert not [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    cache.close()


def test_a_sigterm_inside_close_on_a_full_disk_writes_nothing_and_exits_as_asked(tmp_path, monkeypatch):
    # close() deletes the pages, then closes the store: stopped part-way by a SIGTERM handler's SystemExit, the
    # store's close wrote every page still in host memory into the folder about to be removed, and on a full disk
    # raised that write's error (with advice to flush) in the SystemExit's place: exit status 1, not 143.
    import errno

    m = llama()
    cache = TieredCache(m.config, tmp_path, gpu_budget=1, host_budget="64MiB", page_tokens=4)
    greedy(m, torch.randint(1, 96, (1, 20)), cache, new=8)
    store, writes = cache._store, []
    assert len(store.keys()) > 1

    def full(*a, **k):
        writes.append(a[1])
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def delete(key):
        raise SystemExit(143)  # a SIGTERM handler's, at the first page

    monkeypatch.setattr(store._state.io, "pwrite", full)
    monkeypatch.setattr(store, "delete", delete)
    with pytest.raises(SystemExit) as stopped:
        cache.close()
    assert stopped.value.code == 143 and writes == []
    assert store._closed and os.listdir(tmp_path) == []


def test_left_open_is_closed_at_exit(tmp_path):
    from helpers import run_script

    code = (
        "import torch, transformers\n"
        "from tiered.kv import TieredCache\n"
        "cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,"
        " num_attention_heads=2, num_key_value_heads=1)\n"
        "m = transformers.LlamaForCausalLM(cfg).eval()\n"
        f"c = TieredCache(cfg, {str(tmp_path)!r}, gpu_budget=1, host_budget='16KiB', page_tokens=2)\n"
        "m.generate(torch.ones(1, 9, dtype=torch.long), past_key_values=c, max_new_tokens=4, pad_token_id=0)\n"
        "print('done')\n"
    )
    r = run_script(code, timeout=BOUND)
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert os.listdir(tmp_path) == []


def test_a_dropped_cache_is_closed_when_collected(tmp_path):
    # A cache made per request and dropped, as DynamicCache users do, kept its store, ~30 I/O threads and its
    # folder of keys and values (on disk after the process exited): nothing closed it once collected.
    from helpers import run_script

    code = (
        "import gc, os, sys, threading, torch, transformers\n"
        "from tiered.kv import TieredCache\n"
        "cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,"
        " num_attention_heads=2, num_key_value_heads=1)\n"
        "m = transformers.LlamaForCausalLM(cfg).eval()\n"
        "threads = threading.active_count()\n"
        "def answer(prefetch):\n"
        f"    c = TieredCache(cfg, {str(tmp_path)!r}, gpu_budget=1, host_budget='16KiB', page_tokens=2,"
        " prefetch=prefetch)\n"
        "    m.generate(torch.ones(1, 9, dtype=torch.long), past_key_values=c, max_new_tokens=6, pad_token_id=0)\n"
        "    assert c.stats()['store']['nvme']['writes'] > 0\n"
        "    return c.workdir\n"
        "for prefetch in (0, 2):\n"
        "    folder = answer(prefetch)\n"
        "    print('dropped', os.path.exists(folder), threading.active_count() - threads)\n"
        "    gc.collect()\n"
        "    print('collected', os.path.exists(folder), threading.active_count() - threads)\n"
        "answer(2)\n"  # and one dropped just before the exit
    )
    r = run_script(code, timeout=BOUND)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:4] == ["dropped False 0", "collected False 0"] * 2, r.stdout
    assert "failed" not in r.stderr and os.listdir(tmp_path) == [], r.stderr


LATE_CACHE = """
import concurrent.futures.thread, sys, threading, warnings, torch, transformers
sys.path.insert(0, {tests!r})
from helpers import main_thread_joins, wait_until
from tiered.kv import TieredCache
warnings.simplefilter("ignore", FutureWarning)
cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, eos_token_id=None)  # never stops early
torch.manual_seed(0)
m = transformers.LlamaForCausalLM(cfg).eval()
ids = torch.ones(1, 9, dtype=torch.long)
def greedy(ids, new, **kw):  # a generated pad token (0) is no padding
    return m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, pad_token_id=0,
                      **kw)
def late():  # a thread that makes its first cache once the main thread has ended and the exit has begun
    global c  # kept: a dropped cache closes when collected
    assert wait_until(main_thread_joins)
    print("concurrent.futures shut down:", concurrent.futures.thread._shutdown, flush=True)
    want = greedy(ids, 8)  # DynamicCache
    c = TieredCache(cfg, {root!r}, gpu_budget=1, host_budget="1MiB", page_tokens=2)
    first = greedy(ids, 3, past_key_values=c)
    c.swap_out(0)  # its held pages checksummed in parallel
    c.swap_in(0)
    got = greedy(first, 5, past_key_values=c)
    print("as DynamicCache", torch.equal(got, want), flush=True)
{ending}
threading.Thread(target=late).start()  # non-daemon: Python waits for it
"""


def test_a_cache_first_used_after_the_main_thread_ended_generates(tmp_path):
    # A generate() in a non-daemon thread that outlives the main thread, with nothing of tiered's open before:
    # concurrent.futures had shut its pools down by then, and the cache's mover failed the forward pass ("cannot
    # schedule new futures after interpreter shutdown"), where DynamicCache generates.
    from helpers import TESTS_ROOT, run_script

    r = run_script(LATE_CACHE.format(tests=TESTS_ROOT, root=str(tmp_path), ending="    c.close()"), timeout=BOUND)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split("\n")[:2] == ["concurrent.futures shut down: True", "as DynamicCache True"], r.stderr


FORK_SETUP = """
import os, sys, warnings, torch, transformers
from tiered.kv import TieredCache, cache_kwargs
warnings.simplefilter("ignore", FutureWarning)
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1)
m = transformers.LlamaForCausalLM(cfg).eval()
@torch.no_grad()
def decode(cache, cur, steps):
    toks = []
    for _ in range(steps):
        cur = m(input_ids=cur, **cache_kwargs(m, cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        toks.append(cur)
    return toks
def files(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
prompt = torch.randint(1, 32, (1, 9), generator=torch.Generator().manual_seed(3))
want = decode(transformers.DynamicCache(config=cfg), prompt, 8)
cache = TieredCache(cfg, {root!r}, gpu_budget=1, host_budget="16KiB", page_tokens=2, prefetch={prefetch})
got = decode(cache, prompt, 4)
assert cache.stats()["store"]["nvme"]["writes"] > 0  # pages on disk
"""
FORK_SCRIPT = (
    FORK_SETUP
    + """
from tiered.store.lock import FolderLock, StoreLockedError
before = files(cache.workdir)
pid = os.fork()
if pid == 0:  # a helper forked from the serving process that ends the usual way
    {child}
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
# The parent's own read-ahead may still add or replace pages meanwhile: the folder is there with its pages
# (and the tokens below read them all back).
print("folder kept", os.path.isdir(cache.workdir) and len(files(cache.workdir)) >= len(before) > 0, flush=True)
try:
    FolderLock(cache.workdir).release()
    print("lock taken by a probe", flush=True)
except StoreLockedError:
    print("lock held", flush=True)
except FileNotFoundError:
    print("lock gone with the folder", flush=True)
got += decode(cache, got[-1], 4)
print("same tokens", torch.equal(torch.cat(got, 1), torch.cat(want, 1)), flush=True)
cache.close()
print("removed at close", os.listdir({root!r}) == [], flush=True)
"""
)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("child", ["pass", "cache.close()", "del cache; import gc; gc.collect()"])
def test_a_forked_child_that_exits_normally_leaves_the_parents_cache_alone(tmp_path, child, prefetch):
    # A child of os.fork() that ended with sys.exit ran the cache's finalizer it had copied: it deleted the parent's
    # pages and folder, the parent's next forward failing on a missing page; its close() or collection did the same.
    from helpers import run_script

    r = run_script(FORK_SCRIPT.format(root=str(tmp_path), child=child, prefetch=prefetch), timeout=BOUND)
    assert r.returncode == 0, r.stdout + r.stderr
    for line in ("child exit 0", "folder kept True", "lock held", "same tokens True", "removed at close True"):
        assert line in r.stdout, r.stdout + r.stderr


CHILD_CALLS_SCRIPT = (
    FORK_SETUP
    + """
import signal, threading
held, go = threading.Event(), threading.Event()
def hold():  # a serving thread inside a layer update at the fork
    with cache._lock:
        held.set()
        go.wait()
holder = threading.Thread(target=hold)
if {held}:
    holder.start()
    held.wait()
refused = {{"select": lambda: cache.select([0]), "swap_out": lambda: cache.swap_out(0), "stats": cache.stats,
           "swap_in": lambda: cache.swap_in(0), "free": lambda: cache.free(0), "reset": cache.reset,
           "forward (update)": lambda: decode(cache, got[-1], 1)}}
reads = {{"seq_length": lambda: cache.seq_length(0), "is_swapped": lambda: cache.is_swapped(0),
         "get_seq_length": cache.get_seq_length, "sequences": lambda: cache.sequences}}
public = {{n for n, v in vars(TieredCache).items() if callable(v) and n[0] != "_"}}
print("untested:", sorted(public - {{"select", "swap_out", "stats", "swap_in", "free", "reset", "update", "close",
                                   "seq_length", "is_swapped", "get_seq_length"}}) or "none", flush=True)
pid = os.fork()
if pid == 0:
    signal.alarm(60)  # a call that waits for ever is killed by SIGALRM
    for name, call in {{**refused, **reads}}.items():
        try:
            call()
            print("child:", name, "returned", flush=True)
        except RuntimeError as e:
            print("child:", name, "raised", "TieredCache" in str(e) and "before a fork" in str(e), flush=True)
    cache.close()
    os._exit(0)
go.set()
if {held}:
    holder.join()
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
got += decode(cache, got[-1], 4)
print("same tokens", torch.equal(torch.cat(got, 1), torch.cat(want, 1)), flush=True)
cache.close()
print("removed at close", os.listdir({root!r}) == [], flush=True)
"""
)


@pytest.mark.parametrize("held", [True, False], ids=["lock-held-at-fork", "idle-at-fork"])
def test_every_call_of_a_forked_childs_cache_refuses_at_once(tmp_path, held):
    # In a child forked while a serving thread held the cache's lock (a forward's layer update), select, swaps,
    # free, stats and a forward waited for ever for a holder that does not exist there; forked idle, swap_out
    # waited for the parent's loads. Every call that takes the lock now refuses first; the reads answer.
    from helpers import run_script

    r = run_script(CHILD_CALLS_SCRIPT.format(root=str(tmp_path), held=held, prefetch=2), timeout=BOUND)
    assert r.returncode == 0, r.stdout + r.stderr
    for line in ("untested: none", "child exit 0", "same tokens True", "removed at close True"):
        assert line in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("raised True") == 7 and r.stdout.count("returned") == 4, r.stdout


def test_a_file_where_the_nvme_path_should_be_is_named(tmp_path):
    # The message spoke of "the optimizer state".
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file, not a folder") as ei:
        TieredCache(llama().config, tmp_path / "f")
    assert "KV cache" in str(ei.value) and "optimizer state" not in str(ei.value)


def test_top_level_export():
    import tiered

    assert tiered.TieredCache is TieredCache


def test_example_batch_generate_preempts_and_matches(tmp_path):
    """examples/kv_batch_generate.py at toy size: more requests than run at once, preempted by swapping (to
    NVMe past a small host budget), every output equal to its request run alone."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "examples" / "kv_batch_generate.py"
    out = tmp_path / "report.json"
    args = "--requests 4 --running 1 --quantum 2 --new-tokens 7 --layers 2 --host-budget 32KiB".split()
    cmd = [sys.executable, str(script), *args, "--nvme-path", str(tmp_path / "root"), "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=BOUND)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())["swap"]
    assert report["equal"] and report["preemptions"] >= 4
    assert report["swaps"]["out"] == report["swaps"]["in"] == report["preemptions"]
    assert report["nvme"]["bytes_written"] > 0  # the swapped sequences went past host memory
    assert os.listdir(tmp_path / "root") == []


def test_example_batch_generate_exit_status_counts_the_recompute_run(tmp_path, monkeypatch):
    """With --recompute the exit status is 1 when either run's outputs differ from the requests run alone: a
    wrong token in the recompute run alone once exited 0."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "examples" / "kv_batch_generate.py"
    spec = importlib.util.spec_from_file_location("kv_batch_generate", script)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    argv = "--requests 2 --running 1 --quantum 2 --new-tokens 4 --layers 1 --recompute".split()
    argv += ["--nvme-path", str(tmp_path)]
    assert run_bounded(lambda: example.main(argv), BOUND) == 0
    real = example.serve

    def serve(model, requests, cache, *, recompute, **kw):
        out = real(model, requests, cache, recompute=recompute, **kw)
        if recompute:
            requests[0].tokens[-1] += 1  # the recompute run's outputs differ; the swap run's do not
        return out

    monkeypatch.setattr(example, "serve", serve)
    assert run_bounded(lambda: example.main(argv), BOUND) == 1


def _logits_with_swaps(model, prompts, steps, cache, rng):
    """Sequences take turns in ``cache`` (random order, random swaps from ``rng``); every step's logits."""
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    nxt = list(prompts)
    while any(len(g) < steps for g in got):
        s = rng.choice([i for i in range(len(prompts)) if len(got[i]) < steps])
        if s in cache.sequences and cache.is_swapped(s):
            cache.swap_in(s)
        cache.select([s])
        logits = model(input_ids=nxt[s], **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
        nxt[s] = logits.argmax(-1, keepdim=True)
        got[s].append(logits)
        for other in cache.sequences:
            if not cache.is_swapped(other) and rng.random() < 0.4:
                cache.swap_out(other)
    return [torch.cat(g) for g in got]


@pytest.mark.parametrize("place", sorted(PLACES))
def test_prefetch_equals_its_serial_twin(model, place, tmp_path):
    """Loading layers ahead (prefetch 2, and 1) gives the same logits, bit for bit, as loading each layer when it
    is needed (prefetch 0), with the pages in the window, in host memory and on NVMe, and across swaps (the same
    random turns and swaps for each)."""
    prompts = [torch.randint(1, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
               for n in (6, 17)]  # fmt: skip
    outs = {}
    for pf in (0, 1, 2):

        def run(pf=pf):
            with torch.no_grad(), TieredCache(model.config, tmp_path / str(pf), page_tokens=4, prefetch=pf,
                                              **PLACES[place]) as cache:  # fmt: skip
                out = _logits_with_swaps(model, prompts, 9, cache, random.Random(3))
                return out, cache.stats()

        outs[pf], st = run_bounded(run, BOUND)
        assert st["swaps"]["out"] >= 3 and st["swaps"]["in"] >= 3
        if place != "window":  # the twin loads each layer when needed; prefetching loads most ahead (not a
            # pass's first layers after a switch of sequence: nothing ran before them to hide the load behind)
            assert st["loads"]["prefetched"] > st["loads"]["waited"] if pf else st["loads"]["prefetched"] == 0
    for pf in (1, 2):
        for s in range(len(prompts)):
            assert torch.equal(outs[pf][s], outs[0][s]), f"prefetch {pf}, sequence {s}"


@pytest.mark.parametrize("host_budget", ["64KiB", "16KiB"])  # a reserve of 4 pages; of 1, the least there is
def test_reading_ahead_reads_no_page_twice(host_budget, tmp_path):
    """Decoding past host_budget, prefetch 2 reads from NVMe the bytes the serial twin reads, at most plus the
    pages read ahead past the last one used (the store's read-ahead, and the first two layers, which the last
    forward loads for a next one): it read up to twice as many, the read-ahead's count of the pages used having
    drifted from the pages the loads read (it read ahead pages used and retired already), or reading ahead where
    the reserve had room for the page being pinned only."""
    m = llama()
    ids = torch.randint(1, 96, (1, 21), generator=torch.Generator().manual_seed(3))
    read, logits = {}, {}
    for pf in (0, 2):

        def run(pf=pf):
            with torch.no_grad(), TieredCache(m.config, tmp_path / str(pf), gpu_budget=1, host_budget=host_budget,
                                              page_tokens=4, prefetch=pf) as cache:  # fmt: skip
                out = decode(m, ids, cache, 40)
                ahead = cache._win._ahead
                return out, cache.stats()["store"]["nvme"]["bytes_read"], ahead.limit if ahead else 0

        logits[pf], read[pf], limit = run_bounded(run, BOUND)
    page = kv_bytes(m, 4)  # one page of one layer
    last = 2 * ((21 + 40) // 4)  # the full pages of the first two layers at the end
    assert read[0] > 100 * page and read[2] <= read[0] + (limit + last) * page, (read, limit)
    assert all(torch.equal(a, b) for a, b in zip(logits[2], logits[0]))


def test_the_serial_twin_settles_the_copies_it_queued_on_the_callers_stream(monkeypatch):
    """With ``prefetch=0`` a layer's loads from held pages are queued on the caller's stream (no side stream):
    ``settle`` (before a sequence is freed and its pages go back to the pool) waits for that stream, as it waits
    for the side stream otherwise."""
    from tiered.kv.window import Window
    from tiered.kv.writes import PageWrites

    class Stream:
        waited = 0

        def synchronize(self) -> None:
            Stream.waited += 1

    w = Window.__new__(Window)
    w._pending, w.mover, w.writes = {}, None, PageWrites(None)  # type: ignore[arg-type]
    monkeypatch.setattr(w, "_compute", lambda: Stream())
    w.settle()
    assert Stream.waited == 1


def test_a_multimodal_models_config_is_its_text_decoders(tmp_path):
    # LlavaConfig (as Qwen2-VL's, PaliGemma's, ...) keeps num_hidden_layers in its text_config: model.config was
    # refused as "not a PretrainedConfig".
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    from tiered.kv.layout import layout_from_config

    text = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=28, patch_size=14)  # fmt: skip
    cfg = LlavaConfig(text_config=text, vision_config=vision, image_token_index=95)
    assert layout_from_config(cfg, 4) == layout_from_config(text, 4)
    assert (layout_from_config(cfg, 4).layers, layout_from_config(cfg, 4).kv_heads) == (3, 2)
    torch.manual_seed(0)
    m = LlavaForConditionalGeneration(cfg).eval()
    ids = torch.randint(1, 90, (1, 12), generator=torch.Generator().manual_seed(3))
    with TieredCache(m.config, tmp_path, gpu_budget=1, host_budget="16KiB", page_tokens=4) as cache:
        assert torch.equal(greedy(m, ids, cache, new=12), greedy(m, ids, DynamicCache(config=m.config), new=12))
