#!/bin/bash
# Chapter 6: train on a SLURM cluster. srun starts one task (one Python process) per GPU on every node;
# ddp_slurm.py reads its rank, the world size and the master's address from the SLURM_* variables.
#
#   sbatch scripts/job.sh                   # from the repository root: 2 nodes x 4 GPUs, as below
#   sbatch scripts/job.sh --epochs 1        # anything after the script is passed on to ddp_slurm.py
#   sbatch --nodes 4 scripts/job.sh         # options on the command line override the #SBATCH lines
#   # a CPU-only cluster (how the tests submit it): no GPUs, 2 single-core tasks on one node
#   sbatch --nodes 1 --ntasks-per-node 2 --cpus-per-task 1 --gpus-per-node 0 scripts/job.sh
#
# To change the size: --nodes is the number of machines, --ntasks-per-node and --gpus-per-node are both the
# GPUs per machine (one task per GPU), so the world size is nodes x ntasks-per-node. The global
# --batch-size (default 64) must split evenly over that many tasks.
#
#SBATCH --job-name=fmnist-ddp
#SBATCH --nodes=2                # machines
#SBATCH --ntasks-per-node=4      # tasks (processes) per machine: one per GPU
#SBATCH --gpus-per-node=4        # GPUs per machine: keep it equal to --ntasks-per-node
#SBATCH --cpus-per-task=8        # CPU cores per task; ddp_slurm.py uses this many CPU threads
#SBATCH --time=00:30:00          # wall-clock limit: SLURM stops the job after this
#SBATCH --output=%x-%j.out       # the log, in the folder you submitted from: %x = job name, %j = job id

# Fail the job instead of hanging: if one task exits non-zero, srun stops the others at once.
# `python` is whatever the submitting shell had on PATH (sbatch passes the environment on): activate
# your venv before `sbatch`. The job starts in the folder sbatch was run from.
srun --kill-on-bad-exit=1 python ddp_slurm.py "$@"
