#!/usr/bin/env bash
# One call on the GPU machine: build for the H200, then run the steps named on the command line
# (default: all), each with a time limit, logging under $OUT (or /tmp/moelab-out), and print a
# short table last.  Used as: source .device/env.sh && bash scenarios/device.sh build programs specs
set -uo pipefail
out=${OUT:-/tmp/moelab-out}
mkdir -p "$out"
export LUA_CPATH="./build/?.so;${LUA_CPATH:-;}"
steps=${*:-build programs specs kimi scheduler}
declare -A result
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
    programs) for p in build/gpu_tests/*; do run "$(basename "$p")" 240 "$p"; done ;;
    specs) run specs 400 busted ;;
    gpuspecs) run gpuspecs 400 busted --tags=gpu ;;
    kimi) run kimi 400 lua scenarios/kimi.lua --json "$out/kimi.json" ;;
    scheduler) run scheduler 300 lua scenarios/scheduler.lua --json "$out/scheduler.json" ;;
    experts) run experts 400 lua scenarios/experts.lua --json "$out/experts.json" ;;
    memcheck|racecheck)
      # the programs without their timed shapes: experts takes --no-bench, the others --quick
      for p in build/gpu_tests/*; do
        flag=--quick; case $p in *experts*) flag=--no-bench ;; esac
        run "$s-$(basename "$p")" 300 compute-sanitizer --tool "$s" --error-exitcode 1 "$p" $flag
      done ;;
    *) echo "unknown step $s" ;;
  esac
done
echo "==== summary"
for s in "${!result[@]}"; do echo "$s ${result[$s]}"; done | sort
