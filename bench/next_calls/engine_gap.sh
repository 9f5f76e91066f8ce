#!/usr/bin/env bash
# Issue 31, item 1 (carry [".anchors"]; timeout_s 450; written in the fifteenth session, not yet run): which
# shape or submission closes io_engine's gap to libaio (0.83x read, 0.85x write at 64 x 1 MiB, interleaved,
# bench/RESULTS.md fifteenth session)? One process, one 4 GiB file, mirrored rounds of: libaio's best read config;
# tiered-bench io at 64, 32, 16 and 8 threads x 1 MiB and 32 x 8 MiB; kernel AIO from one thread
# (bench/kernel_aio.py) at 32 x 1 MiB and 8 x 8 MiB; the calibration.
# What the fifteenth session's calls suggest: fewer threads read faster (call 1's probe: 16 x 1 MiB 2.16 GB/s
# against 32 x 1 MiB 1.91, libaio 2.30 minutes later; call 3's io defaults: 64 x 1 MiB 1.71 against 32 x 1 MiB
# 1.81). Prediction: if each thread's Python between requests is the cost, the thread shapes rank 8 >= 16 > 32 > 64
# and kernel AIO at 32 x 1 MiB reads within 5 % of libaio; if the disk slows with requests outstanding, kernel
# AIO at 32 x 1 MiB ranks with 32 threads, and 8 x 8 MiB (64 MiB outstanding in 8 requests) leads.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
echo "=== $(date +%T) disk_compare (DeepSpeed's aio op builds first, about 60 s)"
timeout -k 5 430 bash .anchors/run_on_device.sh ../bench/disk_compare.py --dir /root/gap --out $OUT/engine_gap.json \
  --budget 420 --rounds 2 --shapes 64x1MiB,32x1MiB,16x1MiB,8x1MiB,32x8MiB --kaio 32x1MiB,8x8MiB > $OUT/engine_gap.log 2>&1; echo "rc=$?"
grep -v WARNING $OUT/engine_gap.log | cut -c1-300 | tail -40
rm -rf /root/gap
