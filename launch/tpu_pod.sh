#!/usr/bin/env bash
# Train on every worker of a Cloud TPU VM pod slice (one JAX process per host, all running one program).
#
# Usage:
#   launch/tpu_pod.sh TPU_NAME ZONE [PROJECT] -- --config configs/<config>.py \
#       --workdir gs://BUCKET/runs/NAME [--config.a.b=value ...]
# Example:
#   launch/tpu_pod.sh my-v5p-64 us-east5-a my-project -- --config configs/models/llama3_8b.py \
#       --workdir gs://my-bucket/runs/llama3_8b --config.data.source=tokens \
#       --config.data.tokens.path=gs://my-bucket/stores/corpus
#
# What it does: `gcloud compute tpus tpu-vm ssh TPU_NAME --worker=all --command=...` runs
# `tieflax train ARGS` on all hosts at once with TIEFLAX_DISTRIBUTED=1, so each process calls
# jax.distributed.initialize(), which reads the pod topology from the TPU metadata.
# Requirements on every worker: tieflax installed (set TIEFLAX_SETUP to a command that installs it,
# e.g. TIEFLAX_SETUP="pip install -e ~/tieflax jax[tpu]"; it runs before training). The workdir is a
# gs:// prefix every host reads and writes directly (checkpoints, metrics, TensorBoard, the lease; see the
# README's "Runs in a bucket"); the TPU VM's service account needs write access to the bucket. A shared
# file system mounted at the same path on every host works too.
# Resume: rerun the same command. Preemption: after a SIGTERM all hosts stop together at the next
# log step (config.train.log_every), save a checkpoint and exit 0.
# Logs: all workers stream to this terminal; metrics are written by process 0 only.
set -euo pipefail

if [[ $# -lt 3 ]]; then
  sed -n '2,21p' "$0"
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
