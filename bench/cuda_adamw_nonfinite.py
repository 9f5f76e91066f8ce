"""torch.optim.AdamW on CUDA, foreach and fused, after one gradient of 1e30: which weights end non-finite, and
the moments there (bench/RESULTS.md, eighth session). Needs CUDA: python bench/cuda_adamw_nonfinite.py"""

import torch
from torch import nn

B = 256
for fused in (False, True):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(4 * B + 30, device="cuda"))
    o = torch.optim.AdamW([p], lr=1e-2, fused=fused)
    for i in range(3):
        g = torch.randn(p.shape, device="cuda")
        if i == 0:
            g[B + 17] = 1e30
        p.grad = g
        o.step()
        st = o.state[p]
        print(
            "fused",
            fused,
            "step",
            i,
            "nonfinite",
            (~torch.isfinite(p)).nonzero().flatten().tolist(),
            "w",
            p[B + 17].item(),
            "m",
            st["exp_avg"][B + 17].item(),
            "v",
            st["exp_avg_sq"][B + 17].item(),
        )
