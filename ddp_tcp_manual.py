"""Chapter 5: DDP with every process started by hand and an explicit rendezvous (tcp:// or file://).

Two machines, one process each. Rank 0 listens; HOST is rank 0's address as the others see it:
    machine A (10.0.0.1):  python ddp_tcp_manual.py --init-method tcp://10.0.0.1:29500 --rank 0 --world-size 2
    machine B:             python ddp_tcp_manual.py --init-method tcp://10.0.0.1:29500 --rank 1 --world-size 2
Two processes on one machine (each GPU gets its own --local-rank):
    python ddp_tcp_manual.py --init-method tcp://127.0.0.1:29500 --rank 0 --world-size 2 --local-rank 0 &
    python ddp_tcp_manual.py --init-method tcp://127.0.0.1:29500 --rank 1 --world-size 2 --local-rank 1
A file on a filesystem every machine mounts (NFS) instead of a port; the file must not exist yet:
    python ddp_tcp_manual.py --init-method file:///shared/rdzv-job1 --rank 0 --world-size 2   # and rank 1

Nothing starts the other ranks for you: each waits up to --timeout seconds for the rest, then gives up.
"""
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common.checkpoint import load_snapshot, prepare_output, save_snapshot, save_weights
from common.config import parse_config
from common.data import ShardSampler, load_fashion_mnist, locate_fashion_mnist, make_loader
from common.engine import evaluate, train_one_epoch
from common.errors import run_main
from common.metrics import MetricsLog
from common.model import NeuralNetwork
from common.ranks import DistContext, check_global_batch, check_rendezvous, meet_the_group, print0, rank_device


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


def main():
    cfg = parse_config(description=__doc__, chapter_flags=("init_method", "rank", "world_size", "local_rank"))
    rank, world_size = cfg.rank, cfg.world_size  # nobody starts these processes for us: the flags say who is who
    local_rank = cfg.local_rank or 0  # ranks that share a machine each need their own: it picks the GPU
    check_global_batch(cfg.batch_size, world_size, cfg.accum_steps)
    device = rank_device(cfg.device, local_rank)  # cuda:<local_rank>, or the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init_process_group: NCCL binds this process to its own GPU
    ctx = DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    check_rendezvous(cfg.init_method, rank, cfg.timeout)  # a leftover file://, or no rank 0 after --timeout
    # tcp://HOST:PORT: rank 0 opens a key-value store on PORT and the others connect to it; file://: they meet in
    # the file. Either way each rank publishes its address there and waits up to --timeout for the rest.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=cfg.init_method, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=cfg.timeout),
                            device_id=device if device.type == "cuda" else None)  # NCCL connects here, not later
    try:
        train(cfg, ctx)
    finally:
        dist.destroy_process_group()  # leave, after an error too: the others stop at once (gloo) or at --timeout (NCCL)
        if cfg.init_method.startswith("file://"):  # the next run needs a fresh file (torch 2.14 leaves it after DDP)
            Path(cfg.init_method.removeprefix("file://")).unlink(missing_ok=True)


if __name__ == "__main__":
    run_main(main)
