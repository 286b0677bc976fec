"""Chapter 6: DDP on a SLURM cluster: srun starts one task per GPU on every node, SLURM tells each who it is.

    sbatch scripts/job.sh                       # 2 nodes x 4 GPUs, as its #SBATCH lines say
    sbatch scripts/job.sh --epochs 1            # flags after the script go to ddp_slurm.py
    sbatch --nodes 1 --ntasks-per-node 2 --gpus-per-node 0 --cpus-per-task 1 scripts/job.sh   # a CPU-only cluster
    srun --nodes 1 --ntasks-per-node 2 python ddp_slurm.py   # interactively, inside or as an allocation

SLURM_PROCID is the global rank, SLURM_NTASKS the world size, SLURM_LOCALID the local rank (it picks the GPU).
The master is the first host of SLURM_JOB_NODELIST, on a port derived from SLURM_JOB_ID (MASTER_ADDR and
MASTER_PORT override them), so every task computes the same tcp:// address without talking to the others.
"""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common.checkpoint import prepare_output, save_weights
from common.config import parse_config
from common.data import ShardSampler, load_fashion_mnist, make_loader
from common.distributed import cleanup, init_distributed, print0, slurm_env
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
    rank, local_rank, world_size, init_method = slurm_env()
    ctx = init_distributed(cfg, rank=rank, local_rank=local_rank, world_size=world_size, init_method=init_method)
    try:
        train(cfg, ctx)
    finally:
        cleanup(ctx)


if __name__ == "__main__":
    run_main(main)
