#!/usr/bin/env bash
# Issue 31 (timeout_s 420; written in the seventeenth session, run there once at --rounds 1: default 9.00 s,
# switch=0.0005 8.30, aio at 0.0005 10.63, one round on a slow disk, bench/RESULTS.md): the GIL's switch interval
# and the step. The GPU machine's gil_busy (seventeenth session, call 2) lost a third of the engine's write rate,
# and with kernel AIO most of both, beside a thread running Python at the interpreter's 5 ms switch interval; on the development VM at
# 0.5 ms the engine beside Python kept 0.87x / 0.95x of its idle read / write (32 x 1 MiB threads; 0.50x / 0.34x at
# 5 ms) and kernel AIO 0.97x / 0.72x (0.22x / 0.49x). The reference step (state on NVMe at 2 GiB) A/B, interleaved:
# the default, at 0.5 ms (llama_ab's `switch=0.0005`), and the engine at 16 threads x 8 MiB with and without it, two
# rounds (gil_busy in call 2: 8 x 8 MiB threads wrote 2.74 GB/s idle against 32 x 1 MiB's 2.46, and read 2.17
# against 1.87 beside Python; libaio's best configuration is 8 MiB requests).
# Prediction: at 0.5 ms the step 3-8 % shorter; 16 x 8 MiB 0-5 % shorter than the default, the two together 5-10 %.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say "the step, A/B"
timeout -k 5 390 python3 bench/llama_ab.py --nvme /root/ab --host-budget 2GiB --steps 4 --warmup 1 --rounds 2 \
  --deadline 340 --name switch_ab --variants 'default;switch=0.0005;io=16x8MiB;io=16x8MiB,switch=0.0005' \
  > $OUT/switch_ab.log 2>&1
echo "ab rc=$?"; grep -v '^{' $OUT/switch_ab.log | grep "round\|deadline" | cut -c1-200
rm -rf /root/ab
say done
