# Sourced by the next calls that run examples/big_model.py with the held sums added from the GPU's kept copies
# switched on or off (tiered/offload/accumulation.py SUM_FROM_KEPT) and the allocator's expandable segments on or
# off: `ours_with NAME True|False 0|1 SECONDS FLAGS...` writes $OUT/NAME.log and .jsonl and prints what matters.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say() { echo "=== [+${SECONDS}s] $*"; }
ours_with() {
  local name=$1 flag=$2 exp=$3 limit=$4; shift 4
  # A call lasts 600 s: a run cut by the call's own limit never deletes its state (62 GB for the 13.01B), and
  # the next call on the warm machine then finds the disk full; each run ends 30 s before the call does.
  local left=$((570 - SECONDS)); [ "$limit" -gt "$left" ] && limit=$left
  say "ours $name SUM_FROM_KEPT=$flag expandable=$exp"
  local conf=""; [ "$exp" = 1 ] && conf="expandable_segments:True"
  PYTORCH_CUDA_ALLOC_CONF=$conf timeout -k 10 $limit python3 -c "import sys, runpy, tiered.offload.accumulation as a;
a.SUM_FROM_KEPT = eval(sys.argv[1]); sys.argv = ['examples/big_model.py', *sys.argv[2:]];
runpy.run_path('examples/big_model.py', run_name='__main__')" $flag "$@" --nvme-path /root/big_nvme \
    --json $OUT/$name.jsonl > $OUT/$name.log 2>&1
  echo "rc=$?"; grep -v '^{' $OUT/$name.log \
    | grep "^step \|first step\|peak GPU\|peak host\|link,\|on the GPU for\|weights kept\|gpu_budget\|OutOfMemory" \
    | tail -16 \
    | cut -c1-300
  rm -rf /root/big_nvme
}
