#!/usr/bin/env bash
# Run any tieflax command on every worker of a Cloud TPU VM pod slice (one process per host), detached.
#
# Usage:
#   launch/tpu_pod.sh [OPTIONS] TPU_NAME ZONE [PROJECT] -- [COMMAND] ARGS...
# COMMAND: train (the default when ARGS start with an option), compare, sweep, evaluate, eval, prepare, ...;
#   one that the tieflax it installs does not have (tieflax/cli.py's COMMANDS: of the --code tree, the
#   --wheel, else of this launcher's repository) is refused before anything starts
# Examples:
#   launch/tpu_pod.sh my-v5p-64 us-east5-a my-project -- train --config configs/models/llama3_8b.py \
#       --workdir gs://my-bucket/runs/llama3_8b --config.data.source=tokens \
#       --config.data.tokens.path=gs://my-bucket/stores/corpus
#   launch/tpu_pod.sh --logs gs://my-bucket/logs my-v5p-64 us-east5-a -- compare \
#       --config configs/experiments/tie_vs_untie_pod.py --workdir gs://my-bucket/study
#   launch/tpu_pod.sh my-v5p-64 us-east5-a -- prepare --config CONFIG --out gs://my-bucket/stores/corpus
#       (each host runs --shard i/N of its own; then once: ... --worker 0 -- prepare ... --finalize;
#       or, on a Ray cluster over the hosts (docs/tpu.md): ... --worker 0 -- prepare ... --ray HEAD:6379)
# Options:
#   --dry-run        print every gcloud command instead of running it
#   --code DIR       copy this source tree (its git-tracked files) to ~/tieflax-src on every host and pip install
#                    it (default: this repository); --wheel FILE installs a built wheel, --version V installs
#                    tieflax==V from the package index (both copy the tree's configs/ to ~/tieflax-src too);
#                    --no-install installs nothing (already there). Every host runs the command in
#                    ~/tieflax-src (its home folder if there is none), so configs/... paths work as here
#   --extras E       pip extras to install with it (default: tpu)
#   --logs URL       also copy each host's log to URL/<tag>/host<i>.log (every 60 s and at the end)
#   --worker W       run on worker W only (default: all)
#   --tag TAG        the run's name in log file names (default: COMMAND-<UTC time>; letters, digits, . _ -)
#   --attach         stay in the foreground, streaming every host's output (closing the terminal stops it)
# What it does: installs the code (one `gcloud compute tpus tpu-vm scp` and one `ssh --worker=all`), then
# one `ssh --worker=all` that starts the command under nohup on every host, its output in
# ~/tieflax-logs/<tag>.log there, and returns: closing the laptop does not stop the run. Each host learns its
# index from the TPU metadata (agent-worker-number; TIEFLAX_HOST_INDEX overrides it); train, compare, sweep
# and evaluate run with TIEFLAX_DISTRIBUTED=1 (jax.distributed.initialize reads the pod topology from the
# TPU metadata); prepare runs with --shard <index>/<hosts> instead (a --shard of your own: with --worker W
# only; --finalize: as given). A host where the command could not start says so, and the launcher exits 1.
# Follow a host's log:
#   gcloud compute tpus tpu-vm ssh TPU_NAME --zone ZONE --worker=0 --command='tail -f ~/tieflax-logs/<tag>.log'
# Resume: rerun the same command (checkpoints and a prepare's ledger live in the bucket). Preemption: after a
# SIGTERM all hosts stop together at the next log step, save a checkpoint and exit 0.
set -euo pipefail

ME=tpu_pod.sh
usage() { sed -n "2,$(grep -n '^set -euo pipefail' "$0" | cut -d: -f1)p" "$0" | sed '$d'; }
die() { echo "$ME: $*" >&2; exit 2; }
# An option's value: one line when it is missing (not bash's "$2: unbound variable").
value() { [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || die "$1 needs a value (see --help)"; }
# Values that end up inside the remote shell command are refused unless they are plain words: a tag names
# files there, extras go inside pip's brackets; nothing a user types can become a command.
plain() { [[ "$2" =~ ^[A-Za-z0-9][A-Za-z0-9._,-]*$ ]] || die "$1 '$2': use letters, digits, '.', '_', ',' or '-' only"; }
HERE="$(cd "$(dirname "$0")/.." && pwd)"
DRY=0; INSTALL=code; CODE="$HERE"; WHEEL=""; VERSION=""; EXTRAS=tpu; LOGS=""
WORKER=all; TAG=""; ATTACH=0
while [[ $# -gt 0 && "$1" == -* && "$1" != "--" ]]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --code) value "$@"; INSTALL=code; CODE="$2"; shift 2 ;;
    --wheel) value "$@"; INSTALL=wheel; WHEEL="$2"; shift 2 ;;
    --version) value "$@"; plain "$1" "$2"; INSTALL=version; VERSION="$2"; shift 2 ;;
    --no-install) INSTALL=none; shift ;;
    --extras) value "$@"; plain "$1" "$2"; EXTRAS="$2"; shift 2 ;;
    --logs) value "$@"; LOGS="${2%/}"; shift 2 ;;
    --worker) value "$@"; [[ "$2" == all || "$2" =~ ^[0-9]+$ ]] || die "--worker '$2': give a worker number or all"
              WORKER="$2"; shift 2 ;;
    --tag) value "$@"; plain "$1" "$2"; TAG="$2"; shift 2 ;;
    --attach) ATTACH=1; shift ;;
    --help|-h) usage; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[[ $# -ge 3 ]] || die "give TPU_NAME ZONE [PROJECT] -- COMMAND ARGS... (see --help)"
TPU_NAME="$1"; ZONE="$2"; shift 2
PROJECT_FLAG=()
if [[ "$1" != "--" ]]; then PROJECT_FLAG=(--project "$1"); shift; fi
[[ $# -ge 1 && "$1" == "--" ]] || die "put -- before the tieflax command"
shift
[[ $# -ge 1 ]] || die "no tieflax command after --"
if [[ "$1" == -* ]]; then COMMAND=train; else COMMAND="$1"; shift; fi
plain "the command" "$COMMAND"
[[ $INSTALL != code || -d "$CODE" ]] || die "--code $CODE: no such folder"
[[ $INSTALL != code ]] || git -C "$CODE" rev-parse --git-dir > /dev/null 2>&1 \
  || die "--code $CODE: not a git checkout (the launcher copies its git-tracked files)"
[[ $INSTALL != wheel || -f "$WHEEL" ]] || die "--wheel $WHEEL: no such file"
# The command must be one the hosts' tieflax has: the names in tieflax/cli.py's COMMANDS and RENAMED of the
# code they get (the --code tree, or the --wheel: a zip Python imports from), else of this launcher's
# repository (--version, --no-install). Read by importing tieflax.cli from there alone (python3 -S: not a
# tieflax installed here; it imports no jax), not by parsing `tieflax --help`. Where that cannot be read
# (no python3 3.11+ here), one line says the command is not checked, and the launch goes on.
case "$INSTALL" in code) FROM="$CODE" ;; wheel) FROM="$WHEEL" ;; *) FROM="$HERE" ;; esac
KNOWN=$(env JAX_PLATFORMS=cpu python3 -S -c 'import sys; sys.path.insert(0, sys.argv[1]); from tieflax.cli import COMMANDS, RENAMED; print(", ".join([*COMMANDS, *RENAMED]))' "$FROM" 2>/dev/null) || KNOWN=""
if [[ -z "$KNOWN" ]]; then
  echo "$ME: could not read tieflax's commands from $FROM (python3 -S -c 'from tieflax.cli import COMMANDS'); '$COMMAND' is not checked" >&2
elif [[ ", $KNOWN, " != *", $COMMAND, "* ]]; then
  die "unknown tieflax command '$COMMAND'; the commands: $KNOWN"
fi
# prepare: each host gets its own --shard i/N, unless the user gave one (kept, but only on one worker: the
# same share on every host would be written by several writers at once) or asked to --finalize.
# prepare --ray: one driver for the whole Ray cluster (its tasks run on every host), so on one worker only.
OWN_SHARD=0; FINALIZE=0; RAY=0
for a in "$@"; do
  case "$a" in --shard|--shard=*) OWN_SHARD=1 ;; --finalize) FINALIZE=1 ;; --ray|--ray=*) RAY=1 ;; esac
done
if [[ $COMMAND == prepare && $OWN_SHARD -eq 1 && $WORKER == all ]]; then
  die "prepare --shard: the launcher gives each host its own --shard i/N; drop yours, or run one share with --worker W"
fi
if [[ $COMMAND == prepare && $RAY -eq 1 && $WORKER == all ]]; then
  die "prepare --ray: one driver schedules the whole cluster; add --worker 0 (start the Ray cluster first: docs/tpu.md)"
fi
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
  HOSTS=$(tr ';,' '\n\n' <<< "$ENDPOINTS" | grep -c . || true)
  [[ $HOSTS -ge 1 ]] || { echo "$ME: $TPU_NAME in $ZONE lists no hosts" >&2; exit 1; }
fi

# 1. The code on every host, in ~/tieflax-src: the whole tree (--code), or its configs/ beside a wheel or a
# released version, so that a command's configs/... paths mean on every host what they mean here.
PIP="python3 -m pip install --quiet"
SRC='~/tieflax-src'
if [[ $INSTALL != none ]]; then
  SRC_TREE="$CODE"; WHAT=(.)
  [[ $INSTALL == code ]] || WHAT=(configs)
  ARCHIVE="$(mktemp -d)/tieflax-src.tar.gz"
  if [[ $DRY -eq 1 ]]; then echo "git -C $(printf '%q' "$SRC_TREE") ls-files -z ${WHAT[*]} | tar czf $ARCHIVE -C $(printf '%q' "$SRC_TREE") --null -T -"
  else git -C "$SRC_TREE" ls-files -z "${WHAT[@]}" | tar czf "$ARCHIVE" -C "$SRC_TREE" --null -T -; fi
  run "${GC[@]}" scp "$ARCHIVE" "$TPU_NAME:tieflax-src.tar.gz" "${WHERE[@]}" --worker="$WORKER"
  UNPACK="rm -rf $SRC && mkdir -p $SRC && tar xzf ~/tieflax-src.tar.gz -C $SRC"
  case "$INSTALL" in
    code) SETUP="$UNPACK && $PIP -e $SRC[$EXTRAS]" ;;
    wheel)
      WHEEL_NAME=$(basename "$WHEEL"); plain "--wheel" "$WHEEL_NAME"
      run "${GC[@]}" scp "$WHEEL" "$TPU_NAME:$WHEEL_NAME" "${WHERE[@]}" --worker="$WORKER"
      SETUP="$UNPACK && $PIP ~/$WHEEL_NAME[$EXTRAS]" ;;
    version) SETUP="$UNPACK && $PIP 'tieflax[$EXTRAS]==$VERSION'" ;;
  esac
  run "${GC[@]}" ssh "$TPU_NAME" "${WHERE[@]}" --worker="$WORKER" --command="set -e; $SETUP"
fi

# 2. The command, detached on every host, in ~/tieflax-src. Every user value reaches the remote shell
# quoted (printf %q), so it arrives as one word, as typed.
ARGS=$(printf '%q ' "$@")
INDEX='I=${TIEFLAX_HOST_INDEX:-$(curl -s -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number)}'
case "$COMMAND" in
  prepare) if [[ $OWN_SHARD -eq 1 || $FINALIZE -eq 1 || $RAY -eq 1 ]]; then JOB="tieflax prepare ${ARGS}"
           else JOB="tieflax prepare ${ARGS}--shard \$I/$HOSTS"; fi ;;
  train|compare|sweep|evaluate|eval|val-loss|sample) JOB="TIEFLAX_DISTRIBUTED=1 tieflax $COMMAND ${ARGS}" ;;
  *) JOB="tieflax $COMMAND ${ARGS}" ;;
esac
LOG="~/tieflax-logs/${TAG}.log"
# Where the command runs, and whether it can: a host without tieflax says so instead of "started".
ENTER="cd $SRC 2>/dev/null || cd ~; mkdir -p ~/tieflax-logs || exit 1; command -v tieflax > /dev/null || { echo \"tieflax-pod: host \$I: no tieflax command on PATH (install it: drop --no-install)\" >&2; exit 127; }"
COPY=""
if [[ -n "$LOGS" ]]; then COPY="gcloud storage cp -q $LOG $(printf '%q' "$LOGS/$TAG")/host\$I.log >/dev/null 2>&1 || true"; fi
# The job, then its exit status, in the log; a copier sends the log to the bucket every 60 s while it runs
# and at the end (it looks every second whether the job has ended, so the last copy comes at once).
BODY="( $JOB; echo \"tieflax-pod: host \$I exit \$?\" ) > $LOG 2>&1"
if [[ -n "$COPY" ]]; then
  BODY="( ( $JOB; echo \"tieflax-pod: host \$I exit \$?\" ) > $LOG 2>&1 & job=\$!; n=0; while kill -0 \$job 2>/dev/null; do if [ \$((n % 60)) -eq 0 ]; then $COPY; fi; n=\$((n + 1)); sleep 1; done; wait \$job || true; $COPY )"
fi
BODY="$INDEX; $BODY"
if [[ $ATTACH -eq 1 ]]; then
  REMOTE="$INDEX; $ENTER; $JOB 2>&1 | tee $LOG; exit \${PIPESTATUS[0]}"
else
  # Started detached; a job whose shell could not start (no log written within 5 s) is reported, with
  # what the detached shell printed, and the host's ssh ends with 1.
  REMOTE="$INDEX; $ENTER; rm -f $LOG; nohup bash -c $(printf '%q' "$BODY") > ~/tieflax-logs/${TAG}.start 2>&1 < /dev/null & for n in 1 2 3 4 5 6 7 8 9 10; do [ -e $LOG ] && break; sleep 0.5; done; if [ -e $LOG ]; then echo \"tieflax-pod: started on host \$(hostname): $LOG\"; else echo \"tieflax-pod: host \$I: the command did not start: \$(tail -n 3 ~/tieflax-logs/${TAG}.start)\" >&2; exit 1; fi"
fi
if ! run "${GC[@]}" ssh "$TPU_NAME" "${WHERE[@]}" --worker="$WORKER" --command="$REMOTE"; then
  if [[ $ATTACH -eq 1 ]]; then echo "$ME: $COMMAND failed on some host (see its output above)" >&2
  else echo "$ME: $COMMAND did not start on every host (see the lines above); nothing was left running where it did not" >&2; fi
  exit 1
fi
if [[ $ATTACH -eq 0 && $DRY -eq 0 ]]; then
  echo "$ME: $COMMAND started on $HOSTS host(s), detached; logs: $LOG on each host${LOGS:+, $LOGS/$TAG/}" >&2
  echo "  follow: gcloud compute tpus tpu-vm ssh $TPU_NAME --zone $ZONE --worker=0 --command='tail -f $LOG'" >&2
fi
