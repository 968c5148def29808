#!/bin/bash
# torchrun on each node, without a scheduler: run this script on every node with the same MAIN_HOST.
# Usage: NNODES=2 NODE_RANK=0 MAIN_HOST=10.0.0.1 pipelines/torchrun/train-multinode.sh /data/latents /runs/x
set -euo pipefail
LATENTS=${1:?latent shard folder}
RUN=${2:?run folder}
shift 2
# On SIGTERM torchrun forwards it to the ranks, which checkpoint within two steps; it SIGKILLs them after
# this many seconds (torchrun's default is 30, too short for a large checkpoint).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}
exec torchrun --nnodes "${NNODES:?}" --node_rank "${NODE_RANK:?}" \
  --nproc_per_node "${GPUS_PER_NODE:-$(nvidia-smi -L | wc -l)}" \
  --rdzv_backend c10d --rdzv_endpoint "${MAIN_HOST:?}:${MAIN_PORT:-29500}" --rdzv_id "${RUN_ID:-laionkit}" \
  -m laionkit.cli train "$LATENTS" --output "$RUN" --resume latest "$@"
