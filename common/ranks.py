"""Who this process is among the ranks, which device it computes on, how the launchers start them, and the few things
all ranks say together."""
import contextlib
import os
import random
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from common.cli import EXPLAINED, RANK, FatalError, UsageError, flag_text, say


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job. rank is global; local_rank only picks the device on its machine."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    data_group: object = None  # the ranks whose batches differ, that sums run over (None: all; chapter 9: its dp row)

    @property
    def is_main(self):  # Global rank 0 is the one process that prints the tutorial's lines and writes files.
        return self.rank == 0


def choose_device(requested=None):
    """One process (chapters 1 and 2): --device as given, else the current GPU if one is visible, else the CPU."""
    device = torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def print0(ctx, *args):
    """print() on global rank 0 only, as one flushed write, so other ranks' lines cannot land inside it."""
    if ctx.is_main:
        print(" ".join(map(str, args)) + "\n", end="", flush=True)


def destroy_process_group():
    """dist.destroy_process_group() in a chapter's `finally`; the backends freed after it, each letting go of the GIL
    (troubleshooting.md). On the way out of an error, the error's line first, and the groups left without a wait."""
    error = sys.exc_info()[1]  # In a `finally`, this is the error on its way out, if there is one.
    if error is not None and dist.is_initialized():
        # Say its line now, before any teardown. Since torch 2.6, NCCL's teardown finishes every collective this rank
        # queued, and one that no peer joins never ends. So NCCL's communicators are aborted instead.
        if isinstance(error, Exception):  # On Ctrl-C, run_main says "interrupted" instead.
            say(error)
        if dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()  # every group's (torch's own; on gloo it does nothing)
        return  # the process ends next (run_main's os._exit), which closes every connection: gloo's peers see it
    backends = [pg._get_backend(d) for pg in dist.distributed_c10d._world.pg_map for d in pg._device_types]
    dist.destroy_process_group()  # torch 2.6 freed them in here, holding the GIL a gloo thread may need: a deadlock
    del backends


def all_reduce_sum(values, ctx, group=None):
    """Sum a few numbers over all ranks or group (each in it must call it) in float64 (exact counts): floats."""
    if ctx.world_size == 1:
        return [float(v) for v in values]
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=ctx.device) for v in values])
    dist.all_reduce(t, group=group)
    return t.tolist()


# ---- Several ranks: each one's device, the launchers' checks, the lines they all say ----

def rank_device(requested, local_rank, ranks_here=None):
    """A rank's device: the CPU, cuda:<local rank>, or its one visible GPU (srun, by hand); else one line why not."""
    if requested not in (None, "cpu", "cuda"):
        raise UsageError(f"--device {requested}: a DDP rank always uses the GPU of its local rank; choose the GPUs with "
                         f"CUDA_VISIBLE_DEVICES (e.g. CUDA_VISIBLE_DEVICES=2,3) and pass --device cuda or nothing")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    if gpus == 1 and not ranks_here:  # The one visible GPU is this rank's own, whatever its index on the machine.
        return torch.device("cuda", 0)
    if max(ranks_here or 0, local_rank + 1) > gpus:
        raise UsageError(f"{f'{ranks_here} ranks on this machine' if ranks_here else f'local rank {local_rank}'} but "
                         f"{gpus} GPU(s) visible: start at most one rank per GPU (check CUDA_VISIBLE_DEVICES), or "
                         f"train on the CPU with --device cpu")
    return torch.device("cuda", local_rank)


def check_global_batch(batch_size, world_size, accum_steps=1):
    """--batch-size is the global batch, so it must split evenly over the ranks and their --accum-steps micro-batches."""
    if batch_size % (world_size * accum_steps):
        split = f"{world_size} ranks" + (f" x {accum_steps} micro-batches" if accum_steps > 1 else "")
        raise UsageError(f"--batch-size {batch_size} is the global batch and must split evenly over {split}; use a "
                         f"multiple of {world_size * accum_steps}")


def check_torchrun_worker(cfg=None):
    """A torchrun worker (--max-restarts each need a fresh store); its errors then name its rank; cfg's batch splits."""
    if not {"RANK", "LOCAL_RANK", "WORLD_SIZE"} <= os.environ.keys():
        raise UsageError(f"RANK/LOCAL_RANK/WORLD_SIZE are not set: start this script with torchrun, e.g. "
                         f"`torchrun --standalone --nproc-per-node 2 {Path(sys.argv[0]).name}`")
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise UsageError("torchrun --max-restarts needs a fresh store per restart: run it as "
                         "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ...` with a c10d rendezvous (--standalone, "
                         "or --rdzv-backend c10d --rdzv-endpoint HOST:PORT), not --master-addr/--node-rank")
    name_rank_in_errors(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    if cfg is not None:
        check_global_batch(cfg.batch_size, int(os.environ["WORLD_SIZE"]), cfg.accum_steps)


@contextlib.contextmanager
def local_rank_0_first(ctx):
    """The block runs on each machine's local rank 0 first (it may download files), then on that machine's others."""
    if ctx.local_rank != 0:
        dist.barrier()  # It meets local rank 0's barrier below, once that rank has run the block.
    yield
    if ctx.local_rank == 0:
        dist.barrier()


def ephemeral_low():
    """The first port of the OS's ephemeral range, from which bind(0) and every outgoing connection take theirs."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")  # Linux; 32768 is below macOS's 49152 too
    return int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768


def free_port(host="127.0.0.1", candidates=None):
    """A port free now, for a command told its port before it binds it (tcp://HOST:PORT, --rdzv-endpoint): from
    below the OS's ephemeral range (bind(0)'s pick), whose ports any outgoing connection may take in between."""
    low = ephemeral_low()
    start = random.randrange(10000, low)
    for port in candidates or [*range(start, low), *range(10000, start)]:
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind((host, port))
            return port
    raise OSError(f"no free port on {host} below {low}")


# The flags every rank must share. With different ones the ranks take different numbers of steps or collectives, and
# gloo aborts the process (SIGABRT) on the first mismatched one. --data-dir, --output and --device may differ.
SAME_ON_EVERY_RANK = ("epochs", "batch_size", "lr", "momentum", "seed", "train_samples", "test_samples", "log_every",
                      "save_every", "accum_steps", "precision", "compile")


def check_flags_and_set_threads(cfg, ctx):
    """Every rank's flags compared (a mismatch stops all in one line), this rank's share of the cores set, its line."""
    flags = {name: getattr(cfg, name) for name in SAME_ON_EVERY_RANK} | {"snapshot": cfg.snapshot is not None}
    everyone, host = [None] * ctx.world_size, socket.gethostname()
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
    torch.set_num_threads(threads)
    print(f"[rank {ctx.rank}] host={host} local_rank={ctx.local_rank} device={ctx.device} "
          f"backend={dist.get_backend()} world_size={ctx.world_size} threads={threads}\n", end="", flush=True)


def cpu_threads(ranks_here):
    """Threads for one CPU rank: the cores SLURM gave its task, or this machine's, split over the ranks sharing them."""
    if per_task := int(os.environ.get("SLURM_CPUS_PER_TASK") or 0):  # srun gave this task cores of its own
        return max(1, per_task // int(os.environ.get("LOCAL_WORLD_SIZE") or 1))  # shared by torchrun's workers in it
    return max(1, len(os.sched_getaffinity(0)) // ranks_here)


def print_parameter_bytes(model, ctx):
    """Rank 0's line: the model's parameter bytes, and those each rank holds (a DTensor's slice, a stage's layers)."""
    mine = sum(getattr(p, "to_local", lambda: p)().numel() * p.element_size() for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())  # A DTensor's numel() counts the whole tensor.
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    if not any(hasattr(p, "to_local") for p in model.parameters()):  # pipeline stages: their layers add up
        full = sum(everyone)
    per_rank = (", ".join(f"rank {r} {b:,}" for r, b in enumerate(everyone)) if ctx.world_size <= 8
                else f"{min(everyone):,} to {max(everyone):,} per rank")
    print0(ctx, f"Parameter bytes: {full:,} in the whole model; held: {per_rank}")


# ---- What torch says when ranks cannot meet or lose each other, explained in one line with the fix ----

NO_RANK0 = ("rank 0 is not running there, a firewall blocks the port, or the address is wrong. Start rank 0, check "
            "the address and port, and set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface that reaches it")
MISSING_PEERS = ("start every rank, with the same address and world size; a firewall between the machines, or "
                 "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME naming the wrong interface, keeps them apart too")
CONNECT_TIMED_OUT = r"timed out after (\d+)ms while trying to connect to \((.+), (\d+)\)"  # a store not answering
DISTRIBUTED_ERRORS = [  # (torch's words, as seen on torch 2.14.1, and the line for them)
    (r"Unable to find address for: ?(\S+)", lambda m: (
        f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', m[1])} is not a network interface of this "
        f"machine; set it to the one on the network the ranks share (`ip -br addr` lists them), or unset it")),
    (CONNECT_TIMED_OUT, lambda m: (
        f"no rendezvous at {m[2]}:{m[3]} (torch's tries timed out after {int(m[1]) / 1000:g}s each): {NO_RANK0}")),
    (r"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined", lambda m: (
        f"only {m[2]} of {m[3]} processes reached the rendezvous within {m[1]}s: {MISSING_PEERS}")),
    # a store's wait ran out: a peer never came (torch 2.14: "wait timeout after 120000ms, keys: /default_pg/0//cpu//0")
    (r"^\s*(Wait timeout|Socket Timeout|wait timeout after (\d+)ms, keys: .*)\s*$", lambda m: (
        f"not every rank reached the rendezvous within --timeout{f' ({int(m[2]) / 1000:g}s)' if m[2] else ''}: "
        f"{MISSING_PEERS}")),
    (r"Connection (?:closed|reset) by peer|Broken pipe", lambda m: (  # Gloo says this when a peer's process died.
        f"lost contact with the other ranks ({m[0]}): another rank died (see its log), or the "
        f"network between them failed")),
    # gloo: a peer stopped answering but kept its connection (stopped, hung, or elsewhere), or gloo then closed it
    (r"Timed out waiting (\d+)ms for (?:recv|send) operation|Application timeout caused pair closure", lambda m: (
        f"no answer from another rank within --timeout{f' ({int(m[1]) / 1000:g}s)' if m[1] else ''}: one of them is "
        f"stopped or stuck (see its log), or the network between them stalled")),
]


def name_rank_in_errors(rank, world_size):
    """From now on this rank's error lines start [rank N], and torch's words for lost ranks are explained."""
    RANK[0] = rank if world_size > 1 else None
    EXPLAINED.extend(x for x in DISTRIBUTED_ERRORS if x not in EXPLAINED)
