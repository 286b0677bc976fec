"""Who this process is among the ranks, which device it computes on, and the few things all ranks say together."""
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.config import flag_text
from common.errors import FatalError, UsageError


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
    """A DDP rank's device: cuda:<local rank>, else the CPU; one line for what cannot work. ranks_here: the ranks this
    machine runs where the launcher shows them all the same GPUs (torchrun, mp.spawn); without it (srun, by hand) a
    rank that sees exactly one GPU was shown its own (--gpus-per-task 1, per-rank CUDA_VISIBLE_DEVICES) and uses it."""
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


def cpu_threads(ranks_here):
    """Threads for one CPU rank: the cores SLURM gave its task, or this machine's, split over the ranks sharing them."""
    per_task = int(os.environ.get("SLURM_CPUS_PER_TASK") or 0)
    if per_task:  # srun gave this task cores of its own; torchrun's workers inside one task share them
        return max(1, per_task // int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    return max(1, len(os.sched_getaffinity(0)) // ranks_here)


# Flags every rank must share: with others, the ranks take different numbers of steps or collectives, and gloo
# aborts the process (SIGABRT) on the first mismatched one. --data-dir, --output and --device may differ.
SAME_ON_EVERY_RANK = ("epochs", "batch_size", "lr", "momentum", "seed", "train_samples", "test_samples", "log_every",
                      "save_every", "accum_steps", "precision", "compile")


def all_gather_flags(cfg, ctx):
    """Once the group is up, an all_gather of every rank's host and flags: ranks started with different flags stop in
    one line; each prints its own line; returns its CPU threads (on the CPU: its share of its machine's cores, unless
    OMP_NUM_THREADS is set; more threads than cores makes every rank slower)."""
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
    """One line from rank 0 after an all_gather (every rank takes part): the whole model's parameter bytes, and the
    bytes of the slices each rank holds (FSDP2 and tensor parallel: a parameter is a DTensor, of which a rank holds its slice, to_local();
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
