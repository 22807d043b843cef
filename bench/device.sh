#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Build for the H200, then run the steps named on the command line on a GPU machine (default:
# build programs specs kimi scheduler; the others are the cases below), each with a time limit,
# logging one file a step under MOE_LOG_DIR (default /tmp/moelab-logs), and print a short table
# last.  From the repository root, with lua, busted and nvcc on the PATH:
#   bash bench/device.sh build programs specs
# MOE_LOG_TAR=file packs the logs into that tarball at the end.
set -uo pipefail
out=${MOE_LOG_DIR:-/tmp/moelab-logs}
mkdir -p "$out"
export LUA_CPATH="./build/?.so;${LUA_CPATH:-;}"
steps=${*:-build programs specs kimi scheduler}
only=${ONLY:-*} # which GPU test programs the programs, memcheck and racecheck steps run (a glob)
declare -A result
ncu_pages() { # report path without .ncu-rep: its source view (stalls per line) and details as text
  ncu -i "$1.ncu-rep" --page source --print-source cuda,sass --csv >"$1-source.csv" 2>&1
  ncu -i "$1.ncu-rep" --page details >"$1-details.txt" 2>&1
  rm -f "$1.ncu-rep"
}
run() { # name, limit in seconds, command...
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s%N)
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  result[$name]="rc=$rc $(( ($(date +%s%N) - t0) / 1000000 )) ms"
  echo "---- $name: rc=$rc"; tail -n "${TAIL:-25}" "$out/$name.log"
}
for s in $steps; do
  case $s in
    build) run build 300 bash -c 'cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a && cmake --build build' ;;
    programs) # the test programs, then (unless ONLY picks some) the programs that time the stages
      for p in build/gpu_tests/$only; do run "$(basename "$p")" 240 "$p"; done
      if [ "$only" = "*" ]; then
        for p in experts_bench dispatch_combine_bench schedule_trace; do run "$p" 240 "build/bench/$p"; done
      fi ;;
    specs) run specs 400 busted ;;
    trace) run trace 120 build/bench/schedule_trace ;;
    gpuspecs) run gpuspecs 400 busted --tags=gpu ;;
    profile) # ncu on the scheduler's kernels at PROFILE_SHAPE (W,T; default 8,512): stall reasons per
      # source line (CSV) and the details page, each kernel once, packed with the logs
      shape=${PROFILE_SHAPE:-8,512}
      for k in ${PROFILE_KERNELS:-schedule_kernel}; do
        f="$out/$k-${shape/,/x}"
        run "ncu-$k-${shape/,/x}" 300 ncu -f -o "$f" --clock-control none --import-source yes --set full -k "regex:$k" --launch-skip 50 \
          --launch-count 1 build/bench/schedule_trace --shape "$shape"
        ncu -i "$f.ncu-rep" --page raw --csv >"$f-raw.csv" 2>&1
        ncu_pages "$f"
      done ;;
    profile-experts) # ncu on the experts GEMM at the Kimi shape, EXPERTS_KERNEL's kernel (default
      # sm90w, the one the library takes there): its gate_up and down launches of the third run
      # (the checked one, then two warm-ups)
      k=${EXPERTS_KERNEL:-sm90w}
      f="$out/experts-$k"
      run "ncu-experts-$k" 300 ncu -f -o "$f" --clock-control none --import-source yes --set full \
        -k regex:sm90_gemm --launch-skip 4 --launch-count 2 build/bench/experts_bench --kernel "$k"
      ncu_pages "$f" ;;
    spread) # run-to-run spread of the experts GEMM: SPREAD_RUNS processes of SPREAD_PASSES passes
      # each, SM clock, power and clock-event reasons sampled every 20 ms beside them (smi.csv)
      q=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active
      nvidia-smi --query-gpu=$q --format=csv,noheader -lms 20 >"$out/smi.csv" 2>&1 &
      smi=$!
      for i in $(seq "${SPREAD_RUNS:-4}"); do
        echo "run $i $(date +%H:%M:%S.%N)" >>"$out/smi.csv"
        run "spread-$i" 120 build/bench/experts_bench --kernel "${EXPERTS_KERNEL:-sm90w}" \
          --passes "${SPREAD_PASSES:-30}"
      done
      # cuBLAS beside it, the same rows (Kimi K2, 48 experts of 1,194-1,195) and the same pass count
      sizes=$(for e in $(seq 0 47); do echo $((e < 32 ? 1195 : 1194)); done | paste -sd' ')
      for i in $(seq "${SPREAD_RUNS:-4}"); do
        echo "cublas $i $(date +%H:%M:%S.%N)" >>"$out/smi.csv"
        run "spread-cublas-$i" 120 build/bench/cublas_baseline 7168 2048 --warmup 2 --iters "${SPREAD_PASSES:-30}" \
          $sizes
      done
      nvidia-smi -q -d POWER,CLOCK,PERFORMANCE >"$out/smi-q.txt" 2>&1
      kill "$smi" ;;
    dram-experts) # DRAM and L2 bytes of the experts GEMM's launches (gate_up, down) at the Kimi shape
      k=${EXPERTS_KERNEL:-sm90w}
      m=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,lts__t_sector_hit_rate.pct
      run "dram-experts-$k" 200 ncu --clock-control none --metrics "$m" \
        -k regex:sm90_gemm --launch-skip 4 --launch-count 2 build/bench/experts_bench --kernel "$k" ;;
    energy) # joules per pass of the experts stage at the Kimi shape (the GPU's energy counter)
      run energy 120 build/bench/experts_energy ${ENERGY_ARGS:-} ;;
    exchange) run exchange 400 build/bench/exchange_bench ${EXCHANGE_ARGS:-} ;;
    kimi-world) # the layer over a real world: one rank per visible GPU (KIMI_DEVICES, default all)
      devs=${KIMI_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)}
      run kimi-world 500 lua scenarios/kimi.lua --devices "$devs" --json "$out/kimi-world.json" ;;
    ranks) # a multi-process world: one process per visible GPU (RANKS, default all), each checked
      n=${RANKS:-$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)}
      run ranks 300 scenarios/launch.sh "$n" lua scenarios/world_ranks.lua ;;
    fault) # a rank that leaves mid-run: the others fail within MOE_WORLD_TIMEOUT (5 s here)
      run fault 120 env MOE_WORLD_TIMEOUT=5 scenarios/launch.sh 2 lua scenarios/world_fault.lua ;;
    kimi) run kimi 400 lua scenarios/kimi.lua --json "$out/kimi.json" ;;
    fp8) # the FP8 layer's measurements, each beside its anchor in the same call: the experts
      # against cuBLASLt's FP8 pair, the layer and its decode against the bf16 layer
      run fp8-experts-bench 120 build/bench/experts_fp8_bench 30
      run fp8-experts 300 lua scenarios/experts.lua --precision fp8 --models kimi_k2 --dists uniform --pads 1 \
        --json "$out/fp8-experts.json"
      run fp8-kimi 400 lua scenarios/kimi.lua --precision fp8 --anchor --json "$out/fp8-kimi.json"
      run fp8-decode 200 lua scenarios/kimi.lua --precision fp8 --tokens 128 --anchor --json "$out/fp8-decode.json"
      run fp8-quantize 60 lua bench/quantize_tokens.lua ;;
    scheduler) run scheduler 300 lua scenarios/scheduler.lua --json "$out/scheduler.json" ;;
    experts) run experts 400 lua scenarios/experts.lua --json "$out/experts.json" ;;
    memcheck|racecheck)
      # the test programs; the scheduler's without its cases over 200,000 routes (--quick)
      for p in build/gpu_tests/$only; do
        flag=; case $p in *schedule*) flag=--quick ;; esac
        # racecheck runs the scheduler's cases up to RACE_MAX_ROUTES routes (20,000: ~210 s)
        case $s$p in racecheck*schedule*) flag="--quick --max-routes ${RACE_MAX_ROUTES:-20000}" ;; esac
        # NCCL's own start-up asks cudaFuncGetAttributes of kernels built for other chips (error
        # 209, inside ncclCommInitAll): API errors are not reported for the world program
        api=; case $p in *world*) api="--report-api-errors no" ;; esac
        case $p in
          *experts*) # one kernel a run (MOE_EXPERTS_CHECK), so that each fits its limit
            for k in mma sm90x1 sm90x2 sm90w auto; do
              # racecheck of the mma kernel at Kimi's width passes five minutes: its quick cases only
              flag=; case $s$k in racecheckmma) flag=--quick ;; esac
              run "$s-$(basename "$p")-$k" 300 env MOE_EXPERTS_CHECK=$k compute-sanitizer --tool "$s" --error-exitcode 1 \
                "$p" $flag
            done ;;
          *) run "$s-$(basename "$p")" 300 compute-sanitizer --tool "$s" $api --error-exitcode 1 "$p" $flag ;;
        esac
      done
      # the FP8 dispatch and the router's logits have specs rather than test programs
      if [ "$only" = "*" ]; then
        run "$s-spec-dispatch_fp8" 300 compute-sanitizer --tool "$s" --error-exitcode 1 \
          busted --tags=gpu --filter=dispatch_fp8 spec/fp8_spec.lua
        run "$s-spec-logits" 300 compute-sanitizer --tool "$s" --error-exitcode 1 busted --tags=gpu spec/logits_spec.lua
      fi ;;
    *) echo "unknown step $s" ;;
  esac
done
echo "==== summary"
for s in "${!result[@]}"; do echo "$s ${result[$s]}"; done | sort
[ -n "${MOE_LOG_TAR:-}" ] && tar czf "$MOE_LOG_TAR" -C "$out" .
