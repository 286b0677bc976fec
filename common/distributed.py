"""Who am I and where do I run: device and backend choice, DistContext, rank-0 printing, reductions."""
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job. rank is global; local_rank only picks the device on this node."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = "none"  # "nccl" or "gloo" once a process group is up

    @property
    def is_main(self):
        """Global rank 0: the one process that prints the tutorial lines and writes files."""
        return self.rank == 0


def choose_device(requested=None, local_rank=0):
    """--device if given, else the GPU for this local rank if CUDA is visible, else the CPU."""
    if requested is not None:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device):
    """NCCL for GPUs, gloo for the CPU: nothing else hard-codes a backend."""
    return "nccl" if device.type == "cuda" else "gloo"


def single_process(cfg):
    """The context of a plain one-process run (chapters 1 and 2)."""
    device = choose_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return DistContext(device=device)


def print0(ctx, *args, **kwargs):
    """print() on global rank 0 only, flushed so logs interleave correctly under launchers."""
    if ctx.is_main:
        print(*args, **kwargs, flush=True)


def all_reduce_sum(values, ctx):
    """Sum a few numbers over all ranks (every rank must call it); returns them as Python floats."""
    if ctx.world_size == 1:
        return [float(v) for v in values]
    # float64 holds counts up to 2**53 exactly; the tensor lives where the backend can reach it.
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.tolist()
