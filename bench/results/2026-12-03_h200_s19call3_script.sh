#!/usr/bin/env bash
# Issue 31 (carry [".anchors"]; timeout_s 560; nineteenth session's call 3). `tiered-bench io` against
# DeepSpeed's libaio, interleaved (L T.. C, mirrored, two rounds), at three engine shapes: the defaults' first
# (64 threads x 1 MiB), 16 threads x 8 MiB (libaio's best is 8 MiB requests), kernel AIO 64 x 8 MiB from one thread
# (as libaio queues them); then the reference step at 16 x 8 MiB against the default, two rounds.
# The seventeenth session's interleaved medians: 64 x 1 MiB read 0.922x, write 0.893x libaio's. gil_busy there:
# 8 x 8 MiB threads 2.10 / 2.74 GB/s idle against 32 x 1 MiB's 2.04 / 2.46.
# Prediction: 16 x 8 MiB read 0.95-1.05x, write 0.95-1.05x libaio; kernel AIO 64 x 8 MiB within 5 % of libaio
# both ways; the step at 16 x 8 MiB within 5 % of the default (the seventeenth session's A/B: 6.95 against 6.62 s).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
here=$PWD/.anchors
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $here/whl/*.whl >/dev/null 2>&1
for f in $here/deb/*.deb; do dpkg -x "$f" /tmp/aio; done
say disk_compare
lib=/tmp/aio/usr/lib/x86_64-linux-gnu
(export PYTHONPATH=/tmp/site:$PYTHONPATH CPATH=/tmp/aio/usr/include LIBRARY_PATH=$lib LD_LIBRARY_PATH=$lib TORCH_CUDA_ARCH_LIST=9.0
 timeout -k 5 320 python3 bench/disk_compare.py --dir /root/cmp --out $OUT/disk_compare.json --budget 305 --rounds 2 \
   --shapes 64x1MiB,16x8MiB,aio:64x8MiB > $OUT/disk_compare.log 2>&1; echo "cmp rc=$?")
grep -v WARNING $OUT/disk_compare.log | cut -c1-300 | tail -26
rm -rf /root/cmp
say "step A/B"
timeout -k 5 200 python3 bench/llama_ab.py --nvme /root/ab --host-budget 2GiB --steps 4 --warmup 1 --rounds 2 \
  --deadline 185 --name shape_ab --variants 'default;io=16x8MiB' > $OUT/shape_ab.log 2>&1
echo "ab rc=$?"; grep -v '^{' $OUT/shape_ab.log | grep "round\|deadline\|median" | cut -c1-200 | tail -8
rm -rf /root/ab
say done
