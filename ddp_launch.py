"""Chapter 3: DDP started by torchrun, which runs one copy of this script per GPU and tells each who it is.

    torchrun --standalone --nproc-per-node 2 ddp_launch.py                 # one machine, 2 processes
    torchrun --standalone --nproc-per-node gpu ddp_launch.py               # one process per visible GPU
    # two machines, 4 GPUs each; run on both, with --node-rank 0 on the master (10.0.0.1):
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 ddp_launch.py
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 ddp_launch.py
    # or let the nodes find each other through a c10d rendezvous (same command on every node):
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 --rdzv-id job1 ddp_launch.py
    # elastic: if a worker dies, torchrun restarts the whole group (up to 3 times); --snapshot lets it resume
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 --max-restarts 3 ddp_launch.py --snapshot runs/snap-ddp.pt

torchrun sets RANK (global), LOCAL_RANK (index on this node, picks the GPU), WORLD_SIZE, MASTER_ADDR and
MASTER_PORT; `init_method="env://"` reads them. No --local_rank argument, no hard-coded addresses.
SIGUSR1 (scripts/job_torchrun.sh asks SLURM for it before the time limit) makes every worker stop after the
epoch, at a --snapshot.
"""
import os
import signal
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common.checkpoint import load_snapshot, prepare_output, save_snapshot, save_weights
from common.config import parse_config
from common.data import ShardSampler, load_fashion_mnist, locate_fashion_mnist, make_loader
from common.engine import evaluate, train_one_epoch
from common.errors import UsageError, run_main
from common.metrics import MetricsLog
from common.model import NeuralNetwork
from common.ranks import DistContext, all_reduce_sum, check_global_batch, meet_the_group, print0, rank_device


# Set by SIGUSR1, which SLURM sends ahead of the time limit (scripts/job_torchrun.sh): stop after this epoch.
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


@record  # under torchrun: this worker's error and traceback go into torchrun's failure summary
def main():
    cfg = parse_config(description=__doc__)
    if not {"RANK", "LOCAL_RANK", "WORLD_SIZE"} <= os.environ.keys():
        raise UsageError("RANK/LOCAL_RANK/WORLD_SIZE are not set: start this script with torchrun, e.g. "
                         "`torchrun --standalone --nproc-per-node 2 ddp_launch.py`")
    # torchrun --max-restarts starts a new group after a failure. Sharing torchrun's own key-value store (its
    # default) the new workers would meet among the dead ones' keys and could dial their addresses (on torch 2.14
    # the store keeps every attempt's keys), and on several nodes they need not agree which attempt they are in.
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes rank 0 open a fresh store for every attempt instead.
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise UsageError("torchrun --max-restarts needs a fresh store per restart: run it as "
                         "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ...` with a c10d rendezvous (--standalone, "
                         "or --rdzv-backend c10d --rdzv-endpoint HOST:PORT), not --master-addr/--node-rank")
    rank = int(os.environ["RANK"])  # global: 0 .. world_size - 1 over all machines; rank 0 prints and saves
    local_rank = int(os.environ["LOCAL_RANK"])  # this process's index on its machine: it picks the GPU
    world_size = int(os.environ["WORLD_SIZE"])  # processes over all machines
    check_global_batch(cfg.batch_size, world_size, cfg.accum_steps)
    device = rank_device(cfg.device, local_rank, int(os.environ["LOCAL_WORLD_SIZE"]))  # cuda:<local_rank>, or the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init_process_group: NCCL binds this process to its own GPU
    signal.signal(signal.SIGUSR1, lambda signum, frame: stop_requested.set())  # before the first epoch
    ctx = DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    # env:// reads MASTER_ADDR and MASTER_PORT, which torchrun also set. A peer that does not come within --timeout
    # (here, and in every collective later) is an error, never a hang.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=cfg.timeout),
                            device_id=device if device.type == "cuda" else None)  # NCCL connects here, not later
    try:
        train(cfg, ctx)
    finally:
        dist.destroy_process_group()  # leave, after an error too: the others stop at once (gloo) or at --timeout (NCCL)


if __name__ == "__main__":
    run_main(main)
