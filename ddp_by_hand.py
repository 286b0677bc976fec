"""Chapter 3b: DDP's job done by hand, chapter 3 otherwise: rank 0's weights sent to every rank, and before each
optimizer step every gradient all-reduced and divided by the world size. The lesson: diff ddp_launch.py ddp_by_hand.py

    torchrun --standalone --nproc-per-node 2 ddp_by_hand.py     # one machine, 2 processes (GPUs, or the CPU)

It trains chapter 3's model, and waits for the network where DDP need not: one all-reduce per tensor, in turn, after
the whole backward (gloo's call returns when it is done; NCCL's at once, and the GPU's stream waits), where DDP sends
buckets while the backward runs (docs/scaling.md: 45% longer than DDP at 1 Gbit/s, the same at 100 Mbit/s).
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, DistributedSampler, Subset, default_convert

from common.checkpoint import load_snapshot, prepare_output, save_snapshot, save_weights
from common.cli import UsageError, parse_config, run_main
from common.data import load_fashion_mnist
from common.engine import MetricsLog, evaluate, train_one_epoch
from common.model import NeuralNetwork
from common.ranks import (DistContext, check_flags_and_set_threads, check_torchrun_worker, destroy_process_group,
                          local_rank_0_first, print0, rank_device)


@record  # Under torchrun, this worker's error and traceback go into torchrun's failure summary.
def main():
    cfg = parse_config(description=__doc__)
    if cfg.precision == "fp16":  # GradScaler skips a step on this rank's own overflow, before the average is taken
        raise UsageError("ddp_by_hand.py trains in --precision fp32 or bf16: fp16's GradScaler would check each rank's "
                         "own gradients for overflow before they are averaged, so one rank could skip a step the "
                         "others take; use --precision bf16, or chapter 3 (ddp_launch.py)")
    check_torchrun_worker(cfg)  # One line if torchrun did not start this process or the global batch does not split.
    # Step 1, who am I: torchrun sets RANK (global: rank 0 prints and saves), LOCAL_RANK (it picks the GPU), WORLD_SIZE.
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    # Step 2, device: this process's GPU, or the CPU (--device cpu, or no GPU visible).
    device = rank_device(cfg.device, local_rank, int(os.environ["LOCAL_WORLD_SIZE"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Pin this process's GPU before anything else touches one.
    ctx = DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    # Step 3, init: env:// reads torchrun's MASTER_ADDR and MASTER_PORT. A peer missing for --timeout is an error.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://", rank=rank,
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
    # Step 5, wrap: by hand, every rank starts from rank 0's weights (what DDP's constructor does) ...
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    if cfg.compile:  # in place (state_dict() keeps its keys): docs/benchmark.md says what it compiles
        model.compile()
    print0(ctx, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    # ... and steps with the ranks' mean gradient (what DDP's backward() does): averaged just before each step
    optimizer.register_step_pre_hook(lambda *_: average_gradients(model, ctx.world_size))
    scaler = None  # no loss scaling: fp16, which needs it, is refused above

    first_epoch = load_snapshot(model, optimizer, scaler, cfg, ctx)  # 0, or the epochs it holds
    metrics = MetricsLog(output, ctx, first_epoch)
    # Step 6, epochs: each draws its own shuffle from seed + epoch.
    for epoch in range(first_epoch, cfg.epochs):
        print0(ctx, f"Epoch {epoch + 1}\n-------------------------------")
        train_sampler.set_epoch(epoch)  # without it, every epoch would repeat epoch 0's order
        # backward() leaves each rank its own gradients (--accum-steps: summed over micro-batches); step() averages
        train_one_epoch(model, train_loader, optimizer, scaler, epoch, cfg, ctx, metrics)
        evaluate(model, test_loader, epoch, ctx, metrics)
        if save_snapshot(model, optimizer, scaler, epoch + 1, cfg, ctx):  # Every --save-every epochs.
            return  # SLURM warned of its time limit (docs/slurm.md): the snapshot holds the run.
    print0(ctx, "Done!")

    # Step 7, save: the model's weights, once (every rank holds the same).
    if ctx.is_main:
        save_weights(model, output / "model.pth")
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")


def average_gradients(model, world_size):
    """DDP's job by hand: each gradient summed over the ranks, one all-reduce per tensor in turn, then averaged."""
    for param in model.parameters():
        dist.all_reduce(param.grad)  # the sum of every rank's gradient, in place on every rank
        param.grad /= world_size


if __name__ == "__main__":
    run_main(main)
