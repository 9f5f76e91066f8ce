# Ran as `bash bench/next_calls/sum_from_kept.sh`, call 1 of the twenty-fifth session (530.6 s).
#!/usr/bin/env bash
# Issue 29 (timeout_s 600; written in the twenty-fourth session, not yet run). The held sums added on the GPU from
# the copies the backward before kept there (tiered/offload_accumulation.py SUM_FROM_KEPT), instead of copied up
# from their homes every micro-batch: A/B in one call, the 4.42B under a 12 GB cap at 2 x 2048 x 16 (this session's
# call 4: forward and backward 10.9-11.0 s against 6.7 under 24 GB at 4 x 2048 x 8, 5,292-5,336 tokens/s, 6.16 GiB
# of sums kept a backward) and under a 24 GB cap at 4 x 2048 x 8; then its CUDA test and the kept sums' others.
# Prediction: 12 GB: 6.16 GiB x 15 micro-batches, 99 GB a step, no longer crosses the link upward (shared with the
# weights' 17.7 GB a micro-batch) at 45-50 GB/s: forward and backward 9.0-9.5 s, 6,050-6,350 tokens/s (1.67-1.75x
# DeepSpeed's 3,622 with its weights offloaded); 24 GB: 7 x 4.6 GiB, 0.7 s of the link: forward and backward
# 6.2-6.5 s, 8,350-8,700 tokens/s. bytes_summed_from_kept a step: 99 and 35 GB; peak GPU as the A run's (the room
# is measured over forward's peak too); losses as the A run's to the fourth decimal.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
L34="--hidden 3200 --heads 32 --inter 8640 --seq 2048 --layers 34 --steps 3"
ab() {  # name, flag, seconds, flags...
  local name=$1 flag=$2 limit=$3; shift 3
  say "ours $name SUM_FROM_KEPT=$flag"
  timeout -k 5 $limit python3 -c "import sys, runpy, tiered.offload_accumulation as a; a.SUM_FROM_KEPT = eval(sys.argv[1]);
sys.argv = ['examples/big_model.py', *sys.argv[2:]]; runpy.run_path('examples/big_model.py', run_name='__main__')" \
    $flag $L34 "$@" --nvme-path /root/big_nvme --json $OUT/${name}_$flag.jsonl > $OUT/${name}_$flag.log 2>&1
  echo "rc=$?"; grep "^step \|gradient sums\|gradients on the GPU\|peak GPU\|link\|Error" $OUT/${name}_$flag.log | tail -10 \
    | cut -c1-300
  rm -rf /root/big_nvme
}
for flag in True False; do ab 12GB_4.42B $flag 110 --batch 2 --accumulate 16 --gpu-memory-cap 12GB; done
for flag in True False; do ab 24GB_4.42B $flag 90 --batch 4 --accumulate 8 --gpu-memory-cap 24GB; done
say "CUDA tests of the kept sums"
timeout -k 5 $((590 - SECONDS)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_offload_params_cuda.py \
  -k "kept or slow or last_micro or backwards or link" > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?"; tail -4 $OUT/gpu_tests.log
say done
