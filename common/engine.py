"""The one training loop. Every chapter calls fit(); DDP changes what the model and sampler are, not this code."""
import time

import torch
from torch import nn

from common.checkpoint import load_snapshot, save_snapshot
from common.distributed import all_reduce_sum, print0
from common.metrics import MetricsLog

loss_fn = nn.CrossEntropyLoss()


def _sync(device):
    """Wait for queued GPU work so wall-clock timings are honest (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_one_epoch(model, loader, optimizer, cfg, ctx, epoch=0, log=None):
    """One pass over this rank's batches; prints the quickstart's loss lines. Returns global (mean loss, samples)."""
    model.train()
    size = len(loader.dataset)  # the whole training set, not this rank's share
    loss_sum = torch.zeros((), device=ctx.device)  # summed on the device: no per-step sync
    seen = 0
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
            if log is not None:
                log.write("train", epoch=epoch + 1, step=epoch * len(loader) + batch + 1,
                          samples=epoch * size + min((batch + 1) * cfg.batch_size, size), loss=round(float(total / count), 6))
    total, count = all_reduce_sum([loss_sum, seen], ctx)
    return total / count, int(count)


@torch.no_grad()
def evaluate(model, loader, ctx):
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
    return total_correct / total, total_loss / total


def fit(model, train_loader, test_loader, optimizer, cfg, ctx):
    """Train for cfg.epochs, testing after each; prints the quickstart's log and returns one dict per epoch.

    With --snapshot, it first continues from the snapshot if there is one, and saves one every --save-every
    epochs (and after the last), so a run that is killed loses at most those epochs.
    """
    start, history = load_snapshot(model, optimizer, cfg, ctx) if cfg.snapshot else (0, [])
    log = MetricsLog(cfg.output, ctx, epochs_done=start)
    for epoch in range(start, cfg.epochs):
        print0(ctx, f"Epoch {epoch + 1}\n-------------------------------")
        # A new order each epoch. DistributedSampler needs this call on every rank, or every epoch repeats epoch 0.
        sampler = getattr(train_loader.sampler, "sampler", train_loader.sampler)  # DataLoader -> BatchSampler -> sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        _sync(ctx.device)
        start = time.perf_counter()
        train_loss, samples = train_one_epoch(model, train_loader, optimizer, cfg, ctx, epoch, log)
        _sync(ctx.device)
        seconds = time.perf_counter() - start
        print0(ctx, f"Train time: {seconds:.2f}s ({samples / seconds:.0f} samples/s), train loss: {train_loss:>7f}")
        accuracy, test_loss = evaluate(model, test_loader, ctx)
        print0(ctx, f"Test Error: \n Accuracy: {100 * accuracy:>0.1f}%, Avg loss: {test_loss:>8f} \n")
        history.append(dict(epoch=epoch + 1, train_loss=train_loss, train_seconds=seconds,
                            samples_per_second=samples / seconds, test_accuracy=accuracy, test_loss=test_loss))
        log.write("epoch", step=(epoch + 1) * len(train_loader), **{k: float(v) if k != "epoch" else v for k, v in history[-1].items()})
        if cfg.snapshot and ((epoch + 1) % cfg.save_every == 0 or epoch + 1 == cfg.epochs):
            save_snapshot(model, optimizer, epoch + 1, history, cfg, ctx)
    log.close()
    print0(ctx, "Done!")
    return history
