#!/bin/bash
# Chapter 12 on a SLURM cluster: torchft's lighthouse on the job's first node, then a replica group on every node (its
# own torchrun, one rank), all asking that lighthouse for each step's quorum. When a node's group dies, the other
# groups train on; started again, it heals from a live one.
#
#   sbatch scripts/job_ft.sh                        # from the repository root: 2 nodes x 1 GPU, as below
#   sbatch scripts/job_ft.sh --epochs 1             # anything after the script is passed on to ddp_ft.py
#   # a CPU-only cluster (how the tests submit it): 2 nodes, one core each
#   sbatch --cpus-per-task 1 --gpus-per-node 0 scripts/job_ft.sh
#
# Compared with job_torchrun.sh: one torchrun job per node (--standalone), not one job over all of them; torchft, not
# torchrun's rendezvous, decides which nodes take part in each step.
#
#SBATCH --job-name=fmnist-ft
#SBATCH --nodes=2                # machines: a replica group on each (--replica-groups is the job's node count)
#SBATCH --ntasks-per-node=1      # ONE task per machine: the group's torchrun
#SBATCH --gpus-per-node=1        # one rank per group: ddp_ft.py takes one
#SBATCH --cpus-per-task=8        # the group's cores
#SBATCH --time=00:30:00          # wall-clock limit: SLURM stops the job after this
#SBATCH --output=%x-%j.out       # the log, in the folder you submitted from: %x = job name, %j = job id

# The lighthouse: a step of its own on the first node, beside that node's group (--overlap: the two steps share the
# node's allocation). The port is derived from the job id, so two jobs on one node do not collide.
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=$((20000 + SLURM_JOB_ID % 10000))
RUST_LOG=${RUST_LOG:-warn} srun --overlap --nodes 1 --ntasks 1 --nodelist "$head" \
    torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 --bind "[::]:$port" &
lighthouse=$!
export TORCHFT_LIGHTHOUSE="http://$head:$port"
# Each group's cores (the lighthouse's step above takes one): since Slurm 22.05 srun does not take --cpus-per-task
# from the job, and SRUN_CPUS_PER_TASK passes it on.
[ -z "$SLURM_CPUS_PER_TASK" ] || export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"

# A group per node, numbered by the node's place in the job (SLURM_NODEID: 0, 1, ...). A task that fails does not end
# the others (--kill-on-bad-exit=0, whatever the cluster's default): they train on without it. A group started again
# with the same --replica-group and TORCHFT_LIGHTHOUSE heals from a live one (docs/fault_tolerance.md).
srun --overlap --kill-on-bad-exit=0 bash -c 'exec torchrun --standalone --nproc-per-node 1 ddp_ft.py \
    --replica-group "$SLURM_NODEID" --replica-groups "$SLURM_NNODES" "$@"' torchrun "$@"
status=$?
kill "$lighthouse"  # srun passes the SIGTERM on to the lighthouse
wait "$lighthouse"
exit "$status"
