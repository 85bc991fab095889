#!/usr/bin/env bash
# N CPU processes on this machine, talking over gloo: the multi-host code path, on a laptop.
#
# Usage:
#   launch/local_multiprocess.sh NUM_PROCESSES DEVICES_PER_PROCESS tieflax train --config CONFIG --workdir DIR [...]
#   launch/local_multiprocess.sh --help     # this text
# Example (2 processes x 4 CPU devices = one 8-device mesh):
#   launch/local_multiprocess.sh 2 4 tieflax train --config configs/experiments/tiny.py --workdir /tmp/mp
#
# Every process runs the same command; process i gets TIEFLAX_PROCESS_ID=i, all share
# TIEFLAX_COORDINATOR=localhost:PORT (a free port; set TIEFLAX_PORT to choose it) and
# TIEFLAX_NUM_PROCESSES, which `tieflax train` hands to jax.distributed.initialize (tieflax/hardware/distributed.py).
# Logs: process 0 prints to this terminal; the others to $WORKDIR_LOGS/process_<i>.log (default /tmp).
# Exit status: the first non-zero exit status of any process, else 0. Ctrl-C / SIGTERM is forwarded to
# every process (training saves a checkpoint and exits 0).
set -euo pipefail

usage() { sed -n "2,$(grep -n '^set -euo pipefail' "$0" | cut -d: -f1)p" "$0" | sed '$d'; }
die() { echo "local_multiprocess.sh: $*" >&2; exit 2; }
[[ "${1:-}" == --help || "${1:-}" == -h ]] && { usage; exit 0; }
[[ $# -ge 3 ]] || die "give NUM_PROCESSES DEVICES_PER_PROCESS COMMAND [ARGS...] (see --help)"
[[ "$1" =~ ^[1-9][0-9]*$ ]] || die "NUM_PROCESSES '$1': give a whole number, 1 or more (see --help)"
[[ "$2" =~ ^[1-9][0-9]*$ ]] || die "DEVICES_PER_PROCESS '$2': give a whole number, 1 or more (see --help)"
NUM="$1"; DEVICES="$2"; shift 2
PORT="${TIEFLAX_PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')}"
LOGS="${WORKDIR_LOGS:-/tmp}"
PIDS=()

forward() { for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done; }
trap forward TERM INT

for ((i = 0; i < NUM; i++)); do
  run=(env XLA_FLAGS="--xla_force_host_platform_device_count=${DEVICES} ${XLA_FLAGS:-}" JAX_PLATFORMS=cpu
       TIEFLAX_COORDINATOR="localhost:${PORT}" TIEFLAX_NUM_PROCESSES="$NUM" TIEFLAX_PROCESS_ID="$i" "$@")
  if [[ $i -eq 0 ]]; then
    "${run[@]}" &
  else
    "${run[@]}" > "${LOGS}/process_${i}.log" 2>&1 &
  fi
  PIDS+=("$!")
done

status=0
for pid in "${PIDS[@]}"; do
  rc=0
  wait "$pid" || rc=$?  # (not `if ! wait`: inside it, $? is the negation's status, always 0)
  # `wait` returns 128+n when interrupted by a trapped signal: wait again for the real status.
  while kill -0 "$pid" 2>/dev/null; do wait "$pid" && rc=0 || rc=$?; done
  [[ $status -eq 0 ]] && status=$rc
done
exit "$status"
