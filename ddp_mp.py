"""Chapter 4: DDP, one process per GPU, started from Python by torch.multiprocessing.spawn.

    python ddp_mp.py                         # one process per visible GPU (2 processes on a CPU-only machine)
    python ddp_mp.py --nprocs 2 --device cpu
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python ddp_mp.py   # a fixed port instead of a free one

The parent process parses the flags, picks the rendezvous address and spawns --nprocs workers; worker i
is rank i and runs chapter 1's steps plus DDP's: join the group, shard the data, wrap the model, leave.
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common.checkpoint import load_snapshot, prepare_output, save_snapshot, save_weights
from common.config import parse_config
from common.data import ShardSampler, load_fashion_mnist, locate_fashion_mnist, make_loader
from common.engine import evaluate, train_one_epoch
from common.errors import one_line_errors, run_main
from common.metrics import MetricsLog
from common.model import NeuralNetwork
from common.ranks import DistContext, check_global_batch, default_nprocs, free_port, meet_the_group, print0, rank_device


def train(cfg, ctx):
    print0(ctx, cfg.describe())
    print0(ctx, f"Using {ctx.device} device, {ctx.world_size} processes, backend {dist.get_backend()}")
    meet_the_group(cfg, ctx)  # each rank's line; one line if they disagree on flags or share a GPU
    output = prepare_output(cfg.output)

    if ctx.local_rank == 0:  # one process per machine finds the data, downloading it if it must, ...
        locate_fashion_mnist(cfg.data_dir)
    dist.barrier()  # ... while the machine's other ranks wait here; then every rank reads it
    train_set, test_set, folder = load_fashion_mnist(cfg, ctx.device)
    print0(ctx, f"Data: {folder} ({len(train_set)} train / {len(test_set)} test images)")
    # Each rank takes every world_size-th image of chapter 1's shuffle, batch_size / world_size at a time, so
    # the ranks' k-th batches together are chapter 1's k-th batch. Each rank tests a disjoint shard.
    train_sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, seed=cfg.seed)
    train_loader = make_loader(train_set, cfg.batch_size // (ctx.world_size * cfg.accum_steps), train_sampler)
    test_loader = make_loader(test_set, 1000, ShardSampler(test_set, ctx.rank, ctx.world_size))

    torch.manual_seed(cfg.seed)  # the same initial weights in every chapter
    model = NeuralNetwork().to(ctx.device)
    # DDP copies rank 0's weights to every rank, then averages the gradients over all ranks in each backward().
    model = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)
    if cfg.compile:
        # After the wrap: TorchDynamo sees DDP and cuts the graph where DDP's gradient buckets end (here two: the
        # last two layers fill the 1 MB first bucket, the first layer the next), so a bucket's all-reduce starts while
        # backward() goes on. Compiled before the wrap, backward is one graph that hands DDP every gradient at its end.
        model.compile()
    print0(ctx, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    # --precision fp16: scale the loss up so float16's small gradients do not round to zero.
    scaler = torch.amp.GradScaler(ctx.device.type) if cfg.precision == "fp16" else None

    first_epoch = load_snapshot(model, optimizer, scaler, cfg, ctx)  # 0, or the epochs a --snapshot file already holds
    metrics = MetricsLog(output, ctx, first_epoch)
    for epoch in range(first_epoch, cfg.epochs):
        print0(ctx, f"Epoch {epoch + 1}\n-------------------------------")
        train_sampler.set_epoch(epoch)  # this epoch's shuffle: seed + epoch (without it, every epoch is epoch 0's)
        train_one_epoch(model, train_loader, optimizer, scaler, epoch, cfg, ctx, metrics)
        evaluate(model, test_loader, epoch, ctx, metrics)
        save_snapshot(model, optimizer, scaler, epoch + 1, cfg, ctx)  # with --snapshot: every --save-every epochs
    print0(ctx, "Done!")

    if ctx.is_main:  # one copy: rank 0 saves model.module, the plain model inside DDP (no `module.` prefix)
        save_weights(model.module, output / "model.pth")
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")


@one_line_errors  # a failing worker prints one line and exits non-zero; mp.spawn then stops the others
def worker(rank, cfg, world_size):  # mp.spawn passes each worker its index first: here, its rank
    local_rank = rank  # every rank runs on this machine
    device = rank_device(cfg.device, local_rank, world_size)  # cuda:<local_rank>, or the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init_process_group: NCCL binds this process to its own GPU
    ctx = DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    # env:// reads the MASTER_ADDR and MASTER_PORT that main() put in the environment every worker inherits.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=cfg.timeout),
                            device_id=device if device.type == "cuda" else None)  # NCCL connects here, not later
    try:
        train(cfg, ctx)
    finally:
        dist.destroy_process_group()  # leave, after an error too: the others stop at once (gloo) or at --timeout (NCCL)


def main():
    cfg = parse_config(description=__doc__, chapter_flags=("nprocs",))
    world_size = cfg.nprocs or default_nprocs(cfg.device)  # one process per visible GPU, or 2 on the CPU
    check_global_batch(cfg.batch_size, world_size, cfg.accum_steps)
    rank_device(cfg.device, 0, ranks_here=world_size)  # more processes than GPUs: one line now, before any starts
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # where the workers reach rank 0: all run on this machine
    os.environ.setdefault("MASTER_PORT", str(free_port()))  # a port that is free now, not a fixed 12355
    mp.spawn(worker, args=(cfg, world_size), nprocs=world_size)  # worker(i, cfg, world_size) for i in 0..nprocs-1


if __name__ == "__main__":
    run_main(main)
