#!/usr/bin/env bash
# Twelfth session, call 2: the clip no longer waits for the GPU (issue 31 item 4: the staged step with a clip
# every step); the KV cache bitwise at 16K with deterministic kernels, then its target set (issue 30).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say tests
timeout -k 5 80 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_staged_cuda.py tests/gpu/test_under_backward_cuda.py > $OUT/tests.log 2>&1; echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/tests.log | tail -8 | cut -c1-300
say ddr
timeout -k 5 90 python3 bench/llama_ab.py --nvme /root/ab --batch 32 --steps 6 --warmup 2 --sync stream --same-start --deadline 70 --name ddr_ab32 --variants 'plain=1;host_budget=state+10%;plain=1,clip=1.0;host_budget=state+10%,max_grad_norm=1.0' > $OUT/ddr.log 2>&1; echo "ab32 rc=$?"
timeout -k 5 40 python3 bench/llama_ab.py --nvme /root/ab --layers 2 --batch 4 --seq 512 --steps 5 --warmup 1 --sync stream --same-start --deterministic --name ddr_exact --variants 'host_budget=state+10%,max_grad_norm=1.0;host_budget=state+10%,early=0,max_grad_norm=1.0' >> $OUT/ddr.log 2>&1; echo "exact rc=$?"
rm -rf /root/ab
python3 - <<'PY'
import json, os
for n in ("ddr_ab32", "ddr_exact"):
    try:
        r = json.load(open(os.path.join(os.environ["OUT"], n + ".json")))
    except OSError as e:
        print(n, "missing", e); continue
    for x in r["runs"]:
        s = (x["under_backward"] or {}).get("staged") or {}
        ph = x.get("phases") or {}
        print(n, x["variant"], "med", round(x["median_s"], 4), "steps", [round(t, 3) for t in x["step_s"]], "item", [round(t, 4) for t in x.get("item_s", [])], "clip_active", x["clip_active"], "staged", s.get("updated"), "waited", s.get("waited_bytes"), "step_s", ph.get("step_s"), "update_s", ph.get("update_s"), "losses", x["losses"])
    print(n, "summary", json.dumps({k: {f: v.get(f) for f in ("median_s", "over_bar", "same_losses")} for k, v in r["summary"].items()}))
PY
say kv-exact
mkdir -p /root/kv_nvme
timeout -k 5 200 python3 -m tiered.bench.kv --shape 8b --prefill-chunk 2048 --memory-cap 24GB --page-tokens 1024 --disk-size 1GiB --dir /root/kv_nvme --out "$OUT/kv_exact.json" --suite exact --context 16384 --new-tokens 16 --time-limit 185 > $OUT/kv_exact.log 2>&1; echo "kv exact rc=$?"; tail -22 $OUT/kv_exact.log | cut -c1-260
rm -rf /root/kv_nvme
say kv-targets
mkdir -p /root/kv_nvme
timeout -k 5 190 python3 -m tiered.bench.kv --shape 8b --prefill-chunk 2048 --memory-cap 24GB --page-tokens 1024 --disk-size 1GiB --dir /root/kv_nvme --out "$OUT/kv_targets.json" --suite targets --context 32768 --new-tokens 16 --time-limit 175 > $OUT/kv_targets.log 2>&1; echo "kv targets rc=$?"; tail -22 $OUT/kv_targets.log | cut -c1-260
rm -rf /root/kv_nvme
say done
