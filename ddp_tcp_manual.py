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
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common.checkpoint import prepare_output, save_weights
from common.config import parse_config
from common.data import ShardSampler, load_fashion_mnist, make_loader
from common.distributed import cleanup, claim_rendezvous_file, init_distributed, print0
from common.engine import fit
from common.errors import run_main
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


def main():
    cfg = parse_config(description=__doc__, chapter_flags=("init_method", "rank", "world_size", "local_rank"))
    claim_rendezvous_file(cfg.init_method, cfg.timeout)
    ctx = init_distributed(cfg, rank=cfg.rank, local_rank=cfg.local_rank or 0, world_size=cfg.world_size,
                           init_method=cfg.init_method)
    try:
        train(cfg, ctx)
    finally:
        cleanup(ctx)


if __name__ == "__main__":
    run_main(main)
