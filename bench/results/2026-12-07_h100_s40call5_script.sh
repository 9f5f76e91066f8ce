#!/usr/bin/env bash
# Fortieth session, call 5 (as run, one command line): the 8-bit example as before this session's update changes
# (the codes in torch ops, the record's download on the work stream, two chunks in flight), by bench/update_profile.py's
# variants applied before the example runs in the same process.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; S="--hidden 3200 --layers 34 --heads 32 --inter 8640 --seq 2048"; timeout -k 5 170 python3 -c "
import sys, runpy
sys.path.insert(0, 'bench')
import update_profile as u
u.VARIANTS['workdown'](); u.VARIANTS['torchcodec']()
from tiered import shares
shares.CHUNKS_IN_FLIGHT = 2
sys.argv = ['examples/big_model.py'] + sys.argv[1:]
runpy.run_path('examples/big_model.py', run_name='__main__')
" $S --batch 8 --accumulate 4 --steps 3 --gpu-memory-cap 24GB --nvme-path /root/big_nvme --moments-dtype int8 --json $OUT/ex_b8a4_int8_before.jsonl > $OUT/ex_b8a4_int8_before.log 2>&1; echo rc=$?; grep "^step \|link, whole\|optimizer:\|peak GPU\|out of memory\|Error" $OUT/ex_b8a4_int8_before.log | tail -8 | cut -c1-220; rm -rf /root/big_nvme
