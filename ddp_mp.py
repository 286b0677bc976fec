"""Chapter 4: DDP, one process per GPU, started from Python by torch.multiprocessing.spawn.

    python ddp_mp.py                         # one process per visible GPU (2 processes on a CPU-only machine)
    python ddp_mp.py --nprocs 2 --device cpu
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python ddp_mp.py   # fixed rendezvous instead of a free port

The parent process parses the flags, picks the rendezvous address and spawns --nprocs workers; worker i
is rank i and runs chapter 1's steps plus DDP's: join the group, shard the data, wrap the model, leave.
"""
import os

import torch
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common.checkpoint import prepare_output, save_weights
from common.config import parse_config
from common.data import ShardSampler, load_fashion_mnist, make_loader
from common.distributed import check_global_batch, cleanup, default_nprocs, free_port, init_distributed, print0
from common.engine import fit
from common.errors import run_main, run_worker
from common.model import NeuralNetwork


def train(cfg, ctx):
    print0(ctx, cfg.describe())
    print0(ctx, f"Using {ctx.device} device, {ctx.world_size} processes, backend {ctx.backend}")
    output = prepare_output(cfg.output)

    train_set, test_set, folder = load_fashion_mnist(cfg, ctx.device)
    print0(ctx, f"Data: {folder} ({len(train_set)} train / {len(test_set)} test images)")
    # Each rank takes every world_size-th item of the same seeded permutation, batch_size / world_size at a time.
    train_sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, seed=cfg.seed)
    train_loader = make_loader(train_set, cfg.batch_size // ctx.world_size, train_sampler)
    test_loader = make_loader(test_set, 1000, ShardSampler(test_set, ctx.rank, ctx.world_size))

    torch.manual_seed(cfg.seed)  # the same initial weights in every chapter
    model = NeuralNetwork().to(ctx.device)
    # One bucket for the whole 2.7 MB gradient: one all-reduce per step (measured faster than DDP's default two).
    model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None, bucket_cap_mb=4)
    print0(ctx, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)

    fit(model, train_loader, test_loader, optimizer, cfg, ctx)

    save_weights(model, output / "model.pth", ctx)  # rank 0 saves model.module: no `module.` prefix
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")


def worker(rank, cfg, world_size, init_method):
    ctx = init_distributed(cfg, rank=rank, local_rank=rank, world_size=world_size, init_method=init_method)
    try:
        train(cfg, ctx)
    finally:
        cleanup(ctx)


def main():
    cfg = parse_config(description=__doc__, chapter_flags=("nprocs",))
    world_size = cfg.nprocs or default_nprocs(cfg.device)
    check_global_batch(cfg.batch_size, world_size)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT") or free_port(addr)
    mp.spawn(run_worker, args=(worker, cfg, world_size, f"tcp://{addr}:{port}"), nprocs=world_size)


if __name__ == "__main__":
    run_main(main)
