"""The two-thread, six-key store mix of tests/unit/store/test_store_threads.py, seeds 0-39, each under a 15 s
watchdog; on a hang it prints every record's state and the threads' stacks. Run from the repo root (TMPDIR: a
folder on disk)."""

import faulthandler
import random
import tempfile
import threading
import time

import torch

from io_engine import IOConfig
from tiered.store import TieredStore

KIB = 1024
KEYS = [f"k{i}" for i in range(6)]


def chunk(v: float) -> torch.Tensor:
    return torch.full((16 * KIB // 4,), float(v))


def worker(s: TieredStore, seed: int, w: int) -> None:
    rng = random.Random(seed * 100 + w)
    for n in range(1500):
        k = rng.choice(KEYS)
        if rng.random() < 0.5:
            s.put(k, chunk(n))
        else:
            try:
                s.get(k)
            except KeyError:
                pass


for seed in range(40):
    s = TieredStore(tempfile.mkdtemp() + "/s", host_budget=3 * 16 * KIB, io=IOConfig(threads=2, block_size="16KiB"))
    ts = [threading.Thread(target=worker, args=(s, seed, w), daemon=True) for w in (0, 1)]
    t0 = time.time()
    for t in ts:
        t.start()
    for t in ts:
        t.join(15)
    if any(t.is_alive() for t in ts):
        print("HANG seed", seed)
        st = s._state
        with st.lock:
            for k, r in st.recs.items():
                print(k, r.kind, f"buf={r.buf is not None} pins={r.pins} dirty={r.dirty} evictable={r.evictable}")
            print(f"pool in_use={st.pool.in_use} of {st.pool.capacity}, nudges={st.pool.nudges}")
        faulthandler.dump_traceback(all_threads=True)
        break
    print("seed", seed, round(time.time() - t0, 2), flush=True)
    s.close()
