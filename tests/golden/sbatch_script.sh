#!/usr/bin/env bash
# Fine-tune llama-2-70b with zero3 on 2 node(s) x 8 a100-80g GPU(s).
# Written by `python -m launcher` into /scratch/runs/2026-01-01/12-00-00_llama-2-70b.
# Submit with:
#   sbatch /scratch/runs/2026-01-01/12-00-00_llama-2-70b/sbatch.sh
#SBATCH --job-name=launcher-llama-2-70b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --mem=900G
#SBATCH --time=240
#SBATCH --partition=gpu
#SBATCH --account=proj-1
#SBATCH --output=/scratch/runs/2026-01-01/12-00-00_llama-2-70b/slurm-%j.out
set -euo pipefail

export OMP_NUM_THREADS=8
export PYTHONPATH=/opt/launcher
# The first node of the allocation hosts torchrun's c10d rendezvous; the job id names it.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RUN_ID="$SLURM_JOB_ID"
export MASTER_ADDR RUN_ID

# One task per node; each runs torchrun, which starts 8 rank(s) on its node.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  /opt/venv/bin/python \
  -m torch.distributed.run \
  --nproc-per-node=8 \
  --nnodes=2 \
  --rdzv-backend=c10d \
  "--rdzv-endpoint=${MASTER_ADDR}:29517" \
  "--rdzv-id=${RUN_ID}" \
  --max-restarts=0 \
  -m launcher.worker /scratch/runs/2026-01-01/12-00-00_llama-2-70b/run.json
