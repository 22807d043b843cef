#!/usr/bin/env bash
# Starts a world of W ranks on this host, one process per GPU (rank r on GPU r), all running the
# same command: scenarios/launch.sh W command args...  Each process gets MOE_RANK, MOE_WORLD_SIZE,
# MOE_DEVICE and MOE_NCCL_ID_FILE (a fresh path: rank 0 writes the NCCL id there, the others wait
# for it), which moe.world{from_env = true} reads; its output is prefixed with its rank.  Exits
# with the first failing rank's status, 0 when every rank succeeds.  For several hosts, do the
# same on each host with the global ranks and a shared id file (README).
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
for ((r = 0; r < W; r++)); do
  # the subshell's status is the command's (pipefail), not sed's
  (MOE_RANK=$r MOE_WORLD_SIZE=$W MOE_DEVICE=$r MOE_NCCL_ID_FILE=$id_file "$@" 2>&1 | sed -u "s/^/[$r] /") &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do
  wait "$p"
  rc=$?
  [ $status -eq 0 ] && [ $rc -ne 0 ] && status=$rc
done
exit $status
