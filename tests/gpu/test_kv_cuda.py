"""TieredCache on CUDA: the side-stream loads and event-ordered write-backs give the same tokens as DynamicCache,
in fp32 and bf16, with the KV in the window, spilled to host and to NVMe, and after swaps; in deterministic mode
(tiered/bench/kv_exact.py) DynamicCache repeats itself and TieredCache (prefetching, and its serial twin) and the
race-free OffloadedCache equal it bit for bit at every step; prefetching equals its serial twin across swaps.
Skipped without CUDA."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from helpers import run_bounded

pytest.importorskip("transformers", minversion="5.0")
from test_kv_cache import BOUND, PLACES, _logits_with_swaps, decode, greedy  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiered.kv import TieredCache, cache_kwargs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")]


def cuda_llama(dtype: torch.dtype, layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)  # fmt: skip
    return LlamaForCausalLM(cfg).to("cuda", dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("place", sorted(PLACES))
def test_cuda_generate_equals_dynamic_cache(dtype, place, tmp_path):
    m = cuda_llama(dtype)
    ids = torch.randint(1, 512, (2, 150), generator=torch.Generator().manual_seed(3)).cuda()
    ref = greedy(m, ids, DynamicCache(config=m.config), new=40)
    budgets = dict(PLACES[place])
    if place == "nvme":
        budgets["host_budget"] = "256KiB"  # a few pages of 2 x 2 heads x 16 tokens x 32 x 4 bytes
    with TieredCache(m.config, tmp_path, page_tokens=16, **budgets) as cache:
        out = greedy(m, ids, cache, new=40)
        st = cache.stats()
    assert torch.equal(out, ref)
    if place != "window":
        assert st["loaded_bytes"] > 0
    if place == "nvme":
        assert st["store"]["nvme"]["reads"] > 0


def test_cuda_window_streams_with_less_memory(tmp_path):
    """With a window of a few layers, a long context decodes holding less GPU memory than DynamicCache."""
    m = cuda_llama(torch.bfloat16, layers=32)
    ids = torch.randint(1, 512, (1, 1500), generator=torch.Generator().manual_seed(4)).cuda()
    # bytes of the whole KV at the end: 6.2 MB. The tiered window holds about three layers' (0.4 MB each: the one
    # written back, the one in use, the one loading), whatever the layer count.
    kv = 2 * 2 * 32 * 2 * 1516 * 32
    peaks, outs = {}, {}
    for name in ("dynamic", "tiered"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        with contextlib.ExitStack() as stack:
            if name == "dynamic":
                cache = DynamicCache(config=m.config)
            else:
                cache = stack.enter_context(TieredCache(m.config, tmp_path, page_tokens=64, gpu_budget="1MiB"))
            with torch.no_grad():
                first = (
                    m(input_ids=ids, **cache_kwargs(m, cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                )
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()  # decode only: prefill's activations dwarf the KV
                outs[name] = run_bounded(lambda c=cache, f=first: decode(m, f, c, 16)[0], BOUND)
                torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() - base
            if name == "tiered":
                assert cache.stats()["resident"] == 0
    assert torch.equal(outs["tiered"], outs["dynamic"])
    assert peaks["dynamic"] >= kv
    assert peaks["tiered"] < peaks["dynamic"] - kv // 2


@pytest.mark.parametrize("place", ["window", "nvme"])
def test_cuda_swaps_at_random_points(place, tmp_path):
    m = cuda_llama(torch.bfloat16)
    rng = random.Random(5)
    prompts = [torch.randint(1, 512, (1, n), generator=torch.Generator().manual_seed(n)).cuda() for n in (7, 33, 70)]
    steps = 20
    with torch.no_grad():
        want = [decode(m, p, DynamicCache(config=m.config), steps)[0] for p in prompts]
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    nxt = list(prompts)

    def run():
        with torch.no_grad(), TieredCache(m.config, tmp_path, page_tokens=16, **PLACES[place]) as cache:
            while any(len(g) < steps for g in got):
                s = rng.choice([i for i in range(len(prompts)) if len(got[i]) < steps])
                if s in cache.sequences and cache.is_swapped(s):
                    cache.swap_in(s)
                cache.select([s])
                nxt[s] = (
                    m(input_ids=nxt[s], **cache_kwargs(m, cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                )
                got[s].append(nxt[s])
                for other in cache.sequences:
                    if not cache.is_swapped(other) and rng.random() < 0.5:
                        cache.swap_out(other)
            return cache.stats()["swaps"]["out"]

    assert run_bounded(run, BOUND) >= 10
    for s in range(len(prompts)):
        assert torch.equal(torch.cat(got[s], 1), want[s]), f"sequence {s}"


@pytest.fixture
def exact():
    """Deterministic kernels and the math attention backend, put back afterwards."""
    from tiered.bench.kv_exact import deterministic, sdpa

    with deterministic(), sdpa("math"):
        yield


def _run(m, prompt, make, ref, keep=None, again=None):
    from tiered.bench.kv_decode import run_cache

    return run_bounded(lambda: run_cache(m, prompt, make, new_tokens=12, chunk=64, ref=ref, keep=keep, again=again),
                       BOUND)  # fmt: skip


def test_cuda_deterministic_caches_equal_the_reference_bitwise(exact, tmp_path):
    """In deterministic mode DynamicCache repeats itself, and every cache equals it at every step, bit for bit
    (teacher-forced on the reference's tokens, several prefill chunks)."""
    from tiered.bench.kv_decode import Reference
    from tiered.bench.kv_exact import offloaded_cache

    m = cuda_llama(torch.bfloat16)
    prompt = torch.randint(1, 512, (1, 300), generator=torch.Generator().manual_seed(6)).cuda()
    ref, again = Reference(), Reference()
    _run(m, prompt, lambda: DynamicCache(config=m.config), None, keep=ref)
    rows = {"dynamic_again": _run(m, prompt, lambda: DynamicCache(config=m.config), ref, keep=again)}
    rows["offloaded"] = _run(m, prompt, lambda: offloaded_cache(m.config), ref)
    for pf in (0, 2):
        for place in ("host", "nvme"):
            budgets = dict(PLACES[place], host_budget="256KiB" if place == "nvme" else "64MiB")

            def make(pf=pf, budgets=budgets, place=place):
                return TieredCache(m.config, tmp_path / f"{place}{pf}", page_tokens=16, prefetch=pf, **budgets)

            rows[f"tiered_{place}_prefetch{pf}"] = _run(m, prompt, make, ref)
    for name, row in rows.items():
        assert row["logits_equal"], (name, row["first_logits_difference"], row["max_abs_logit_diff"])


@pytest.mark.parametrize("place", ["host", "nvme"])
def test_cuda_prefetch_equals_its_serial_twin_across_swaps(place, tmp_path):
    """The same random turns and swaps with prefetch 2 and prefetch 0: the same logits, bit for bit. Same
    kernels on both sides, so no deterministic mode is needed: a difference is a defect of the loads."""
    m = cuda_llama(torch.bfloat16)
    prompts = [torch.randint(1, 512, (1, n), generator=torch.Generator().manual_seed(n)).cuda() for n in (40, 90)]
    budgets = dict(PLACES[place], host_budget="256KiB" if place == "nvme" else "64MiB")
    outs = {}
    for pf in (0, 2):

        def run(pf=pf):
            with torch.no_grad(), TieredCache(m.config, tmp_path / str(pf), page_tokens=16, prefetch=pf,
                                              **budgets) as cache:  # fmt: skip
                return _logits_with_swaps(m, prompts, 16, cache, random.Random(9))

        outs[pf] = run_bounded(run, BOUND)
    for s in range(len(prompts)):
        assert torch.equal(outs[2][s], outs[0][s]), f"sequence {s}"
