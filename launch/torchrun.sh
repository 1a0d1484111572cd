#!/usr/bin/env bash
# Single-node launcher: one process per GPU on this machine, everything after the script's name is
# handed to `mugrpo train` (or `mugrpo $MUGRPO_VERB`) unchanged.
#
#   launch/torchrun.sh --config configs/paper/qwen3_8b_base__mu_grpo.yaml --run-dir runs/q8_mu \
#       model.hf_dir=/models/Qwen3-8B-Base data.train_path=/data/deepscaler.jsonl
#   MUGRPO_VERB=generate launch/torchrun.sh --run-dir runs/q8_mu --stage 2   # D_2 on every GPU
#
# Environment (defaults in brackets):
#   MUGRPO_VERB     mugrpo verb to run on every rank: train, generate, optimize or eval [train]
#   NPROC_PER_NODE  processes = GPUs to use [number of GPUs nvidia-smi lists, else 1]
#   MASTER_ADDR     rendezvous address [127.0.0.1]
#   MASTER_PORT     rendezvous port [29500]; change it to run two jobs on one node
#   OMP_NUM_THREADS CPU threads per rank [8]
#   PYTHON          interpreter that runs torch.distributed.run when no `torchrun` is on PATH [python]
#
# Async mode (mode: async): the last async.rollout_ranks processes are rollout workers, the others
# train; NPROC_PER_NODE counts both (Table 2: NPROC_PER_NODE=4 with async.rollout_ranks=2).
set -euo pipefail

# --- processes ---------------------------------------------------------------------------------
count_gpus() {
  local n=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    n="$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)"
  fi
  echo $(( n > 0 ? n : 1 ))
}
NPROC_PER_NODE="${NPROC_PER_NODE:-$(count_gpus)}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"

MUGRPO_VERB="${MUGRPO_VERB:-train}"
case "${MUGRPO_VERB}" in
  train|generate|optimize|eval) ;;
  *) echo "MUGRPO_VERB=${MUGRPO_VERB}: expected train, generate, optimize or eval" >&2; exit 2 ;;
esac

# --- runtime -----------------------------------------------------------------------------------
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
# Megatron orders tensor-parallel communication and compute on one CUDA queue per device.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"

if command -v torchrun >/dev/null 2>&1; then
  TORCHRUN=(torchrun)
else
  TORCHRUN=("${PYTHON:-python}" -m torch.distributed.run)
fi

# exec: signals (Ctrl-C, a scheduler's SIGTERM) reach torchrun, which stops its own workers.
exec "${TORCHRUN[@]}" \
  --nnodes=1 --node-rank=0 \
  --nproc-per-node="${NPROC_PER_NODE}" \
  --master-addr="${MASTER_ADDR}" --master-port="${MASTER_PORT}" \
  -m megatron_mugrpo.cli "${MUGRPO_VERB}" "$@"
