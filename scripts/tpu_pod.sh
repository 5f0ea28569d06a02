#!/usr/bin/env bash
# A TPU VM pod slice: the same command on every worker; jax.distributed detects the pod.
# Mesh: FSDP over all chips (data fills the rest), a typical choice for models that fit per slice.
#
#   bash scripts/tpu_pod.sh TPU_NAME ZONE experiments/paper_base_en_de.py /mnt/shared/runs/paper_base
# (the workdir must be a filesystem path every worker sees, e.g. a gcsfuse or NFS mount)
set -euo pipefail
name=${1:?TPU name}; zone=${2:?zone}; config=${3:?experiment}; workdir=${4:?workdir on a shared filesystem}
gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all --command "
  cd jaxformer && .venv/bin/jaxformer train --config $config --workdir $workdir \
    --set mesh.distributed=true --set mesh.data=-1 --set mesh.fsdp=4"
