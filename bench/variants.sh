#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Time variants of one library source against each other in one call: the source is compiled once
# a variant with extra flags (its #ifdef switches), the program is linked by hand with each
# object, and each runs in turn, the unchanged build first and last.  From the repository root,
# after a build:
#   bash bench/variants.sh build kernels/experts/fp8.cu experts_fp8_bench "30 3" stages4=-DX_STAGES=4 ...
# Why by hand: ninja's deps log records each object's mtime, so an object copied into the build
# tree looks stale and ninja compiles it again from source: the variant would never run.  Each
# line gives the program's checksum, so that two variants that ran the same code show it.
set -uo pipefail
if [ $# -lt 5 ]; then
  echo "usage: $0 BUILD_DIR SOURCE TARGET \"ARGS\" NAME=FLAGS..." >&2
  exit 2
fi
build=$1 src=$2 target=$3 args=$4
shift 4
obj="CMakeFiles/moelab_objects.dir/$src.o"
[ -f "$build/$obj" ] || { echo "no object $build/$obj (a library source, built?)" >&2; exit 2; }
ninja -C "$build" "$target" >/dev/null || exit 1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
compile=$(ninja -C "$build" -t commands "$obj" | tail -1)
commands=$(ninja -C "$build" -t commands "$target")
link="$(grep -E 'qc [^ ]*moelab_internal' <<<"$commands" | tail -1) && $(tail -1 <<<"$commands")"
program=$(tail -1 <<<"$commands" | grep -oE ' -o [^ ]+' | tail -1 | cut -c5-)
[ -n "$program" ] || { echo "cannot find $target's output in its link command" >&2; exit 2; }
cp "$build/$obj" "$work/base.o"
names=()
for v in "$@"; do
  name=${v%%=*} flags=${v#*=}
  names+=("$name")
  (cd "$build" && eval "${compile/-o $obj/-o $work/$name.o} $flags") >"$work/$name.log" 2>&1 &
done
wait
relink() { cp "$work/$1.o" "$build/$obj" && (cd "$build" && eval "$link") >"$work/link.log" 2>&1; }
for name in base "${names[@]}" base; do
  if [ ! -f "$work/$name.o" ]; then
    echo "== $name: did not compile"; tail -5 "$work/$name.log"; continue
  fi
  relink "$name" || { echo "== $name: did not link"; tail -5 "$work/link.log"; continue; }
  echo "== $name ($(md5sum "$build/$program" | cut -c1-8))"
  # shellcheck disable=SC2086 # args are the program's words
  "$build/$program" $args 2>&1 | tail -n "${TAIL:-4}"
done
# the unchanged object back (ninja will compile it once more, its mtime being newer than its log's)
relink base || echo "could not link $target back to the unchanged object" >&2
