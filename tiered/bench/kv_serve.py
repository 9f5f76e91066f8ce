"""`tiered-bench kv --preempt`: more requests than the window holds, preempted by swapping or by recomputing.

The workload: ``requests`` prompts of ``prompt`` tokens each, every one to decode ``new_tokens`` greedily. A
round-robin scheduler runs at most ``running`` at once; one TieredCache serves them all, its window
(``gpu_budget``) sized for ``running`` sequences at their longest. A running request decodes ``quantum`` tokens a
turn (one sequence a forward: ``cache.select([seq])``), then, when others wait, is preempted and goes to the back
of the queue. Two ways to preempt, on the same schedule:

- swap: ``cache.swap_out(seq)`` (its tails stored, its pages already are; checksummed), ``swap_in`` at its next
  turn, where it resumes;
- recompute (what vLLM V1 does): the sequence is freed, and at its next turn its prompt and the tokens it made so
  far are prefilled again.

Every turn runs one sequence (batch size 1), as the run alone does, so batching cannot change the kernels. Each
request's logits at every step are compared with the request run alone through ``DynamicCache``, bit for bit, and
the run alone is made twice: its second run against the first is the reference's own spread (on a GPU whose
attention kernels do not repeat themselves, kv_exact.py), which the swap and recompute ways are judged against
(``verdict``). Swapping moves the keys and values bit for bit, so in deterministic mode it must be ``bitwise``.
Recomputing cannot be, by construction: the keys and values of the tokens made before the preemption are computed
again by a prefill (one matrix product over those tokens) where the run alone made them one token a forward, and
on a GPU the two shapes take different GEMM kernels, which sum in different orders. Each way's throughput is the
new tokens of all requests over its wall time (prefills included); the run alone is timed too (one request after
the other, no preemption).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Request", "serve", "measure_preempt", "window_for"]


@dataclass
class Request:
    rid: int
    prompt: Any  # (1, n) token ids on the model's device
    tokens: list[int] = field(default_factory=list)
    logits: list[Any] = field(default_factory=list)  # host copies, one a token


def _step(model: Any, ids: Any, cache: Any, chunk: int, req: Request) -> int:
    """Forward ``ids`` through ``cache`` in ``chunk``-token pieces; the greedy next token, kept in ``req``."""
    import torch

    from tiered.kv import cache_kwargs

    kw = cache_kwargs(model, cache)
    with torch.no_grad():
        for lo in range(0, ids.shape[1], chunk):
            out = model(input_ids=ids[:, lo : lo + chunk], **kw, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1].cpu()
    req.logits.append(logits)
    req.tokens.append(int(logits.argmax()))
    return req.tokens[-1]


def alone(model: Any, req: Request, new_tokens: int, chunk: int) -> Request:
    """The reference: the request decoded on its own, through transformers' DynamicCache."""
    import torch
    from transformers import DynamicCache

    cache, ids = DynamicCache(config=model.config), req.prompt
    for _ in range(new_tokens):
        ids = torch.tensor([[_step(model, ids, cache, chunk, req)]], device=req.prompt.device)
    return req


def window_for(model: Any, page_tokens: int, longest: int, running: int) -> int:
    """Window bytes for ``running`` sequences of ``longest`` tokens with every layer resident."""
    from tiered.kv.layout import layout_from_config

    lay = layout_from_config(model.config, page_tokens)
    return lay.window_bytes([longest] * running, model.dtype.itemsize)


def serve(model: Any, requests: list[Request], cache: Any, *, running: int, quantum: int, new_tokens: int,
          chunk: int, recompute: bool) -> dict[str, Any]:  # fmt: skip
    """Round robin over ``requests``, at most ``running`` at once, preempting by swap (or by recompute)."""
    import torch

    device = requests[0].prompt.device
    waiting = collections.deque(requests)
    active: list[Request] = []
    ran: dict[int, int] = {}  # rid -> steps in the current turn
    seq_of: dict[int, int] = {}  # rid -> its sequence in the cache (a new one after a recompute)
    next_seq = preemptions = recomputed = 0
    t0 = time.perf_counter()
    while waiting or active:
        while waiting and len(active) < running:  # admit: a new request, or a preempted one resumes
            req = waiting.popleft()
            seq = seq_of.get(req.rid)
            if seq is not None and cache.is_swapped(seq):
                cache.swap_in(seq)
            else:  # new, or dropped to be recomputed: prefill the prompt and the tokens so far
                seq_of[req.rid] = seq = next_seq
                next_seq += 1
                cache.select([seq])
                done = torch.tensor([req.tokens], device=device, dtype=torch.long)
                recomputed += done.shape[1] + (req.prompt.shape[1] if req.tokens else 0)
                _step(model, torch.cat([req.prompt, done], 1), cache, chunk, req)
            active.append(req)
            ran[req.rid] = 0
        for req in list(active):
            if len(req.tokens) < new_tokens:
                cache.select([seq_of[req.rid]])
                _step(model, torch.tensor([[req.tokens[-1]]], device=device), cache, chunk, req)
                ran[req.rid] += 1
            if len(req.tokens) >= new_tokens:
                active.remove(req)
                cache.free(seq_of[req.rid])
            elif ran[req.rid] >= quantum and waiting:  # preempt: to the back of the queue
                active.remove(req)
                if recompute:
                    cache.free(seq_of.pop(req.rid))
                else:
                    cache.swap_out(seq_of[req.rid])
                waiting.append(req)
                preemptions += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    st = cache.stats()
    return {"seconds": seconds, "tokens_per_s": len(requests) * new_tokens / seconds, "preemptions": preemptions,
            "recomputed_tokens": recomputed, "swaps": st["swaps"], "window_peak_bytes": st["window_peak"],
            "loaded_bytes": st["loaded_bytes"], "written_bytes": st["written_bytes"],
            "nvme": st["store"].get("nvme", {})}  # fmt: skip


def measure_preempt(model: Any, root: str, *, requests: int, running: int, quantum: int, prompt: int,
                    new_tokens: int, page_tokens: int, host_budget: str, chunk: int,
                    prefetch: int) -> dict[str, Any]:  # fmt: skip
    """The workload three ways (alone, swap, recompute), with every output compared with the run alone."""
    import torch

    from tiered.kv import TieredCache

    from .kv_decode import prompt_ids

    def fresh() -> list[Request]:
        return [Request(i, prompt_ids(model, prompt, seed=100 + i)) for i in range(requests)]

    budget = window_for(model, page_tokens, prompt + new_tokens + 1, running)
    res: dict[str, Any] = {"requests": requests, "running": running, "quantum": quantum, "prompt": prompt,
                           "new_tokens": new_tokens, "gpu_budget": budget,
                           "kv_bytes_all_requests": requests * (prompt + new_tokens) * _token_bytes(model)}  # fmt: skip
    want: dict[int, Request] = {}
    for name in ("alone", "alone_again"):  # the second run: the reference's own spread
        t0 = time.perf_counter()
        done = {r.rid: alone(model, r, new_tokens, chunk) for r in fresh()}
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        res[name] = {"seconds": time.perf_counter() - t0}
        res[name]["tokens_per_s"] = requests * new_tokens / res[name]["seconds"]
        if want:
            res[name].update(compare(list(done.values()), want))
        else:
            want = done
    spread = res["alone_again"]
    for name, recompute in (("swap", False), ("recompute", True)):
        reqs = fresh()
        with TieredCache(model.config, root, gpu_budget=budget, host_budget=host_budget, page_tokens=page_tokens,
                         prefetch=prefetch) as cache:  # fmt: skip
            row = serve(model, reqs, cache, running=running, quantum=quantum, new_tokens=new_tokens, chunk=chunk,
                        recompute=recompute)  # fmt: skip
        row.update(compare(reqs, want))
        row["verdict"] = ("bitwise" if row["logits_equal"] else "within spread" if row["max_abs_logit_diff"] <=
                          spread["max_abs_logit_diff"] else "outside spread")  # fmt: skip
        if recompute and row["verdict"] == "outside spread":  # expected: see the module's text
            row["verdict"] = "differs, as recomputing must"
        res[name] = row
    res["swap_over_recompute"] = res["swap"]["tokens_per_s"] / res["recompute"]["tokens_per_s"]
    return res


def compare(got: list[Request], want: dict[int, Request]) -> dict[str, Any]:
    """Each request's tokens and logits against its run alone: ``equal`` (the tokens), ``logits_equal``, the
    requests whose tokens differ, each request's first step whose logits differ, the largest difference."""
    first: dict[int, int] = {}
    worst = 0.0
    for r in got:
        w = want[r.rid]
        for i, (a, b) in enumerate(zip(r.logits, w.logits)):
            if not bool((a == b).all()):
                first.setdefault(r.rid, i)
                worst = max(worst, float((a.float() - b.float()).abs().max()))
    unequal = [r.rid for r in got if r.tokens != want[r.rid].tokens]
    return {"equal": not unequal, "unequal_requests": unequal, "logits_equal": not first,
            "first_logits_difference": first, "max_abs_logit_diff": worst}  # fmt: skip


def _token_bytes(model: Any) -> int:
    from .kv_decode import kv_token_bytes

    return kv_token_bytes(model)
