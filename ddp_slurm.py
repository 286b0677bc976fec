"""Chapter 6: DDP on a SLURM cluster: srun starts one task per GPU on every node, SLURM tells each who it is.

    sbatch scripts/job.sh                       # 2 nodes x 4 GPUs, as its #SBATCH lines say; flags after it go here
    srun --nodes 1 --ntasks-per-node 2 python ddp_slurm.py   # interactively, inside or as an allocation

The ranks meet on the step's first node, on a port from the job id (MASTER_ADDR / MASTER_PORT override them), so
every task computes the same tcp:// address without talking to the others. Time limits and requeue: docs/slurm.md.
"""
import os
import subprocess
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, default_convert

from common.checkpoint import load_snapshot, prepare_output, save_snapshot, save_weights
from common.cli import FatalError, UsageError, parse_config, run_main
from common.data import load_fashion_mnist
from common.engine import MetricsLog, evaluate, train_one_epoch
from common.model import NeuralNetwork
from common.ranks import (DistContext, check_flags_and_set_threads, check_global_batch, destroy_process_group,
                          local_rank_0_first, name_rank_in_errors, print0, rank_device)


def main():
    cfg = parse_config(description=__doc__)
    if not os.environ.get("SLURM_STEP_ID"):  # set in the tasks of an srun step only, not in the batch script itself
        raise UsageError("this is not a task of an srun step (SLURM_STEP_ID is not set): submit it with `sbatch "
                         "scripts/job.sh`, or run `srun python ddp_slurm.py` inside an allocation")
    # Step 1, who am I: srun sets SLURM_PROCID (global rank), SLURM_LOCALID (picks the GPU), SLURM_NTASKS.
    rank = int(os.environ["SLURM_PROCID"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    name_rank_in_errors(rank, world_size)
    check_global_batch(cfg.batch_size, world_size, cfg.accum_steps)
    # Step 2, device: this process's GPU, or the CPU (--device cpu, or no GPU visible).
    device = rank_device(cfg.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Pin this process's GPU before anything else touches one.
    ctx = DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    # Step 3, init: every task computes the same address by itself: its step's first node (a step may run on some of
    # the job's nodes), and a port from the job id (two jobs that share a node get two); MASTER_ADDR and MASTER_PORT
    # override them.
    master_addr = os.environ.get("MASTER_ADDR") or first_node(os.environ["SLURM_STEP_NODELIST"])
    master_port = os.environ.get("MASTER_PORT") or 20000 + int(os.environ["SLURM_JOB_ID"]) % 10000
    init_method = f"tcp://{master_addr}:{master_port}"
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
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


def first_node(nodes):
    """The first host of a SLURM host list ("gpu[01-03,07]" -> "gpu01") as SLURM itself expands it: `scontrol show
    hostnames`, which every SLURM node has (the line most batch scripts find MASTER_ADDR with)."""
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FatalError(f"cannot run `scontrol show hostnames` to find the job's first node ({e}); run inside a "
                         f"SLURM job, or set MASTER_ADDR to rank 0's address") from None
    if hosts.returncode or not hosts.stdout.split():
        raise FatalError(f"`scontrol show hostnames {nodes}` failed ({hosts.stderr.strip() or 'no host'}); set "
                         f"MASTER_ADDR to rank 0's address")
    return hosts.stdout.split()[0]


if __name__ == "__main__":
    run_main(main)
