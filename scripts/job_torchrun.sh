#!/bin/bash
# Chapter 3 on a SLURM cluster: srun starts ONE torchrun per node, and each torchrun starts one worker per GPU
# running ddp_launch.py. The nodes meet at a c10d rendezvous on the first node of the job.
#
#   sbatch scripts/job_torchrun.sh                  # from the repository root: 2 nodes x 4 GPUs, as below
#   sbatch scripts/job_torchrun.sh --epochs 1       # anything after the script is passed on to the chapter
#   sbatch scripts/job_torchrun.sh --snapshot runs/ddp_launch/snap.pt   # requeued before the time limit, resumes
#   sbatch scripts/job_torchrun.sh diloco.py --ranks-per-replica 4 --sync-every 30   # another torchrun chapter, first
#   # a CPU-only cluster (how the tests submit it): one node, 2 CPU workers
#   NPROC_PER_NODE=2 sbatch --nodes 1 --cpus-per-task 2 --gpus-per-node 0 scripts/job_torchrun.sh
#
# Compared with job.sh: SLURM starts only one task per node and torchrun does the rest (it sets RANK,
# LOCAL_RANK, WORLD_SIZE for its workers, and can restart them with --max-restarts).
#
#SBATCH --job-name=fmnist-torchrun
#SBATCH --nodes=2                # machines
#SBATCH --ntasks-per-node=1      # ONE task per machine: the torchrun launcher
#SBATCH --gpus-per-node=4        # GPUs per machine; torchrun starts one worker per GPU
#SBATCH --cpus-per-task=32       # all the cores torchrun's workers share (each gets cpus / workers threads, below)
#SBATCH --time=00:30:00          # wall-clock limit: SLURM stops the job after this
#SBATCH --signal=B:USR1@180      # SIGUSR1 to this script 3 minutes before the limit: longer than one epoch
#SBATCH --requeue                # the job may go back into the queue (it does so itself, below; so may preemption)
#SBATCH --open-mode=append       # a requeued job appends to its log, so the log holds every part
#SBATCH --output=%x-%j.out       # the log, in the folder you submitted from: %x = job name, %j = job id

# A chapter named first (any that torchrun starts: fsdp.py, tensor_parallel.py, pipeline.py, diloco.py) runs instead
# of chapter 3; the rest of the arguments are its own.
chapter=ddp_launch.py
case "$1" in *.py) chapter=$1; shift ;; esac

# The first host of the allocation hosts the rendezvous; the port is derived from the job id, so two jobs
# on one node do not collide. NPROC_PER_NODE (default: one per visible GPU) overrides the worker count.
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=$((20000 + SLURM_JOB_ID % 10000))

# Each task's cores: since Slurm 22.05 srun does not take --cpus-per-task from the job (SRUN_CPUS_PER_TASK passes it
# on). Each worker's share of them, from its start: torchrun would give every worker OMP_NUM_THREADS=1. The workers
# are NPROC_PER_NODE, or the node's GPUs (SLURM_GPUS_ON_NODE) when torchrun starts one per GPU.
if [ -n "$SLURM_CPUS_PER_TASK" ]; then
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
    workers=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
    case "$workers" in
        "" | *[!0-9]* | 0) ;;  # not known here: torchrun's 1 thread per worker
        *) share=$((SLURM_CPUS_PER_TASK / workers))
           export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$((share > 0 ? share : 1))}" ;;
    esac
fi

# The time limit is near (--signal above): pass SIGUSR1 on to the step (srun forwards it to its every process, and
# torchrun ignores it); the workers finish the epoch, rank 0 writes the --snapshot, and they exit 0. Then this script
# puts the job back in the queue: the same job id, run again with the same arguments, resumes from the snapshot. A job
# killed without warning is not requeued: submit it again with the same --snapshot and it resumes from the last
# epoch the snapshot holds. The trap comes first, so a warning that arrives early cannot end this script
# (one that comes before the step exists is not passed on: the tasks could not catch it yet).
trap 'warned=1; [ -z "$step" ] || kill -USR1 "$step"' USR1
# torchrun itself must not see SIGUSR1 (it would die of it, and take its workers along): it starts with the signal
# ignored (an ignored signal stays ignored across exec, in every shell; coreutils' `env --ignore-signal` needs 8.31),
# and each worker sets its own handler (load_snapshot in common/checkpoint.py, or StopAtTimeLimit).
srun --kill-on-bad-exit=1 bash -c 'trap "" USR1; exec torchrun "$@"' torchrun --nnodes "$SLURM_NNODES" \
    --nproc-per-node "${NPROC_PER_NODE:-gpu}" --rdzv-backend c10d --rdzv-endpoint "$head:$port" \
    --rdzv-id "$SLURM_JOB_ID" "$chapter" "$@" &
step=$!
wait "$step"; status=$?
# 138 (128 + SIGUSR1): the trap cut `wait` short while the step runs on, so wait again; or the step itself died of
# the signal, and then it is gone and that is its status.
while [ "$status" = 138 ] && kill -0 "$step" 2>/dev/null; do wait "$step"; status=$?; done
if [ -n "$warned" ] && [ "$status" = 0 ]; then
    case " $* " in
        *" --snapshot"*) echo "job_torchrun.sh: warned before the time limit; requeueing job $SLURM_JOB_ID"
                         scontrol requeue "$SLURM_JOB_ID" ;;
        *) echo "job_torchrun.sh: SIGUSR1 came, but without --snapshot there is nothing to resume from: not requeued" ;;
    esac
fi
exit "$status"
