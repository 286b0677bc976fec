"""Chapter 10: pipeline parallel: each rank holds some of the layers; micro-batches flow through them in turn.

    torchrun --standalone --nproc-per-node 2 pipeline.py                    # 2 stages, GPipe, 4 micro-batches
    torchrun --standalone --nproc-per-node 3 pipeline.py --schedule 1f1b    # 3 stages, one forward one backward

Started like chapter 3; torch.distributed.pipelining cuts nothing itself here: the chapter cuts the model by hand
(a stage per Linear layer, at most 3), and snapshots are chapter 7's sharded ones (--snapshot DIR). docs/pipeline.md.
A stage steps in its own epoch (train_stage_epoch, below): the first feeds the images, the last the labels.
"""
import contextlib
import inspect
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.data import DataLoader, DistributedSampler, default_convert

from common.checkpoint import StopAtTimeLimit, atomic_save, prepare_output
from common.cli import POSITIVE, UsageError, flag, parse_config, run_main
from common.data import load_fashion_mnist
from common.engine import MetricsLog, autocast, print_epoch_line, print_loss_line, print_test_lines, synchronize
from common.model import NeuralNetwork
from common.ranks import (DistContext, check_flags_and_set_threads, check_torchrun_worker, destroy_process_group,
                          local_rank_0_first, print0, print_parameter_bytes, rank_device)
from fsdp import load_sharded_snapshot, save_sharded_snapshot  # chapter 7's DCP snapshots: each stage its layers

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# Where the stages start in [flatten, Linear, ReLU, Linear, ReLU, Linear]: one Linear or more each, cut after a ReLU.
# 2 stages: 784x512 | 512x512 and 512x10 (402k and 268k weights); 3 stages: one Linear each.
CUTS = {1: (0, 6), 2: (0, 3, 6), 3: (0, 3, 5, 6)}
PADDING = -100  # the label of a padding row: cross_entropy's ignore_index, so it adds nothing to a loss or gradient


@record  # Under torchrun, this worker's error and traceback go into torchrun's failure summary.
def main():
    cfg = parse_config(description=__doc__, schedule=flag("gpipe", tuple(SCHEDULES), "pipeline schedule: all forwards then "
                                                          "all backwards, or one of each in turn"),
                       microbatches=flag(4, POSITIVE, "micro-batches each global batch is cut into"))
    check_pipeline_flags(cfg)  # below: 1-3 stages; micro-batches that split the batch; no fp16
    check_torchrun_worker()  # One line, not a traceback, if torchrun did not start this process.
    # Step 1, who am I: torchrun sets RANK (global: rank 0 prints and saves), LOCAL_RANK (it picks the GPU), WORLD_SIZE.
    # Here the rank is also the stage: rank 0 holds the first layers and reads the images, the last rank the loss.
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
    finally:  # Step 8, teardown: after an error too; a stage waiting on this one stops at once (gloo) or at --timeout
        destroy_process_group()  # dist.destroy_process_group(); after an error, common/ranks.py prints it first.


def train(cfg, ctx):
    print0(ctx, cfg.describe())
    print0(ctx, f"Using {ctx.device} device, {ctx.world_size} processes, backend {dist.get_backend()}")
    check_flags_and_set_threads(cfg, ctx)  # Each rank's line and share of the cores; differing flags stop all.
    output = prepare_output(cfg.output)
    time_limit = StopAtTimeLimit()  # SLURM's SIGUSR1 warns of the time limit; the run then stops at a snapshot.

    # Step 4, data: every stage walks chapter 1's shuffle, the whole global batch (1 replica): the first stage feeds
    # its images into the pipeline, the last its labels into the loss; the stages between use neither. The test set
    # goes through in batches of the same size (a pipeline's micro-batches have one shape), each image once.
    with local_rank_0_first(ctx):  # One process per machine finds the data (downloading it if it must), then the rest.
        train_set, test_set, folder = load_fashion_mnist(cfg, ctx.device)
    print0(ctx, f"Data: {folder} ({len(train_set)} train / {len(test_set)} test images)")
    train_sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=cfg.seed)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=train_sampler, collate_fn=default_convert)
    test_loader = DataLoader(test_set, batch_size=cfg.batch_size, collate_fn=default_convert)

    torch.manual_seed(cfg.seed)  # the same initial weights in every chapter
    model = NeuralNetwork().to(ctx.device)
    # Step 5, wrap: this rank keeps its stage's layers and puts Identity in place of the others, so its weights keep
    # chapter 1's names (linear_relu_stack.2.weight ...). PipelineStage sends this stage's outputs to the next rank and
    # receives their gradients back; the schedule cuts each global batch into --microbatches and orders the work:
    # GPipe runs every micro-batch's forward, then every backward; 1F1B starts the backwards as soon as the last
    # stage has a loss, so fewer micro-batches' activations wait in memory. The stages then wait less at the ends
    # of a step (the "bubble") the more micro-batches there are: docs/pipeline.md.
    layers = [model.flatten, *model.linear_relu_stack]
    print0(ctx, f"Stages: {describe_stages(layers, CUTS[ctx.world_size])}")  # below
    first, end = CUTS[ctx.world_size][ctx.rank], CUTS[ctx.world_size][ctx.rank + 1]
    for i in [*range(first), *range(end, len(layers))]:
        if i > 0:  # Flatten stays: on a later stage's (batch, 512) input it changes nothing
            model.linear_relu_stack[i - 1] = nn.Identity()
    stage = PipelineStage(model, ctx.rank, ctx.world_size, ctx.device)
    loss_fn = PipelineLoss()  # the last stage's: each micro-batch's share of the step's mean loss (below)
    schedule = SCHEDULES[cfg.schedule](stage, n_microbatches=cfg.microbatches, loss_fn=loss_fn, scale_grads=False)
    # The test set's forwards, in float32 whatever --precision, on a stage of their own over the same layers (torch
    # before 2.14 keeps the dtypes a stage's first step inferred: autocast's bf16 would refuse float32 later).
    testing = ScheduleGPipe(PipelineStage(model, ctx.rank, ctx.world_size, ctx.device), cfg.microbatches)
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
        train_stage_epoch(schedule, stage, loss_fn, train_loader, optimizer, epoch, cfg, ctx, metrics,
                          show_timetable=epoch == first_epoch)
        evaluate_stages(testing, stage, test_loader, cfg.batch_size, epoch, ctx, metrics)
        save_sharded_snapshot(model, optimizer, epoch + 1, cfg, ctx)  # Every --save-every epochs, if --snapshot is set.
        if time_limit.any_rank_warned(epoch + 1, cfg, ctx):
            return
    print0(ctx, "Done!")

    # Step 7, save: the plain model's weights, once, under chapter 1's names: each stage sends rank 0 its layers.
    full = gather_stage_weights(model, ctx)  # rank 0: every stage's weights together; the others: None
    if ctx.is_main:
        atomic_save(full, output / "model.pth")
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")



def train_stage_epoch(schedule, stage, loss_fn, loader, optimizer, epoch, cfg, ctx, metrics, show_timetable=False):
    """Chapter 1's epoch for a pipeline stage: one schedule.step() per global batch runs every micro-batch's forward
    and backward through all the stages, in the schedule's order; then this stage's optimizer steps its own layers.

    Every stage walks the same loader (the same shuffle): the first feeds the images in, the last the labels, and
    only the last gets the losses; the others add 0 to the loss lines' all-reduce, which rank 0 prints, as in every
    chapter. show_timetable: rank 0 prints the order each stage worked in, in the first step.
    """
    stage.submod.train()
    size, steps = len(loader.dataset), len(loader)
    loss_sum, seen = torch.zeros((), device=ctx.device), 0
    synchronize(ctx.device)
    start = time.perf_counter()
    for step, (X, y) in enumerate(loader):
        images = len(y) if stage.is_last else 0  # counted once, where the loss is
        loss_fn.images = len(y)  # each micro-batch's summed loss is divided by the step's images
        X, y = padded(X, y, cfg.batch_size)
        losses, order = [], []
        inputs = (X,) if stage.is_first else ()  # the first stage feeds the images in ...
        labels = dict(target=y, losses=losses) if stage.is_last else {}  # ... the last the labels: it gets the losses
        recording = timetable(stage, order) if show_timetable and step == 0 else contextlib.nullcontext()
        with autocast(cfg, ctx.device), recording:
            schedule.step(*inputs, **labels)  # sends activations on (forward) and their gradients back (backward)
        if show_timetable and step == 0:
            print_timetable(order, cfg, ctx)
        optimizer.step()  # this stage's layers
        optimizer.zero_grad()
        step_loss = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=ctx.device)
        loss_sum.add_(step_loss, alpha=images)
        seen += images
        if step % cfg.log_every == 0:
            print_loss_line(step_loss, images, step, epoch, steps, size, cfg, ctx, metrics)
    print_epoch_line(loss_sum, seen, start, epoch, steps, ctx, metrics)


@torch.no_grad()
def evaluate_stages(schedule, stage, loader, batch_size, epoch, ctx, metrics):
    """evaluate() for a pipeline stage: schedule.eval() runs the forward passes only; the last stage gets the logits
    and counts (padding rows left out), the others add 0, so every test image is counted once."""
    stage.submod.eval()
    loss_sum, correct, seen = torch.zeros((), device=ctx.device), torch.zeros((), device=ctx.device).long(), 0
    for X, y in loader:
        X, y = padded(X, y, batch_size)
        inputs = (X,) if stage.is_first else ()
        pred = schedule.eval(*inputs)  # the whole batch's logits on the last stage, None on the others
        if stage.is_last:
            real = y != PADDING
            loss_sum += nn.functional.cross_entropy(pred[real], y[real], reduction="sum")
            correct += (pred[real].argmax(1) == y[real]).sum()
            seen += int(real.sum())
    return print_test_lines(loss_sum, correct, seen, epoch, ctx, metrics)


class PipelineLoss:
    """The last stage's loss for one micro-batch: its cross-entropy summed over its images and divided by the step's
    images, so the micro-batches' losses add up to the mean over the step, as chapter 1's one batch (the schedule is
    told not to divide the gradients by the number of micro-batches: scale_grads=False). Padding rows count nothing.
    """

    images = 1  # the step's real images; set before each step

    def __call__(self, logits, labels):
        return nn.functional.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=PADDING) / self.images


def padded(X, y, batch_size):
    """A short batch padded to batch_size rows (zero images labelled PADDING): a pipeline's stages exchange micro-
    batches of one shape, and torch re-infers the buffers' shapes only when training turns to evaluation and back
    (the last batch of an epoch or of the test set may be short)."""
    missing = batch_size - len(y)
    if missing == 0:
        return X, y
    return torch.cat([X, X.new_zeros(missing, *X.shape[1:])]), torch.cat([y, y.new_full((missing,), PADDING)])


@contextlib.contextmanager
def timetable(stage, order):
    """Within it, this stage's work is appended to order as the schedule runs it: F2 is micro-batch 2's forward, B2
    its backward (PipelineStage.forward_one_chunk and backward_one_chunk, wrapped)."""
    def logged(kind, run):
        return lambda chunk, *args, **kwargs: order.append(f"{kind}{chunk}") or run(chunk, *args, **kwargs)

    stage.forward_one_chunk = logged("F", stage.forward_one_chunk)
    stage.backward_one_chunk = logged("B", stage.backward_one_chunk)
    try:
        yield
    finally:
        del stage.forward_one_chunk, stage.backward_one_chunk  # the class's own methods again


def print_timetable(order, cfg, ctx):
    """Rank 0 prints every stage's order of work in one step, from an all_gather_object of each stage's."""
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, " ".join(order))
    print0(ctx, f"One step, schedule {cfg.schedule} (F2: micro-batch 2's forward, B2: its backward):\n" +
           "\n".join(f"  stage {rank}: {work}" for rank, work in enumerate(everyone)))


def describe_stages(layers, cuts):
    """The layers of each stage, e.g. "Flatten, Linear 784->512, ReLU | Linear 512->512, ReLU, Linear 512->10"."""
    def name(layer):
        if isinstance(layer, nn.Linear):
            return f"Linear {layer.in_features}->{layer.out_features}"
        return type(layer).__name__

    return " | ".join(", ".join(name(layer) for layer in layers[a:b]) for a, b in zip(cuts, cuts[1:]))


def gather_stage_weights(model, ctx):
    """Every stage sends rank 0 the weights it holds (a gather_object, on the CPU); rank 0 gets them all in one plain
    state_dict under chapter 1's names and order, the others None."""
    everyone = [None] * ctx.world_size
    mine = {name: t.detach().cpu() for name, t in model.state_dict().items()}
    dist.gather_object(mine, everyone if ctx.is_main else None, dst=0)
    if not ctx.is_main:
        return None
    held = {name: t for part in everyone for name, t in part.items()}
    return {name: held[name] for name in NeuralNetwork().state_dict()}  # chapter 1's order; a missing layer: KeyError


def check_pipeline_flags(cfg):
    """This chapter's refusals, each one line and exit 2, before any rendezvous: more stages than the cuts it knows,
    micro-batches that do not split the global batch or (1F1B) are fewer than the stages, flags a pipeline does not
    take (fp16, --accum-steps, --compile), a torch whose pipelining lacks what the chapter uses."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > len(CUTS):
        raise UsageError(f"{world_size} ranks but pipeline.py cuts the model into at most {len(CUTS)} stages "
                         f"(one per Linear layer): start --nproc-per-node {len(CUTS)} or fewer")
    if cfg.batch_size % cfg.microbatches:
        raise UsageError(f"--batch-size {cfg.batch_size} must split into --microbatches {cfg.microbatches} equal "
                         f"micro-batches; use a multiple of {cfg.microbatches}")
    if cfg.schedule == "1f1b" and cfg.microbatches < world_size:  # torch's Schedule1F1B refuses it after the rendezvous
        raise UsageError(f"--schedule 1f1b with {world_size} stages needs at least {world_size} --microbatches (each "
                         f"stage takes one forward before the first backward reaches it); pass --microbatches "
                         f"{world_size} or more, or --schedule gpipe")
    if cfg.precision == "fp16":  # each stage's scaler would see only its own layers' gradients
        raise UsageError("pipeline.py trains in --precision fp32 or bf16; fp16 needs a scaler that checks every "
                         "stage's gradients for overflow, which this chapter does not have: use --precision bf16")
    if cfg.accum_steps != 1:
        raise UsageError("pipeline.py takes no --accum-steps: its micro-batches already add their gradients up "
                         "before each optimizer step; use --microbatches")
    if cfg.compile:
        raise UsageError("pipeline.py takes no --compile: the schedule calls each stage's layers once per micro-batch "
                         "and torch.compile is not part of this chapter; leave --compile out")
    if pipelining_missing():
        raise UsageError(pipelining_missing())


def pipelining_missing():
    """Why this torch cannot run pipeline.py (one line), or None: its schedules need scale_grads= and eval()."""
    if "scale_grads" in inspect.signature(ScheduleGPipe).parameters and hasattr(ScheduleGPipe, "eval"):
        return None
    return (f"pipeline.py needs torch 2.9 or later, whose pipeline schedules take scale_grads= and have eval(); this "
            f"is torch {torch.__version__}: upgrade torch")


if __name__ == "__main__":
    run_main(main)
