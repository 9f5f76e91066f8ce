"""How fast the host sums bf16 gradients (``a += b``), on the main thread and on another one: the work the
offloaded model's gradient accumulation does per micro-batch (tiered/offload/accumulation.py), for 200 Mi
elements (a 10B Llama block's gradients). Prints one JSON line: GB/s of memory traffic (two reads, one write).

    python bench/host_add.py
"""

import json
import threading
import time

import torch

n = 200 * 2**20
a, b = torch.randn(n).bfloat16(), torch.randn(n).bfloat16()
out: dict = {"threads": torch.get_num_threads(), "elements": n}
for where in ("main", "thread"):

    def go(where: str = where) -> None:
        a.add_(b)  # first touch and warm-up
        t = time.perf_counter()
        for _ in range(5):
            a.add_(b)
        out[f"{where}_GBps"] = round(5 * n * 2 * 3 / (time.perf_counter() - t) / 1e9, 2)

    if where == "main":
        go()
    else:
        th = threading.Thread(target=go)
        th.start()
        th.join()
print(json.dumps(out))
