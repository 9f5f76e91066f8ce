#!/usr/bin/env bash
# This session's last GPU call: the state visiting HBM (ddr), the KV cache suite (kv), the disk against libaio (io).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
(timeout -k 5 150 bash .anchors/run_on_device.sh build_aio.py > $OUT/aio_build.log 2>&1) &
say tests
timeout -k 5 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_staged_cuda.py tests/gpu/test_under_backward_cuda.py tests/gpu/test_kv_cuda.py > $OUT/tests.log 2>&1; tail -8 $OUT/tests.log
wait; cat $OUT/aio_build.log | tail -2
say ddr
timeout -k 5 100 python3 bench/llama_ab.py --nvme /root/ab --batch 32 --steps 6 --warmup 2 --sync stream --same-start --deadline 75 --name ddr_ab32 --variants 'plain=1;host_budget=state+10%;plain=1,clip=1.0;host_budget=state+10%,max_grad_norm=1.0;host_budget=state+10%,early=0' 2>&1 | grep -v '^{' | tail -6 | cut -c1-400
timeout -k 5 40 python3 bench/llama_ab.py --nvme /root/ab --layers 2 --batch 4 --seq 512 --steps 5 --warmup 1 --sync stream --same-start --deterministic --name ddr_exact --variants 'host_budget=state+10%;host_budget=state+10%,early=0;host_budget=state+10%,max_grad_norm=1.0;host_budget=state+10%,early=0,max_grad_norm=1.0' 2>&1 | grep -v '^{' | tail -2 | cut -c1-300
python3 - <<'PY'
import json, os
for n in ("ddr_ab32", "ddr_exact"):
    try:
        r = json.load(open(os.path.join(os.environ["OUT"], n + ".json")))
    except OSError as e:
        print(n, "missing", e); continue
    for x in r["runs"]:
        s = (x["under_backward"] or {}).get("staged") or {}
        print(n, x["variant"], "med", round(x["median_s"], 4), "steps", [round(t, 3) for t in x["step_s"]], "clip_active", x["clip_active"], "norms", [round(g, 2) for g in x["grad_norms"]], "staged", s.get("updated"), "waited", s.get("waited_bytes"), "peak", x["peak_gpu_GiB"], x["peak_reserved_GiB"], "losses", x["losses"])
    print(n, "summary", json.dumps({k: {f: v.get(f) for f in ("median_s", "over_bar", "same_losses")} for k, v in r["summary"].items()}))
PY
rm -rf /root/ab
say kv
mkdir -p /root/kv_nvme
timeout -k 5 185 python3 -m tiered.bench.kv --shape 8b --prefill-chunk 2048 --memory-cap 24GB --page-tokens 1024 --disk-size 1GiB --dir /root/kv_nvme --out "$OUT/kv_1.json" --suite targets --context 32768 --new-tokens 16 --time-limit 175 > $OUT/kv.log 2>&1; echo "kv rc=$?"; tail -30 $OUT/kv.log | cut -c1-300
rm -rf /root/kv_nvme
say io
timeout -k 10 130 bash .anchors/run_on_device.sh ../bench/disk_compare.py --dir /root/cmp --out $OUT/disk_compare.json --budget 120 2>&1 | tail -30
say done
