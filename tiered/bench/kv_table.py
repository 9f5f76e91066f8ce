"""The printed result of `tiered-bench kv` (without ``--json``): ``table(res)``, a line for the model and what was
measured, then per step of the run or the suite one line a cache (its speed, the bytes a token moved, its distance
to the floor, its exactness and verdict) and the preemption step's line.

This module exists so that kv.py keeps the command (its flags, the run, the suite's steps) and this one how the
result reads, each read in one sitting. It formats only: the figures and verdicts are kv.py's and kv_exact.py's.
"""

from __future__ import annotations

from typing import Any

__all__ = ["table"]


def table(res: dict[str, Any]) -> str:
    lines = [f"{res['shape']} Llama, {res['layers']} layers, {res['device']} {res.get('gpu', '')}; KV "
             f"{res['kv_bytes_per_token']} bytes a token; built in {res['build_s']:.1f} s"]  # fmt: skip
    bw = res.get("bandwidth", {})
    lines.append("measured: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in bw.items() if v))
    ex = res.get("exactness", {})
    lines.append(f"exactness: {'deterministic' if ex.get('deterministic') else 'default kernels'}, sdpa "
                 f"{ex.get('sdpa')}" + (f"; ops without a deterministic kernel: {ex['nondeterministic_ops']}"
                                        if ex.get("nondeterministic_ops") else ""))  # fmt: skip
    groups = {"runs": res["runs"]} if "runs" in res else res.get("suite", {})
    for step, runs in groups.items():
        if not isinstance(runs, dict):
            lines.append(f"[{step}] {runs}")
            continue
        if step == "preempt":
            lines.append(_preempt_line(runs))
            continue
        lines.append(f"[{step}] context {runs.get('context', '')}, {runs.get('new_tokens', '')} new tokens"
                     + (f"; tiered/offloaded decode {runs['tiered_over_offloaded']:.2f}x"
                        if runs.get("tiered_over_offloaded") else ""))  # fmt: skip
        sp = runs.get("reference_spread")
        if sp:
            lines.append("  reference spread (DynamicCache against itself): " + ("none, bitwise" if
                         sp["logits_equal"] else f"logits from step {sp['first_logits_difference']}, max "
                         f"{sp['max_abs_logit_diff']:.3g}"))  # fmt: skip
        for name, r in runs.items():
            if isinstance(r, (dict, str)) and name not in ("context", "new_tokens", "reference_spread"):
                lines.append("  " + _row(name, r))
    lines.append(f"total {res.get('total_s', 0):.1f} s; {'ok' if res.get('ok') else 'NOT OK (see above)'}")
    return "\n".join(lines)


def _row(name: str, r: Any) -> str:
    from io_engine import format_size

    if isinstance(r, str):
        return f"{name:13s} {r}"
    if r.get("oom"):
        return f"{name:13s} out of GPU memory after {r['prompt_tokens_reached']} prompt tokens"
    if "error" in r:
        return f"{name:13s} error: {r['error']}"
    s = f"{name:13s} prefill {r['prefill_s']:.2f} s, decode {r['decode_tokens_per_s']:.2f} tokens/s"
    b = r.get("bytes_per_token")
    if b:
        s += f", a token: {format_size(int(b['host_to_gpu']))} up, {format_size(int(b['nvme_read']))} NVMe read, " \
             f"{b['page_copies']:.0f} page copies, {b['host_syncs']:.0f} host syncs"  # fmt: skip
    if r.get("floor_ratio"):
        s += f"; {r['floor_ratio']:.2f}x the {r['floor_link']} floor"
    if "tokens_equal" in r:
        s += "; tokens equal" if r["tokens_equal"] else f"; TOKENS DIFFER from step {r['first_token_difference']}"
        s += ", logits equal" if r["logits_equal"] else \
            f", logits differ from step {r['first_logits_difference']} (max {r['max_abs_logit_diff']:.3g})"  # fmt: skip
        if r.get("again") and not r["logits_equal"]:
            a = r["again"]
            s += "; against the second run: " + (
                "bitwise" if a["logits_equal"] else f"max {a['max_abs_logit_diff']:.3g}"
            )
        if r.get("verdict"):
            s += f" -> {r['verdict'].upper()}"
    return s


def _preempt_line(p: dict[str, Any]) -> str:
    if "error" in p:
        return f"[preempt] error: {p['error']}"
    sw, rc = p["swap"], p["recompute"]
    ag = p["alone_again"]
    return (f"[preempt] {p['requests']} requests of {p['prompt']} tokens, {p['running']} at once: swap "
            f"{sw['tokens_per_s']:.2f} tokens/s ({sw['preemptions']} preemptions, tokens equal {sw['equal']}, "
            f"{sw['verdict'].upper()}, max {sw['max_abs_logit_diff']:.3g}), recompute {rc['tokens_per_s']:.2f} (tokens "
            f"equal {rc['equal']}, {rc['verdict']}, max {rc['max_abs_logit_diff']:.3g}), alone "
            f"{p['alone']['tokens_per_s']:.2f} (against itself: max {ag['max_abs_logit_diff']:.3g}); swap/recompute "
            f"{p['swap_over_recompute']:.2f}x")  # fmt: skip
