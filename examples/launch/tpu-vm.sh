#!/usr/bin/env bash
# Continued pretraining on a TPU VM pod slice (v5e-256: 64 hosts), one process per host.
# Create the slice first, e.g. as a queued resource that is recreated after a preemption:
#   gcloud compute tpus queued-resources create cpt --node-id cpt --zone us-west4-a \
#       --accelerator-type v5litepod-256 --runtime-version v2-alpha-tpuv5-lite --spot
# Then run this script (again after each preemption: the same command continues from the newest checkpoint).
set -euo pipefail
NAME=${NAME:-cpt}
ZONE=${ZONE:-us-west4-a}
BUCKET=${BUCKET:?set BUCKET to your bucket}
gcloud compute tpus tpu-vm ssh "$NAME" --zone "$ZONE" --worker=all --command "
  set -e
  pip install --quiet 'upcycler[tpu]'
  gcloud storage cp gs://$BUCKET/configs/train-pod.yaml train.yaml
  upcycle continued-pretrain --config train.yaml --coordinator auto
"
