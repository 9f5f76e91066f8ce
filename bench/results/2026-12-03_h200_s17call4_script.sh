#!/usr/bin/env bash
# Issue 31 (timeout_s 230; written in the seventeenth session): the GIL's switch interval and the step. The GPU
# machine's gil_busy (seventeenth session, call 2) lost a third of the engine's write rate, and with kernel AIO most
# of both, beside a thread running Python at the interpreter's 5 ms switch interval; on the development VM at
# 0.5 ms the engine beside Python kept 0.87x / 0.95x of its idle read / write (32 x 1 MiB threads; 0.50x / 0.34x at
# 5 ms) and kernel AIO 0.97x / 0.72x (0.22x / 0.49x). The reference step (state on NVMe at 2 GiB) A/B, interleaved:
# the default, the default at 0.5 ms (llama_ab's `switch=0.0005`), kernel AIO 32 x 1 MiB at 0.5 ms.
# Prediction: at 0.5 ms the default step 3-8 % shorter (6.62 s in call 2: 6.1-6.4 s), kernel AIO within 3 % of it
# (7.41 s at 5 ms).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say "the step, A/B"
timeout -k 5 190 python3 bench/llama_ab.py --nvme /root/ab --host-budget 2GiB --steps 4 --warmup 1 --rounds 1 \
  --deadline 160 --name switch_ab --variants 'default;switch=0.0005;io=aio:32x1MiB,switch=0.0005' > $OUT/switch_ab.log 2>&1
echo "ab rc=$?"; grep -v '^{' $OUT/switch_ab.log | grep "round\|deadline" | cut -c1-200
rm -rf /root/ab
say done
