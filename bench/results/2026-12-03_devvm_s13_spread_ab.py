"""A/B on the development machine: the optimizer step with the on-disk chunks spread among the resident ones (the
step's order since cad5a86), and in put order (spread_disk replaced by the identity). Run from the repo root:
    python3 bench/results/2026-12-03_devvm_s13_spread_ab.py spread|put_order PARAMS HOST_BUDGET CHUNK_BYTES
"""

import json
import os
import statistics
import sys

import torch

import tiered.optim.pipeline as pl
from tiered import TieredOptimizer

mode, params, host, chunk = sys.argv[1], int(float(sys.argv[2])), sys.argv[3], sys.argv[4]
if mode == "put_order":
    pl.spread_disk = lambda store, keys: list(range(len(keys)))
torch.manual_seed(0)
n_t = 16
ps = [torch.nn.Parameter(torch.randn(params // n_t)) for _ in range(n_t)]
for p in ps:
    p.grad = torch.randn_like(p)
with TieredOptimizer(ps, nvme_path=os.environ.get("TMPDIR", "/tmp"), host_budget=host, chunk_bytes=chunk) as opt:
    rows = []
    for _ in range(5):
        opt.step()
        rows.append(opt.stats()["last_step"])
    res = {k: statistics.median(r[k] for r in rows[1:]) for k in ("step_s", "read_wait_s", "write_wait_s", "update_s")}
    res["nvme_GB"] = (rows[-1]["nvme_read_bytes"] + rows[-1]["nvme_write_bytes"]) / 1e9
    res["resident"] = sum(opt.store.is_resident(c.key) for c in opt.chunks)
    res["chunks"] = len(opt.chunks)
    print(mode, json.dumps({k: round(v, 3) for k, v in res.items()}), flush=True)
