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
# A failed or timed-out collective (a dead node) ends the ranks instead of hanging (torchrun's default too;
# the old name NCCL_ASYNC_ERROR_HANDLING is deprecated). Bound the wait with train's --pg-timeout-minutes.
# Between nodes also see NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG (`laionkit doctor --allreduce`).
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
exec torchrun --nnodes "${NNODES:?}" --node_rank "${NODE_RANK:?}" \
  --nproc_per_node "${GPUS_PER_NODE:-$(nvidia-smi -L | wc -l)}" \
  --rdzv_backend c10d --rdzv_endpoint "${MAIN_HOST:?}:${MAIN_PORT:-29500}" --rdzv_id "${RUN_ID:-laionkit}" \
  -m laionkit.cli train "$LATENTS" --output "$RUN" --resume latest "$@"
