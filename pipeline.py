"""Chapter 10: pipeline parallel: each rank holds some of the layers; micro-batches flow through them in turn.

    torchrun --standalone --nproc-per-node 2 pipeline.py                    # 2 stages, GPipe, 4 micro-batches
    torchrun --standalone --nproc-per-node 3 pipeline.py --schedule 1f1b    # 3 stages, one forward one backward

Started like chapter 3; torch.distributed.pipelining cuts nothing itself here: the chapter cuts the model by hand
(a stage per Linear layer, at most 3), and snapshots are chapter 7's sharded ones (--snapshot DIR). docs/pipeline.md.
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.data import DataLoader, DistributedSampler

from common.checkpoint import StopAtTimeLimit, atomic_save, prepare_output
from common.config import check_pipeline_flags, parse_config
from common.data import ShardSampler, load_fashion_mnist, locate_fashion_mnist
from common.engine import PipelineLoss, evaluate_pipeline, train_pipeline_epoch
from common.errors import name_rank_in_errors, run_main
from common.metrics import MetricsLog
from common.model import NeuralNetwork, describe_stages
from common.ranks import (DistContext, check_torchrun_worker, gather_stage_weights, meet_the_group, print0,
                          print_parameter_bytes, rank_device)
from fsdp import load_sharded_snapshot, save_sharded_snapshot  # chapter 7's DCP snapshots: each stage its layers

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# Where the stages start in [flatten, Linear, ReLU, Linear, ReLU, Linear]: one Linear or more each, cut after a ReLU.
# 2 stages: 784x512 | 512x512 and 512x10 (402k and 268k weights); 3 stages: one Linear each.
CUTS = {1: (0, 6), 2: (0, 3, 6), 3: (0, 3, 5, 6)}


@record  # under torchrun: this worker's error and traceback go into torchrun's failure summary
def main():
    cfg = parse_config(description=__doc__, chapter_flags=("schedule", "microbatches"))
    check_pipeline_flags(cfg, stages_at_most=len(CUTS))  # 1-3 stages; micro-batches that split the batch; no fp16
    check_torchrun_worker("pipeline.py")  # started by torchrun; --max-restarts with a fresh store each time
    # Step 1, who am I: torchrun sets RANK (global; rank 0 prints and saves), LOCAL_RANK (picks the GPU), WORLD_SIZE.
    # Here the rank is also the stage: rank 0 holds the first layers and reads the images, the last rank the loss.
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    name_rank_in_errors(rank, world_size)
    # Step 2, device: this process's GPU, or the CPU (--device cpu, or no GPU visible).
    device = rank_device(cfg.device, local_rank, int(os.environ["LOCAL_WORLD_SIZE"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this process's GPU, before anything else touches one
    ctx = DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    # Step 3, init: env:// reads MASTER_ADDR/MASTER_PORT (torchrun's); a peer missing for --timeout is an error.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=cfg.timeout),
                            device_id=device if device.type == "cuda" else None)  # NCCL connects here, not later
    try:
        train(cfg, ctx)  # steps 4 to 7, below
    finally:  # Step 8, teardown: after an error too; a stage waiting on this one stops at once (gloo) or at --timeout
        dist.destroy_process_group()


def train(cfg, ctx):
    print0(ctx, cfg.describe())
    print0(ctx, f"Using {ctx.device} device, {ctx.world_size} processes, backend {dist.get_backend()}")
    torch.set_num_threads(meet_the_group(cfg, ctx))  # each rank's line (one if they disagree on flags); its cores
    output = prepare_output(cfg.output)
    time_limit = StopAtTimeLimit()  # SLURM's SIGUSR1 before the time limit: stop after the epoch, at a snapshot

    # Step 4, data: every stage walks chapter 1's shuffle, the whole global batch (1 replica): the first stage feeds
    # its images into the pipeline, the last its labels into the loss; the stages between use neither. The test set
    # goes through in batches of the same size (a pipeline's micro-batches have one shape), each image once.
    if ctx.local_rank == 0:  # one process per machine finds the data, downloading it if it must ...
        locate_fashion_mnist(cfg.data_dir)
    dist.barrier()  # ... while the others wait here
    train_set, test_set, folder = load_fashion_mnist(cfg, ctx.device)
    print0(ctx, f"Data: {folder} ({len(train_set)} train / {len(test_set)} test images)")
    train_sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=cfg.seed)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=cfg.batch_size, sampler=ShardSampler(test_set))

    torch.manual_seed(cfg.seed)  # the same initial weights in every chapter
    model = NeuralNetwork().to(ctx.device)
    # Step 5, wrap: this rank keeps its stage's layers and puts Identity in place of the others, so its weights keep
    # chapter 1's names (linear_relu_stack.2.weight ...). PipelineStage sends this stage's outputs to the next rank and
    # receives their gradients back; the schedule cuts each global batch into --microbatches and orders the work:
    # GPipe runs every micro-batch's forward, then every backward; 1F1B starts the backwards as soon as the last
    # stage has a loss, so fewer micro-batches' activations wait in memory. The stages then wait less at the ends
    # of a step (the "bubble") the more micro-batches there are: docs/pipeline.md.
    layers = [model.flatten, *model.linear_relu_stack]
    print0(ctx, f"Stages: {describe_stages(layers, CUTS[ctx.world_size])}")
    first, end = CUTS[ctx.world_size][ctx.rank], CUTS[ctx.world_size][ctx.rank + 1]
    for i in [*range(first), *range(end, len(layers))]:
        if i > 0:  # Flatten stays: on a later stage's (batch, 512) input it changes nothing
            model.linear_relu_stack[i - 1] = nn.Identity()
    stage = PipelineStage(model, ctx.rank, ctx.world_size, ctx.device)
    loss_fn = PipelineLoss()  # the last stage's: each micro-batch's share of the step's mean loss (common/engine.py)
    schedule = SCHEDULES[cfg.schedule](stage, n_microbatches=cfg.microbatches, loss_fn=loss_fn, scale_grads=False)
    print0(ctx, f"Pipeline: {ctx.world_size} stage(s), {cfg.microbatches} micro-batches of "
                f"{cfg.batch_size // cfg.microbatches} images per step, schedule {cfg.schedule}")
    print_parameter_bytes(model, ctx)  # the whole model's, and each stage's layers
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)  # this stage's weights

    first_epoch = load_sharded_snapshot(model, optimizer, cfg, ctx)  # 0, or the epochs a --snapshot folder holds
    metrics = MetricsLog(output, ctx, first_epoch)
    # Step 6, epochs: each draws its own shuffle from seed + epoch.
    for epoch in range(first_epoch, cfg.epochs):
        print0(ctx, f"Epoch {epoch + 1}\n-------------------------------")
        train_sampler.set_epoch(epoch)  # without it, every epoch would repeat epoch 0's order
        # The pipeline acts inside: one schedule.step() per global batch runs all micro-batches through all stages
        train_pipeline_epoch(schedule, stage, loss_fn, train_loader, optimizer, epoch, cfg, ctx, metrics)
        evaluate_pipeline(schedule, stage, test_loader, cfg.batch_size, epoch, ctx, metrics)
        save_sharded_snapshot(model, optimizer, epoch + 1, cfg, ctx)  # with --snapshot: every --save-every epochs
        if time_limit.reached(epoch + 1, cfg, ctx):
            return
    print0(ctx, "Done!")

    # Step 7, save: the plain model's weights, once, under chapter 1's names: each stage sends rank 0 its layers.
    full = gather_stage_weights(model, ctx)  # rank 0: every stage's weights together; the others: None
    if ctx.is_main:
        atomic_save(full, output / "model.pth")
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")


if __name__ == "__main__":
    run_main(main)
