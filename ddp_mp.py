"""Chapter 4: DDP, one process per GPU, started from Python by torch.multiprocessing.spawn.

    python ddp_mp.py                         # one process per visible GPU (2 processes on a CPU-only machine)
    python ddp_mp.py --nprocs 2 --device cpu

The parent process parses the flags, holds the rendezvous store and spawns --nprocs workers; worker i is rank i.
"""
import functools
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, default_convert

from common.checkpoint import load_snapshot, prepare_output, save_snapshot, save_weights
from common.cli import POSITIVE, end_process, flag, parse_config, run_main, stop
from common.data import load_fashion_mnist
from common.engine import MetricsLog, evaluate, train_one_epoch
from common.model import NeuralNetwork
from common.ranks import (DistContext, check_flags_and_set_threads, check_global_batch, cpu_threads,
                          destroy_process_group, local_rank_0_first, name_rank_in_errors, print0, rank_device)


def main():
    cfg = parse_config(description=__doc__,
                       nprocs=flag(None, POSITIVE, "processes to spawn (default one per visible GPU, or 2 on a CPU)"))
    gpus = torch.cuda.device_count() if cfg.device != "cpu" and torch.cuda.is_available() else 0
    world_size = cfg.nprocs or gpus or 2  # one process per visible GPU, or 2 on the CPU (still two ranks to show)
    check_global_batch(cfg.batch_size, world_size, cfg.accum_steps)
    rank_device(cfg.device, 0, world_size)  # more processes than GPUs: one line now, before any starts
    if not gpus:  # as torchrun does, the workers' share of the cores goes into the environment they start with:
        os.environ.setdefault("OMP_NUM_THREADS", str(cpu_threads(world_size)))  # every thread's then, gloo's too
    # As torchrun's agent does, this process holds the store where the ranks meet, on a free port bound before any
    # worker starts (a port only chosen now could be taken by another program before rank 0 binds it). The ranks are
    # all on this machine, so it listens on loopback only: a store that binds its own listens on every interface.
    listener = socket.create_server(("127.0.0.1", 0))  # handed over: the store closes it (libuv's takes one from 2.8)
    store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=cfg.timeout), master_listen_fd=listener.detach(),
                          use_libuv=False)
    try:
        mp.spawn(worker, args=(cfg, world_size, store.port), nprocs=world_size)  # worker(i, cfg, world_size, port)
    except mp.ProcessExitedException as e:  # a worker failed (and said why, unless killed); spawn stopped the others
        raise SystemExit(e.exit_code if e.exit_code > 0 else f"error: rank {e.error_index} was killed by {e.signal_name}")


def spawned(fn):
    """mp.spawn's worker fn(rank, ...), ended as run_main ends a chapter: an error in one line or with its traceback."""
    @functools.wraps(fn)
    def worker(rank, *args):
        try:
            fn(rank, *args)
        except Exception as e:
            stop(e, rank)
        end_process(0)  # not back into spawn, whose sys.exit would shut the interpreter down (see end_process)

    return worker


@spawned  # a failing worker prints its error and exits non-zero; mp.spawn then stops the others
def worker(rank, cfg, world_size, port):
    # Step 1, who am I: mp.spawn passes each worker its index first: its rank, and its local rank (one machine).
    local_rank = rank
    name_rank_in_errors(rank, world_size)
    # Step 2, device: this process's GPU, or the CPU (--device cpu, or no GPU visible).
    device = rank_device(cfg.device, local_rank, world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Pin this process's GPU before anything else touches one.
    ctx = DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    # Step 3, init: join main()'s store (what env:// would make on rank 0); a peer missing for --timeout is an error.
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=cfg.timeout))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=cfg.timeout),
                            device_id=device if device.type == "cuda" else None)  # NCCL then connects here.
    try:
        train(cfg, ctx)  # steps 4 to 7, below
    finally:  # Step 8, teardown: it runs after an error too. The other ranks stop (gloo at once, NCCL at --timeout).
        destroy_process_group()  # dist.destroy_process_group(); after an error, common/ranks.py prints it first.


def train(cfg, ctx):
    print0(ctx, cfg.describe())
    print0(ctx, f"Using {ctx.device} device, {ctx.world_size} processes, backend {dist.get_backend()}")
    check_flags_and_set_threads(cfg, ctx)  # Each rank's line and share of the cores; differing flags stop all.
    output = prepare_output(cfg.output)

    # Step 4, data: chapter 1's shuffle dealt to the ranks in turn; each rank tests its own part of the test set.
    with local_rank_0_first(ctx):  # One process per machine finds the data (downloading it if it must), then the rest.
        train_set, test_set, folder = load_fashion_mnist(cfg, ctx.device)
    print0(ctx, f"Data: {folder} ({len(train_set)} train / {len(test_set)} test images)")
    train_sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, seed=cfg.seed)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size // (ctx.world_size * cfg.accum_steps),
                              sampler=train_sampler, collate_fn=default_convert)
    test_set = Subset(test_set, range(ctx.rank, len(test_set), ctx.world_size))
    test_loader = DataLoader(test_set, batch_size=1000, collate_fn=default_convert)  # The dataset gives whole batches.

    torch.manual_seed(cfg.seed)  # the same initial weights in every chapter
    model = NeuralNetwork().to(ctx.device)
    # Step 5, wrap: DDP copies rank 0's weights to every rank, then averages the gradients in each backward().
    model = DDP(model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None)  # The GPU this rank computes on.
    if cfg.compile:  # In place, after any wrap, so state_dict() keeps its keys (docs/training_options.md).
        model.compile()
    print0(ctx, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    # --precision fp16: scale the loss up so float16's small gradients do not round to zero.
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.precision == "fp16")

    first_epoch = load_snapshot(model, optimizer, scaler, cfg, ctx)  # 0, or the epochs a --snapshot file holds.
    metrics = MetricsLog(output, ctx, first_epoch)
    # Step 6, epochs: each draws its own shuffle from seed + epoch.
    for epoch in range(first_epoch, cfg.epochs):
        print0(ctx, f"Epoch {epoch + 1}\n-------------------------------")
        train_sampler.set_epoch(epoch)  # without it, every epoch would repeat epoch 0's order
        train_one_epoch(model, train_loader, optimizer, scaler, epoch, cfg, ctx, metrics, no_sync=model.no_sync)
        evaluate(model, test_loader, epoch, ctx, metrics)
        if save_snapshot(model, optimizer, scaler, epoch + 1, cfg, ctx):  # Every --save-every epochs, with --snapshot.
            return  # SLURM warned of its time limit (docs/slurm.md): the snapshot holds the run.
    print0(ctx, "Done!")

    # Step 7, save: the plain model's weights, once, without DDP's `module.` prefix, so every chapter loads them.
    if ctx.is_main:
        save_weights(model.module, output / "model.pth")
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")


if __name__ == "__main__":
    run_main(main)
