#!/usr/bin/env bash
# N local processes of `ao-mdm train` joined through a coordinator on 127.0.0.1 (CPU by default).
# Usage: launch/local_multiprocess.sh N CONFIG WORKDIR [more ao-mdm train flags...]
# Env: PORT (coordinator port, default 12355), DEVICES_PER_PROCESS (CPU devices each, default 4),
#      AO_MDM (the command; default: this checkout's .venv/bin/ao-mdm if `make` made it, else
#      ao-mdm on PATH), JAX_PLATFORMS (default cpu).
# Process 0 prints to the terminal; process i > 0 logs to WORKDIR/process_i.log. Exits 0 when
# every process did, 130 after Ctrl-C (every process saved and stopped), 1 when one failed (the
# others are stopped).
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
    "${cmd[@]}" &
  else
    "${cmd[@]}" > "$workdir/process_$i.log" 2>&1 &
  fi
  pids+=($!)
done
# Ctrl-C in the terminal reaches every process: each saves the same step and exits 130, an
# interrupt honoured, not a failure; this script then exits 130 too.
interrupted=0
trap 'interrupted=1' INT
left=$n
while (( left > 0 )); do
  id=
  wait -n -p id && rc=0 || rc=$?
  [[ -z ${id:-} ]] && continue  # the wait was cut short by the Ctrl-C trap, no process ended
  left=$((left - 1))
  if (( rc == 130 )); then
    interrupted=1
  elif (( rc != 0 )); then
    echo "a process failed (exit $rc); stopping the others" >&2
    exit 1
  fi
done
exit $(( interrupted ? 130 : 0 ))
