"""Where an offloaded model's GPU memory goes, layer by layer: the CUDA test's 0.27B Llama (16 decoder layers, bf16)
under ``tiered.offload_model``, with GPU memory allocated (and its peak) printed after each decoder layer's forward
and before its backward, after each micro-batch's backward, and after the optimizer's step.

A window of layers should hold a few layers' weights and gradients at a time; memory growing by one layer's
weights per layer of forward means layers stay gathered on the GPU. Synchronizes at every mark (it measures
memory, not time). Needs CUDA.

    PYTHONPATH=$PWD python bench/offload_memory.py --nvme /root/tb > offload_memory.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "unit" / "offload")]  # the CUDA test's model and data

from test_offload_params import SHAPES, llama, micro_batch  # noqa: E402

import tiered  # noqa: E402
from tiered import TieredOptimizer  # noqa: E402
from tiered.offload import offload_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvme", default="/tmp/offload_memory")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=2)
    a = p.parse_args()
    marks: list[tuple[str, float, float]] = []
    mib = 2**20

    def mark(tag: str) -> None:
        torch.cuda.synchronize()
        marks.append((tag, torch.cuda.memory_allocated() / mib, torch.cuda.max_memory_allocated() / mib))

    model = llama(torch.bfloat16, "wide")
    offload_model(model, device="cuda", keep_for_backward=False)  # the streamed window is what this measures
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    mark("offloaded")
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda m, args, out, i=i: mark(f"forward {i}"))
        layer.register_full_backward_pre_hook(lambda m, grad, i=i: mark(f"backward {i}"))
    opt = TieredOptimizer(model, nvme_path=a.nvme, update_on="host", split_masters=True, host_budget="3GiB",
                          chunk_bytes="64MiB", max_grad_norm=1.0)  # fmt: skip
    try:
        for step in range(a.steps):
            for k in range(a.accumulate):
                x = micro_batch(step, k, SHAPES["wide"][3]).to("cuda")
                loss = model(input_ids=x, labels=x).loss / a.accumulate
                mark(f"step {step} micro-batch {k} forward")
                loss.backward()
                mark(f"step {step} micro-batch {k} backward")
            opt.step()
            mark(f"step {step} optimizer")
            opt.zero_grad()
            mark(f"step {step} zero_grad")
    finally:
        opt.close()
        tiered.offload.close()
    params = sum(p.numel() for p in model.parameters())
    layer_bytes = sum(p.numel() for p in model.model.layers[0].parameters()) * 2
    print(json.dumps({"params": params, "weights_and_grads_mib": params * 4 / mib,
                      "layer_weights_mib": layer_bytes / mib, "peak_mib": torch.cuda.max_memory_allocated() / mib,
                      "marks": [{"at": t, "allocated_mib": round(m, 1), "peak_mib": round(pk, 1)}
                                for t, m, pk in marks]}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
