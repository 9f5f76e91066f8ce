#!/usr/bin/env bash
# Issue 29, the fourteenth session's call 2 (carry [".anchors"]; timeout_s 600): the offloaded model's weights kept
# on the GPU from forward to backward (keep_for_backward), its CUDA test, then the 4.42B under a 24 GB cap with
# them kept (--keep-for-backward auto), and with DS=1 beside DeepSpeed ZeRO-Offload on the same model, tokens and clip (the tenth
# session's `C`).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
C="--hidden 3200 --layers 34 --heads 32 --inter 8640 --seq 2048 --gpu-memory-cap 24GB --steps 3 --batch 4 --accumulate 8"
say gpu_test
timeout -k 5 110 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_offload_params_cuda.py -k kept > $OUT/gpu_kept.log 2>&1; echo "test rc=$?"; tail -3 $OUT/gpu_kept.log | cut -c1-300
say ours44
timeout -k 5 170 python3 examples/big_model.py $C --keep-for-backward auto --nvme-path /root/big_nvme --json $OUT/big44.jsonl > $OUT/big44.log 2>&1; echo "ours rc=$?"
grep -v '^{' $OUT/big44.log | grep -v "^  " | tail -14 | cut -c1-300
rm -rf /root/big_nvme
[ "${DS:-0}" = 1 ] || { say done; exit 0; }
say ds44
timeout -k 5 230 bash .anchors/run_on_device.sh ../bench/ds_big.py $C --offload cpu --nvme-path /root/ds_nvme --json $OUT/ds44.jsonl > $OUT/ds44.log 2>&1; echo "ds rc=$?"
grep -v '^{' $OUT/ds44.log | grep -i "step\|tokens\|peak\|loss\|error" | tail -10 | cut -c1-300
rm -rf /root/ds_nvme
say done
