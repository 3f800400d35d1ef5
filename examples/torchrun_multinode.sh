#!/usr/bin/env bash
# Multi-node megalite training with torchrun's c10d rendezvous: run this same script on every
# node. RDZV_HOST is an address of one node that all nodes reach (usually the first); no node
# needs to start first. For example, two nodes of eight GPUs:
#
#   RDZV_HOST=node0.cluster NNODES=2 NPROC=8 examples/torchrun_multinode.sh \
#       --config configs/gpt2-124m.yaml train.out_dir=/shared/runs/gpt2-124m
#
# - train.out_dir must be on a filesystem every node sees: each rank writes its own checkpoint
#   shards there (megalite checks this at start).
# - Restarts: when a rank dies, torchrun stops the others and restarts all of them (up to
#   MAX_RESTARTS times); they resume from the newest complete checkpoint, losing at most the
#   steps since it (keep checkpoint.interval short enough for that to be cheap). torchrun
#   restarts on a bad config too (exit 2): check a new one first with
#   `megalite estimate --config ... --world-size N`, which refuses what train would.
# - Elastic: NNODES=2:4 lets the job run on 2 to 4 nodes; after a node is lost or added, it
#   resumes in the layout the config gives for the new world size with the same global batch
#   (more or fewer micro-batches per step), and rank 0 prints what changed. tp * pp must divide
#   every world size in the range, and the global batch must divide by micro batch * dp.
# - Preemption: SIGTERM or SIGUSR1 to torchrun is forwarded to the ranks, which finish their
#   step, save it and exit with code 75; SHUTDOWN_TIMEOUT is how long torchrun waits for that
#   before killing them. Run the same command again to continue.
# - Each node's first process prints one line when the node joins and one when it leaves;
#   only global rank 0 shows the progress bar.
set -euo pipefail
: "${RDZV_HOST:?set RDZV_HOST to an address of the first node}"

exec torchrun \
    --nnodes "${NNODES:-2}" \
    --nproc-per-node "${NPROC:-8}" \
    --rdzv-backend c10d \
    --rdzv-endpoint "${RDZV_HOST}:${RDZV_PORT:-29400}" \
    --rdzv-id "${RUN_ID:-megalite}" \
    --max-restarts "${MAX_RESTARTS:-3}" \
    --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    --shutdown-timeout "${SHUTDOWN_TIMEOUT:-120}" \
    -m megalite train "$@"
