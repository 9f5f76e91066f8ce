#!/usr/bin/env bash
# Issue 31, item 1 (carry [".anchors"]; timeout_s 330; written in the fifteenth session, not yet run): which
# submission closes io_engine's gap to libaio (0.83x read, 0.85x write, interleaved, bench/RESULTS.md fifteenth
# session)? One process, one 4 GiB file, mirrored rounds of: libaio's best read config; tiered-bench io at 64 x 1
# MiB (its defaults' first), 16 x 1 MiB (the best read of the step's own probe in that call) and 32 x 8 MiB; kernel
# AIO from one thread (bench/kernel_aio.py) at 32 x 1 MiB and 32 x 8 MiB; the calibration.
# Prediction: if the gap is the thread-per-request model (each of io_engine's threads runs Python between its
# requests), kernel AIO reads and writes within 5 % of libaio at 32 x 8 MiB and the thread shapes stay 10-20 % below;
# if it is the request size or depth, 32 x 8 MiB through io_engine closes most of it.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
echo "=== $(date +%T) disk_compare (DeepSpeed's aio op builds first, about 60 s)"
timeout -k 5 310 bash .anchors/run_on_device.sh ../bench/disk_compare.py --dir /root/gap --out $OUT/engine_gap.json \
  --budget 300 --rounds 2 --shapes 64x1MiB,16x1MiB,32x8MiB --kaio 32x1MiB,32x8MiB > $OUT/engine_gap.log 2>&1; echo "rc=$?"
grep -v WARNING $OUT/engine_gap.log | cut -c1-300 | tail -40
rm -rf /root/gap
