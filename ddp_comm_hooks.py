"""Chapter 11b: chapter 3 on a slow link, sending less. torch's DDP communication hooks change what each bucket's
all-reduce sends: bf16 or fp16 (half the bytes), PowerSGD's low-rank factors, or nothing at most steps (post-local SGD,
the weights averaged every H steps). The lesson: diff ddp_launch.py ddp_comm_hooks.py

    torchrun --standalone --nproc-per-node 2 ddp_comm_hooks.py --comm-hook bf16        # half the bytes
    torchrun --standalone --nproc-per-node 2 ddp_comm_hooks.py --comm-hook powersgd    # 15 KiB a step, not 2.6 MB
    torchrun --standalone --nproc-per-node 2 ddp_comm_hooks.py --comm-hook localsgd:16 # average every 16 steps

What each costs in accuracy, and what it saves on a shaped link: docs/scaling.md. PowerSGD and post-local SGD keep
state (residuals, step counts) that --snapshot saves with the weights.
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, default_convert

from common.checkpoint import load_snapshot, prepare_output, save_snapshot, save_weights
from common.cli import parse_config, run_main
from common.comm_hooks import COMM_HOOK, ONE_BUCKET_MB, register_comm_hook
from common.data import load_fashion_mnist
from common.engine import MetricsLog, evaluate, train_one_epoch
from common.model import NeuralNetwork
from common.ranks import (DistContext, check_flags_and_set_threads, check_torchrun_worker, destroy_process_group,
                          local_rank_0_first, print0, rank_device)


@record  # Under torchrun, this worker's error and traceback go into torchrun's failure summary.
def main():
    cfg = parse_config(description=__doc__, comm_hook=COMM_HOOK)
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
    # Step 5, wrap: DDP copies rank 0's weights to every rank, then averages the gradients in each backward().
    # With PowerSGD, one bucket from the first step: its residuals are kept per bucket (common/comm_hooks.py).
    model = DDP(model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
                bucket_cap_mb=ONE_BUCKET_MB if cfg.comm_hook.startswith("powersgd") else None)
    if cfg.compile:  # In place, after any wrap, so state_dict() keeps its keys (docs/training_options.md).
        model.compile()
    print0(ctx, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    # The lesson: torch's hook decides what each bucket's all-reduce sends (--comm-hook). It is registered after the
    # optimizer exists, because post-local SGD steps it between averages.
    hook_state = register_comm_hook(model, cfg, optimizer, train_loader)  # Its state, or None, goes into snapshots.
    # --precision fp16: scale the loss up so float16's small gradients do not round to zero.
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.precision == "fp16")

    first_epoch = load_snapshot(model, optimizer, scaler, cfg, ctx, hook_state)  # with the hook's state
    metrics = MetricsLog(output, ctx, first_epoch)
    # Step 6, epochs: each draws its own shuffle from seed + epoch.
    for epoch in range(first_epoch, cfg.epochs):
        print0(ctx, f"Epoch {epoch + 1}\n-------------------------------")
        train_sampler.set_epoch(epoch)  # without it, every epoch would repeat epoch 0's order
        train_one_epoch(model, train_loader, optimizer, scaler, epoch, cfg, ctx, metrics, no_sync=model.no_sync)
        evaluate(model, test_loader, epoch, ctx, metrics)
        if save_snapshot(model, optimizer, scaler, epoch + 1, cfg, ctx, hook_state):  # With the hook's state.
            return  # SLURM warned of its time limit (docs/slurm.md): the snapshot holds the run.
    print0(ctx, "Done!")

    # Step 7, save: the plain model's weights, once, without DDP's `module.` prefix, so every chapter loads them.
    if ctx.is_main:
        save_weights(model.module, output / "model.pth")
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")


if __name__ == "__main__":
    run_main(main)
