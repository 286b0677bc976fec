"""The SLURM side of chapter 6: is this an srun task, and where do its ranks meet (the job's first node)?"""
import os
import socket
import subprocess

from common.errors import FatalError, UsageError


def check_srun_task():
    """One clear line unless this process is a task of an srun step whose SLURM_* variables can be read."""
    env = os.environ
    if not env.get("SLURM_JOB_ID"):
        raise UsageError("this is not a SLURM job (SLURM_JOB_ID is not set): submit it with `sbatch scripts/job.sh`, "
                         "or run `srun python ddp_slurm.py` inside an allocation")
    # SLURM_STEP_ID is set in an srun step only: without it this is the batch script itself, not one of its tasks.
    needed = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_STEP_ID")
    missing = [name for name in needed if not env.get(name)]
    if missing:
        raise UsageError(f"{'/'.join(missing)} not set: start one task per GPU with `srun python ddp_slurm.py` "
                         f"(as scripts/job.sh does), not plain python inside the job")
    try:
        rank, world_size, _ = (int(env[name]) for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
    except ValueError as e:
        raise UsageError(f"cannot read the SLURM environment ({e}); is this an srun task of a SLURM job?") from None
    if not 0 <= rank < world_size:
        raise UsageError(f"SLURM_PROCID={rank} is not below SLURM_NTASKS={world_size}; start the tasks with srun")


def slurm_master():
    """(address, port) every task computes by itself: the job's first node, port 20000 + job id % 10000.

    Two jobs that share a node get different ports. MASTER_ADDR / MASTER_PORT override both.
    """
    nodes = os.environ["SLURM_JOB_NODELIST"]
    addr = os.environ.get("MASTER_ADDR") or first_node(nodes)
    port = int(os.environ.get("MASTER_PORT") or 20000 + int(os.environ["SLURM_JOB_ID"]) % 10000)
    try:
        socket.getaddrinfo(addr, port)
    except OSError:
        raise FatalError(f"head node {addr!r} (the first host of SLURM_JOB_NODELIST={nodes}) does not resolve "
                         f"here; set MASTER_ADDR to its address") from None
    return addr, port


def first_node(nodes):
    """The first host of a SLURM host list ("gpu[01-03,07]" -> "gpu01"), as SLURM expands it: `scontrol show
    hostnames`, which every SLURM node has (the same line most batch scripts use to find MASTER_ADDR)."""
    try:
        proc = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FatalError(f"cannot run `scontrol show hostnames` to find the job's first node ({e}); run inside a "
                         f"SLURM job, or set MASTER_ADDR to rank 0's address") from None
    if proc.returncode or not proc.stdout.split():
        why = (proc.stderr.strip().splitlines() or ["no host"])[0]
        raise FatalError(f"`scontrol show hostnames {nodes}` failed ({why}); is SLURM_JOB_NODELIST this job's? "
                         f"Else set MASTER_ADDR to rank 0's address")
    return proc.stdout.split()[0]
