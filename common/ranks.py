"""Who this process is among the ranks: its DistContext and device, rank-0 printing, sums over all ranks."""
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from common.config import flag_text
from common.errors import NO_RANK0, FatalError, UsageError


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job. rank is global; local_rank only picks the device on its machine."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    # The ranks whose batches differ, over which losses and test counts are summed: None is all of them. Under tensor
    # parallelism the ranks of one tp group share each batch, so the sums run over one of them per batch (the dp ranks).
    data_group: object = None

    @property
    def is_main(self):
        """Global rank 0: the one process that prints the tutorial lines and writes files."""
        return self.rank == 0


def choose_device(requested=None):
    """One process (chapters 1 and 2): --device as given, else the current GPU if one is visible, else the CPU."""
    device = torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def rank_device(requested, local_rank, ranks_here=None):
    """A DDP rank's device: cuda:<local rank> where GPUs are used, else the CPU; one line for what cannot work.

    ranks_here is how many ranks this machine runs, where the launcher starts them all with the same GPUs visible
    (torchrun, mp.spawn). Where it is not given (srun, ranks started by hand), a rank may have been shown only its
    own GPU (`srun --gpus-per-task 1`, `--gpu-bind`, CUDA_VISIBLE_DEVICES per rank): a rank that sees exactly one GPU
    uses it, whatever its local rank.
    """
    if requested not in (None, "cpu") and torch.device(requested).index is not None:
        raise UsageError(f"--device {requested}: a DDP rank always uses the GPU of its local rank, cuda:<local rank>; "
                         f"choose the GPUs with CUDA_VISIBLE_DEVICES (e.g. CUDA_VISIBLE_DEVICES=2,3) and pass "
                         f"--device cuda or nothing")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    if ranks_here and ranks_here > gpus:
        raise UsageError(f"{ranks_here} ranks on this machine but {gpus} GPU(s) visible: start at most one rank per "
                         f"GPU (check CUDA_VISIBLE_DEVICES), or train on the CPU with --device cpu")
    if gpus == 1 and not ranks_here:  # this rank's own GPU, whatever its index on the machine
        return torch.device("cuda", 0)
    if local_rank >= gpus:
        raise UsageError(f"local rank {local_rank} but {gpus} GPU(s) visible (cuda:0 .. cuda:{gpus - 1}): start at "
                         f"most one rank per GPU (check CUDA_VISIBLE_DEVICES), or train on the CPU with --device cpu")
    return torch.device("cuda", local_rank)


def default_nprocs(requested=None):
    """ddp_mp.py's default: one process per visible GPU; 2 on the CPU, so the chapter still shows two ranks."""
    if requested != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


def check_torchrun_worker(script):
    """One line unless this process is a torchrun worker whose restarts (--max-restarts) each get a fresh store.

    torchrun --max-restarts starts a new group after a failure. Sharing torchrun's own key-value store (its
    default) the new workers would meet among the dead ones' keys and could dial their addresses (on torch 2.14
    the store keeps every attempt's keys), and on several nodes they need not agree which attempt they are in.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes rank 0 open a fresh store for every attempt instead.
    """
    if not {"RANK", "LOCAL_RANK", "WORLD_SIZE"} <= os.environ.keys():
        raise UsageError(f"RANK/LOCAL_RANK/WORLD_SIZE are not set: start this script with torchrun, e.g. "
                         f"`torchrun --standalone --nproc-per-node 2 {script}`")
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise UsageError("torchrun --max-restarts needs a fresh store per restart: run it as "
                         "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ...` with a c10d rendezvous (--standalone, "
                         "or --rdzv-backend c10d --rdzv-endpoint HOST:PORT), not --master-addr/--node-rank")


def free_port(host="127.0.0.1"):
    """A port the OS says is free right now (instead of a hard-coded 12355 that a second job would collide on)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_global_batch(batch_size, world_size, accum_steps=1):
    """--batch-size is the global batch, so it must split evenly over the ranks and their --accum-steps micro-batches."""
    parts = world_size * accum_steps
    if batch_size % parts:
        split = f"{world_size} ranks" + (f" x {accum_steps} micro-batches" if accum_steps > 1 else "")
        raise UsageError(f"--batch-size {batch_size} is the global batch and must split evenly over {split}; "
                         f"use a multiple of {parts}, e.g. {batch_size // parts * parts or parts}")


def check_rendezvous(init_method, rank, timeout):
    """Before init_process_group(init_method=tcp:// or file://): a stale file or a missing rank 0 fails at --timeout.

    file://: a file older than --timeout was left by a crashed run (a clean run's ranks delete it); its keys
    would mix two jobs' rendezvous. tcp://, ranks > 0: wait here until rank 0's port answers. torch's own store client
    retries once more after its deadline with a grown back-off (torch 2.14.1: --timeout 10 ended after 16-21 s,
    --timeout 20 after 43 s; the retry loop came with pytorch/pytorch#129261), so a missing rank 0 is reported here.
    """
    url = urlparse(init_method)
    if url.scheme == "file":
        path = Path(url.path)
        if not path.parent.is_dir():
            raise FatalError(f"rendezvous folder {path.parent} does not exist; create it on a filesystem every "
                             f"machine shares")
        if path.exists() and time.time() - path.stat().st_mtime > timeout:
            raise FatalError(f"rendezvous file {path} is left over from an earlier run "
                             f"({time.time() - path.stat().st_mtime:.0f}s old); delete it or pass a new file:// name")
    elif rank > 0:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection((url.hostname, url.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise FatalError(f"no rendezvous at {url.hostname}:{url.port} within {timeout:g}s: "
                                     f"{NO_RANK0}") from None
                time.sleep(0.2)


def cpu_threads(ranks_here):
    """Threads for one CPU rank: the cores SLURM gave its task, or this machine's, split over the ranks sharing them."""
    per_task = int(os.environ.get("SLURM_CPUS_PER_TASK") or 0)
    if per_task:  # srun gave this task cores of its own; torchrun's workers inside one task share them
        return max(1, per_task // int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    return max(1, len(os.sched_getaffinity(0)) // ranks_here)


# Flags every rank must share: with others, the ranks take different numbers of steps or collectives, and gloo
# aborts the process (SIGABRT) on the first mismatched one. --data-dir, --output and --device may differ.
SAME_ON_EVERY_RANK = ("epochs", "batch_size", "lr", "momentum", "seed", "train_samples", "test_samples", "log_every", "save_every",
                      "accum_steps", "precision", "compile")


def meet_the_group(cfg, ctx):
    """Every rank, once the group is up: one all_gather of (host name, flags), then this rank's one line; returns
    the CPU threads this rank should use (the chapter sets them).

    Ranks started with different flags are refused in one line. On the CPU the ranks of one machine split its cores
    (more threads than cores makes every rank slower), unless OMP_NUM_THREADS says otherwise; on a GPU, and with
    OMP_NUM_THREADS, the threads stay as they are.
    """
    flags = {name: getattr(cfg, name) for name in SAME_ON_EVERY_RANK} | {"snapshot": cfg.snapshot is not None}
    host = socket.gethostname()
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, (host, flags))
    for rank, (_, their_flags) in enumerate(everyone):
        differ = [name for name in flags if their_flags[name] != flags[name]]
        if differ:
            theirs, mine = (" ".join(flag_text(n, f[n]) for n in differ) for f in (their_flags, flags))
            raise FatalError(f"rank {rank} was started with {theirs}, rank {ctx.rank} with {mine}: start every rank "
                             f"with the same flags (--data-dir, --output and --device may differ)")
    threads = torch.get_num_threads()
    if ctx.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        threads = cpu_threads(sum(other == host for other, _ in everyone))
    # One write per line (newline included), so the ranks' lines do not interleave in a shared log file.
    print(f"[rank {ctx.rank}] host={host} local_rank={ctx.local_rank} device={ctx.device} "
          f"backend={dist.get_backend()} world_size={ctx.world_size} threads={threads}\n", end="", flush=True)
    return threads


def print0(ctx, *args, **kwargs):
    """print() on global rank 0 only, as one flushed write, so other ranks' lines cannot land inside it."""
    if ctx.is_main:
        sep, end = kwargs.pop("sep", " "), kwargs.pop("end", "\n")
        print(sep.join(map(str, args)) + end, end="", flush=True, **kwargs)


def all_reduce_sum(values, ctx, group=None):
    """Sum a few numbers over all ranks, or over group (every rank in it must call it); returns Python floats."""
    if ctx.world_size == 1:
        return [float(v) for v in values]
    # float64 holds counts up to 2**53 exactly; the tensor lives where the backend can reach it.
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=ctx.device) for v in values])
    dist.all_reduce(t, group=group)
    return t.tolist()


def print_parameter_bytes(model, ctx):
    """One line from rank 0 (every rank takes part): the whole model's parameter bytes, and the bytes of the slices
    each rank holds (FSDP2 and tensor parallel: a parameter is a DTensor, of which a rank holds its slice, to_local();
    a plain parameter is held whole; pipeline stages: each rank holds whole layers, no two ranks the same ones)."""
    mine = sum(getattr(p, "to_local", lambda: p)().numel() * p.element_size() for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())  # a DTensor's numel() is the whole
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    if not any(hasattr(p, "to_local") for p in model.parameters()):  # pipeline stages: their layers add up
        full = sum(everyone)
    per_rank = (", ".join(f"rank {r} {b:,}" for r, b in enumerate(everyone)) if ctx.world_size <= 8
                else f"{min(everyone):,} to {max(everyone):,} per rank")
    print0(ctx, f"Parameter bytes: {full:,} in the whole model; held: {per_rank}")


def hide_2d_notices():
    """Two notices torch 2.14 prints on every rank of a 2-D (FSDP2 x tensor parallel) run, hidden: neither asks
    anything of this model.

    FSDP2 warns that a tp Linear "returned a view tensor", which an in-place op (x += y) would break: no op after
    these Linears is in place (ReLU(inplace=False)). The save's full state_dict gathers each 2-D weight in two
    all-gathers, which DTensor calls "suboptimal": once per run, a latency of milliseconds.
    """
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def gather_stage_weights(model, ctx):
    """Pipeline stages: every rank sends rank 0 the weights it holds (on the CPU); rank 0 gets them all in one plain
    state_dict under chapter 1's names and order, the others None. Every rank must call it."""
    everyone = [None] * ctx.world_size
    mine = {name: t.detach().cpu() for name, t in model.state_dict().items()}
    dist.gather_object(mine, everyone if ctx.is_main else None, dst=0)
    if not ctx.is_main:
        return None
    held = {name: t for part in everyone for name, t in part.items()}
    from common.model import NeuralNetwork

    return {name: held[name] for name in NeuralNetwork().state_dict()}  # chapter 1's order; a missing layer: KeyError
