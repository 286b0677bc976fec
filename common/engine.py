"""The one training step and evaluation every chapter calls: DDP changes what the model and sampler are, not this."""
import time

import torch
from torch import nn

from common.ranks import all_reduce_sum, print0

loss_fn = nn.CrossEntropyLoss()


def _sync(device):
    """Wait for queued GPU work so wall-clock timings are honest (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_one_epoch(model, loader, optimizer, epoch, cfg, ctx, metrics):
    """One pass over this rank's batches, printing the quickstart's loss lines and the epoch's time and mean loss."""
    model.train()
    size = len(loader.dataset)  # the whole training set, not this rank's share
    loss_sum = torch.zeros((), device=ctx.device)  # summed on the device: no host sync per step
    seen = 0
    _sync(ctx.device)
    start = time.perf_counter()
    for batch, (X, y) in enumerate(loader):
        pred = model(X)
        loss = loss_fn(pred, y)
        loss.backward()  # under DDP this also averages the gradients over all ranks
        optimizer.step()
        optimizer.zero_grad()
        loss_sum.add_(loss.detach(), alpha=len(y))  # one fused op, no temporary
        seen += len(y)
        if batch % cfg.log_every == 0:
            # Every rank joins the reduction; rank 0 prints the loss of the whole global batch.
            total, count = all_reduce_sum([loss.detach() * len(y), len(y)], ctx)
            print0(ctx, f"loss: {total / count:>7f}  [{batch * cfg.batch_size:>5d}/{size:>5d}]")
            metrics.write("train", epoch + 1, step=epoch * len(loader) + batch + 1,
                          samples=epoch * size + min((batch + 1) * cfg.batch_size, size), loss=round(total / count, 6))
    total, count = all_reduce_sum([loss_sum, seen], ctx)
    _sync(ctx.device)
    seconds = time.perf_counter() - start
    print0(ctx, f"Train time: {seconds:.2f}s ({count / seconds:.0f} samples/s), train loss: {total / count:>7f}")
    metrics.note(step=(epoch + 1) * len(loader), train_loss=total / count, train_seconds=seconds,
                 samples_per_second=count / seconds)


@torch.no_grad()
def evaluate(model, loader, epoch, ctx, metrics):
    """Accuracy and mean loss over the whole test set: each rank counts its shard, the counts are summed."""
    model.eval()
    loss_sum = torch.zeros((), device=ctx.device)
    correct = torch.zeros((), dtype=torch.long, device=ctx.device)
    seen = 0
    for X, y in loader:
        pred = model(X)
        loss_sum += nn.functional.cross_entropy(pred, y, reduction="sum")
        correct += (pred.argmax(1) == y).sum()
        seen += len(y)
    total_loss, total_correct, total = all_reduce_sum([loss_sum, correct, seen], ctx)
    accuracy, test_loss = total_correct / total, total_loss / total
    print0(ctx, f"Test Error: \n Accuracy: {100 * accuracy:>0.1f}%, Avg loss: {test_loss:>8f} \n")
    metrics.write("epoch", epoch + 1, test_accuracy=accuracy, test_loss=test_loss)
    return accuracy, test_loss
