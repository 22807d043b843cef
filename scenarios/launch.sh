#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Starts a world of W ranks on this host, one process per GPU (rank r on GPU r), all running the
# same command: scenarios/launch.sh W command args...  Each process gets MOE_RANK, MOE_WORLD_SIZE,
# MOE_DEVICE and MOE_NCCL_ID_FILE (a fresh path: rank 0 writes the NCCL id there, the others wait
# for it), which moe.world{from_env = true} reads; its output is prefixed with its rank.  When a
# rank fails the others are stopped (they would wait for it until a timeout, or in NCCL's set-up
# for ever) and the launcher exits with that rank's status; 0 when every rank succeeds.  For
# several hosts, do the same on each host with the global ranks and a shared id file (README).
set -uo pipefail
if [ $# -lt 2 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: scenarios/launch.sh W command [args...]  (W processes, rank r on GPU r)" >&2
  exit 2
fi
W=$1
shift
# a path where no file is yet: rank 0 makes the NCCL id there (it must: NCCL's bootstrap listens
# in the process that made the id), the others wait for it
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
id_file=$dir/nccl.id
pids=()
stop_all() { for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done; }
# the ranks are not in the terminal's process group (below): pass an interrupt on to them
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
set -m # each rank in its own process group (job control on while they start), so that stopping
#        a rank stops its whole pipeline
for ((r = 0; r < W; r++)); do
  # the subshell's status is the command's (pipefail), not sed's
  (MOE_RANK=$r MOE_WORLD_SIZE=$W MOE_DEVICE=$r MOE_NCCL_ID_FILE=$id_file "$@" 2>&1 | sed -u "s/^/[$r] /") &
  pids+=($!)
done
set +m
status=0
while [ ${#pids[@]} -gt 0 ]; do
  wait -n -p ended "${pids[@]}" # the next rank to end, whichever it is
  rc=$?
  left=()
  for p in "${pids[@]}"; do [ "$p" != "$ended" ] && left+=("$p"); done
  pids=("${left[@]}")
  if [ $status -eq 0 ] && [ $rc -ne 0 ]; then
    status=$rc
    stop_all
  fi
done
exit $status
