"""The one training step and evaluation every chapter calls: DDP changes what the model and sampler are, not this."""
import contextlib
import itertools
import math
import time

import torch
from torch import nn

from common.ranks import all_reduce_sum, print0

loss_fn = nn.CrossEntropyLoss()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(device):
    """Wait for queued GPU work so wall-clock timings are honest (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(cfg, device):
    """--precision bf16/fp16: matrix products run in 16 bits, the weights, optimizer and loss stay float32."""
    return torch.autocast(device.type, dtype=DTYPES[cfg.precision], enabled=cfg.precision != "fp32")


class DataParallel(nn.DataParallel):
    """nn.DataParallel whose replicas compute in the caller's autocast dtype (--precision bf16 stays bf16).

    Each GPU's replica runs in a thread of its own, and autocast's state is per thread: torch's parallel_apply turns
    autocast on in those threads without the dtype (torch 2.14), so they compute in the device's default, float16
    on CUDA, with no GradScaler. Each replica here enters autocast itself with the dtype and switch of the thread
    that called forward(), as torch's AMP notes advise ("autocast in the model's forward").
    """

    def parallel_apply(self, replicas, inputs, kwargs):
        device_type = self.src_device_obj.type
        dtype, enabled = torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type)

        def in_callers_autocast(replica):
            def forward(*args, **kw):
                with torch.autocast(device_type, dtype=dtype, enabled=enabled):
                    return replica(*args, **kw)
            return forward

        return super().parallel_apply([in_callers_autocast(r) for r in replicas], inputs, kwargs)


def steps_per_epoch(loader, cfg):
    """Optimizer steps in one pass: each one takes --accum-steps of the loader's micro-batches (fewer at the end)."""
    return math.ceil(len(loader) / cfg.accum_steps)


@contextlib.contextmanager
def gradient_sync(model, sync):
    """Around one micro-batch's forward and backward: let DDP / FSDP2 send the gradients (sync) or hold them back.

    DDP holds them back in model.no_sync(); FSDP2 with set_requires_gradient_sync(False), keeping the unsharded
    gradients until the last micro-batch's backward() reduce-scatters their sum. One process has nothing to send.
    """
    if sync:
        yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    else:
        yield


def train_one_epoch(model, loader, optimizer, scaler, epoch, cfg, ctx, metrics):
    """One pass over this rank's batches, printing the quickstart's loss lines and the epoch's time and mean loss.

    Each optimizer step sums the gradients of --accum-steps micro-batches (the loader's batches). Each micro-batch's
    mean loss is weighted by its share of this rank's step, so the gradient is the mean over the step's images, as
    one big batch would give (the last step of an epoch may be short). Under DDP and FSDP2 all micro-batches but
    the last hold their gradients back (gradient_sync): they add up locally, and the last backward() sends the sum,
    once per step. scaler: a torch.amp.GradScaler (--precision fp16) or None.
    """
    model.train()
    size = len(loader.dataset)  # the whole training set, not this rank's share
    steps = steps_per_epoch(loader, cfg)
    loss_sum = torch.zeros((), device=ctx.device)  # summed on the device: no host sync per step
    seen = 0
    _sync(ctx.device)
    start = time.perf_counter()
    batches = iter(loader)
    step = -1
    # Until the loader is exhausted (a loader that wraps its batches in a context, as torch's Join does, closes it
    # only then): each step takes its --accum-steps micro-batches.
    while micro := list(itertools.islice(batches, cfg.accum_steps)):
        step += 1
        images = sum(len(y) for _, y in micro)  # this rank's share of the global batch
        step_loss = torch.zeros((), device=ctx.device)
        for i, (X, y) in enumerate(micro):
            X, y = X.to(ctx.device), y.to(ctx.device)  # the quickstart's line; a no-op here: the data lives there
            # DDP / FSDP2: all micro-batches but the last run in no_sync() / with gradient sync off (--accum-steps)
            with gradient_sync(model, i == len(micro) - 1):
                with autocast(cfg, ctx.device):
                    loss = loss_fn(model(X), y) * (len(y) / images)  # x 1.0 without accumulation: unchanged
                # DDP: this backward() all-reduces the gradients, averaging them over the ranks, bucket by bucket
                # while it runs (FSDP2: reduce-scatters them); in no_sync() they only add up here.
                (scaler.scale(loss) if scaler else loss).backward()
            step_loss += loss.detach()
        if scaler:
            scaler.step(optimizer)  # skips the step if fp16 gradients overflowed, then lowers the scale
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        loss_sum.add_(step_loss, alpha=images)  # one fused op, no temporary
        seen += images
        if step % cfg.log_every == 0:
            log_step(step_loss, images, step, epoch, steps, size, cfg, ctx, metrics)
    log_epoch(loss_sum, seen, start, epoch, steps, ctx, metrics)
    if scaler:  # one read of the scale per epoch (it lives on the device): halved once per skipped step, doubled
        print0(ctx, f"fp16 loss scale: {scaler.get_scale():g}")  # after 2000 steps in a row without inf/NaN
    if cfg.compile:
        print0(ctx, compiled_so_far())


def log_step(step_loss, images, step, epoch, steps, size, cfg, ctx, metrics):
    """Every --log-every steps, the quickstart's loss line: every rank joins the reduction (a rank that saw no images
    of the step adds 0 and 0), and rank 0 prints the mean loss over the whole global batch."""
    total, count = all_reduce_sum([step_loss * images, images], ctx, ctx.data_group)
    print0(ctx, f"loss: {total / count:>7f}  [{step * cfg.batch_size:>5d}/{size:>5d}]")
    metrics.write("train", epoch + 1, step=epoch * steps + step + 1,
                  samples=epoch * size + min((step + 1) * cfg.batch_size, size), loss=round(total / count, 6))


def log_epoch(loss_sum, seen, start, epoch, steps, ctx, metrics):
    """The epoch's line: its time, images per second and mean loss, summed over every rank's images."""
    total, count = all_reduce_sum([loss_sum, seen], ctx, ctx.data_group)
    _sync(ctx.device)
    seconds = time.perf_counter() - start
    print0(ctx, f"Train time: {seconds:.2f}s ({count / seconds:.0f} samples/s), train loss: {total / count:>7f}")
    metrics.note(step=(epoch + 1) * steps, train_loss=total / count, train_seconds=seconds,
                 samples_per_second=count / seconds)


def compiled_so_far():
    """One line from torch's own counters: the graphs TorchDynamo captured and the parts AOTAutograd compiled.

    Evaluation (no gradients) is a graph of its own, from the first epoch's test on; under DDP, Dynamo cuts the
    training graph where a gradient bucket ends, so it is compiled in more parts than there are graphs.
    """
    from torch._dynamo.utils import counters

    graphs, parts = counters["stats"]["unique_graphs"], counters["aot_autograd"]["ok"]
    return f"torch.compile so far: {graphs} graph{'s' * (graphs != 1)} captured, compiled in {parts} part{'s' * (parts != 1)}"


@torch.no_grad()
def evaluate(model, loader, epoch, ctx, metrics):
    """Accuracy and mean loss over the whole test set: each rank counts its shard, the counts are summed.

    Outside autocast, so in float32 whatever --precision trained the (float32) weights: the figure measures the model
    itself. (fsdp.py in bf16 is the exception: FSDP2 gathers bf16 weights for every forward, so its products are bf16;
    its outputs come back float32, so the sums below are not rounded to bf16.)
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
    total_loss, total_correct, total = all_reduce_sum([loss_sum, correct, seen], ctx, ctx.data_group)
    accuracy, test_loss = total_correct / total, total_loss / total
    print0(ctx, f"Test Error: \n Accuracy: {100 * accuracy:>0.1f}%, Avg loss: {test_loss:>8f} \n")
    metrics.write("epoch", epoch + 1, test_accuracy=accuracy, test_loss=test_loss)
    return accuracy, test_loss


# Chapter 10: a pipeline stage holds some of the layers; torch's schedule runs the micro-batches through all of them.
PADDING = -100  # the label of a padding row: cross_entropy's ignore_index, so it adds nothing to a loss or gradient


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
    batches of one fixed shape, set by the first step (the last batch of an epoch or a test set may be short)."""
    missing = batch_size - len(y)
    if missing == 0:
        return X, y
    return torch.cat([X, X.new_zeros(missing, *X.shape[1:])]), torch.cat([y, y.new_full((missing,), PADDING)])


def _stage_inputs(stage, X, y, **last):
    """schedule.step()'s arguments on this stage: the images on the first, the labels (and more) on the last."""
    return ((X,) if stage.is_first else ()), (dict(target=y, **last) if stage.is_last else {})


def train_pipeline_epoch(schedule, stage, loss_fn, loader, optimizer, epoch, cfg, ctx, metrics):
    """train_one_epoch for a pipeline stage: one schedule.step() per global batch runs every micro-batch's forward and
    backward through all the stages, in the schedule's order; then this stage's optimizer steps its own layers.

    Every stage iterates the same loader (the same shuffle); the first feeds the images, the last the labels, and
    only the last sees the losses: the others add 0 to the sums (the loss lines come from rank 0, as in every chapter).
    """
    stage.submod.train()
    size, steps = len(loader.dataset), len(loader)
    loss_sum = torch.zeros((), device=ctx.device)
    seen = 0
    _sync(ctx.device)
    start = time.perf_counter()
    for step, (X, y) in enumerate(loader):
        images = len(y) if stage.is_last else 0  # counted once, where the loss is
        loss_fn.images = len(y)
        X, y = padded(X, y.to(ctx.device), cfg.batch_size)
        losses = []
        args, kwargs = _stage_inputs(stage, X, y, losses=losses)
        with autocast(cfg, ctx.device):
            schedule.step(*args, **kwargs)  # sends and receives activations (forward) and their gradients (backward)
        optimizer.step()
        optimizer.zero_grad()
        step_loss = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=ctx.device)
        loss_sum.add_(step_loss, alpha=images)
        seen += images
        if step % cfg.log_every == 0:
            log_step(step_loss, images, step, epoch, steps, size, cfg, ctx, metrics)
    log_epoch(loss_sum, seen, start, epoch, steps, ctx, metrics)


@torch.no_grad()
def evaluate_pipeline(schedule, stage, loader, batch_size, epoch, ctx, metrics):
    """evaluate() for a pipeline stage: schedule.eval() runs the forward passes only; the last stage gets the logits
    and counts (padding rows left out), the others add 0, so every test image is counted once."""
    stage.submod.eval()
    loss_sum = torch.zeros((), device=ctx.device)
    correct = torch.zeros((), dtype=torch.long, device=ctx.device)
    seen = 0
    for X, y in loader:
        X, y = padded(X, y.to(ctx.device), batch_size)
        args, kwargs = _stage_inputs(stage, X, y)  # the last stage takes the labels too (its loss_fn runs; unused here)
        pred = schedule.eval(*args, **kwargs)  # the logits of the whole batch on the last stage, None on the others
        if stage.is_last:
            real = y != PADDING
            loss_sum += nn.functional.cross_entropy(pred[real].float(), y[real], reduction="sum")
            correct += (pred[real].argmax(1) == y[real]).sum()
            seen += int(real.sum())
    total_loss, total_correct, total = all_reduce_sum([loss_sum, correct, seen], ctx)
    accuracy, test_loss = total_correct / total, total_loss / total
    print0(ctx, f"Test Error: \n Accuracy: {100 * accuracy:>0.1f}%, Avg loss: {test_loss:>8f} \n")
    metrics.write("epoch", epoch + 1, test_accuracy=accuracy, test_loss=test_loss)
    return accuracy, test_loss
