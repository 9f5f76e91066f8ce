#!/usr/bin/env bash
# Issue 31, item 1 (carry [".anchors"]; timeout_s 580; written in the fifteenth session, not yet run): which shape or
# submission closes io_engine's gap to libaio (0.83x read, 0.85x write at 64 x 1 MiB, interleaved, bench/RESULTS.md
# fifteenth session)? Part 1, one process, one 4 GiB file, mirrored rounds of: libaio's best read config;
# tiered-bench io at 64, 32 and 16 threads x 1 MiB, and with IOConfig(submit="aio") (kernel AIO from
# one thread, as libaio) at 32 x 1 MiB and 8 x 8 MiB; the calibration. Part 2, the reference step (state on NVMe at
# 2 GiB) A/B, interleaved: the default engine, submit="aio" at 32 x 1 MiB, 16 threads x 1 MiB.
# What the fifteenth session's calls suggest: fewer threads read faster (call 1's probe: 16 x 1 MiB 2.16 GB/s
# against 32 x 1 MiB 1.91, libaio 2.30 minutes later; call 3's io defaults: 64 x 1 MiB 1.71 against 32 x 1 MiB
# 1.81); the development VM, the same rounds: 16 > 32 > 64 threads (1.80, 1.54, 1.27), aio:32x1MiB 1.62.
# Prediction: if each thread's Python between its requests is the cost, the thread shapes rank 16 > 32 > 64,
# aio:32x1MiB reads within 5 % of libaio, and the step with it comes within 5 % of the floor at libaio's rates;
# if the disk slows with requests outstanding, aio:32x1MiB ranks with 32 threads and aio:8x8MiB (8 requests of
# 8 MiB) leads.
# Part 1b (sixteenth session): bench/gil_busy.py, each shape idle, beside a thread that takes a core but not the GIL,
# and beside one running Python (as forward and backward do while a step's reads run ahead). On the 2-core VM,
# 32 x 1 MiB threads fell to 0.23-0.47x idle beside Python (0.60-0.76x beside the native control), 8 x 8 MiB to
# 0.77x. Prediction on 16 cores (a core to spare, so only the GIL counts): 32 x 1 MiB threads <= 0.5x idle beside
# Python and >= 0.9x beside the control; aio and 8 MiB shapes >= 0.8x.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say "disk_compare (DeepSpeed's aio op builds first, about 60 s)"
timeout -k 5 330 bash .anchors/run_on_device.sh ../bench/disk_compare.py --dir /root/gap --out $OUT/engine_gap.json \
  --budget 320 --rounds 2 --shapes 64x1MiB,32x1MiB,16x1MiB,aio:32x1MiB,aio:8x8MiB > $OUT/engine_gap.log 2>&1
echo "rc=$?"; grep -v WARNING $OUT/engine_gap.log | cut -c1-300 | tail -34
rm -rf /root/gap
say "the engine beside Python (GIL)"
timeout -k 5 70 python3 bench/gil_busy.py --dir /root/gil --size 1GiB --rounds 1 \
  --shapes 32x1MiB,aio:32x1MiB,8x8MiB,aio:8x8MiB --out $OUT/gil_busy.json > $OUT/gil_busy.log 2>&1
echo "rc=$?"; tail -13 $OUT/gil_busy.log | cut -c1-200
rm -rf /root/gil
say "the step, A/B"
timeout -k 5 170 python3 bench/llama_ab.py --nvme /root/ab --host-budget 2GiB --steps 4 --warmup 1 --rounds 1 \
  --deadline 140 --name step_io_ab --variants 'default;io=aio:32x1MiB;io=16x1MiB' > $OUT/step_io_ab.log 2>&1
echo "ab rc=$?"; grep -v '^{' $OUT/step_io_ab.log | tail -8 | cut -c1-300
rm -rf /root/ab
say done
