"""The one training loop and evaluation every chapter calls: chapter 1's loop, with the places a strategy plugs in, and
metrics.jsonl, where rank 0 writes each line the loop prints (scripts/plot_curves.py draws it)."""
import contextlib
import itertools
import json
import math
import time
from pathlib import Path

import torch
from torch import nn

from common.cli import FatalError
from common.ranks import all_reduce_sum, print0

loss_fn = nn.CrossEntropyLoss()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(cfg, device):
    """--precision bf16/fp16: matrix products run in 16 bits, the weights, optimizer and loss stay float32."""
    return torch.autocast(device.type, DTYPES[cfg.precision]) if cfg.precision != "fp32" else contextlib.nullcontext()


def synchronize(device):
    """Wait for queued GPU work, so that a clock read after it is honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_one_epoch(model, loader, optimizer, scaler, epoch, cfg, ctx, metrics, no_sync=None, gradient_sync=None):
    """One pass, --accum-steps batches a step; no_sync/gradient_sync: how the strategy keeps gradients local."""
    model.train()
    scaler = scaler or torch.amp.GradScaler(ctx.device.type, enabled=False)  # Off for fp32 and bf16: a plain optimizer.step().
    size, steps = len(loader.dataset), math.ceil(len(loader) / cfg.accum_steps)  # size counts every rank's images.
    loss_sum, seen = torch.zeros((), device=ctx.device), 0  # Summed on the device, so no step waits for the host.
    synchronize(ctx.device)
    start = time.perf_counter()
    batches, step = iter(loader), 0
    while micro := list(itertools.islice(batches, cfg.accum_steps)):  # Every rank runs its loader to the end.
        images = sum(len(y) for _, y in micro)  # This rank's share of the global batch.
        step_loss = 0
        for i, (X, y) in enumerate(micro):
            X, y = X.to(ctx.device), y.to(ctx.device)  # The quickstart's line; the data already lives there.
            last = i == len(micro) - 1  # Only the last micro-batch sends its gradients.
            if gradient_sync:
                gradient_sync(last)
            with no_sync() if no_sync and not last else contextlib.nullcontext():
                with autocast(cfg, ctx.device):
                    loss = loss_fn(model(X), y) * (len(y) / images)  # Each is weighted by its share of the step's images.
                # DDP: this backward() averages the gradients over the ranks, bucket by bucket while it runs (FSDP2
                # reduce-scatters them); under no_sync() they only add up here.
                scaler.scale(loss).backward()  # With fp16 the loss is scaled up first; otherwise it passes.
            step_loss = step_loss + loss.detach()
        scaler.step(optimizer)  # optimizer.step(). With fp16, a step whose gradients overflowed is skipped.
        scaler.update()
        optimizer.zero_grad()
        loss_sum.add_(step_loss, alpha=images)
        seen += images
        if step % cfg.log_every == 0:
            print_loss_line(step_loss, images, step, epoch, steps, size, cfg, ctx, metrics)
        step += 1
    print_epoch_line(loss_sum, seen, start, epoch, steps, ctx, metrics)
    # The scale lives on the device, so it is read once per epoch. It halves at each skipped step and doubles after
    # 2000 steps in a row without inf or NaN.
    if scaler.is_enabled():
        print0(ctx, f"fp16 loss scale: {scaler.get_scale():g}")


def print_loss_line(step_loss, images, step, epoch, steps, size, cfg, ctx, metrics):
    """The quickstart's loss line: the global batch's mean loss, from an all-reduce of the ranks' losses and images."""
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
    metrics.pending = dict(step=(epoch + 1) * steps, train_loss=total / count, train_seconds=seconds,
                           samples_per_second=count / seconds)  # written with the epoch's test lines


@torch.no_grad()
def evaluate(model, loader, epoch, ctx, metrics):
    """Accuracy and mean loss over the whole test set (each rank counts its shard), in float32 whatever --precision."""
    model.eval()
    loss_sum, correct, seen = torch.zeros((), device=ctx.device), torch.zeros((), device=ctx.device).long(), 0
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


class MetricsLog:
    """FOLDER/metrics.jsonl, written by global rank 0 a line as soon as it is known: "train" and "epoch" records."""

    def __init__(self, folder, ctx, epochs_done=0):
        self.path = Path(folder) / "metrics.jsonl" if folder is not None and ctx.is_main else None
        self.pending, self.started = {}, time.perf_counter()  # pending: the epoch's training figures
        kept = self.path.read_text().splitlines() if self.path and epochs_done and self.path.exists() else []
        self._put([line for line in kept if line.endswith("}") and json.loads(line)["epoch"] <= epochs_done], "w")

    def write(self, kind, epoch, **fields):
        """One record; an "epoch" record also takes the epoch's training figures."""
        extra, self.pending = (self.pending, {}) if kind == "epoch" else ({}, self.pending)
        self._put([json.dumps(dict(kind=kind, epoch=epoch, **extra, **fields,
                                   time=round(time.perf_counter() - self.started, 3)))], "a")

    def _put(self, lines, mode):
        """Lines into the file (resuming: the epochs the snapshot holds, without a line a kill cut off)."""
        try:
            if self.path:
                with self.path.open(mode) as f:
                    f.writelines(line + "\n" for line in lines)
        except OSError as e:
            raise FatalError(f"cannot write {self.path}: {e.strerror}; free some space or pass another --output") from None
