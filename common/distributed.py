"""Who am I and where do I run: device and backend choice, DistContext, rank-0 printing, reductions."""
import errno
import ipaddress
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from common.errors import FatalError, UsageError, joined_group

TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job. rank is global; local_rank only picks the device on this node."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = "none"  # "nccl" or "gloo" once a process group is up
    init_method: str = ""  # how the ranks met: env://, tcp://HOST:PORT or file:///path

    @property
    def is_main(self):
        """Global rank 0: the one process that prints the tutorial lines and writes files."""
        return self.rank == 0


def choose_device(requested=None, local_rank=0):
    """--device cpu or cuda:N as given; with no --device or a bare `cuda`, this local rank's GPU if any, else the CPU."""
    if requested is not None:
        device = torch.device(requested)
        if device.type != "cuda" or device.index is not None:
            return device  # an explicit cuda:N: the user placed this process
    if torch.cuda.is_available():  # no --device, or a bare --device cuda: one GPU per local rank
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device):
    """NCCL for GPUs, gloo for the CPU: nothing else hard-codes a backend."""
    return "nccl" if device.type == "cuda" else "gloo"


def default_nprocs(requested_device=None):
    """One process per visible GPU; 2 on a CPU-only machine, so the DDP chapters still show two ranks."""
    if choose_device(requested_device).type == "cuda":
        return torch.cuda.device_count()
    return 2


def free_port(host="127.0.0.1"):
    """A port the OS says is free right now (instead of a hard-coded 12355 that a second job would collide on)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_global_batch(batch_size, world_size):
    """--batch-size is the global batch, so it must split evenly over the ranks."""
    if batch_size % world_size:
        raise UsageError(f"--batch-size {batch_size} is the global batch and must split evenly over "
                         f"{world_size} ranks; use a multiple of {world_size}, e.g. {batch_size // world_size * world_size or world_size}")


def single_process(cfg):
    """The context of a plain one-process run (chapters 1 and 2)."""
    device = choose_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return DistContext(device=device)


def print0(ctx, *args, **kwargs):
    """print() on global rank 0 only, as one flushed write, so other ranks' lines cannot land inside it."""
    if ctx.is_main:
        sep, end = kwargs.pop("sep", " "), kwargs.pop("end", "\n")
        print(sep.join(map(str, args)) + end, end="", flush=True, **kwargs)


def all_reduce_sum(values, ctx):
    """Sum a few numbers over all ranks (every rank must call it); returns them as Python floats."""
    if ctx.world_size == 1:
        return [float(v) for v in values]
    # float64 holds counts up to 2**53 exactly; the tensor lives where the backend can reach it.
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.tolist()


def torchrun_env():
    """(rank, local_rank, world_size) from the variables torchrun sets; a clear error when started without it."""
    try:
        return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError:
        raise UsageError("RANK/LOCAL_RANK/WORLD_SIZE are not set: start this script with torchrun, e.g. "
                         "`torchrun --standalone --nproc-per-node 2 ddp_launch.py`") from None


def expand_hostlist(hostlist):
    """SLURM's compressed host list as names: "gpu[01-03,07],cpu5" -> gpu01, gpu02, gpu03, gpu07, cpu5."""
    hosts, item, depth = [], "", 0
    for char in hostlist + ",":  # split on the commas that are outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced brackets in {hostlist!r}")
        if char == "," and depth == 0:
            if item:
                hosts.extend(_expand_host(item))
            item = ""
        else:
            item += char
    if depth:
        raise ValueError(f"unbalanced brackets in {hostlist!r}")
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


def slurm_env():
    """(rank, local_rank, world_size, init_method) for a task started by srun; one clear line when it cannot be.

    Rank is SLURM_PROCID, the world is SLURM_NTASKS, the local rank SLURM_LOCALID picks the GPU. Every task
    computes the same master: the first host of SLURM_JOB_NODELIST, on a port derived from SLURM_JOB_ID (so two
    jobs sharing a node do not collide); MASTER_ADDR / MASTER_PORT override them.
    """
    env = os.environ
    if not env.get("SLURM_JOB_ID"):
        raise UsageError("this is not a SLURM job (SLURM_JOB_ID is not set): submit it with `sbatch scripts/job.sh`, "
                         "or run `srun python ddp_slurm.py` inside an allocation")
    # SLURM_STEP_ID is set in an srun step only: without it this is the batch script itself, not one of its tasks.
    needed = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_STEP_ID")
    missing = [name for name in needed if not env.get(name)]
    if missing:
        raise UsageError(f"{'/'.join(missing)} not set: start one task per GPU with "
                         f"`srun python ddp_slurm.py` (as scripts/job.sh does), not plain python inside the job")
    try:
        rank, world_size, local_rank = (int(env[name]) for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
        head = env.get("MASTER_ADDR") or expand_hostlist(env["SLURM_JOB_NODELIST"])[0]
        port = int(env.get("MASTER_PORT") or 20000 + int(env["SLURM_JOB_ID"]) % 10000)
    except (ValueError, IndexError) as e:
        raise UsageError(f"cannot read the SLURM environment ({e}); is this an srun task of a SLURM job?") from None
    if not 0 <= rank < world_size:
        raise UsageError(f"SLURM_PROCID={rank} is not below SLURM_NTASKS={world_size}; start the tasks with srun")
    try:
        socket.getaddrinfo(head, port)
    except OSError:
        raise FatalError(f"head node {head!r} (the first host of SLURM_JOB_NODELIST={env['SLURM_JOB_NODELIST']}) does "
                         f"not resolve here; set MASTER_ADDR to its address") from None
    return rank, local_rank, world_size, f"tcp://{head}:{port}"


def _rendezvous_file(init_method):
    """The file of a file:// rendezvous, else None."""
    return Path(init_method.removeprefix("file://")) if init_method.startswith("file://") else None


def claim_rendezvous_file(init_method, timeout):
    """For file://, refuse a file left by a crashed run: its stale keys would mix two jobs' rendezvous.

    A file touched within the last `timeout` seconds is a peer of this job waiting for us; an older one
    is a leftover (torch does not delete the file; cleanup() does, after a clean run).
    """
    path = _rendezvous_file(init_method)
    if path is None:
        return
    if not path.parent.is_dir():
        raise FatalError(f"rendezvous folder {path.parent} does not exist; create it on a filesystem every machine shares")
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return
    if age > timeout:
        raise FatalError(f"rendezvous file {path} is left over from an earlier run ({age:.0f}s old); "
                         f"delete it or pass a new file:// name")


def _where(init_method):
    """host:port (or the file) that a rendezvous uses, for error messages."""
    if init_method.startswith("env://"):
        return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return init_method.removeprefix("tcp://")


def explain_rendezvous_error(error, init_method, rank, timeout):
    """Turn init_process_group's exception into one line that names the cause and the fixes."""
    text = str(error)
    where = _where(init_method)
    if "EADDRINUSE" in text or "ddress already in use" in text:
        return (f"port {where.rsplit(':', 1)[-1]} is busy (another job or a leftover process holds it); "
                f"pick a free port (MASTER_PORT or --init-method tcp://HOST:OTHER_PORT) or stop the old job")
    if "Unable to find address for" in text:  # gloo: GLOO_SOCKET_IFNAME names an interface this machine lacks
        name = os.environ.get("GLOO_SOCKET_IFNAME", text.rsplit(":", 1)[-1].strip())
        return (f"[rank {rank}] GLOO_SOCKET_IFNAME={name} is not a network interface of this machine; set it to "
                f"the one on the network the ranks share (`ip -br addr` lists them), or unset it")
    if "timed out" in text.lower() or "timeout" in text.lower():
        return (f"[rank {rank}] no rendezvous at {where} within {timeout:g}s: rank 0 is not running there, "
                f"a firewall blocks the port, the address is wrong, or fewer processes than the world size "
                f"were started. Check the address and port, open the port, set GLOO_SOCKET_IFNAME / "
                f"NCCL_SOCKET_IFNAME to the interface that reaches the other machines, and start every rank")
    return f"[rank {rank}] rendezvous at {where} failed: {text.strip().splitlines()[0] if text.strip() else type(error).__name__}"


def cpu_threads(world_size):
    """Threads for one CPU rank: the cores SLURM gave this task, or this machine's, split over the ranks sharing them.

    More threads than cores makes every rank slower. Under srun each task has SLURM_CPUS_PER_TASK cores of its own;
    torchrun's workers (LOCAL_WORLD_SIZE of them) share what their launcher got; other ranks share the machine.
    """
    per_task = int(os.environ.get("SLURM_CPUS_PER_TASK") or 0)
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE") or (1 if per_task else world_size))
    return max(1, (per_task or os.cpu_count() or 1) // sharing)


def _listening_socket(host, port):
    """Rank 0's listening socket on exactly `host`, if it is an IP address; None for a host name.

    Left to itself, TCPStore listens on every interface of rank 0's machine, whatever address the
    other ranks were told. With an address (tcp://10.0.0.1:29500, MASTER_ADDR=127.0.0.1) rank 0 listens
    on that one only, so a private-network or loopback address keeps the store off the other networks.
    A host name is left alone: it can resolve to another address on rank 0's own machine (127.0.1.1).
    """
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return None
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            raise FatalError(f"{host} is not an address of this machine, so rank 0 cannot listen on it; give rank 0's "
                             f"own address (`ip -br addr` lists them), e.g. the one on the private network") from None
        raise  # a busy port: explained with the other rendezvous errors


def _rendezvous_store(init_method, rank, world_size, timeout):
    """The key-value store where the ranks exchange addresses; None for file:// (init_process_group opens it)."""
    if init_method.startswith("file://"):
        return None
    if init_method == "env://":
        host, port = os.environ.get("MASTER_ADDR", "localhost"), int(os.environ.get("MASTER_PORT", "29500"))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent serves the store for the whole job and keeps it across --max-restarts, and recent
            # torch (2.14 and 2.15 here) adds no per-attempt prefix. Restarted workers then find the dead workers'
            # gloo/NCCL addresses still there and may dial those instead of their new peers ("Connect timeout",
            # every other restart here). A prefix per restart gives each attempt clean keys, as older torch did.
            agent = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
            return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)
    else:
        url = urlparse(init_method)
        host, port = url.hostname, url.port
    listening = _listening_socket(host, port) if rank == 0 else None
    # The libuv server takes over a listening socket from torch 2.8 on; before that the classic server does.
    classic = {} if listening is None or TORCH_VERSION >= (2, 8) else {"use_libuv": False}
    return dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                         master_listen_fd=listening.detach() if listening else None, **classic)


def init_distributed(cfg, rank, local_rank, world_size, init_method="env://"):
    """Join the process group (NCCL on GPUs, gloo on CPUs) with cfg.timeout; returns this process's DistContext."""
    check_global_batch(cfg.batch_size, world_size)
    device = choose_device(cfg.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds this process to its own GPU, not all to GPU 0
    backend = backend_for(device)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpu_threads(world_size))
    timeout = timedelta(seconds=cfg.timeout)
    try:
        store = _rendezvous_store(init_method, rank, world_size, timeout)
        where = {"store": store} if store is not None else {"init_method": init_method}
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **where)
    except FatalError:
        raise
    except Exception as e:  # DistNetworkError, DistStoreError, RuntimeError, ValueError: one line, not a traceback
        raise FatalError(explain_rendezvous_error(e, init_method, rank, cfg.timeout)) from None
    ctx = DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device, backend=backend,
                      init_method=init_method)
    joined_group(rank)
    # One write per line (newline included), so the ranks' lines do not interleave in a shared log file.
    print(f"[rank {rank}] host={socket.gethostname()} local_rank={local_rank} device={device} backend={backend} "
          f"world_size={world_size} threads={torch.get_num_threads()}\n", end="", flush=True)
    return ctx


def cleanup(ctx):
    """Leave the process group: the other half of init_distributed, called from a `finally`.

    Order matters with gloo. On success, a barrier first lets every rank finish its last collective,
    then destroy_process_group() joins gloo's worker threads while Python is still fully alive; a
    process group left to the interpreter's exit can abort ("terminate called without an active
    exception"). On an error we skip the barrier (the peers may be inside another collective) and
    tear down at once, so the peers' next collective fails fast instead of waiting for the timeout.
    A file:// rendezvous file is removed by every rank after it leaves, so the last one out deletes it.
    """
    if dist.is_initialized():
        if sys.exc_info()[0] is None:  # not unwinding an exception
            dist.barrier()
        dist.destroy_process_group()
    path = _rendezvous_file(ctx.init_method)
    if path is not None:
        path.unlink(missing_ok=True)
