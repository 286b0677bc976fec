"""The SLURM side of chapter 6: is this an srun task, and where do its ranks meet (the job's first node)?"""
import os
import socket

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
        expand_hostlist(env["SLURM_JOB_NODELIST"])
    except ValueError as e:
        raise UsageError(f"cannot read the SLURM environment ({e}); is this an srun task of a SLURM job?") from None
    if not 0 <= rank < world_size:
        raise UsageError(f"SLURM_PROCID={rank} is not below SLURM_NTASKS={world_size}; start the tasks with srun")


def slurm_master():
    """(address, port) every task computes by itself: the job's first node, port 20000 + job id % 10000.

    Two jobs that share a node get different ports. MASTER_ADDR / MASTER_PORT override both.
    """
    nodes = os.environ["SLURM_JOB_NODELIST"]
    addr = os.environ.get("MASTER_ADDR") or expand_hostlist(nodes)[0]
    port = int(os.environ.get("MASTER_PORT") or 20000 + int(os.environ["SLURM_JOB_ID"]) % 10000)
    try:
        socket.getaddrinfo(addr, port)
    except OSError:
        raise FatalError(f"head node {addr!r} (the first host of SLURM_JOB_NODELIST={nodes}) does not resolve "
                         f"here; set MASTER_ADDR to its address") from None
    return addr, port


def expand_hostlist(hostlist):
    """SLURM's compressed host list as names: "gpu[01-03,07],cpu5" -> gpu01, gpu02, gpu03, gpu07, cpu5."""
    hosts, item, depth = [], "", 0
    for char in hostlist + ",":  # split on the commas that are outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if not 0 <= depth <= 1:
            raise ValueError(f"unbalanced brackets in {hostlist!r}")
        if char == "," and depth == 0:
            hosts += _expand_host(item) if item else []
            item = ""
        else:
            item += char
    if depth or not hosts:
        raise ValueError(f"unbalanced brackets in {hostlist!r}" if depth else f"no host in {hostlist!r}")
    return hosts


def _expand_host(pattern):
    """One host pattern with any number of [ranges] groups, e.g. rack[1-2]-n[01,03] (zero padding kept)."""
    if "[" not in pattern:
        return [pattern]
    head, rest = pattern.split("[", 1)
    ranges, tail = rest.split("]", 1)
    names = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or not (high or low).isdigit() or int(high or low) < int(low):
            raise ValueError(f"bad range {part!r} in {pattern!r}")
        names += [f"{head}{n:0{len(low)}d}" for n in range(int(low), int(high or low) + 1)]
    return [name + suffix for name in names for suffix in _expand_host(tail)]
