"""Can the ranks talk? Run this with the launcher and flags of the job, before the job: it meets the group the same
way, says where every rank is and which network interface it uses, and times all-reduce and broadcast.

    torchrun --standalone --nproc-per-node 2 scripts/preflight.py                      # as ddp_launch.py
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 scripts/preflight.py
    python scripts/preflight.py --nprocs 2                                              # as ddp_mp.py (mp.spawn)
    srun --nodes 2 --ntasks-per-node 4 python scripts/preflight.py                      # as ddp_slurm.py

Every rank prints one line (host, rank, local rank, device, backend, and the interface gloo / NCCL will use);
rank 0 prints the timings and ends with one line: `preflight: OK ...` with the ranks, hosts and the measured
bandwidth, or `preflight: FAILED ...` naming the rank that could not meet the others and why (exit 1). A rank that
cannot reach another fails in init_process_group or the first collective, both inside that one line: gloo connects
every pair of ranks inside init_process_group; NCCL, given device_id=, builds its communicator there, and a data
connection it opens later fails in the first collective. (On NCCL a peer that hangs rather than fails is ended by
NCCL's watchdog after --timeout, with torch's own lines instead.) The timings sweep buffer sizes and report the
algorithm and bus bandwidth as nccl-tests does (timed and bus_bandwidth below).
"""
import fcntl
import os
import socket
import struct
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # common/, when run as scripts/preflight.py

from common.cli import POSITIVE, FatalError, explain, flag, parse_config, run_main  # noqa: E402
from common.comm_hooks import COMM_HOOK  # noqa: E402
from common.ranks import DistContext, destroy_process_group, name_rank_in_errors, rank_device  # noqa: E402
from ddp_mp import spawned  # noqa: E402  (how chapter 4's workers end)
from ddp_slurm import first_node  # noqa: E402

# Buffer sizes swept as nccl-tests sweeps them (x4 a step): from latency-bound to bandwidth-bound. On GPUs up to 256
# MiB, where a fast link needs that much to reach its bandwidth; on the CPU (gloo) 16 MiB already does.
SMALLEST, LARGEST = 4 * 1024, {"cuda": 256 * 1024 * 1024, "cpu": 16 * 1024 * 1024}
WARMUP, ITERATIONS = 5, 20  # per size, as nccl-tests' defaults: untimed runs first, then the mean of the timed ones


def interfaces():
    """{interface name: its IPv4 address} of this machine (the first address of each)."""
    found = {}
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
        found[name] = socket.inet_ntoa(packed[20:24])
    return found


def interface_in_use(backend):
    """The interface the backend will use here, and why: its *_SOCKET_IFNAME, else what it picks by itself."""
    variable = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    if os.environ.get(variable):
        return f"{os.environ[variable]} ({variable})"
    if backend == "nccl":
        return "NCCL's own pick: InfiniBand if any, else the first non-loopback interface (set NCCL_SOCKET_IFNAME)"
    # gloo without GLOO_SOCKET_IFNAME: the address this machine's host name resolves to.
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError as e:
        return f"none: host name {host} does not resolve ({e.strerror}); set GLOO_SOCKET_IFNAME"
    names = [name for name, a in interfaces().items() if a == address or (address.startswith("127.") and name == "lo")]
    return f"{names[0] if names else '?'} ({address}, from host name {host}; GLOO_SOCKET_IFNAME unset)"


def sizes(device):
    """The buffer sizes to time, in bytes: SMALLEST x 4^k up to the largest for this device."""
    found, size = [], SMALLEST
    while size <= LARGEST[device.type]:
        found.append(size)
        size *= 4
    return found


def timed(op, tensor, ctx):
    """Mean seconds of one op(tensor) as nccl-tests times it: WARMUP runs, then ITERATIONS back to back between two
    synchronisations, the total divided by ITERATIONS; the slowest rank's mean (the collective waits for it)."""
    for _ in range(WARMUP):
        op(tensor)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(ITERATIONS):
        op(tensor)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    mean = torch.tensor((time.perf_counter() - start) / ITERATIONS, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    return mean.item()


# What a rank sends per byte of the buffer, as nccl-tests counts it: an all-reduce (reduce-scatter, then all-gather)
# moves 2(n-1)/n of the buffer through each rank's link, a broadcast the buffer once. Times the algorithm bandwidth
# (buffer bytes / seconds), this is the bus bandwidth: comparable with the link's speed at any number of ranks.
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1}


def algorithm_bandwidth(nbytes, seconds):
    """nccl-tests' algbw: the buffer's bytes over the time one op took."""
    return nbytes / seconds


def bus_bandwidth(op, nbytes, seconds, world_size):
    """nccl-tests' busbw: bytes per second on each rank's link for op on an nbytes buffer over world_size ranks."""
    return algorithm_bandwidth(nbytes, seconds) * BUS_FACTOR[op](world_size)


def human(nbytes):
    return f"{nbytes // 1024 // 1024} MiB" if nbytes >= 1024 * 1024 else f"{nbytes // 1024} KiB"


def preflight(ctx, backend, everyone):
    """Every rank, once all have met (everyone: each rank's host name): the timings; rank 0 prints the result."""
    results = []
    swept = sizes(ctx.device)
    for size in swept:
        tensor = torch.ones(size // 4, dtype=torch.float32, device=ctx.device)
        for op, run in (("all_reduce", dist.all_reduce), ("broadcast", lambda t: dist.broadcast(t, 0))):
            seconds = timed(run, tensor, ctx)
            results.append((op, size, seconds, algorithm_bandwidth(size, seconds),
                            bus_bandwidth(op, size, seconds, ctx.world_size)))
    if ctx.rank == 0:
        print(f"{'op':>10} {'size':>7}  {'time':>11}  {'algbw':>12}  {'busbw':>12}  (mean of {ITERATIONS}, float32)")
        for name, size, seconds, algbw, busbw in results:
            print(f"{name:>10} {human(size):>7}: {seconds * 1e3:8.3f} ms  {algbw / 1e9:7.3f} GB/s  "
                  f"{busbw / 1e9:7.3f} GB/s")
        hosts = {}
        for rank, h in enumerate(everyone):
            hosts.setdefault(h, []).append(rank)
        where = ", ".join(f"{h}: {','.join(map(str, r))}" for h, r in hosts.items())
        big = {name: busbw for name, size, _, _, busbw in results if size == swept[-1]}
        print(f"preflight: OK: {ctx.world_size} ranks on {len(hosts)} host{'s' * (len(hosts) > 1)} ({where}); "
              f"{human(swept[-1])} all_reduce {big['all_reduce'] / 1e9:.3f} GB/s, broadcast "
              f"{big['broadcast'] / 1e9:.3f} GB/s (bus bandwidth, {backend})", flush=True)


def run_rank(rank, local_rank, world_size, ranks_here, cfg, init_method):
    """Join the group as the job would (same backend, rendezvous and --timeout), run the checks, leave."""
    name_rank_in_errors(rank, world_size)
    device = rank_device(cfg.device, local_rank, ranks_here)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    host = socket.gethostname()
    print(f"[rank {rank}] host={host} local_rank={local_rank} device={device} backend={backend} "
          f"world_size={world_size} iface={interface_in_use(backend)}\n", end="", flush=True)
    everyone = [None] * world_size
    where = init_method or f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"  # None: the spawner's store
    try:
        try:
            store = None if init_method else dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                                           is_master=False, timeout=timedelta(seconds=cfg.timeout))
            dist.init_process_group(backend, init_method=init_method, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=cfg.timeout),
                                    device_id=device if device.type == "cuda" else None)  # NCCL connects here
            dist.all_gather_object(everyone, host)  # the first collective: every rank's host name
        except Exception as e:
            why = explain(e) or f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
            raise FatalError(f"preflight: FAILED: rank {rank} on {host} could not meet the others at {where}: "
                             f"{why}") from None
        preflight(ctx, backend, everyone)
    finally:
        if dist.is_initialized():
            destroy_process_group()  # after an error: its line first, and no wait (common/ranks.py)


@spawned
def spawned_rank(rank, cfg, world_size):
    run_rank(rank, rank, world_size, world_size, cfg, None)


def main():
    cfg = parse_config(description=__doc__, comm_hook=COMM_HOOK,  # the job's flags are accepted as they are
                       nprocs=flag(None, POSITIVE, "processes to spawn, as ddp_mp.py (default one per visible GPU)"))
    if cfg.nprocs is not None or not ({"RANK", "WORLD_SIZE"} <= os.environ.keys() or "SLURM_STEP_ID" in os.environ):
        gpus = torch.cuda.device_count() if cfg.device != "cpu" and torch.cuda.is_available() else 0
        world_size = cfg.nprocs or gpus or 2  # as ddp_mp.py: mp.spawn on this machine
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # as ddp_mp.py: the store is bound before the ranks start
        # and, the ranks being on this machine, on MASTER_ADDR alone (a store binding its own port takes every address)
        listener = socket.create_server((os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", 0))))
        store = dist.TCPStore(os.environ["MASTER_ADDR"], listener.getsockname()[1], is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=cfg.timeout),
                              master_listen_fd=listener.detach(), use_libuv=False)  # libuv's takes an fd from 2.8 on
        os.environ["MASTER_PORT"] = str(store.port)
        try:
            mp.spawn(spawned_rank, args=(cfg, world_size), nprocs=world_size)
        except mp.ProcessExitedException as e:  # a rank failed and said why; spawn stopped the others
            raise SystemExit(e.exit_code if e.exit_code > 0 else f"error: rank {e.error_index} was killed by "
                                                                  f"{e.signal_name}")
    elif "RANK" in os.environ:  # torchrun
        run_rank(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]),
                 int(os.environ["LOCAL_WORLD_SIZE"]), cfg, "env://")
    else:  # a task of srun, meeting where ddp_slurm.py's ranks meet
        master_addr = os.environ.get("MASTER_ADDR") or first_node(os.environ["SLURM_STEP_NODELIST"])
        master_port = os.environ.get("MASTER_PORT") or 20000 + int(os.environ["SLURM_JOB_ID"]) % 10000
        run_rank(int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_LOCALID"]), int(os.environ["SLURM_NTASKS"]),
                 None, cfg, f"tcp://{master_addr}:{master_port}")


if __name__ == "__main__":
    run_main(main)
