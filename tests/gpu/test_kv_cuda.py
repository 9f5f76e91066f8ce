"""TieredCache on CUDA: the side-stream loads and event-ordered write-backs give the same tokens as DynamicCache,
in fp32 and bf16, with the KV in the window, spilled to host and to NVMe, and after swaps. Skipped without CUDA."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from helpers import run_bounded

pytest.importorskip("transformers", minversion="5.0")
from test_kv_cache import BOUND, PLACES, decode, greedy  # noqa: E402
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
