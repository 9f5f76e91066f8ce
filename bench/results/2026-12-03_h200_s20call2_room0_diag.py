"""Issue 29 (twentieth session): why does an offloaded run whose clip keeps no gradient copy on the GPU
(auto_budget.grad_room forced to 0) differ from the run on the GPU, when keeping all or half agrees bitwise?
Each variant trains the 0.27B of tests/gpu/test_offload_params_cuda.py one step (2 micro-batches, clip 0.5) and
prints the parameters whose weights differ from the run on the GPU's."""

import json
import os
import sys
from pathlib import Path

for d in Path("tests").rglob("*"):
    if d.is_dir() and "__pycache__" not in str(d):
        sys.path.append(str(d))
sys.path.append("tests")
import torch  # noqa: E402
from test_offload_params import train  # noqa: E402

import tiered.offload_accumulation as acc  # noqa: E402
import tiered.optim.resident_grads as resident_grads  # noqa: E402
import tiered.optim.shards as shards  # noqa: E402
from tiered import shares  # noqa: E402
from tiered.optim.device_update import DeviceUpdate  # noqa: E402

ON_GPU = dict(
    device="cuda",
    shape="wide",
    update_on="device",
    split_masters=True,
    host_budget="3GiB",
    chunk_bytes="64MiB",
    accumulate=2,
    steps=(0, 1),
    keep=False,
)
resident_grads.ENABLED = False  # the clip's own copies only (the last variant finds backward's sums)
out = Path(os.environ.get("OUT", "/tmp"))
real_room, real_stage, real_inflight = shards.grad_room, DeviceUpdate._stage_grads, shares.CHUNKS_IN_FLIGHT


def synced(self, chunk, js):
    torch.cuda.synchronize()
    r = real_stage(self, chunk, js)
    torch.cuda.synchronize()
    return r


def variant(name, offload=True, room=None, clip=0.5, sync=False, inflight=None, device_sums=None, resident=False):
    resident_grads.ENABLED = resident
    shards.grad_room = real_room if room is None else (lambda device: room)
    DeviceUpdate._stage_grads = synced if sync else real_stage
    shares.CHUNKS_IN_FLIGHT = inflight or real_inflight
    if device_sums is not None:
        acc.SUM_ON_DEVICE = device_sums
    d = Path(f"/root/diag/{name}")
    d.mkdir(parents=True, exist_ok=True)
    r = train(str(d), offload=offload, clip=clip, **ON_GPU)
    acc.SUM_ON_DEVICE = True
    return r


plain = variant("plain", offload=False)
plain_noclip = variant("plain_noclip", offload=False, clip=None)
rows = {}
for name, kw in [
    ("whole", {}),
    ("none", {"room": 0}),
    ("none_noclip", {"room": 0, "clip": None}),
    ("none_sync", {"room": 0, "sync": True}),
    ("none_inflight1", {"room": 0, "inflight": 1}),
    ("none_worker_sums", {"room": 0, "device_sums": False}),
    ("half_sync", {"room": 2**28}),
    ("resident_none", {"room": 0, "resident": True}),
]:
    try:
        r = variant(name, **kw)
    except Exception as e:  # noqa: BLE001
        print(name, "FAILED", repr(e)[:300], flush=True)
        continue
    ref = plain_noclip if kw.get("clip", 0.5) is None else plain
    differ = [n for n in ref["weights"] if r["weights"][n] != ref["weights"][n]]
    rows[name] = {
        "differ": len(differ),
        "of": len(ref["weights"]),
        "first": differ[:8],
        "kept": r["grads_kept"],
        "losses_equal": r["losses"] == ref["losses"],
    }
    print(name, json.dumps(rows[name]), flush=True)
(out / "room0_diag.json").write_text(json.dumps(rows, indent=1))
