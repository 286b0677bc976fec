"""Chapter 5: DDP with every process started by hand and an explicit rendezvous (tcp:// or file://).

    # two machines, one process each; rank 0 listens, HOST is its address as the others see it
    python ddp_tcp_manual.py --init-method tcp://10.0.0.1:29500 --rank 0 --world-size 2   # on 10.0.0.1
    python ddp_tcp_manual.py --init-method tcp://10.0.0.1:29500 --rank 1 --world-size 2   # on the other one
    # two processes on one machine: each GPU its own --local-rank
    python ddp_tcp_manual.py --init-method tcp://127.0.0.1:29500 --rank 0 --world-size 2 --local-rank 0 &
    python ddp_tcp_manual.py --init-method tcp://127.0.0.1:29500 --rank 1 --world-size 2 --local-rank 1
    # a file on a filesystem every machine mounts, instead of a port (it must not exist yet)
    python ddp_tcp_manual.py --init-method file:///shared/rdzv-job1 --rank 0 --world-size 2   # and rank 1

Nothing starts the other ranks for you: each waits up to --timeout seconds for the rest, then gives up.
"""
import argparse
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, default_convert

from common.checkpoint import load_snapshot, prepare_output, save_snapshot, save_weights
from common.cli import NON_NEGATIVE, POSITIVE, REQUIRED, FatalError, UsageError, flag, parse_config, run_main
from common.data import load_fashion_mnist
from common.engine import MetricsLog, evaluate, train_one_epoch
from common.model import NeuralNetwork
from common.ranks import (DistContext, check_flags_and_set_threads, check_global_batch, destroy_process_group,
                          local_rank_0_first, name_rank_in_errors, print0, rank_device)


def main():
    cfg = parse_config(description=__doc__,
                       init_method=flag(REQUIRED, rendezvous_url, "tcp://HOST:PORT (rank 0's address) or file:///path"),
                       rank=flag(REQUIRED, NON_NEGATIVE, "this process's global rank, 0 .. world size - 1"),
                       world_size=flag(REQUIRED, POSITIVE, "total number of processes over all machines"),
                       local_rank=flag(None, NON_NEGATIVE, "this process's index on its machine; picks cuda:N (default 0)"))
    # Step 1, who am I: nobody starts these processes for us, so the flags say who is who.
    rank, world_size = cfg.rank, cfg.world_size
    if rank >= world_size:
        raise UsageError(f"--rank {rank} must be below --world-size {world_size} (ranks count from 0)")
    local_rank = cfg.local_rank or 0  # ranks that share a machine each need their own: it picks the GPU
    name_rank_in_errors(rank, world_size)
    check_global_batch(cfg.batch_size, world_size, cfg.accum_steps)
    # Step 2, device: this process's GPU, or the CPU (--device cpu, or no GPU visible).
    device = rank_device(cfg.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Pin this process's GPU before anything else touches one.
    ctx = DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    # Step 3, init: rank 0 opens a store on tcp://'s port (or the ranks meet in the file://); each publishes its
    # address there and waits up to --timeout for the rest (no rank 0: one line).
    check_file_rendezvous(cfg.init_method, cfg.timeout)  # a file:// left over by a crashed run: one line
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=cfg.init_method, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=cfg.timeout),
                            device_id=device if device.type == "cuda" else None)  # NCCL then connects here.
    try:
        train(cfg, ctx)  # steps 4 to 7, below
    finally:  # Step 8, teardown: it runs after an error too. The other ranks stop (gloo at once, NCCL at --timeout).
        destroy_process_group()  # dist.destroy_process_group(); after an error, common/ranks.py prints it first.
        if cfg.init_method.startswith("file://"):  # the next run needs a fresh file (torch 2.14 leaves it after DDP)
            Path(cfg.init_method.removeprefix("file://")).unlink(missing_ok=True)


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


# ---- The rendezvous flag, checked before init_process_group waits on it ----

def rendezvous_url(text):
    """--init-method's type: tcp://HOST:PORT with a port in 1..65535, or file:// with an absolute path."""
    url = urlparse(text)
    try:
        if url.scheme == "file" and url.path.startswith("/") and not url.netloc or url.scheme == "tcp" and url.hostname \
                and 0 < (url.port or 0) < 65536:
            return text
    except ValueError:  # a port that is not a number
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: use tcp://HOST:PORT (rank 0's address) or file:///shared/path")


def check_file_rendezvous(init_method, timeout):
    """file://: its folder must exist; a file older than --timeout is a crashed run's (the ranks would meet there)."""
    path = Path(urlparse(init_method).path)
    if not init_method.startswith("file://"):
        return
    if not path.parent.is_dir():
        raise FatalError(f"rendezvous folder {path.parent} does not exist; create it on a filesystem every machine "
                         f"shares")
    if path.exists() and time.time() - path.stat().st_mtime > timeout:
        raise FatalError(f"rendezvous file {path} is left over from an earlier run "
                         f"({time.time() - path.stat().st_mtime:.0f}s old); delete it or pass a new file:// name")


if __name__ == "__main__":
    run_main(main)
