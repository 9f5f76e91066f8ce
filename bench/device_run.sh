#!/usr/bin/env bash
# The GPU machine's side of one device call. From the repo root there:
#     STAGES="info ours ds" bash bench/device_run.sh          (carry [".anchors"] for the ds stages)
# Stages run in this order, those STAGES names (default: all), each under its own `timeout`, all of them
# within TOTAL_S seconds (default 540); a stage that no longer fits is skipped, and says so.
#   info       GPU, disk, memory, versions                                   (device.log only)
#   tests      python3 -m pytest -m gpu                                      -> gpu_tests.log
#   io         python3 -m tiered.cli io --dir /root/tb --size 4GiB --json    -> io.json
#   mixed      bench/disk_mixed.py: read alone, write alone, both at once    -> mixed.json
#   ours       bench/llama_step.py, state in /root/tiered_nvme, host 2GiB    -> llama_hb2GiB.json
#              (the optimizer's defaults: on the GPU, split masters)
#   ds         ds_aio (DeepSpeed's libaio GB/s) then ds_anchor (ZeRO-Infinity) -> ds.jsonl
#   ourshost   bench/llama_step.py, host 2GiB, --update-on host (full masters) -> llama_hb2GiB_host.json
#   oursfull   bench/llama_step.py, host 2GiB, --split-masters off (on the GPU) -> llama_hb2GiB_full.json
#   plain      bench/llama_step.py --plain: the loss reference               -> llama_plain.json
#   plainm     bench/llama_step.py --plain --masters: over fp32 masters       -> llama_plain_masters.json
#   ab         bench/llama_ab.py: optimizer settings in turn on one model, $VARIANTS -> llama_ab.json
#   ab32       the same at batch 32 (32 x 1024 tokens a step)                  -> llama_ab32.json
#   ranks      tiered-bench optim --nproc 1, then 2: CPU ranks (gloo) sharing this disk, $RANK_PARAMS (200M)
#              parameters in all                                             -> optim_nproc{1,2}.json
#   ds_cpu     DeepSpeed ZeRO-Offload (offload_optimizer to cpu) at batch $DS_BATCH (8)  -> ds.jsonl
#   ours8      bench/llama_step.py, host 8GiB; last, so it gets what is left -> llama_hb8GiB.json
#   oursbf16   bench/llama_step.py, host 2GiB, --moments-dtype bf16          -> llama_hb2GiB_bf16.json
#   ckpt       bench/checkpoint_bench.py, 250M params (3 GB of state)       -> ckpt.json
#   vsbase     the same call's A/B against an earlier commit's code, unpacked in .base/ (carry it; e.g.
#              `git archive COMMIT | tar -x -C .base`): base then ours ($ORDER="ours base" swaps them), $ROUNDS
#              times, at each host budget of $VS_HOSTS (default 2GiB; "2GiB 12GiB" adds the state in DDR)
#              -> llama_{base,ours}_HOST_rN.json
#   exit       bench/llama_step.py, 2 steps, ends without opt.close(): seconds from its last line to the
#              process's exit, and the state files left                     -> llama_exit.json, exit.json
#   oursint8   bench/llama_step.py, host 2GiB, --moments-dtype int8 (before ds) -> llama_hb2GiB_int8.json
#   study      bench/moments_study.py on the GPU: fp32, bf16, int8 moments x 3 seeds, $STUDY_ARGS
#              -> moments_study.json, moments_study.png
#   pin        bench/pin_bench.py: page-locking 16 GiB three ways             -> pin.json
#   ds_big     bench/ds_big.py: DeepSpeed ZeRO-3 on big's model and data, once per run of $DS_BIG_ARGS,
#              swap files in /root/ds_nvme (before big; carry .anchors)       -> ds_big.jsonl, ds_big.log
#   big        examples/big_model.py (default: the 13B Llama), once per run of $BIG_ARGS, state in
#              /root/big_nvme; last, so it gets what is left                  -> big.jsonl, big.log
#   kv         tiered-bench kv on an 8B-shaped Llama under a 24 GB cap, once per run of $KV_ARGS (';' between runs;
#              default: --suite exact, deterministic kernels, then --suite targets, the issue's target set;
#              each one process of at most 240 s), state in
#              /root/kv_nvme                                                  -> kv_N.json, kv.log
# Everything printed also goes to $OUT/device.log: 7 files at most come back. The state and test files
# (/root/tb, /root/tiered_nvme, /root/ds_nvme, /root/aio) are removed after every stage (64 GiB disk).
# Knobs: VARIANTS, ROUNDS, AB_HOST (host budget, default 2GiB), WARMUP (steps out of the median, 1) and AB_ARGS (more
# llama_ab flags, e.g. --timeline) for the ab stages, STEPS (5), FLOOR_BUDGET (60: seconds of disk sweep per llama_step run), IO_ARGS (more flags for
# the io stage), LLAMA_ARGS (more flags for every llama_step run, e.g. "--moments-dtype bf16" or "--layers 4"),
# BIG_ARGS and DS_BIG_ARGS (runs of the big and ds_big stages, ';' between two runs' flags, e.g.
# "--layers 20 --steps 4;--layers 20 --steps 4 --gpu-memory-cap 24GB"; ds_big's take --offload cpu|nvme). A run
# that fails does not stop the next; the stage's rc is then nonzero.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export OUT=${OUT:-/tmp/device_out} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export STEPS=${STEPS:-5} FLOOR_BUDGET=${FLOOR_BUDGET:-60} IO_ARGS=${IO_ARGS:-} LLAMA_ARGS=${LLAMA_ARGS:-} AB_ARGS=${AB_ARGS:-}
STAGES=" ${STAGES:-info tests io mixed ours ds ourshost oursfull plain plainm ours8 oursbf16 ckpt} "
TOTAL_S=${TOTAL_S:-540}
BIG="/root/tb /root/mixed /root/ab /root/tiered_nvme /root/ds_nvme /root/aio /root/ckb /root/big_nvme /root/kv_nvme"
mkdir -p "$OUT"

say() { echo "=== [$(date +%T) +${SECONDS}s] $*"; }
wanted() { [[ $STAGES == *" $1 "* ]]; }

# stage NAME MAX_S MIN_S FUNC: FUNC under `timeout` (MAX_S, or less when less is left), skipped when less
# than MIN_S is left; the big folders go afterwards however it ended. 15 s stay in hand for the kill grace.
stage() {
  local name=$1 max=$2 min=$3 fn=$4 left=$((TOTAL_S - SECONDS - 15)) rc=0 t0=$SECONDS
  if ((left < min)); then say "skip $name: ${left}s left, it needs ${min}s"; return; fi
  local t=$((left < max ? left : max))
  say "$name: start (timeout ${t}s)"
  STAGE_S=$t timeout -k 10 "$t" bash -o pipefail -c "$fn" || rc=$?
  rm -rf $BIG
  say "$name: rc=$rc after $((SECONDS - t0))s$( ((rc == 124 || rc == 137)) && echo ' TIMED OUT')"
}

st_info() {
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
  df -h / /root /tmp | awk '!seen[$0]++'
  free -g
  echo "cpus $(nproc); anchors: $(ls .anchors 2>/dev/null | tr '\n' ' ')"
  python3 -c 'import sys, torch, transformers as t; print("python", sys.version.split()[0], "torch",
torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available(), "transformers", t.__version__)'
}
st_tests() { python3 -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors 2>&1 | tee "$OUT/gpu_tests.log"; }
st_io() {
  python3 -m tiered.cli io --dir /root/tb --size 4GiB --json $IO_ARGS >"$OUT/io.json"
  local rc=$?
  cat "$OUT/io.json"
  return $rc
}
st_mixed() { python3 bench/disk_mixed.py --dir /root/mixed --budget $((STAGE_S - 30)) >"$OUT/mixed.json"; }
# The deadline counts from llama_step's start; it stops taking steps 30 s before the stage's timeout.
llama() {
  python3 bench/llama_step.py --steps "$STEPS" --deadline $((STAGE_S - 30)) --floor-budget "$FLOOR_BUDGET" $LLAMA_ARGS "$@"
}
st_ours() { llama --nvme /root/tiered_nvme --host-budget 2GiB --name llama_hb2GiB; }
st_ourshost() { llama --nvme /root/tiered_nvme --host-budget 2GiB --update-on host --name llama_hb2GiB_host; }
st_oursfull() { llama --nvme /root/tiered_nvme --host-budget 2GiB --split-masters off --name llama_hb2GiB_full; }
st_ours8() { llama --nvme /root/tiered_nvme --host-budget 8GiB --name llama_hb8GiB; }
st_oursint8() { llama --nvme /root/tiered_nvme --host-budget 2GiB --moments-dtype int8 --name llama_hb2GiB_int8; }
st_study() {
  python3 bench/moments_study.py --device cuda --options fp32,bf16,int8 --seeds 0,1,2 --png "$OUT/moments_study.png" \
    ${STUDY_ARGS:---dim 384 --layers 6 --seq 256 --batch 32 --steps 1500 --eval-every 100 --lr 1e-3 --host-budget 4GiB}
}
st_pin() { python3 bench/pin_bench.py --gib 16 >"$OUT/pin.json"; }
# each_run NAME DIR RUNS CMD...: `CMD --json FILE RUN` for each ';'-separated RUN of RUNS (RUNS empty: CMD
# alone), output appended to $OUT/NAME.log, FILE's line to $OUT/NAME.jsonl, DIR removed after each run.
each_run() {
  local name=$1 dir=$2 spec=$3 tmp=/tmp/$1_run.json rc=0 stop=0 run
  local -a runs
  shift 3
  IFS=';' read -ra runs <<<"$spec"
  ((${#runs[@]})) || runs=("")
  # `timeout` signals the stage's whole process group. A trapped signal waits for the running command, so this
  # shell outlives the run and keeps the line the run writes on SIGTERM (`timeout -k` kills both if the run
  # hangs); the tee ignores SIGTERM, so that the run's last lines still reach the log.
  trap 'stop=1' TERM
  for run in "${runs[@]}"; do
    if [[ -z ${run//[[:space:]]/} && ${#runs[@]} -gt 1 ]]; then continue; fi
    rm -f "$tmp"
    echo "--- $name: $* $run" | tee -a "$OUT/$name.log"
    "$@" --json "$tmp" $run 2>&1 | (trap '' TERM; exec tee -a "$OUT/$name.log") || rc=$?
    if [ -s "$tmp" ]; then cat "$tmp" >>"$OUT/$name.jsonl"; fi
    rm -rf "$dir" "$tmp"
    if ((stop)); then return 143; fi
  done
  return $rc
}
st_big() { each_run big /root/big_nvme "${BIG_ARGS:-}" python3 examples/big_model.py --nvme-path /root/big_nvme; }
st_ds_big() {
  each_run ds_big /root/ds_nvme "${DS_BIG_ARGS:-}" \
    bash .anchors/run_on_device.sh ../bench/ds_big.py --nvme-path /root/ds_nvme
}
# The kv stage: first bitwise exactness with deterministic kernels (tiered-bench kv --suite exact: compare at 16K
# tokens, part on NVMe, preemption; the math attention backend, whose fp32 scores put DynamicCache out of a 24 GB
# card's memory at ~30K tokens), then the issue's whole target set with the default
# kernels (--suite targets: the same and 128K tokens against DynamicCache's out-of-memory), each one bounded
# process, JSON after each step.
export KV_DEFAULT="--suite exact --context 16384 --new-tokens 16 --time-limit 200;--suite targets --context 32768 \
--new-tokens 16 --time-limit 175"
st_kv() {
  local i=0 rc=0 run
  local -a runs
  IFS=';' read -ra runs <<<"${KV_ARGS:-$KV_DEFAULT}"
  for run in "${runs[@]}"; do
    i=$((i + 1))
    mkdir -p /root/kv_nvme
    echo "--- kv $i: $run" | tee -a "$OUT/kv.log"
    timeout -k 5 240 python3 -m tiered.bench.kv --shape 8b --prefill-chunk 2048 --memory-cap 24GB --page-tokens 1024 \
      --disk-size 1GiB --dir /root/kv_nvme --out "$OUT/kv_$i.json" $run 2>&1 | tee -a "$OUT/kv.log" || rc=$?
    rm -rf /root/kv_nvme
  done
  return $rc
}
st_ckpt() { python3 bench/checkpoint_bench.py --params 250M --dir /root/ckb --loops 2 --drop-caches >"$OUT/ckpt.json"; }
st_ab() {
  python3 bench/llama_ab.py --nvme /root/ab --variants "${VARIANTS:-default;verify=0}" --rounds "${ROUNDS:-2}" \
    --host-budget "${AB_HOST:-2GiB}" --steps "$STEPS" --warmup "${WARMUP:-1}" --deadline $((STAGE_S - 60)) $AB_ARGS "$@"
}
st_ab32() { st_ab --batch 32 --name llama_ab32; }
st_ranks() {
  local n
  for n in 1 2; do
    python3 -m tiered.cli optim --nproc $n --device cpu --params "${RANK_PARAMS:-200M}" --host-budget 512MiB \
      --dir /root/tb --size 2GiB --loops 1 --steps 3 --json >"$OUT/optim_nproc$n.json" || return $?
    tail -c 1500 "$OUT/optim_nproc$n.json"; echo
    rm -rf /root/tb
  done
}
st_exit() {
  llama --nvme /root/tiered_nvme --host-budget 2GiB --steps 2 --floor-budget 0 --no-close --name llama_exit
  local rc=$? end
  end=$(python3 -c 'import time; print(time.time())')
  python3 - "$OUT/llama_exit.json" "$end" /root/tiered_nvme <<'PY' | tee "$OUT/exit.json"
import json, os, sys
r = json.loads(open(sys.argv[1]).read().splitlines()[-1])
files = [os.path.join(d, f) for d, _, fs in os.walk(sys.argv[3]) for f in fs]
print(json.dumps({"exit_s": round(float(sys.argv[2]) - r["leaving_at"], 2), "files_left": len(files),
                  "bytes_left": sum(os.path.getsize(f) for f in files), "steps": len(r.get("step_s", []))}))
PY
  return $rc
}
st_vsbase() {
  local r first host
  for host in ${VS_HOSTS:-2GiB}; do
    for r in $(seq 1 "${ROUNDS:-2}"); do
      for first in ${ORDER:-base ours}; do
        if [ "$first" = base ]; then
          (cd .base && PYTHONPATH=$PWD python3 bench/llama_step.py --steps "$STEPS" --floor-budget 0 \
            --nvme /root/tiered_nvme --host-budget "$host" --name "llama_base_${host}_r$r" $LLAMA_ARGS) || return $?
        else
          llama --nvme /root/tiered_nvme --host-budget "$host" --floor-budget 0 --name "llama_ours_${host}_r$r" \
            || return $?
        fi
        rm -rf /root/tiered_nvme
      done
    done
  done
}
st_oursbf16() { llama --nvme /root/tiered_nvme --host-budget 2GiB --moments-dtype bf16 --name llama_hb2GiB_bf16; }
st_plain() { llama --plain --name llama_plain; }
st_plainm() { llama --plain --masters --name llama_plain_masters; }
st_ds_aio() { bash .anchors/run_on_device.sh ds_aio_bw.py /root/aio | tee /tmp/ds_aio.out; }
st_ds_cpu() {
  bash .anchors/run_on_device.sh ds_anchor.py cpu --layers 16 --steps 4 --batch "${DS_BATCH:-8}" | tee /tmp/ds_anchor.out
}
st_ds_anchor() {
  bash .anchors/run_on_device.sh ds_anchor.py nvme --layers 16 --steps 4 --nvme /root/ds_nvme | tee /tmp/ds_anchor.out
}
export -f each_run st_kv st_ds_big st_study st_oursint8 st_pin st_big st_ab32 st_ranks st_ds_cpu st_vsbase st_exit st_info st_tests st_io st_mixed llama st_ours st_ourshost st_oursfull st_ours8 st_oursbf16 st_ckpt st_ab st_plain st_plainm st_ds_aio st_ds_anchor

# to_jsonl SOURCE < output: its dict lines (JSON, or Python's repr as ds_aio_bw.py prints rows) as JSON lines
to_jsonl() {
  python3 -c '
import ast, json, sys
for line in sys.stdin:
    line = line.strip()
    if line.startswith("{"):
        try:
            row = json.loads(line)
        except ValueError:
            try:
                row = ast.literal_eval(line)
            except (ValueError, SyntaxError):
                continue
        print(json.dumps({"source": sys.argv[1], **row}))' "$1"
}

summary() {
  python3 - "$OUT" <<'PY'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json*"))):
    for line in open(path):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if not isinstance(r, dict):
            continue
        keys = ("name", "source", "mode", "engine", "offload", "phase", "complete", "median_steady_s", "floor_s",
                "ratio", "ratio_own", "tokens_per_s", "first_step_at_s", "peak_gpu_GiB", "peak_host_GiB", "best_read",
                "best_write", "error")
        row = {k: r[k] for k in keys if k in r}
        if "disk" in r:
            row["disk_GBps"] = (r["disk"].get("read_GBps"), r["disk"].get("write_GBps"))
        if "losses" in r:
            row["losses"] = [round(x, 4) for x in r["losses"]]
        print(os.path.basename(path), json.dumps(row) if row else "(no summary keys)")
PY
}

main() {
  say "stages:${STAGES}total ${TOTAL_S}s, OUT=$OUT"
  trap 'rm -rf $BIG' EXIT
  if wanted info; then stage info 60 5 st_info; fi
  if wanted tests; then stage tests "${TESTS_S:-300}" 30 st_tests; fi
  if wanted io; then stage io 240 60 st_io; fi
  if wanted mixed; then stage mixed 180 60 st_mixed; fi
  if wanted ours; then stage ours 300 120 st_ours; fi
  if wanted oursint8; then stage oursint8 300 120 st_oursint8; fi
  if wanted ds || wanted ds_aio || wanted ds_anchor || wanted ds_cpu; then
    if [ ! -f .anchors/run_on_device.sh ]; then
      say "skip ds: no .anchors/ (README.md, Development, says how to fill it; then carry .anchors)"
    else
      : >/tmp/ds_aio.out
      : >/tmp/ds_anchor.out
      if wanted ds || wanted ds_aio; then stage ds_aio 180 60 st_ds_aio; fi
      to_jsonl ds_aio_bw </tmp/ds_aio.out >>"$OUT/ds.jsonl"
      if wanted ds || wanted ds_anchor; then stage ds_anchor 420 150 st_ds_anchor; fi
      to_jsonl ds_anchor </tmp/ds_anchor.out >>"$OUT/ds.jsonl"
      : >/tmp/ds_anchor.out
      if wanted ds_cpu; then stage ds_cpu 300 90 st_ds_cpu; fi
      to_jsonl ds_cpu </tmp/ds_anchor.out >>"$OUT/ds.jsonl"
    fi
  fi
  if wanted ourshost; then stage ourshost 300 90 st_ourshost; fi
  if wanted oursfull; then stage oursfull 300 90 st_oursfull; fi
  if wanted plain; then stage plain 150 60 st_plain; fi
  if wanted plainm; then stage plainm 150 60 st_plainm; fi
  if wanted ab; then stage ab 540 120 st_ab; fi
  if wanted ab32; then stage ab32 540 120 st_ab32; fi
  if wanted ranks; then stage ranks 300 120 st_ranks; fi
  if wanted ours8; then stage ours8 300 120 st_ours8; fi
  if wanted oursbf16; then stage oursbf16 300 120 st_oursbf16; fi
  if wanted ckpt; then stage ckpt 240 90 st_ckpt; fi
  if wanted exit; then stage exit 240 90 st_exit; fi
  if wanted vsbase; then stage vsbase 540 150 st_vsbase; fi
  if wanted study; then stage study 540 120 st_study; fi
  if wanted pin; then stage pin 120 30 st_pin; fi
  if wanted ds_big; then
    if [ ! -f .anchors/run_on_device.sh ]; then
      say "skip ds_big: no .anchors/ (README.md, Development, says how to fill it; then carry .anchors)"
    else
      stage ds_big 600 120 st_ds_big
    fi
  fi
  if wanted kv; then stage kv 500 120 st_kv; fi
  if wanted big; then stage big 600 200 st_big; fi
  say "summary"
  summary
  say "done; files: $(ls "$OUT" | tr '\n' ' ')"
}

main 2>&1 | tee -a "$OUT/device.log"
