"""The one training loop and evaluation every chapter calls: chapter 1's loop, with the places a strategy plugs in."""
import contextlib
import itertools
import math
import time

import torch
from torch import nn

from common.ranks import all_reduce_sum, print0

loss_fn = nn.CrossEntropyLoss()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(cfg, device):
    """--precision bf16/fp16: matrix products run in 16 bits, the weights, optimizer and loss stay float32."""
    return torch.autocast(device.type, dtype=DTYPES[cfg.precision], enabled=cfg.precision != "fp32")


def synchronize(device):
    """Wait for queued GPU work, so that a clock read after it is honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_one_epoch(model, loader, optimizer, scaler, epoch, cfg, ctx, metrics, no_sync=None, gradient_sync=None):
    """One pass over this rank's batches, with the quickstart's loss lines, then the epoch's time and mean loss.

    Each optimizer step takes --accum-steps micro-batches (the loader's batches), each loss weighted by its share of
    the step's images, so the gradient is the mean over the step, as one batch of them all gives (an epoch's last
    step may be short). The chapter passes its way to keep a micro-batch's gradients on this rank, DDP's no_sync()
    or FSDP2's gradient_sync switch: all micro-batches of a step but the last keep theirs, so the last backward()
    sends their sum, once per step. scaler: fp16's torch.amp.GradScaler, or None.
    """
    model.train()
    size, steps = len(loader.dataset), math.ceil(len(loader) / cfg.accum_steps)  # size: every rank's images
    loss_sum, seen = torch.zeros((), device=ctx.device), 0  # summed on the device: no host sync per step
    synchronize(ctx.device)
    start = time.perf_counter()
    batches, step = iter(loader), 0
    while micro := list(itertools.islice(batches, cfg.accum_steps)):  # to its end: torch's Join waits for that
        images = sum(len(y) for _, y in micro)  # this rank's share of the global batch
        step_loss = 0
        for i, (X, y) in enumerate(micro):
            X, y = X.to(ctx.device), y.to(ctx.device)  # the quickstart's line; a no-op here: the data lives there
            last = i == len(micro) - 1
            if gradient_sync:
                gradient_sync(last)
            with no_sync() if no_sync and not last else contextlib.nullcontext():
                with autocast(cfg, ctx.device):
                    loss = loss_fn(model(X), y) * (len(y) / images)  # x 1.0 without accumulation: unchanged
                # DDP: this backward() averages the gradients over the ranks, bucket by bucket while it runs (FSDP2
                # reduce-scatters them); under no_sync() they only add up here.
                (scaler.scale(loss) if scaler else loss).backward()
            step_loss = step_loss + loss.detach()
        if scaler:
            scaler.step(optimizer)  # skips the step if fp16's gradients overflowed, then lowers the scale
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        loss_sum.add_(step_loss, alpha=images)
        seen += images
        if step % cfg.log_every == 0:
            print_loss_line(step_loss, images, step, epoch, steps, size, cfg, ctx, metrics)
        step += 1
    print_epoch_line(loss_sum, seen, start, epoch, steps, ctx, metrics)
    if scaler:  # one read of the scale per epoch (it lives on the device): halved per skipped step, doubled
        print0(ctx, f"fp16 loss scale: {scaler.get_scale():g}")  # after 2000 steps in a row without inf/NaN
    if cfg.compile:
        print0(ctx, compiled_so_far())


def print_loss_line(step_loss, images, step, epoch, steps, size, cfg, ctx, metrics):
    """The quickstart's loss line, from an all-reduce of every rank's loss and images (a rank with none adds 0, 0):
    rank 0 prints the mean loss over the whole global batch."""
    total, count = all_reduce_sum([step_loss * images, images], ctx, ctx.data_group)
    print0(ctx, f"loss: {total / count:>7f}  [{step * cfg.batch_size:>5d}/{size:>5d}]")
    metrics.write("train", epoch + 1, step=epoch * steps + step + 1,
                  samples=epoch * size + min((step + 1) * cfg.batch_size, size), loss=round(total / count, 6))


def print_epoch_line(loss_sum, seen, start, epoch, steps, ctx, metrics):
    """The epoch's line, from an all-reduce of every rank's loss sum and images: its time, images/s and mean loss."""
    total, count = all_reduce_sum([loss_sum, seen], ctx, ctx.data_group)
    synchronize(ctx.device)
    seconds = time.perf_counter() - start
    print0(ctx, f"Train time: {seconds:.2f}s ({count / seconds:.0f} samples/s), train loss: {total / count:>7f}")
    metrics.note(step=(epoch + 1) * steps, train_loss=total / count, train_seconds=seconds,
                 samples_per_second=count / seconds)


def compiled_so_far():
    """torch's own counters: the graphs Dynamo captured and the parts AOTAutograd compiled (DDP cuts at its buckets)."""
    from torch._dynamo.utils import counters

    graphs, parts = counters["stats"]["unique_graphs"], counters["aot_autograd"]["ok"]
    return (f"torch.compile so far: {graphs} graph{'s' * (graphs != 1)} captured, compiled in {parts} "
            f"part{'s' * (parts != 1)}")


@torch.no_grad()
def evaluate(model, loader, epoch, ctx, metrics):
    """Accuracy and mean loss over the whole test set: each rank counts its shard, an all-reduce sums the counts.

    Outside autocast, so in float32 whatever --precision trained the (float32) weights: the figure measures the model
    itself (fsdp.py in bf16 is the exception: FSDP2 gathers bf16 weights for every forward; its outputs come back
    float32, so the sums below are not rounded to bf16).
    """
    model.eval()
    loss_sum = torch.zeros((), device=ctx.device)
    correct = torch.zeros((), dtype=torch.long, device=ctx.device)
    seen = 0
    for X, y in loader:
        X, y = X.to(ctx.device), y.to(ctx.device)
        pred = model(X)
        loss_sum += nn.functional.cross_entropy(pred, y, reduction="sum")
        correct += (pred.argmax(1) == y).sum()
        seen += len(y)
    return print_test_lines(loss_sum, correct, seen, epoch, ctx, metrics)


def print_test_lines(loss_sum, correct, seen, epoch, ctx, metrics):
    """The quickstart's test lines, from an all-reduce of every rank's counts: (accuracy, mean loss)."""
    total_loss, total_correct, total = all_reduce_sum([loss_sum, correct, seen], ctx, ctx.data_group)
    accuracy, test_loss = total_correct / total, total_loss / total
    print0(ctx, f"Test Error: \n Accuracy: {100 * accuracy:>0.1f}%, Avg loss: {test_loss:>8f} \n")
    metrics.write("epoch", epoch + 1, test_accuracy=accuracy, test_loss=test_loss)
    return accuracy, test_loss
