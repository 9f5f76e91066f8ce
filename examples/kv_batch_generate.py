"""Serve more requests than fit: a round-robin scheduler that preempts sequences by swapping their KV cache out.

    python examples/kv_batch_generate.py                      # 8 requests, 2 at a time, a tiny Llama on the CPU
    python examples/kv_batch_generate.py --requests 16 --running 4 --quantum 3 --host-budget 64KiB
    python examples/kv_batch_generate.py --recompute          # also: preempt by dropping and recomputing
    python examples/kv_batch_generate.py --device cuda --hidden 1024 --layers 8 --new-tokens 64

All requests share one ``TieredCache``. At most ``--running`` sequences hold window memory at once (the window,
``gpu_budget``, is sized for that many); the others wait. Each running sequence decodes ``--quantum`` tokens,
then, when others wait, it is preempted: ``cache.swap_out(seq)`` moves its keys and values to host memory (and
to NVMe past ``--host-budget``) and frees its window buffers, and it goes to the back of the queue. When its
turn comes, ``cache.swap_in(seq)`` brings it back, checked against the checksum taken at swap-out, and it
resumes where it stopped. Each decode step runs one sequence (``cache.select([seq])``), so the tokens can be
compared with each request run alone through ``DynamicCache``: the script says whether they are all equal (exit
status 0) or not (1). ``--recompute`` runs the same schedule again, preempting by forgetting the sequence and
recomputing its prompt and tokens so far at resume, and prints both times; the exit status is then 0 only when
both runs' outputs are equal. The scheduler is
``tiered.bench.kv_serve.serve``, the one ``tiered-bench kv --preempt`` times on a GPU.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from io_engine import parse_size
from tiered.bench import example_args as checks
from tiered.bench.arg_types import positive
from tiered.bench.kv_serve import Request, alone, serve
from tiered.kv import TieredCache

WHOLE = 1 << 30  # prefill chunk: a prompt in one forward


def build_model(args: argparse.Namespace, device: torch.device) -> LlamaForCausalLM:
    """A Llama with grouped-query attention, random weights from a fixed seed: nothing is downloaded."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=4096)  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in place, in its dtype: a large model never exists in fp32 on the host
    try:
        with torch.device(device):
            return LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)


def make_requests(args: argparse.Namespace, device: torch.device) -> list[Request]:
    g = torch.Generator().manual_seed(1)
    out = []
    for rid in range(args.requests):
        n = int(torch.randint(args.min_prompt, args.max_prompt + 1, (1,), generator=g))
        out.append(Request(rid, torch.randint(1, args.vocab, (1, n), generator=g).to(device)))
    return out


def window_budget(model: LlamaForCausalLM, args: argparse.Namespace) -> int:
    """Window bytes for ``--running`` sequences of the longest length in every layer (pages rounded up, plus
    the page of room a slot keeps): so the running ones stay in the window and the waiting ones cannot."""
    cfg, p = model.config, args.page_tokens
    longest = args.max_prompt + args.new_tokens
    tokens = (-(-(longest + 2 * p) // p)) * p
    per_token = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * model.dtype.itemsize
    return args.running * tokens * per_token * cfg.num_hidden_layers


def run(model: LlamaForCausalLM, requests: list[Request], args: argparse.Namespace, recompute: bool = False) -> dict:
    """The requests through one TieredCache whose window holds ``--running`` of them: tiered.bench.kv_serve's
    round robin (admit, decode ``--quantum`` tokens a turn, preempt by ``swap_out``/``swap_in`` or by recomputing)."""
    with TieredCache(model.config, args.nvme_path, gpu_budget=window_budget(model, args), host_budget=args.host_budget,
                     page_tokens=args.page_tokens) as cache:  # fmt: skip
        return serve(model, requests, cache, running=args.running, quantum=args.quantum, new_tokens=args.new_tokens,
                     chunk=WHOLE, recompute=recompute)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=positive, default=8)
    p.add_argument("--running", type=positive, default=2, help="sequences in the window at once")
    p.add_argument("--quantum", type=positive, default=4, help="tokens a turn before a preemption")
    p.add_argument("--new-tokens", type=positive, default=20)
    p.add_argument("--min-prompt", type=positive, default=4)
    p.add_argument("--max-prompt", type=positive, default=24)
    p.add_argument("--page-tokens", type=positive, default=8)
    p.add_argument("--host-budget", default="96KiB", help="pinned host memory for pages; the rest goes to NVMe")
    p.add_argument("--nvme-path", type=checks.user_path,
                   help="root of the NVMe tier (default: $TIERED_NVME_PATH, else <tempdir>/tiered)")  # fmt: skip
    p.add_argument("--device", type=checks.device, default="cpu")
    p.add_argument("--hidden", type=positive, default=64)
    p.add_argument("--layers", type=positive, default=4)
    p.add_argument("--heads", type=positive, default=4)
    p.add_argument("--kv-heads", type=positive, default=2)
    p.add_argument("--vocab", type=positive, default=256)
    p.add_argument("--recompute", action="store_true", help="also preempt by dropping and recomputing")
    p.add_argument("--json", metavar="PATH", type=checks.output_file, help="write the figures here as JSON")
    args = p.parse_args(argv)
    # Before the model is built and each request run alone: one line naming the flag, not a traceback.
    if args.min_prompt > args.max_prompt:
        p.error("need --min-prompt <= --max-prompt")
    if args.vocab < 2:
        p.error("--vocab must be >= 2: prompts draw token ids from 1 up")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here; pass --device cpu")
    try:
        parse_size(args.host_budget, name="--host-budget")
    except ValueError as e:
        p.error(str(e))
    for problem in (checks.llama_shape_problem(args.hidden, args.heads, args.kv_heads),
                    args.nvme_path and checks.folder_problem("--nvme-path", args.nvme_path)):  # fmt: skip
        if problem:
            p.error(problem)
    device = args.device
    model = build_model(args, device)
    requests = make_requests(args, device)
    want = {r.rid: alone(model, Request(r.rid, r.prompt), args.new_tokens, WHOLE).tokens for r in requests}
    report = {"swap": run(model, requests, args)}
    equal = all(r.tokens == want[r.rid] for r in requests)
    report["swap"]["equal"] = equal
    if args.recompute:
        again = make_requests(args, device)
        report["recompute"] = run(model, again, args, recompute=True)
        report["recompute"]["equal"] = all(r.tokens == want[r.rid] for r in again)
    s = report["swap"]
    print(f"{args.requests} requests, {args.running} at a time: {s['preemptions']} preemptions by swapping "
          f"({s['nvme']['bytes_written']} bytes written to NVMe) in {s['seconds']:.2f} s; outputs equal to each "
          f"request run alone: {equal}")  # fmt: skip
    if args.recompute:
        r = report["recompute"]
        print(f"preempting by recomputing instead: {r['seconds']:.2f} s; outputs equal: {r['equal']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(each["equal"] for each in report.values()) else 1  # --recompute's run counts too


if __name__ == "__main__":
    checks.exit_on_sigterm("kv_batch_generate.py")  # the cache's `with` then removes its page files
    try:
        raise SystemExit(main())
    except (ValueError, TypeError, OSError) as e:  # what the cache refuses (a host budget too small for a page)
        raise SystemExit(f"kv_batch_generate.py: error: {e}") from None
