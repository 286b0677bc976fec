#!/bin/bash
# Chapter 6: train on a SLURM cluster. srun starts one task (one Python process) per GPU on every node;
# ddp_slurm.py reads its rank, the world size and the master's address from the SLURM_* variables.
#
#   sbatch scripts/job.sh                   # from the repository root: 2 nodes x 4 GPUs, as below
#   sbatch scripts/job.sh --epochs 1        # anything after the script is passed on to ddp_slurm.py
#   sbatch --nodes 4 scripts/job.sh         # options on the command line override the #SBATCH lines
#   # longer than the time limit: stop before it, requeue, resume from the snapshot (docs/slurm.md)
#   sbatch scripts/job.sh --snapshot runs/ddp_slurm/snap.pt
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
#SBATCH --signal=B:USR1@180      # SIGUSR1 to this script 3 minutes before the limit: longer than one epoch
#SBATCH --requeue                # the job may go back into the queue (it does so itself, below; so may preemption)
#SBATCH --open-mode=append       # a requeued job appends to its log, so the log holds every part
#SBATCH --output=%x-%j.out       # the log, in the folder you submitted from: %x = job name, %j = job id

# The time limit is near (--signal above): pass SIGUSR1 on to the tasks (srun forwards it); they finish the epoch,
# rank 0 writes the --snapshot, and they exit 0. Then this script puts the job back in the queue: the same job id,
# run again with the same arguments, resumes from the snapshot. A job killed without warning is not requeued:
# submit it again with the same --snapshot and it resumes from the last epoch the snapshot holds.
# The trap comes first, so a warning that arrives early cannot end this script (one that comes before the step
# exists is not passed on: the tasks could not catch it yet).
trap 'warned=1; [ -z "$step" ] || kill -USR1 "$step"' USR1

# Fail the job instead of hanging: if one task exits non-zero, srun stops the others at once.
# `python` is whatever the submitting shell had on PATH (sbatch passes the environment on): activate
# your venv before `sbatch`. The job starts in the folder sbatch was run from.
# Each task's cores: since Slurm 22.05 srun does not take --cpus-per-task from the job, and without
# SRUN_CPUS_PER_TASK each task would get one core (bound to it, where the cluster binds tasks) while it runs 8 threads.
# Its CPU threads from its start: torch.set_num_threads() later would reach only the main thread, and gloo's
# threads, which run chapter 11b's --comm-hook powersgd callbacks, would keep all the cores (docs/snapshots.md).
if [ -n "$SLURM_CPUS_PER_TASK" ]; then
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$SLURM_CPUS_PER_TASK}"
fi
srun --kill-on-bad-exit=1 python ddp_slurm.py "$@" &
step=$!
wait "$step"; status=$?
# 138 (128 + SIGUSR1): the trap cut `wait` short while the step runs on, so wait again; or the step itself died of
# the signal, and then it is gone and that is its status.
while [ "$status" = 138 ] && kill -0 "$step" 2>/dev/null; do wait "$step"; status=$?; done
if [ -n "$warned" ] && [ "$status" = 0 ]; then
    case " $* " in
        *" --snapshot"*) echo "job.sh: warned before the time limit; requeueing job $SLURM_JOB_ID"
                         scontrol requeue "$SLURM_JOB_ID" ;;
        *) echo "job.sh: SIGUSR1 came, but without --snapshot there is nothing to resume from: not requeued" ;;
    esac
fi
exit "$status"
