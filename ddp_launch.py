"""Chapter 3: DDP started by torchrun, which runs one copy of this script per GPU and tells each who it is.

    torchrun --standalone --nproc-per-node 2 ddp_launch.py                 # one machine, 2 processes
    torchrun --standalone --nproc-per-node gpu ddp_launch.py               # one process per visible GPU
    # two machines, 4 GPUs each; run on both, with --node-rank 0 on the master (10.0.0.1):
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 ddp_launch.py
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 ddp_launch.py
    # or let the nodes find each other through a c10d rendezvous (same command on every node):
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 --rdzv-id job1 ddp_launch.py
    # elastic: if a worker dies, torchrun restarts the whole group (up to 3 times); --snapshot lets it resume
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 ddp_launch.py --snapshot runs/snap-ddp.pt

torchrun sets RANK (global), LOCAL_RANK (index on this node, picks the GPU), WORLD_SIZE, MASTER_ADDR and
MASTER_PORT; `init_method="env://"` reads them. No --local_rank argument, no hard-coded addresses.
"""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common.checkpoint import prepare_output, save_weights
from common.config import parse_config
from common.data import ShardSampler, load_fashion_mnist, make_loader
from common.distributed import cleanup, init_distributed, print0, torchrun_env
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
    cfg = parse_config(description=__doc__)
    rank, local_rank, world_size = torchrun_env()
    ctx = init_distributed(cfg, rank=rank, local_rank=local_rank, world_size=world_size, init_method="env://")
    try:
        train(cfg, ctx)
    finally:
        cleanup(ctx)


if __name__ == "__main__":
    run_main(main)
