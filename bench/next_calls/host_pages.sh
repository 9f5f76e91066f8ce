#!/usr/bin/env bash
# Issue 31 (forty-first session): the engine's host buffers from private mappings in huge pages
# (io_engine/hugepages.py) against the shared 4 KiB-page mappings of before, on one GPU machine in one call.
# Run with carry [".anchors"] from the repo root: bash bench/next_calls/host_pages.sh
#
# Predictions, written before the call (call 6-7 of this session, an H100: the engine from torch's pinned memory
# wrote 1.19x and read 1.12x libaio's best; `tiered-bench io` from the pool's shared mappings 0.87x / 0.94x; the
# reference step 5.82 s against libaio's serial floor 5.51 s):
# - `tiered-bench io` (defaults) now at or above libaio: write 1.0-1.2x, read 1.0-1.12x;
# - the reference step (Llama-0.94B, 8 x 1024, host 2 GiB, 7.56 GiB each way) 8-15 % shorter than with the shared
#   buffers in the same call, at or under libaio's serial floor;
# - a fork of a process holding 8 GiB of pinned pool memory takes well under a second, and the child runs.
export PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
say "tree: $(grep -c '_WIPEONFORK' io_engine/hugepages.py) (a new symbol of the forty-second session)"
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled /sys/block/vda/queue/max_segments 2>&1
say fork
PYTHONPATH=$PWD timeout -k 5 60 python3 bench/fork_pinned.py 8
say step_ab
for v in ${VARIANTS:-new shared}; do
  pre=""; [ $v = shared ] && pre="bench/shared_buffers.py"
  PYTHONPATH=$PWD timeout -k 5 75 python3 $pre bench/llama_step.py --steps 4 --deadline 65 --floor-budget 12 \
    --nvme /root/tiered_nvme --host-budget 2GiB --name step_$v > $OUT/step_$v.log 2>&1; echo "$v rc=$?"
  grep -v '^{' $OUT/step_$v.log | grep -E "step [0-9]|floor" | tail -4 | cut -c1-200
  rm -rf /root/tiered_nvme
done
say disk_compare
lib=/tmp/aio/usr/lib/x86_64-linux-gnu
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .anchors/whl/*.whl >/dev/null 2>&1
for f in .anchors/deb/*.deb; do dpkg -x "$f" /tmp/aio; done
(export PYTHONPATH=/tmp/site:$PWD CPATH=/tmp/aio/usr/include LIBRARY_PATH=$lib LD_LIBRARY_PATH=$lib TORCH_CUDA_ARCH_LIST=9.0
 timeout -k 5 150 python3 bench/disk_compare.py --dir /root/cmp --out $OUT/disk_compare.json --budget 140 --rounds 1 --shapes 64x1MiB,32x1MiB > $OUT/disk_compare.log 2>&1; echo "cmp rc=$?")
grep -v WARNING $OUT/disk_compare.log | cut -c1-260 | grep -E "^(libaio|inter|io |calib|drift)|over_libaio" | tail -24
grep '^{' $OUT/disk_compare.log | tail -1 | cut -c1-900
rm -rf /root/cmp
say done
