#!/usr/bin/env bash
# Run any tieflax command on every worker of a Cloud TPU VM pod slice (one process per host), detached.
#
# Usage:
#   launch/tpu_pod.sh [OPTIONS] TPU_NAME ZONE [PROJECT] -- [COMMAND] ARGS...
# COMMAND: train (the default when ARGS start with an option), compare, sweep, evaluate, eval, prepare, ...
# Examples:
#   launch/tpu_pod.sh my-v5p-64 us-east5-a my-project -- train --config configs/models/llama3_8b.py \
#       --workdir gs://my-bucket/runs/llama3_8b --config.data.source=tokens \
#       --config.data.tokens.path=gs://my-bucket/stores/corpus
#   launch/tpu_pod.sh --logs gs://my-bucket/logs my-v5p-64 us-east5-a -- compare \
#       --config configs/experiments/tie_vs_untie_pod.py --workdir gs://my-bucket/study
#   launch/tpu_pod.sh my-v5p-64 us-east5-a -- prepare --config CONFIG --out gs://my-bucket/stores/corpus
#       (each host runs --shard i/N of its own; then once: ... --worker 0 -- prepare ... --finalize)
# Options:
#   --dry-run        print every gcloud command instead of running it
#   --code DIR       copy this source tree (its git-tracked files) to every host and pip install it (default:
#                    this repository); --wheel FILE copies and installs a built wheel; --version V installs
#                    tieflax==V from the package index; --no-install installs nothing (already there)
#   --extras E       pip extras to install with it (default: tpu)
#   --logs URL       also copy each host's log to URL/<tag>/host<i>.log (every 60 s and at the end)
#   --worker W       run on worker W only (default: all)
#   --tag TAG        the run's name in log file names (default: COMMAND-<UTC time>)
#   --attach         stay in the foreground, streaming every host's output (closing the terminal stops it)
# What it does: installs the code (one `gcloud compute tpus tpu-vm scp` and one `ssh --worker=all`), then
# one `ssh --worker=all` that starts the command under nohup on every host, its output in
# ~/tieflax-logs/<tag>.log there, and returns: closing the laptop does not stop the run. Each host learns its
# index from the TPU metadata (agent-worker-number; TIEFLAX_HOST_INDEX overrides it); train, compare, sweep
# and evaluate run with TIEFLAX_DISTRIBUTED=1 (jax.distributed.initialize reads the pod topology from the
# TPU metadata); prepare runs with --shard <index>/<hosts> instead. Follow a host's log:
#   gcloud compute tpus tpu-vm ssh TPU_NAME --zone ZONE --worker=0 --command='tail -f ~/tieflax-logs/<tag>.log'
# Resume: rerun the same command (checkpoints and a prepare's ledger live in the bucket). Preemption: after a
# SIGTERM all hosts stop together at the next log step, save a checkpoint and exit 0.
set -euo pipefail

usage() { sed -n '2,34p' "$0"; exit 2; }
DRY=0; INSTALL=code; CODE="$(cd "$(dirname "$0")/.." && pwd)"; WHEEL=""; VERSION=""; EXTRAS=tpu; LOGS=""
WORKER=all; TAG=""; ATTACH=0
while [[ $# -gt 0 && "$1" == --* && "$1" != "--" ]]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --code) INSTALL=code; CODE="$2"; shift 2 ;;
    --wheel) INSTALL=wheel; WHEEL="$2"; shift 2 ;;
    --version) INSTALL=version; VERSION="$2"; shift 2 ;;
    --no-install) INSTALL=none; shift ;;
    --extras) EXTRAS="$2"; shift 2 ;;
    --logs) LOGS="${2%/}"; shift 2 ;;
    --worker) WORKER="$2"; shift 2 ;;
    --tag) TAG="$2"; shift 2 ;;
    --attach) ATTACH=1; shift ;;
    --help|-h) usage ;;
    *) echo "tpu_pod.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ $# -ge 3 ]] || usage
TPU_NAME="$1"; ZONE="$2"; shift 2
PROJECT_FLAG=()
if [[ "$1" != "--" ]]; then PROJECT_FLAG=(--project "$1"); shift; fi
[[ $# -ge 1 && "$1" == "--" ]] || { echo "tpu_pod.sh: put -- before the tieflax command" >&2; exit 2; }
shift
[[ $# -ge 1 ]] || { echo "tpu_pod.sh: no tieflax command after --" >&2; exit 2; }
if [[ "$1" == -* ]]; then COMMAND=train; else COMMAND="$1"; shift; fi
TAG="${TAG:-${COMMAND}-$(date -u +%Y%m%dT%H%M%SZ)}"
GC=(gcloud compute tpus tpu-vm)
WHERE=(--zone "$ZONE" "${PROJECT_FLAG[@]}")

run() {  # prints the command with --dry-run, runs it otherwise
  if [[ $DRY -eq 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}

# How many hosts: one network endpoint each.
if [[ $DRY -eq 1 ]]; then
  run "${GC[@]}" describe "$TPU_NAME" "${WHERE[@]}" --format='value(networkEndpoints[].ipAddress)'
  HOSTS='$HOSTS'
else
  ENDPOINTS=$("${GC[@]}" describe "$TPU_NAME" "${WHERE[@]}" --format='value(networkEndpoints[].ipAddress)')
  HOSTS=$(tr ';,' '\n\n' <<< "$ENDPOINTS" | grep -c .)
  [[ $HOSTS -ge 1 ]] || { echo "tpu_pod.sh: $TPU_NAME in $ZONE lists no hosts" >&2; exit 1; }
fi

# 1. The code on every host.
PIP="python3 -m pip install --quiet"
case "$INSTALL" in
  code)
    ARCHIVE="$(mktemp -d)/tieflax-src.tar.gz"
    if [[ $DRY -eq 1 ]]; then echo "tar czf $ARCHIVE -C $CODE \$(git -C $CODE ls-files)"
    else tar czf "$ARCHIVE" -C "$CODE" $(git -C "$CODE" ls-files); fi
    run "${GC[@]}" scp "$ARCHIVE" "$TPU_NAME:tieflax-src.tar.gz" "${WHERE[@]}" --worker="$WORKER"
    SETUP="rm -rf ~/tieflax-src && mkdir -p ~/tieflax-src && tar xzf ~/tieflax-src.tar.gz -C ~/tieflax-src && $PIP -e ~/tieflax-src[$EXTRAS]" ;;
  wheel)
    run "${GC[@]}" scp "$WHEEL" "$TPU_NAME:$(basename "$WHEEL")" "${WHERE[@]}" --worker="$WORKER"
    SETUP="$PIP ~/$(basename "$WHEEL")[$EXTRAS]" ;;
  version) SETUP="$PIP 'tieflax[$EXTRAS]==$VERSION'" ;;
  none) SETUP="" ;;
esac
if [[ -n "$SETUP" ]]; then
  run "${GC[@]}" ssh "$TPU_NAME" "${WHERE[@]}" --worker="$WORKER" --command="set -e; $SETUP"
fi

# 2. The command, detached on every host.
ARGS=$(printf '%q ' "$@")
INDEX='I=${TIEFLAX_HOST_INDEX:-$(curl -s -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number)}'
case "$COMMAND" in
  prepare) JOB="tieflax prepare ${ARGS}--shard \$I/$HOSTS" ;;
  train|compare|sweep|evaluate|eval|sample) JOB="TIEFLAX_DISTRIBUTED=1 tieflax $COMMAND ${ARGS}" ;;
  *) JOB="tieflax $COMMAND ${ARGS}" ;;
esac
LOG="~/tieflax-logs/${TAG}.log"
COPY=""
if [[ -n "$LOGS" ]]; then COPY="gcloud storage cp -q $LOG $LOGS/$TAG/host\$I.log >/dev/null 2>&1 || true"; fi
# The job, then its exit status, in the log; a copier sends the log to the bucket every 60 s while it runs
# and at the end (it looks every second whether the job has ended, so the last copy comes at once).
BODY="$INDEX; mkdir -p ~/tieflax-logs; ( $JOB; echo \"tieflax-pod: host \$I exit \$?\" ) > $LOG 2>&1"
if [[ -n "$COPY" ]]; then
  BODY="$INDEX; mkdir -p ~/tieflax-logs; ( ( $JOB; echo \"tieflax-pod: host \$I exit \$?\" ) > $LOG 2>&1 & job=\$!; n=0; while kill -0 \$job 2>/dev/null; do if [ \$((n % 60)) -eq 0 ]; then $COPY; fi; n=\$((n + 1)); sleep 1; done; wait \$job || true; $COPY )"
fi
if [[ $ATTACH -eq 1 ]]; then
  REMOTE="$INDEX; mkdir -p ~/tieflax-logs; $JOB 2>&1 | tee $LOG"
else
  REMOTE="nohup bash -c $(printf '%q' "$BODY") > /dev/null 2>&1 < /dev/null & echo \"tieflax-pod: started on host \$(hostname): $LOG\""
fi
run "${GC[@]}" ssh "$TPU_NAME" "${WHERE[@]}" --worker="$WORKER" --command="$REMOTE"
if [[ $ATTACH -eq 0 && $DRY -eq 0 ]]; then
  echo "tpu_pod.sh: $COMMAND started on $HOSTS host(s), detached; logs: $LOG on each host${LOGS:+, $LOGS/$TAG/}" >&2
  echo "  follow: gcloud compute tpus tpu-vm ssh $TPU_NAME --zone $ZONE --worker=0 --command='tail -f $LOG'" >&2
fi
