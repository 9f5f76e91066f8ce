#!/usr/bin/env bash
# Issue 29 (eighteenth session, call 2; run as one command, kept here as run): the offloaded 4.42B's step profiled
# (2 micro-batches) and its copies summarized by stream and kind (bench/step_timeline.py's `copies`), and the
# copies' sizes by stream; the trace itself was brought back and read by hand for the host ranges around the
# compute stream's host-to-device copies (they sit inside FSDP::pre_forward).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout -k 5 200 python3 examples/big_model.py --hidden 3200 --layers 34 --heads 32 --inter 8640 --seq 2048 \
  --gpu-memory-cap 24GB --steps 1 --batch 4 --accumulate 2 --nvme-path /root/big_nvme --trace /root/trace44.json \
  > $OUT/trace44.log 2>&1; echo "rc=$?"
python3 bench/step_timeline.py /root/trace44.json --step step > $OUT/timeline44.json; echo "timeline rc=$?"
python3 - <<'PY' > $OUT/top_copies.txt
import json
from collections import Counter
ev = json.load(open('/root/trace44.json'))['traceEvents']
c, d = Counter(), Counter()
for e in ev:
    if e.get('cat') == 'gpu_memcpy':
        k = (e['args'].get('stream'), e['name'], round(float(e['args'].get('bytes', 0)) / 1e6))
        c[k] += 1
        d[k] += e['dur']
for k, n in sorted(c.items(), key=lambda kv: -d[kv[0]])[:40]:
    print(k, n, round(d[k] / 1000, 1), 'ms')
PY
gzip -c /root/trace44.json > $OUT/trace44.json.gz
