#!/usr/bin/env bash
# Multi-node training with torchrun. Run the same command on every node, e.g. 2 nodes x 8 GPUs:
#
#   NNODES=2 MASTER_ADDR=node0 RUN_ID=gpt-small-1 ./launch/torchrun_multinode.sh \
#       parallel.tp=8 model=gpt_small precision=bf16
#
# TP groups are consecutive ranks, so tp <= GPUs per node keeps TP's collectives inside a node and
# DP (fewer, larger all-reduces) across nodes. Every node must see the same run directory (a shared
# file system): checkpoints are written shard by shard from every rank. RUN_ID names the run
# directory (outputs/torchrun-<RUN_ID>); relaunching with the same RUN_ID resumes from its
# last complete checkpoint, as does torchrun itself after a crash (--max-restarts).
set -euo pipefail
NNODES=${NNODES:?set NNODES, the number of nodes}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR, the host name of one node that all nodes can reach}
MASTER_PORT=${MASTER_PORT:-29500}
RUN_ID=${RUN_ID:?set RUN_ID, the same on every node}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$NPROC_PER_NODE" -gt 0 ] || NPROC_PER_NODE=1
# Restarted workers must not read dead peers' addresses from the agent's shared store (pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# The repository's environment (`make setup`) when there is one, else torchrun on PATH.
VENV_TORCHRUN="$(dirname "$0")/../.venv/bin/torchrun"
[ -x "$VENV_TORCHRUN" ] && TORCHRUN=$VENV_TORCHRUN || TORCHRUN=torchrun

exec "$TORCHRUN" \
  --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RUN_ID" \
  --max-restarts="${MAX_RESTARTS:-3}" \
  "$(dirname "$0")/train.py" "$@"
