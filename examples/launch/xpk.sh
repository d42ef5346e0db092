#!/usr/bin/env bash
# Continued pretraining on GKE with XPK: one pod per TPU host, restarted after a preemption.
# The image holds upcycler ('upcycler[tpu]'); the config comes from the bucket.
set -euo pipefail
CLUSTER=${CLUSTER:?set CLUSTER}
BUCKET=${BUCKET:?set BUCKET to your bucket}
xpk workload create --cluster "$CLUSTER" --workload cpt-moe-13b \
  --tpu-type v5litepod-256 --num-slices 1 --max-restarts 100 \
  --docker-image "${IMAGE:-us-docker.pkg.dev/YOUR_PROJECT/upcycler/upcycler:latest}" \
  --command "gcloud storage cp gs://$BUCKET/configs/train-pod.yaml train.yaml && upcycle continued-pretrain --config train.yaml --coordinator auto"
