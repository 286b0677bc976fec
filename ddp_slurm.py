"""Chapter 6: DDP on a SLURM cluster: srun starts one task per GPU on every node, SLURM tells each who it is.

    sbatch scripts/job.sh                       # 2 nodes x 4 GPUs, as its #SBATCH lines say
    sbatch scripts/job.sh --epochs 1            # flags after the script go to ddp_slurm.py
    sbatch --nodes 1 --ntasks-per-node 2 --gpus-per-node 0 --cpus-per-task 1 scripts/job.sh   # a CPU-only cluster
    srun --nodes 1 --ntasks-per-node 2 python ddp_slurm.py   # interactively, inside or as an allocation
    sbatch scripts/job.sh --snapshot runs/ddp_slurm/snap.pt   # longer than the time limit: requeued, resumes

SLURM_PROCID is the global rank, SLURM_NTASKS the world size, SLURM_LOCALID the local rank (it picks the GPU).
The master is the first host of SLURM_JOB_NODELIST, on a port derived from SLURM_JOB_ID (MASTER_ADDR and
MASTER_PORT override them), so every task computes the same tcp:// address without talking to the others.
SIGUSR1 (job.sh asks SLURM for it before the time limit) makes every rank stop after the epoch, at a snapshot.
"""
import os
import signal
import threading
from datetime import timedelta

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
from common.ranks import (DistContext, all_reduce_sum, check_global_batch, check_rendezvous, meet_the_group, print0,
                          rank_device)
from common.slurm import check_srun_task, slurm_master


# Set by SIGUSR1, which SLURM sends ahead of the time limit (scripts/job.sh): stop after this epoch, come back later.
stop_requested = threading.Event()


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
        # Every rank adds its flag, so all of them stop after the same epoch (or none does), and only after an epoch
        # the snapshot holds: the requeued job resumes from it. Without --snapshot there is nothing to resume: go on.
        (warned,) = all_reduce_sum([stop_requested.is_set()], ctx)
        if warned and cfg.snapshot and (epoch + 1) % cfg.save_every == 0 and epoch + 1 < cfg.epochs:
            print0(ctx, f"Stopping after epoch {epoch + 1} of {cfg.epochs} (SIGUSR1: the time limit is near); "
                        f"{cfg.snapshot} holds it")
            return
    print0(ctx, "Done!")

    if ctx.is_main:  # one copy: rank 0 saves model.module, the plain model inside DDP (no `module.` prefix)
        save_weights(model.module, output / "model.pth")
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")


def main():
    cfg = parse_config(description=__doc__)
    check_srun_task()  # one clear line when this is not a task that srun started
    rank = int(os.environ["SLURM_PROCID"])  # global: 0 .. world_size - 1 over all nodes; rank 0 prints and saves
    local_rank = int(os.environ["SLURM_LOCALID"])  # this task's index on its node: it picks the GPU
    world_size = int(os.environ["SLURM_NTASKS"])  # tasks over all nodes
    check_global_batch(cfg.batch_size, world_size, cfg.accum_steps)
    device = rank_device(cfg.device, local_rank)  # cuda:<local_rank>, or the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init_process_group: NCCL binds this process to its own GPU
    signal.signal(signal.SIGUSR1, lambda signum, frame: stop_requested.set())  # before the first epoch
    ctx = DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    # Every task computes the same address by itself: the job's first node, on a port from the job id.
    master_addr, master_port = slurm_master()
    init_method = f"tcp://{master_addr}:{master_port}"
    check_rendezvous(init_method, rank, cfg.timeout)  # no rank 0 after --timeout: one line
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=cfg.timeout),
                            device_id=device if device.type == "cuda" else None)  # NCCL connects here, not later
    try:
        train(cfg, ctx)
    finally:
        dist.destroy_process_group()  # leave, after an error too: the others stop at once (gloo) or at --timeout (NCCL)


if __name__ == "__main__":
    run_main(main)
