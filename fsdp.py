"""Chapter 7: the same model sharded with FSDP2 (`fully_shard`): each rank holds a slice of every weight.

    torchrun --standalone --nproc-per-node 2 fsdp.py      # one machine, 2 processes (GPUs, or the CPU)
    torchrun --standalone --nproc-per-node gpu fsdp.py    # one process per visible GPU

Started like chapter 3 (`diff ddp_launch.py fsdp.py` is the lesson); sharded snapshots (--snapshot DIR): docs/fsdp.md.
"""
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler, Subset, default_convert

from common.checkpoint import (StopAtTimeLimit, atomic_save, find_sharded_snapshot, finish_sharded_snapshot,
                               flat_optimizer_options, prepare_output, print_resumed, sharded_snapshot_due,
                               sharded_snapshot_errors)
from common.cli import check_fsdp2, parse_config, run_main
from common.data import load_fashion_mnist
from common.engine import MetricsLog, evaluate, train_one_epoch
from common.model import NeuralNetwork
from common.ranks import (DistContext, check_flags_and_set_threads, check_torchrun_worker, destroy_process_group,
                          local_rank_0_first, print0, print_parameter_bytes, rank_device)


@record  # Under torchrun, this worker's error and traceback go into torchrun's failure summary.
def main():
    cfg = parse_config(description=__doc__)
    check_fsdp2(cfg, "fsdp.py", int(os.environ.get("WORLD_SIZE", 1)))  # no fp16; a test image per rank; FSDP2 here
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
    time_limit = StopAtTimeLimit()  # SLURM's SIGUSR1 warns of the time limit; the run then stops at a snapshot.

    # Step 4, data: chapter 1's shuffle dealt to the ranks in turn; each rank tests its own part of the test set.
    with local_rank_0_first(ctx):  # One process per machine finds the data (downloading it if it must), then the rest.
        train_set, test_set, folder = load_fashion_mnist(cfg, ctx.device)
    print0(ctx, f"Data: {folder} ({len(train_set)} train / {len(test_set)} test images)")
    train_sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, seed=cfg.seed)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size // (ctx.world_size * cfg.accum_steps),
                              sampler=train_sampler, collate_fn=default_convert)
    # Every forward() all-gathers (a collective): test batches sized from the largest shard, as many on every rank.
    largest = math.ceil(len(test_set) / ctx.world_size)
    test_loader = DataLoader(Subset(test_set, range(ctx.rank, len(test_set), ctx.world_size)),
                             batch_size=math.ceil(largest / math.ceil(largest / 1000)), collate_fn=default_convert)

    torch.manual_seed(cfg.seed)  # the same initial weights in every chapter
    model = NeuralNetwork().to(ctx.device)
    # Step 5, wrap: each Linear a unit whose weights are cut into world_size slices (DTensors), gathered whole just
    # before its forward() and freed after; its backward() reduce-scatters the gradient. The root unit comes last.
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))  # the ranks to shard over: all of them
    # --precision bf16: gather and compute in bf16, average gradients in fp32, the model's output float32 (docs/fsdp.md)
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.precision == "bf16" else {}
    for layer in model.linear_relu_stack:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(**bf16))
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(**bf16, output_dtype=torch.float32 if bf16 else None))
    if cfg.compile:  # In place, after any wrap, so state_dict() keeps its keys (docs/training_options.md).
        model.compile()
    print0(ctx, model)
    print_parameter_bytes(model, ctx)  # the whole model's, and each rank's slices
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    scaler = None  # no fp16 here (refused above)

    first_epoch = load_sharded_snapshot(model, optimizer, cfg, ctx)  # 0, or the epochs a --snapshot folder holds
    metrics = MetricsLog(output, ctx, first_epoch)
    # Step 6, epochs: each draws its own shuffle from seed + epoch.
    for epoch in range(first_epoch, cfg.epochs):
        print0(ctx, f"Epoch {epoch + 1}\n-------------------------------")
        train_sampler.set_epoch(epoch)  # without it, every epoch would repeat epoch 0's order
        # FSDP2 acts inside: forward() gathers; backward() reduce-scatters, but for --accum-steps' micro-batches
        train_one_epoch(model, train_loader, optimizer, scaler, epoch, cfg, ctx, metrics,
                        gradient_sync=model.set_requires_gradient_sync)
        evaluate(model, test_loader, epoch, ctx, metrics)
        save_sharded_snapshot(model, optimizer, epoch + 1, cfg, ctx)  # Every --save-every epochs, if --snapshot is set.
        if time_limit.any_rank_warned(epoch + 1, cfg, ctx):
            return
    print0(ctx, "Done!")

    # Step 7, save: the plain model's weights, once, without DDP's `module.` prefix, so every chapter loads them.
    # No rank has them whole: every rank sends its slices, and rank 0 gets the full state_dict on the CPU.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.is_main:
        atomic_save(full, output / "model.pth")
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")


def save_sharded_snapshot(model, optimizer, epochs_done, cfg, ctx):
    """With --snapshot DIR, every --save-every epochs and after the last: DIR/epoch-N, every rank writing its slices."""
    folder = sharded_snapshot_due(epochs_done, cfg)
    if folder is None:
        return
    # this rank's slices, under the plain names (the optimizer's flattened: common/checkpoint.py says why)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=flat_optimizer_options())
    with sharded_snapshot_errors(f"cannot write the snapshot {folder}", "free some space or pass another --snapshot"):
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)  # rank 0 adds .metadata
    finish_sharded_snapshot(folder, epochs_done, cfg, ctx)  # rank 0's snapshot.pt makes it count; older ones go


def load_sharded_snapshot(model, optimizer, cfg, ctx):
    """With --snapshot DIR holding a finished epoch-N: load it into model and optimizer at any world size; else 0."""
    found = find_sharded_snapshot(cfg, ctx)  # (folder, epochs done, ranks that saved it), checked against the flags
    if found is None:
        return 0
    folder, epochs_done, saved_by = found
    model_state, optimizer_state = get_state_dict(model, optimizer, options=flat_optimizer_options())  # this size's
    state = {"model": model_state, "optimizer": optimizer_state}
    with sharded_snapshot_errors(f"snapshot {folder} cannot be read"):
        dcp.load(state, checkpoint_id=folder)  # the pieces they need, from every file, however many ranks wrote them
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=flat_optimizer_options())
    print_resumed(ctx, f"{folder} (saved by {saved_by} ranks, loaded by {ctx.world_size})", epochs_done, cfg)
    return epochs_done


if __name__ == "__main__":
    run_main(main)
