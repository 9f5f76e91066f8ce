#!/usr/bin/env bash
# Issue 31 in ONE call (carry [".anchors"]; timeout_s 600), written in the fifteenth session after its first call
# (bench/results/2026-12-03_h200_s15call1_*) and run as its call 3 (..._s15call3_*); run it again after a change to the
# engine, with --shapes set to the shape bench/next_calls/engine_gap.sh finds best. DeepSpeed ZeRO-Infinity first
# (it installs DeepSpeed and builds its aio op; first, so the disk's drift during the call falls on us, not on it),
# our reference step, disk_compare with the interleaved rounds (libaio, tiered-bench io, the calibration as L T C C T L; the op reused: no
# reinstall in between), 8-bit moments, the state-in-DDR step at host_budget = state + 10 % with and without a
# clip every step. Run from the repo root: bash bench/next_calls/issue31_final_call.sh
# SHAPE=[aio:]THREADSxBLOCK (sixteenth session): every run of ours with that IOConfig (TIERED_IO_CONFIG, so the
# optimizer's calibration too) and disk_compare's rounds at that shape; unset, the defaults as before.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
SHAPES=64x1MiB
if [ -n "${SHAPE:-}" ]; then
  export TIERED_IO_CONFIG=$OUT/io_config.json
  python3 -c "import sys; from tiered.bench.mixed import parse_shape; from io_engine import IOConfig
s, t, b = parse_shape(sys.argv[1]); IOConfig(submit=s, threads=t, block_size=b).to_file(sys.argv[2])" "$SHAPE" "$TIERED_IO_CONFIG" || exit 1
  SHAPES=$SHAPE; say "IOConfig $(cat $TIERED_IO_CONFIG | tr -d '\n ')"
fi
say ds_infinity
mkdir -p /root/ds_nvme
timeout -k 5 210 bash .anchors/run_on_device.sh ds_anchor.py nvme --layers 16 --steps 3 --nvme /root/ds_nvme > $OUT/ds_infinity.log 2>&1; echo "ds rc=$?"
grep '^{' $OUT/ds_infinity.log | tail -1 | cut -c1-600; grep '^\[nvme\]' $OUT/ds_infinity.log | tail -3
rm -rf /root/ds_nvme
say ours
timeout -k 5 85 python3 bench/llama_step.py --steps 4 --deadline 75 --floor-budget 20 --nvme /root/tiered_nvme --host-budget 2GiB --name llama_hb2GiB > $OUT/ours.log 2>&1; echo "ours rc=$?"; grep -v '^{' $OUT/ours.log | tail -5 | cut -c1-300
rm -rf /root/tiered_nvme
say disk_compare
lib=/tmp/aio/usr/lib/x86_64-linux-gnu
(export PYTHONPATH=/tmp/site:$PYTHONPATH CPATH=/tmp/aio/usr/include LIBRARY_PATH=$lib LD_LIBRARY_PATH=$lib TORCH_CUDA_ARCH_LIST=9.0
 timeout -k 5 150 python3 bench/disk_compare.py --dir /root/cmp --out $OUT/disk_compare.json --budget 140 --rounds 2 --shapes $SHAPES > $OUT/disk_compare.log 2>&1; echo "cmp rc=$?")
grep -v WARNING $OUT/disk_compare.log | cut -c1-400 | tail -22
rm -rf /root/cmp
say int8
timeout -k 5 60 python3 bench/llama_step.py --steps 4 --deadline 50 --floor-budget 8 --nvme /root/tiered_nvme --host-budget 2GiB --moments-dtype int8 --name llama_hb2GiB_int8 > $OUT/int8.log 2>&1; echo "int8 rc=$?"; grep -v '^{' $OUT/int8.log | tail -4 | cut -c1-300
rm -rf /root/tiered_nvme
say ddr
timeout -k 5 70 python3 bench/llama_ab.py --nvme /root/ab --batch 32 --steps 6 --warmup 2 --sync stream --same-start --deadline 60 --name ddr_ab32 --variants 'plain=1;host_budget=state+10%;plain=1,clip=1.0;host_budget=state+10%,max_grad_norm=1.0' > $OUT/ddr.log 2>&1; echo "ab32 rc=$?"
rm -rf /root/ab
python3 - <<'PY'
import json, os
try:
    r = json.load(open(os.path.join(os.environ["OUT"], "ddr_ab32.json")))
    for x in r["runs"]:
        print("ddr", x["variant"], "med", round(x["median_s"], 4), "clip_active", x["clip_active"], "losses", x["losses"][:3])
    print("ddr summary", json.dumps({k: {f: v.get(f) for f in ("median_s", "over_bar", "same_losses")} for k, v in r["summary"].items()}))
except OSError as e:
    print("ddr missing", e)
PY
say done
