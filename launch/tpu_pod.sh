#!/usr/bin/env bash
# Train on every worker of a Cloud TPU VM pod slice (one JAX process per host, all running one program).
#
# Usage:
#   launch/tpu_pod.sh TPU_NAME ZONE [PROJECT] -- --config configs/experiments/<pod config>.py \
#       --workdir gs://BUCKET/runs/NAME [--config.a.b=value ...]
# Example:
#   launch/tpu_pod.sh my-v5p-64 us-east5-a my-project -- --config configs/experiments/tiny.py \
#       --workdir gs://my-bucket/runs/tiny --config.mesh.fsdp=-1 --config.mesh.data=1
#
# What it does: `gcloud compute tpus tpu-vm ssh TPU_NAME --worker=all --command=...` runs
# `tieflax train ARGS` on all hosts at once with TIEFLAX_DISTRIBUTED=1, so each process calls
# jax.distributed.initialize(), which reads the pod topology from the TPU metadata.
# Requirements on every worker: tieflax installed (set TIEFLAX_SETUP to a command that installs it,
# e.g. TIEFLAX_SETUP="pip install -e ~/tieflax[tpu]"; it runs before training) and a workdir all hosts
# can reach (a gs:// bucket; orbax and the metrics writer handle gs:// paths through tensorstore/etils).
# Resume: rerun the same command. Preemption: a SIGTERM makes every host save a checkpoint and exit 0.
# Logs: all workers stream to this terminal; metrics are written by process 0 only.
set -euo pipefail

if [[ $# -lt 3 ]]; then
  sed -n '2,20p' "$0"
  exit 2
fi
TPU_NAME="$1"; ZONE="$2"; shift 2
PROJECT_FLAG=()
if [[ "$1" != "--" ]]; then PROJECT_FLAG=(--project "$1"); shift; fi
[[ "$1" == "--" ]] && shift

ARGS=$(printf '%q ' "$@")
SETUP="${TIEFLAX_SETUP:-true}"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" "${PROJECT_FLAG[@]}" --worker=all \
  --command="set -e; ${SETUP}; TIEFLAX_DISTRIBUTED=1 tieflax train ${ARGS}"
