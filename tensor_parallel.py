"""Chapter 9: tensor parallel: the ranks split each big layer's weights and compute one product together.

    torchrun --standalone --nproc-per-node 2 tensor_parallel.py            # 2 ranks split every layer (tp = 2)
    torchrun --standalone --nproc-per-node 4 tensor_parallel.py --dp 2     # 2-D: 2 data-parallel groups x tp = 2

Started like chapter 3 (`diff fsdp.py tensor_parallel.py` is the lesson); the 2-D mesh shards the dp dimension with
chapter 7's FSDP2, and snapshots are chapter 7's sharded ones (--snapshot DIR). The why: docs/tensor_parallel.md.
"""
import math
import os
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler, Subset, default_convert

from common.checkpoint import StopAtTimeLimit, atomic_save, prepare_output
from common.cli import POSITIVE, UsageError, check_fsdp2, flag, parse_config, run_main
from common.data import load_fashion_mnist
from common.engine import MetricsLog, evaluate, train_one_epoch
from common.model import NeuralNetwork
from common.ranks import (DistContext, check_flags_and_set_threads, check_global_batch, check_torchrun_worker,
                          destroy_process_group, local_rank_0_first, print0, print_parameter_bytes, rank_device)
from fsdp import load_sharded_snapshot, save_sharded_snapshot  # chapter 7's DCP snapshots: they take DTensors too


@record  # Under torchrun, this worker's error and traceback go into torchrun's failure summary.
def main():
    cfg = parse_config(description=__doc__, dp=flag(1, POSITIVE, "data-parallel groups; each group's ranks split every "
                                                              "layer"))
    check_tensor_parallel_flags(cfg)  # below: dp x tp ranks, tp divides 512; no fp16; FSDP2 runs here for --dp
    check_torchrun_worker()  # One line, not a traceback, if torchrun did not start this process.
    # Step 1, who am I: torchrun sets RANK (global: rank 0 prints and saves), LOCAL_RANK (it picks the GPU), WORLD_SIZE.
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    check_global_batch(cfg.batch_size, cfg.dp, cfg.accum_steps)  # the batch is split over the dp groups only
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

    # The mesh: the ranks as a grid of dp rows by tp columns. Rank r sits in row r // tp: the tp ranks of a row are
    # neighbours (one machine, its fast links), because they talk in every layer; the rows talk once per step. Its
    # groups are made here so that they too wait --timeout at most (init_device_mesh's own would wait torch's
    # default, 30 minutes on gloo, for a rank that stopped: measured in the tests).
    tp = ctx.world_size // cfg.dp
    grid = torch.arange(ctx.world_size).reshape(cfg.dp, tp)
    wait = timedelta(seconds=cfg.timeout)
    dp_group, _ = dist.new_subgroups_by_enumeration(grid.T.tolist(), timeout=wait)  # a column: one rank of each row
    tp_group, _ = dist.new_subgroups_by_enumeration(grid.tolist(), timeout=wait)  # a row: the ranks splitting layers
    mesh = DeviceMesh.from_group([dp_group, tp_group], ctx.device.type, mesh=grid, mesh_dim_names=("dp", "tp"))
    print0(ctx, f"Mesh: {cfg.dp} data-parallel group(s) (dp) x {tp} ranks splitting each layer (tp); rank 0 splits "
                f"its layers with ranks {mesh['tp'].mesh.tolist()}")
    dp_rank = mesh.get_local_rank("dp")
    # The losses and test counts are summed over one rank per batch (a row's tp ranks compute the same numbers).
    ctx = replace(ctx, data_group=mesh.get_group("dp"))

    # Step 4, data: the tp ranks of a row work on the same batch, so chapter 1's shuffle is split over the rows only:
    # row d takes every dp-th image (with --dp 1 every rank takes the whole global batch).
    with local_rank_0_first(ctx):  # One process per machine finds the data (downloading it if it must), then the rest.
        train_set, test_set, folder = load_fashion_mnist(cfg, ctx.device)
    print0(ctx, f"Data: {folder} ({len(train_set)} train / {len(test_set)} test images)")
    train_sampler = DistributedSampler(train_set, num_replicas=cfg.dp, rank=dp_rank, seed=cfg.seed)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size // (cfg.dp * cfg.accum_steps),
                              sampler=train_sampler, collate_fn=default_convert)
    # Every forward() is collective (tp: an all-reduce per layer pair; dp: FSDP2's gathers), so every rank runs as many
    # test batches: sized from the largest shard (row 0's), they come out the same number in every row.
    largest = math.ceil(len(test_set) / cfg.dp)
    test_loader = DataLoader(Subset(test_set, range(dp_rank, len(test_set), cfg.dp)),
                             batch_size=math.ceil(largest / math.ceil(largest / 1000)), collate_fn=default_convert)

    torch.manual_seed(cfg.seed)  # the same initial weights in every chapter
    model = NeuralNetwork().to(ctx.device)
    # Step 5, wrap: Megatron's cut of a two-layer block. The first Linear is split by its outputs (ColwiseParallel:
    # rank t computes hidden units t*512/tp .. (t+1)*512/tp), the ReLU acts on each rank's slice alone, the second
    # Linear is split by its inputs (RowwiseParallel: each rank multiplies its slice of the hidden vector by its
    # columns of the weight) and one all-reduce per forward adds the tp partial sums. Backward needs none: the
    # input images take no gradient. The last Linear (10 x 512, 0.8% of the weights) stays whole on every rank:
    # split, its 10 outputs would need an all-gather per forward to save 20 KB per rank. It becomes a DTensor all the
    # same, replicated over the tp ranks: on a GPU the optimizer steps all weights in one foreach call, which cannot
    # take DTensors and plain tensors together ("got mixed torch.Tensor and DTensor").
    parallelize_module(model.linear_relu_stack, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    distribute_module(model.linear_relu_stack[4], mesh["tp"],
                      input_fn=lambda _, inputs, tp_mesh: DTensor.from_local(inputs[0], tp_mesh, [Replicate()]),
                      output_fn=lambda _, logits, tp_mesh: logits.to_local())
    if cfg.dp > 1:  # 2-D: chapter 7's FSDP2 cuts each rank's slices again, over the dp rows, and averages the rows
        hide_2d_notices()  # two notices torch prints on every rank of a 2-D run; why they ask nothing: below
        bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.precision == "bf16" else {}
        for layer in model.linear_relu_stack:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["dp"], mp_policy=MixedPrecisionPolicy(**bf16))
        root = MixedPrecisionPolicy(**bf16, output_dtype=torch.float32 if bf16 else None)  # float32 out of it alone
        fully_shard(model, mesh=mesh["dp"], mp_policy=root)
    if cfg.compile:  # In place, after any wrap, so state_dict() keeps its keys (docs/training_options.md).
        model.compile()
    print0(ctx, model)
    for name, weight in model.named_parameters():  # what the plan made of each weight: its placement on each mesh dim
        print0(ctx, f"  {name}: {list(weight.shape)} {weight.placements} on {weight.device_mesh.mesh_dim_names}, "
                    f"rank 0 holds {list(weight.to_local().shape)}")
    print_parameter_bytes(model, ctx)  # the whole model's, and each rank's slices
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    scaler = None  # no fp16 here (check_tensor_parallel_flags, below)

    first_epoch = load_sharded_snapshot(model, optimizer, cfg, ctx)  # 0, or the epochs a --snapshot folder holds
    metrics = MetricsLog(output, ctx, first_epoch)
    # Step 6, epochs: each draws its own shuffle from seed + epoch.
    for epoch in range(first_epoch, cfg.epochs):
        print0(ctx, f"Epoch {epoch + 1}\n-------------------------------")
        train_sampler.set_epoch(epoch)  # without it, every epoch would repeat epoch 0's order
        # Tensor parallel acts inside every forward() (the all-reduce); with --dp, FSDP2 gathers and reduce-scatters
        # (but for --accum-steps' micro-batches, held back as in chapter 7)
        train_one_epoch(model, train_loader, optimizer, scaler, epoch, cfg, ctx, metrics,
                        gradient_sync=model.set_requires_gradient_sync if cfg.dp > 1 else None)
        evaluate(model, test_loader, epoch, ctx, metrics)
        save_sharded_snapshot(model, optimizer, epoch + 1, cfg, ctx)  # Every --save-every epochs, if --snapshot is set.
        if time_limit.any_rank_warned(epoch + 1, cfg, ctx):
            return
    print0(ctx, "Done!")

    # Step 7, save: the plain model's weights, once (chapter 1's names and shapes: they load in every chapter). Every
    # rank sends its slices, and rank 0 gets the full state_dict on the CPU (the others get {}).
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.is_main:
        atomic_save(full, output / "model.pth")
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")



HIDDEN = 512  # the model's hidden width: tensor parallelism cuts it into equal slices


def check_tensor_parallel_flags(cfg):
    """This chapter's refusals, each one line and exit 2 before any rendezvous: a world size that is not dp x tp, tp
    not dividing the 512 hidden units, then what sharded weights refuse (fp16; FSDP2's own needs at --dp 2+)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size % cfg.dp:
        raise UsageError(f"--dp {cfg.dp} does not divide the {world_size} ranks into equal tensor-parallel groups; "
                         f"use a --dp that divides {world_size}")
    tp = world_size // cfg.dp
    if HIDDEN % tp:
        raise UsageError(f"{tp} ranks per tensor-parallel group (world size {world_size} / --dp {cfg.dp}) do not "
                         f"split the {HIDDEN} hidden units evenly; use 1, 2, 4, 8 ... ranks per group")
    check_fsdp2(cfg, "tensor_parallel.py", cfg.dp, uses_fsdp2=cfg.dp > 1)


def hide_2d_notices():
    """Two notices torch 2.14 prints on every rank of a 2-D (FSDP2 x tensor parallel) run, hidden: neither asks
    anything of this model.

    FSDP2 warns that a tp Linear "returned a view tensor", which an in-place op (x += y) would break: no op after
    these Linears is in place (ReLU(inplace=False)). The save's full state_dict gathers each 2-D weight in two
    all-gathers, which DTensor calls "suboptimal": once per run, a latency of milliseconds.
    """
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


if __name__ == "__main__":
    run_main(main)
