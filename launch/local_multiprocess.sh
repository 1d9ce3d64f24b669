#!/usr/bin/env bash
# N local processes of `ao-mdm train` joined through a coordinator on 127.0.0.1 (CPU by default).
# Usage: launch/local_multiprocess.sh N CONFIG WORKDIR [more ao-mdm train flags...]
# Env: PORT (coordinator port, default 12355), DEVICES_PER_PROCESS (CPU devices each, default 4),
#      AO_MDM (the command; default: this checkout's .venv/bin/ao-mdm if `make` made it, else
#      ao-mdm on PATH), JAX_PLATFORMS (default cpu).
# Process 0 prints to the terminal (without gloo's "[Gloo] Rank ... connected" lines); process
# i > 0 logs to WORKDIR/process_i.log.
set -euo pipefail
if (( $# < 3 )); then
  echo "usage: $0 NUM_PROCESSES CONFIG WORKDIR [ao-mdm train flags...]" >&2
  exit 2
fi
n=$1 config=$2 workdir=$3
shift 3
if ! [[ $n =~ ^[1-9][0-9]*$ ]]; then
  echo "NUM_PROCESSES must be a positive integer, got '$n'" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")/.." && pwd)
aomdm=${AO_MDM:-$([[ -x $here/.venv/bin/ao-mdm ]] && echo "$here/.venv/bin/ao-mdm" || echo ao-mdm)}
if ! command -v "$aomdm" > /dev/null; then
  echo "no ao-mdm command: run \`make install\` in $here first, or set AO_MDM" >&2
  exit 2
fi
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${DEVICES_PER_PROCESS:-4}"
mkdir -p "$workdir"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT  # stop the others if one fails or on Ctrl-C
for ((i = 0; i < n; i++)); do
  cmd=("$aomdm" train --config="$config" --workdir="$workdir"
       --coordinator="127.0.0.1:${PORT:-12355}" --num_processes="$n" --process_id="$i" "$@")
  if (( i == 0 )); then
    "${cmd[@]}" 2> >(grep --line-buffered -v '^\[Gloo\] Rank' >&2) &
  else
    "${cmd[@]}" > "$workdir/process_$i.log" 2>&1 &
  fi
  pids+=($!)
done
for ((i = 0; i < n; i++)); do
  wait -n || { echo "a process failed (exit $?); stopping the others" >&2; exit 1; }
done
