#!/usr/bin/env bash
# Which request shape closes io_engine's gap to libaio (0.83x read, 0.85x write interleaved on 2026-12-03)?
# tiered-bench io at 64 x 1 MiB (A), 64 x 8 MiB (B) and 32 x 8 MiB (C), 4 GiB, one timed pass each, in the order
# A B C C B A, twice: the disk's drift falls on each alike. No DeepSpeed (no build): libaio's level is that call's.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for cfg in "1MiB 64" "8MiB 64" "8MiB 32" "8MiB 32" "8MiB 64" "1MiB 64" "1MiB 64" "8MiB 64" "8MiB 32" "8MiB 32" "8MiB 64" "1MiB 64"; do
  set -- $cfg
  timeout -k 5 25 python3 -m tiered.cli io --dir /root/iob --json --no-fio --block-sizes $1 --threads $2 --warmup 0 --loops 1 -q 2>/dev/null \
    | python3 -c "import json,sys; d=json.load(sys.stdin); r=d['sweep'][0]; print('$2 x $1', 'read', r['read_gbps']['median'], 'write', r['write_gbps']['median'], flush=True)"
done
rm -rf /root/iob
