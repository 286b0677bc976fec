"""Chapter 8: broken on purpose. Bugs that make real DDP jobs hang or die, or train a wrong model without a word; the
tools that find them; the fixes.

    torchrun --standalone --nproc-per-node 2 debug_hang.py --bug eval-on-rank0 --timeout 10   # broken: ends in ~10 s
    torchrun --standalone --nproc-per-node 2 debug_hang.py --bug eval-on-rank0 --fix          # fixed
    torchrun --standalone --nproc-per-node 2 debug_hang.py --bug early-stop
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 debug_hang.py --bug eval-on-rank0
    torchrun --standalone --nproc-per-node 2 debug_hang.py --bug uneven-batches
    torchrun --standalone --nproc-per-node 2 debug_hang.py --bug shape-mismatch
    torchrun --standalone --nproc-per-node 2 debug_hang.py --bug unused-parameters
    torchrun --standalone --nproc-per-node 2 debug_hang.py --bug slow-save --timeout 10
    torchrun --standalone --nproc-per-node 2 debug_hang.py --bug save-wrapped
    torchrun --standalone --nproc-per-node 2 debug_hang.py --bug same-augmentation    # silent: see the last line
    torchrun --standalone --nproc-per-node 2 debug_hang.py --bug batchnorm
    torchrun --standalone --nproc-per-node 2 debug_hang.py --bug shard-grad-norm

The bugs (search for "BUG" below; --fix runs the same case with the line that follows "FIX"). Each shows with no
other flag, on the full data and any number of ranks:
  eval-on-rank0   evaluation inside `if rank == 0:`; evaluate() all-reduces, so only rank 0 enters a collective.
  early-stop      rank 0 decides to stop (after epoch 2: the test loss then improves by less than 15%); the others
                  go on into the next epoch's all-reduces. Fix: an all-reduced flag.
  uneven-batches  a sampler without padding, on a training set one image longer than whole global batches (the
                  first 59,969 images at the default batch of 64, unless --train-samples says otherwise): one rank
                  gets one batch more. Fix: torch.distributed.algorithms.Join, with every collective of a step in it.
  shape-mismatch  per-class counts with torch.bincount() but no minlength, on a small test set (the first 10 images
                  unless --test-samples says otherwise): a rank whose shard lacks the top class counts fewer classes.
The mistakes of a script ported to DDP or FSDP2; the first three fail, the last three train a wrong model silently:
  unused-parameters  a head that forward() never uses: DDP's defaults raise on every rank at the second step ("Expected
                  to have finished reduction in the prior iteration"). Fix: find_unused_parameters=True (or
                  static_graph=True, when the same parameters go unused at every step).
  slow-save       rank 0 writes a checkpoint after each epoch to a slow shared disk (simulated: the write takes
                  --timeout + 8 s), while the others go on into the next epoch's gradient all-reduce and time out
                  (from the second epoch on). Fix: a CPU copy of the weights, written by a background thread.
  save-wrapped    rank 0 saves the DDP wrapper's state_dict, whose keys all start with `module.`; loading the file
                  into the plain model, as every chapter's model.pth loads, fails ("Missing key(s) in state_dict").
                  Fix: save model.module.
  same-augmentation  a random shift of each training image, drawn from the global RNG that every rank seeded alike:
                  every rank draws the same shifts for its different images. Fix: image i's shift drawn from (seed,
                  epoch, i), so it is the same at any world size.
  batchnorm       a BatchNorm1d after the first Linear: each rank normalises by its own shard's statistics. Fix:
                  SyncBatchNorm on GPUs; on the CPU, where SyncBatchNorm refuses, the global batch's statistics by hand.
  shard-grad-norm FSDP2 with gradient clipping whose norm is computed from this rank's slices of the gradients. Fix:
                  the squares summed over the ranks (--max-norm sets the clip).
A silent case trains the distributed model and then, on every rank alike, the model one process trains, and prints the
largest difference between their weights ("Differs from one process's model by ..."), with the bound for the same
model. It trains on the first 960 training images unless --train-samples says otherwise: rounding alone parts longer
runs.

The tools (they work the same on any DDP job):
  - the flight recorder: every rank keeps its last 2000 collectives (TORCH_FR_BUFFER_SIZE; torch 2.11 and later by
    default, gloo's too from 2.8; set here for older ones); each rank writes them to OUTPUT/flight_recorder/rank_N as it
    leaves, and a failing rank compares them: which collective had no partner, or the first one the ranks ran
    differently. On NCCL a timed-out rank is ended by the watchdog, not Python: NCCL's own dump
    (TORCH_NCCL_DUMP_ON_TIMEOUT, TORCH_FR_DUMP_TEMP_FILE) writes the records to
    OUTPUT/flight_recorder/nccl_trace_rank_N, and torch's `torchfrtrace` compares them.
  - stacks: a rank that makes no step for --timeout / 2 seconds writes the stacks of all its threads, taken while it
    waits, to OUTPUT/stacks/rank_N.txt: `py-spy dump` where py-spy is installed, else Python's faulthandler.
  - TORCH_DISTRIBUTED_DEBUG=DETAIL (on the command line, as above): before every collective the ranks compare
    what they are about to run, and a mismatch fails at once, naming both sides. On torch 2.14.1 on the CPU it
    often crashes DDP's constructor (SIGSEGV) before the first step: see docs/debugging.md.
  - faulthandler: when gloo aborts the process on a collective whose sizes differ ("Is there a distributed
    collective mismatch in your code?"), the dying rank still prints every thread's Python stack, and so does
    each rank torchrun then stops with SIGTERM.
Every collective has --timeout, so a broken run ends (non-zero), never hangs: on gloo within --timeout plus a few
seconds; on NCCL (torch 2.8+) the watchdog first waits 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC for the records (60 s
at torch 2.14's default), then ends the process.
"""
import contextlib
import faulthandler
import io
import itertools
import math
import os
import pickle
import signal
import shutil
import socket
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.algorithms import Join, Joinable, JoinHook
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.torch_version import TorchVersion
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset, default_convert

from common.checkpoint import atomic_save, prepare_output, save_weights
from common.cli import RATE, REQUIRED, UsageError, flag, parse_config, run_main
from common.data import DeviceImages, load_fashion_mnist, locate_fashion_mnist
from common.engine import MetricsLog, evaluate, train_one_epoch
from common.model import NeuralNetwork
from common.ranks import (DistContext, all_reduce_sum, check_flags_and_set_threads, check_global_batch,
                          destroy_process_group, name_rank_in_errors, print0, rank_device)

SILENT = ("same-augmentation", "batchnorm", "shard-grad-norm")  # no error: a model unlike one process's
BUGS = ("eval-on-rank0", "early-stop", "uneven-batches", "shape-mismatch", "unused-parameters", "slow-save",
        "save-wrapped", *SILENT)
CLASSES = 10
PLATEAU = 0.15  # early-stop: an epoch that improves the test loss by less than this is a plateau (chapter 1: 12%
# in epoch 2 on the full data, so it stops there; a few 0.1% on the tests' small slices)
SMALL_TEST_SET = 10  # shape-mismatch: the test images when --test-samples is not given
SLOW_WRITE = 8  # slow-save: the write of a checkpoint takes --timeout + 8 s (a slow shared disk, simulated). The 8 s:
# the waiting rank then has the 5 s it gives the flight records and its line before rank 0 wakes
SHIFT = 2  # same-augmentation: each training image rolled by -2..2 pixels across and down
SILENT_TRAIN_SET = 960  # the silent cases: the training images when --train-samples is not given (15 batches of 64)
# The silent cases: how far (largest |difference| of the state_dict) the distributed model may be from one process's
# and still be the same model. Measured, 2 ranks, torch 2.14.1 on the CPU, no other flag (5 epochs of 15 batches of
# 64) and on the tests' slice (2 epochs of 20 batches of 48): fixed 3.7e-9 and 3.7e-9, 1.8e-7 and 1.8e-7, 1.5e-8 and
# 7.5e-9; broken 8.0e-5 and 6.0e-5, 1.3e-2 and 2.1e-2, 3.2e-4 and 1.6e-4. batchnorm's is its running mean: a sum over
# the first layer's 784 inputs, it carries the weights' rounding (7.5e-9) 25 times over. Longer runs drift apart by
# rounding alone (the fixed same-augmentation: 1.8e-5 after 5 epochs of the full data), hence SILENT_TRAIN_SET.
SAME_AS_ONE_PROCESS = {"same-augmentation": 1e-6, "batchnorm": 1e-5, "shard-grad-norm": 1e-6}


class StrideSampler(Sampler):
    """Every world_size-th index of chapter 1's shuffle, WITHOUT DistributedSampler's padding (as a hand-made or
    streaming loader shards): with an odd number of images one rank gets one image, so one batch, more."""

    def __init__(self, dataset, rank, world_size, seed):
        self.order = DistributedSampler(dataset, num_replicas=1, rank=0, seed=seed)  # chapter 1's shuffle
        self.rank, self.world_size = rank, world_size

    def __iter__(self):
        return itertools.islice(iter(self.order), self.rank, None, self.world_size)

    def __len__(self):
        return len(range(self.rank, len(self.order), self.world_size))

    def set_epoch(self, epoch):
        self.order.set_epoch(epoch)


class JoinedLoader:
    """FIX for uneven batches: iterate inside torch's Join, so a rank that runs out of batches keeps answering
    the others' collectives until every rank is done: DDP's gradient all-reduce (with zeros), and the loss line's
    all-reduce (LossLine). The context closes when the batches do, before train_one_epoch's own epoch-end sum,
    which every rank then runs together."""

    def __init__(self, loader, model, cfg, ctx):
        self.loader, self.model, self.dataset = loader, model, loader.dataset
        self.cfg, self.ctx = cfg, ctx

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        # divide_by_initial_world_size=False: a step that only some ranks take averages over those ranks, so the
        # last, short global batch gets the gradient chapter 1 gives it. The model comes first: its forward tells
        # Join, once a step, that this rank still trains; Join then runs every joinable's hook on the ranks that
        # are done.
        with Join([self.model, LossLine(len(self.loader), self.cfg, self.ctx)], divide_by_initial_world_size=False):
            yield from self.loader


class LossLine(Joinable):
    """The other collective of a training step: every --log-every steps train_one_epoch all-reduces the loss for
    its `loss:` line. Joined without it, a rank that ran out of batches answers only DDP's all-reduce, and a step
    the others log hangs them (whenever their extra step's number is a multiple of --log-every)."""

    def __init__(self, steps, cfg, ctx):
        super().__init__()
        self.steps, self.cfg, self.ctx = steps, cfg, ctx

    def join_hook(self, **kwargs):
        return _AnswerLossLines(self)

    @property
    def join_device(self):
        return self.ctx.device

    @property
    def join_process_group(self):
        return dist.group.WORLD


class _AnswerLossLines(JoinHook):
    """On a rank that is done: Join calls main_hook once for each step the others still take; on the steps that
    print a loss line it joins that all-reduce, adding no loss and no images."""

    def __init__(self, line):
        self.line, self.step = line, line.steps  # the first step this rank does not take

    def main_hook(self):
        if self.step % self.line.cfg.log_every == 0:
            all_reduce_sum([0.0, 0.0], self.line.ctx)  # the same [2] float64 sum as train_one_epoch's
        self.step += 1


@torch.no_grad()
def per_class_accuracy(model, loader, ctx, fix):
    """Accuracy of each class over all ranks' test shards: counts per class, summed over the ranks."""
    counts = torch.zeros(0, device=ctx.device)
    right = torch.zeros(0, device=ctx.device)
    labels, hits = [], []
    for X, y in loader:
        X, y = X.to(ctx.device), y.to(ctx.device)
        labels.append(y)
        hits.append((model(X).argmax(1) == y).float())
    y, hit = torch.cat(labels), torch.cat(hits)
    if fix:
        # FIX: the same length on every rank (minlength), and a common check before the all-reduce that names
        # the ranks and shapes if they still differ, instead of a collective that cannot match.
        counts, right = torch.bincount(y, minlength=CLASSES).float(), torch.bincount(y, hit, minlength=CLASSES)
        same_shape_everywhere(counts, ctx)
    else:
        counts, right = torch.bincount(y).float(), torch.bincount(y, hit)  # BUG: length = this shard's top label + 1
    dist.all_reduce(counts)
    dist.all_reduce(right)
    return (right / counts.clamp(min=1)).tolist()


def same_shape_everywhere(tensor, ctx):
    """Every rank's tensor has this shape and dtype, else one clear error naming the ranks (a small all_gather)."""
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, (tuple(tensor.shape), str(tensor.dtype)))
    if len(set(everyone)) > 1:
        shapes = ", ".join(f"rank {r} {list(s)} {d}" for r, (s, d) in enumerate(everyone))
        raise RuntimeError(f"all_reduce of tensors that differ between ranks: {shapes}")


# ---- unused-parameters and slow-save: the mistakes that fail ----

class WithUnusedHead(nn.Module):
    """unused-parameters: chapter 1's model and a second head that forward() never calls (an auxiliary loss the port
    switched off, a layer kept for later): its parameters never get a gradient."""

    def __init__(self):
        super().__init__()
        self.net = NeuralNetwork()  # first, right after the seed: chapter 1's initial weights
        self.aux_head = nn.Linear(512, CLASSES)

    def forward(self, x):
        return self.net(x)


def write_to_slow_disk(state, path, seconds):
    """slow-save: torch.save as a slow shared filesystem does it: the file is there `seconds` later (the sleep is the
    slow disk; this machine's is fast)."""
    time.sleep(seconds)
    atomic_save(state, path)


def cpu_copy(module):
    """The weights copied to the CPU (detached clones): what a writer may hold while training changes the originals."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


class BackgroundSave:
    """FIX for slow-save: the write off the training path. Rank 0 copies the weights to the CPU and a thread writes
    the copy while every rank trains on; torch.distributed.checkpoint.async_save does the same for sharded state.
    One write at a time: a checkpoint due while the last is still being written is skipped (waiting for it here
    would stall the training path again), and the last write is joined before the process ends."""

    def __init__(self):
        self.thread, self.error = None, None

    def save(self, module, path, seconds):
        if self.thread is not None and self.thread.is_alive():
            print(f"[rank 0] checkpoint skipped: the last one is still being written to {path}", flush=True)
            return
        self.wait()  # the previous write's error, if it had one
        self.thread = threading.Thread(target=self._write, args=(cpu_copy(module), path, seconds))
        self.thread.start()

    def _write(self, *args):
        try:
            write_to_slow_disk(*args)
        except Exception as e:  # raised on the main thread, at the next save or at the end
            self.error = e

    def wait(self):
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error


# ---- The silent ones: a model unlike one process's ----

class ShiftedImages(Dataset):
    """same-augmentation: the training images, each rolled by a random -SHIFT..SHIFT pixels across and down."""

    def __init__(self, images, seed, fix):
        self.images, self.seed, self.fix = images, seed, fix
        self.drawn = []  # every shift this rank drew, in order: to count those that match the other ranks'

    def __len__(self):
        return len(self.images)

    def set_epoch(self, epoch):
        # FIX: one shift per image of the whole training set, drawn from (seed, epoch): image i gets row i, on
        # whichever rank and in whichever batch it lands, so at any world size it gets the shift it gets in one process.
        self.table = torch.randint(-SHIFT, SHIFT + 1, (len(self), 2),
                                   generator=torch.Generator().manual_seed(self.seed + epoch))

    def __getitems__(self, indices):
        X, y = self.images.__getitems__(indices)
        if self.fix:
            shifts = self.table[indices]
        else:  # BUG: the global RNG, seeded alike on every rank: each rank draws the same shifts for its own images
            shifts = torch.randint(-SHIFT, SHIFT + 1, (len(indices), 2))
        self.drawn.append(shifts)
        return torch.stack([x.roll(tuple(s.tolist()), dims=(1, 2)) for x, s in zip(X, shifts)]), y


def print_alike_shifts(images, ctx):
    """Rank 0's line: how many of every rank's k-th images got the same shift (by chance: 1 in 25 ** (ranks - 1))."""
    mine = torch.cat(images.drawn).to(ctx.device)
    everyone = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, mine)  # the same count on every rank: DistributedSampler pads the shards alike
    alike = torch.stack([(x == everyone[0]).all(1) for x in everyone]).all(0).sum().item()
    print0(ctx, f"Shifts alike on every rank (their k-th images): {alike} of {len(mine)} (by chance: 1 in "
                f"{(2 * SHIFT + 1) ** (2 * (ctx.world_size - 1))})")


class BatchNormNetwork(NeuralNetwork):
    """batchnorm: chapter 1's MLP with a BatchNorm1d after its first Linear."""

    def __init__(self):
        super().__init__()
        self.linear_relu_stack.insert(1, nn.BatchNorm1d(512))


class SumOverRanks(torch.autograd.Function):
    """An all-reduce autograd knows: forward sums a tensor over the ranks, and backward sums its gradient over them,
    since every rank's loss depends on every rank's share of the sum."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class AllReducedBatchNorm1d(nn.BatchNorm1d):
    """FIX for batchnorm on the CPU, where SyncBatchNorm refuses (torch 2.13-2.14: DDP's constructor says "SyncBatchNorm
    layers only work with GPU modules", its forward "SyncBatchNorm expected input tensor to be on GPU or XPU or
    privateuseone"): in training, the mean and variance of the global batch, from sums over the ranks (SumOverRanks,
    so backward() sums their gradients too). The running statistics are updated as torch's are (momentum, the
    unbiased variance); eval mode is BatchNorm1d's."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        count = len(x) * dist.get_world_size()  # every rank's batch is as large: the global batch splits evenly
        mean = SumOverRanks.apply(x.sum(0)) / count
        var = SumOverRanks.apply(((x - mean) ** 2).sum(0)) / count  # biased, to normalise
        with torch.no_grad():
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * count / (count - 1), self.momentum)
            self.num_batches_tracked += 1
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def all_reduced_batchnorm(model):
    """convert_sync_batchnorm's twin for the CPU: every BatchNorm1d becomes an AllReducedBatchNorm1d, its state kept."""
    for layer in model.modules():
        if type(layer) is nn.BatchNorm1d:
            layer.__class__ = AllReducedBatchNorm1d
    return model


def clip_gradients(model, max_norm, fix, ctx):
    """shard-grad-norm, before each optimizer step: the gradients scaled to a norm of at most max_norm, with
    clip_grad_norm_'s factor. One process: torch's own clip_grad_norm_. FSDP2: by hand, from this rank's slices."""
    if ctx.world_size == 1:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return
    slices = [p.grad.to_local() for p in model.parameters()]  # this rank's rows of each gradient (a DTensor)
    squares = torch.stack([g.pow(2).sum() for g in slices]).sum()  # BUG: this rank's rows alone, a smaller norm
    if fix:
        dist.all_reduce(squares)  # FIX: summed over every rank's rows: the whole gradient's squared norm
    factor = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)
    for g in slices:
        g.mul_(factor)


def distribute(model, bug, fix, ctx):
    """A silent case's model on ctx's ranks: FSDP2 for shard-grad-norm, else DDP; in a world of one, as it is."""
    if ctx.world_size == 1:
        return model
    if bug == "shard-grad-norm":
        fully_shard(model, mesh=init_device_mesh(ctx.device.type, (ctx.world_size,)))  # every rank: a slice of each
        return model
    if bug == "batchnorm" and fix:  # FIX: normalise by the global batch's statistics, as one process does
        cuda = ctx.device.type == "cuda"
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model) if cuda else all_reduced_batchnorm(model)
    return DDP(model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None)


def fit(cfg, bug, fix, ctx, train_set, test_set, watch, metrics):
    """A silent case trained on ctx's ranks (in a world of one: what one process trains); its whole weights, on CPU."""
    if bug == "same-augmentation":
        train_set = ShiftedImages(train_set, cfg.seed, fix)
    sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, seed=cfg.seed)
    loader = DataLoader(train_set, batch_size=cfg.batch_size // ctx.world_size, sampler=sampler,
                        collate_fn=default_convert)
    torch.manual_seed(cfg.seed)  # the same initial weights in every chapter
    model = distribute((BatchNormNetwork() if bug == "batchnorm" else NeuralNetwork()).to(ctx.device), bug, fix, ctx)
    model.register_forward_pre_hook(watch.step)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    if bug == "shard-grad-norm":
        optimizer.register_step_pre_hook(lambda *_: clip_gradients(model, cfg.max_norm, fix, ctx))
    for epoch in range(cfg.epochs):
        print0(ctx, f"Epoch {epoch + 1}\n-------------------------------")
        sampler.set_epoch(epoch)
        if bug == "same-augmentation":
            train_set.set_epoch(epoch)
        train_one_epoch(model, loader, optimizer, None, epoch, cfg, ctx, metrics)
        evaluate(model, eval_loader(test_set, ctx), epoch, ctx, metrics)
    if bug == "same-augmentation" and ctx.world_size > 1:
        print_alike_shifts(train_set, ctx)
    state = (model.module if isinstance(model, DDP) else model).state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()  # FSDP2's DTensors: gathered
            for k, v in state.items()}


def compare_with_one_process(cfg, bug, fix, ctx, output, watch, train_set, test_set):
    """A silent case: the distributed model, then, on every rank alike (no collective, so no rank waits alone), the
    model one process trains; rank 0 prints how far apart they are and saves both."""
    model = fit(cfg, bug, fix, ctx, train_set, test_set, watch, MetricsLog(output, ctx))
    print0(ctx, "Done!")
    one = DistContext(device=ctx.device)  # a world of one
    with contextlib.redirect_stdout(io.StringIO()):  # quietly: its lines would repeat the ones above
        reference = fit(cfg, bug, fix, one, train_set, test_set, watch, MetricsLog(None, one))
    diff = max((model[k].float() - reference[k].float()).abs().max().item() for k in model)
    print0(ctx, f"Differs from one process's model by {diff:.1e} (the same model: at most "
                f"{SAME_AS_ONE_PROCESS[bug]:.0e})")
    if ctx.is_main:
        atomic_save(model, output / "model.pth")
        atomic_save(reference, output / "one_process.pth")
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}, one process's to {output / 'one_process.pth'}")


def eval_loader(test_set, ctx):
    """This rank's test images, every world_size-th, in batches of up to 1000, as many on every rank (under FSDP2
    every forward() gathers the weights, a collective)."""
    largest = math.ceil(len(test_set) / ctx.world_size)
    return DataLoader(Subset(test_set, range(ctx.rank, len(test_set), ctx.world_size)),
                      batch_size=math.ceil(largest / math.ceil(largest / 1000)), collate_fn=default_convert)


def train(cfg, bug, fix, ctx, output, watch):
    print0(ctx, cfg.describe())
    print0(ctx, f"Case: {bug} ({'fixed' if fix else 'broken on purpose'}), {ctx.world_size} processes, "
                f"backend {dist.get_backend()}, --timeout {cfg.timeout:g}s")
    check_flags_and_set_threads(cfg, ctx)

    if ctx.local_rank == 0:  # one process per machine finds the data, downloading it if it must, ...
        locate_fashion_mnist(cfg.data_dir)
    dist.barrier()  # ... while the machine's other ranks wait here; then every rank reads it
    train_set, test_set, folder = load_fashion_mnist(cfg, ctx.device)
    if bug == "uneven-batches" and cfg.train_samples is None:  # one image more than whole global batches
        n = cfg.batch_size * ((len(train_set) - 1) // cfg.batch_size) + 1
        train_set = DeviceImages(train_set.images[:n], train_set.labels[:n])
    print0(ctx, f"Data: {folder} ({len(train_set)} train / {len(test_set)} test images)")
    if bug in SILENT:
        return compare_with_one_process(cfg, bug, fix, ctx, output, watch, train_set, test_set)
    if bug == "uneven-batches":
        train_sampler = StrideSampler(train_set, ctx.rank, ctx.world_size, cfg.seed)  # BUG: no padding
    else:
        train_sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, seed=cfg.seed)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size // ctx.world_size, sampler=train_sampler,
                              collate_fn=default_convert)
    test_loader = eval_loader(test_set, ctx)
    print(f"[rank {ctx.rank}] {len(train_sampler)} training images, {len(train_loader)} batches\n", end="", flush=True)

    torch.manual_seed(cfg.seed)  # the same initial weights in every chapter
    network = WithUnusedHead() if bug == "unused-parameters" else NeuralNetwork()
    # unused-parameters: BUG: DDP's defaults wait, each step, for a gradient of every parameter; the head forward()
    # skips never sends one, so the next step refuses to start. FIX: find_unused_parameters=True (after each forward
    # DDP marks what it did not use as ready; static_graph=True also does, for the same unused set at every step).
    find_unused = bug == "unused-parameters" and fix
    model = DDP(network.to(ctx.device), device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
                find_unused_parameters=find_unused)
    model.register_forward_pre_hook(watch.step)  # every step (and test batch) tells the watch it is alive
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    if bug == "uneven-batches" and fix:
        train_loader = JoinedLoader(train_loader, model, cfg, ctx)

    metrics = MetricsLog(output, ctx)
    best_loss = float("inf")
    writer, write_seconds = BackgroundSave(), cfg.timeout + SLOW_WRITE  # slow-save
    for epoch in range(cfg.epochs):
        print0(ctx, f"Epoch {epoch + 1}\n-------------------------------")
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, train_loader, optimizer, None, epoch, cfg, ctx, metrics)
        if bug == "eval-on-rank0" and not fix:
            if ctx.is_main:  # BUG: "only rank 0 prints, so only rank 0 evaluates"; evaluate() all-reduces the counts
                _, test_loss = evaluate(model, test_loader, epoch, ctx, metrics)
        else:
            _, test_loss = evaluate(model, test_loader, epoch, ctx, metrics)  # FIX: every rank, its own shard
        if bug == "shape-mismatch":
            classes = per_class_accuracy(model, test_loader, ctx, fix)
            print0(ctx, "Per class: " + " ".join(f"{100 * a:.0f}%" for a in classes))
        if bug == "early-stop":
            # Early stopping on a plateau: stop once an epoch improves the test loss by less than 15%.
            plateau = test_loss > (1 - PLATEAU) * best_loss
            best_loss = min(best_loss, test_loss)
            if fix:
                # FIX: whoever decides, every rank learns the decision: a flag all-reduced over the ranks.
                stop = torch.tensor(float(ctx.is_main and plateau), device=ctx.device)
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
                if stop.item():
                    print0(ctx, f"Early stop after epoch {epoch + 1}: test loss {test_loss:f}, "
                                f"less than {PLATEAU:.0%} better")
                    break
            elif ctx.is_main and plateau:  # BUG: only rank 0 leaves the loop; the others train on without it
                print0(ctx, f"Early stop after epoch {epoch + 1}: test loss {test_loss:f}, "
                            f"less than {PLATEAU:.0%} better")
                break
        if bug == "slow-save" and ctx.is_main:  # a checkpoint after each epoch, to a slow shared disk
            if fix:  # FIX: a copy on the CPU, written by a thread while every rank trains on
                writer.save(model.module, output / "checkpoint.pth", write_seconds)
            else:  # BUG: written on the training path; the others wait for it in the next step's all-reduce
                write_to_slow_disk(cpu_copy(model.module), output / "checkpoint.pth", write_seconds)
            # The other fix: the write where it is, and a wait for it where you wrote it, with time for it: every rank
            # calls dist.barrier(group=save_group) right after the save, in a group made once on every rank with
            # save_group = dist.new_group(timeout=timedelta(seconds=cfg.timeout + SLOW_WRITE + 60)).
    if ctx.is_main:
        writer.wait()  # slow-save: the last checkpoint is written before the process ends
    print0(ctx, "Done!")
    if ctx.is_main:
        if bug == "save-wrapped" and not fix:
            save_weights(model, output / "model.pth")  # BUG: DDP's own state_dict: every key starts with `module.`
        else:  # FIX (save-wrapped): model.module, the plain model; its keys are chapter 1's
            save_weights(network.net if bug == "unused-parameters" else network, output / "model.pth")
        if bug == "save-wrapped":  # load it back as an evaluation script does: into the plain model
            NeuralNetwork().load_state_dict(torch.load(output / "model.pth", weights_only=True))
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")


class HangWatch:
    """A thread that writes this rank's stacks when no forward() has started for `seconds` (a rank that waits).

    `py-spy dump` where py-spy is installed (it reads the process from outside; its --native mode showed only a
    garbage-collector frame here, so it is not used); else faulthandler, which dumps every Python thread's stack from here, while the main thread is still stuck.
    """

    def __init__(self, seconds, path):
        self.seconds, self.path, self.last = seconds, path, float("inf")  # watching from the first step on
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def step(self, *args):
        """A forward pre-hook: the rank is making progress."""
        self.last = time.monotonic()

    def _watch(self):
        while not self.stopped.wait(0.5):
            waited = time.monotonic() - self.last
            if waited >= self.seconds:
                self.dump(f"no forward() for {waited:.1f}s")
                self.last = float("inf")  # once per wait is enough

    def dump(self, why):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(f"=== {socket.gethostname()} pid {os.getpid()}: {why}\n")
            f.flush()
            spy = shutil.which("py-spy")
            if spy:
                subprocess.run([spy, "dump", "--pid", str(os.getpid())], stdout=f, stderr=f, timeout=30)
            else:
                faulthandler.dump_traceback(f, all_threads=True)

    def stop(self):
        self.stopped.set()


# The flight recorder's buffer size and dump file: torch 2.8 renamed them (the old names still work, with a warning).
FLIGHT_RECORDER_VARIABLES = (("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE") if TorchVersion(torch.__version__) >=
                             (2, 8) else ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"))


def write_flight_record(folder, rank):
    """This rank's flight recorder (its last TORCH_FR_BUFFER_SIZE collectives), the pickle torch dumps, to FOLDER/rank_N.

    NCCL keeps a recorder of its own (its entries carry CUDA events); gloo's collectives go to torch's generic one."""
    folder.mkdir(parents=True, exist_ok=True)
    c10d = torch._C._distributed_c10d
    data = c10d._dump_nccl_trace() if dist.get_backend() == "nccl" else c10d._dump_fr_trace()
    tmp = folder / f".rank_{rank}.tmp"
    tmp.write_bytes(data)
    tmp.replace(folder / f"rank_{rank}")


def describe_flight_records(folder, world_size, wait):
    """One line comparing the ranks' records (the files they wrote, waiting up to `wait` s for all), or None."""
    deadline = time.monotonic() + wait
    while len(list(folder.glob("rank_*"))) < world_size and time.monotonic() < deadline:
        time.sleep(0.2)
    last = {}
    for path in folder.glob("rank_*"):
        entries = pickle.loads(path.read_bytes()).get("entries", [])
        last[int(path.name.split("_")[1])] = entries
    if not any(last.values()):  # the recorder was off (TORCH_FR_BUFFER_SIZE=0)
        return None
    seqs = {r: (e[-1]["collective_seq_id"] if e else 0) for r, e in sorted(last.items())}

    def what(entry):
        sizes = " ".join("x".join(map(str, s)) or "scalar" for s in entry["input_sizes"])
        return f"#{entry['collective_seq_id']} {entry['profiling_name']} [{sizes}] {','.join(entry['input_dtypes'])}"

    common = min(seqs.values())
    for seq in range(1, common + 1):  # the first collective the ranks did not agree on
        ops = {r: next((x for x in e if x["collective_seq_id"] == seq), None) for r, e in last.items()}
        shown = {r: (o["profiling_name"], o["input_sizes"], o["input_dtypes"]) for r, o in ops.items() if o}
        if len(set(map(repr, shown.values()))) > 1:
            return "flight recorder: the ranks' collective " + f"#{seq} differs: " + "; ".join(
                f"rank {r} {what(o)}" for r, o in sorted(ops.items()) if o)
    missing = [r for r in range(world_size) if r not in last]
    behind = [r for r, s in seqs.items() if s == common]
    ahead = {r: s for r, s in seqs.items() if s > common}
    if ahead:
        r, s = max(ahead.items(), key=lambda kv: kv[1])
        entry = next(x for x in last[r] if x["collective_seq_id"] == common + 1)
        return (f"flight recorder: rank {r} ran {s} collectives, rank{'s' * (len(behind) > 1)} "
                f"{', '.join(map(str, behind))} only {common}: rank {r}'s {what(entry)} had no partner"
                + (f" (no record from rank {', '.join(map(str, missing))})" if missing else ""))
    return f"flight recorder: all ranks ran {common} matching collectives" + (
        f" (no record from rank {', '.join(map(str, missing))})" if missing else "")


def parse_args():
    """This chapter's flags (--bug, --fix) on top of the ones every chapter shares."""
    cfg = parse_config(description=__doc__, bug=flag(REQUIRED, BUGS, "which broken case to run"),
                       fix=flag(False, bool, "run the same case with the bug fixed"),
                       max_norm=flag(0.25, RATE, "shard-grad-norm: clip the gradients to this norm (theirs: 0.5-2)"))
    if cfg.bug == "shape-mismatch" and cfg.test_samples is None:
        cfg.test_samples = SMALL_TEST_SET  # a small test set: a rank's shard need not hold every class
    if cfg.bug in SILENT and cfg.train_samples is None:
        cfg.train_samples = SILENT_TRAIN_SET  # rounding alone parts two runs more with every step: a short run
    return cfg, cfg.bug, cfg.fix


@record
def main():
    cfg, bug, fix = parse_args()
    if cfg.accum_steps != 1 or cfg.precision != "fp32" or cfg.compile or cfg.snapshot:  # each case: one collective
        raise UsageError("debug_hang.py's cases train in fp32, eagerly, one batch per step, without snapshots: leave "
                         "out --accum-steps, --precision, --compile and --snapshot")
    faulthandler.enable()  # a crash below Python (gloo's abort, a segfault) still prints each thread's stack
    # torchrun stops the other workers with SIGTERM when one fails: each prints where it was before it goes.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    if not {"RANK", "LOCAL_RANK", "WORLD_SIZE"} <= os.environ.keys():
        raise UsageError("RANK/LOCAL_RANK/WORLD_SIZE are not set: start this script with torchrun, e.g. "
                         "`torchrun --standalone --nproc-per-node 2 debug_hang.py --bug eval-on-rank0`")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    name_rank_in_errors(rank, world_size)
    check_global_batch(cfg.batch_size, world_size)
    device = rank_device(cfg.device, local_rank, int(os.environ["LOCAL_WORLD_SIZE"]))
    if device.type == "cpu" and not hasattr(torch._C._distributed_c10d, "_dump_fr_trace"):  # gloo's recorder: 2.8+
        raise UsageError(f"debug_hang.py on the CPU needs torch 2.8 or later, whose flight recorder also records gloo's "
                         f"collectives (this is torch {torch.__version__}): upgrade torch, or run it on GPUs")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    output = prepare_output(cfg.output)
    records, stacks = output / "flight_recorder", output / "stacks" / f"rank_{rank}.txt"
    # The flight recorder: every process group made from here on keeps its last 2000 collectives, gloo's too (torch
    # 2.11 and later keep 2000 unless told otherwise; 2.6-2.10 keep none). Its variables were renamed in torch 2.8.
    # (gloo has a recorder from torch 2.8 on, which is why the CPU needs 2.8: above.)
    buffer_size, dump_file = FLIGHT_RECORDER_VARIABLES
    os.environ.setdefault(buffer_size, "2000")
    if device.type == "cuda":
        # NCCL: a collective that overruns --timeout ends the process from the watchdog thread (SIGABRT), where no
        # Python runs, so no rank could write or compare its record below. The watchdog writes it itself first (by
        # default from torch 2.7 on; 2.6 needs the variable): FOLDER/nccl_trace_rank_N, which `torchfrtrace FOLDER
        # --prefix nccl_trace_rank_` compares.
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault(dump_file, str(records / "nccl_trace_rank_"))
        records.mkdir(parents=True, exist_ok=True)
        print0(ctx, f"On NCCL the watchdog writes each rank's flight record to {records}/nccl_trace_rank_N when a "
                    f"collective times out; compare them with `torchfrtrace {records} --prefix nccl_trace_rank_`")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=cfg.timeout),
                            device_id=device if device.type == "cuda" else None)  # NCCL then connects here.
    watch = HangWatch(cfg.timeout / 2, stacks)  # a rank that waits half of --timeout writes its stacks
    try:
        if rank == 0:  # no records or stacks of an earlier run to compare with
            for old in [*records.glob("rank_*"), *stacks.parent.glob("rank_*.txt")]:
                old.unlink()
        dist.barrier()  # the old files are gone before anyone writes new ones
        train(cfg, bug, fix, ctx, output, watch)
        write_flight_record(records, rank)  # for a rank that failed later: what this one ran before it left
    except Exception as e:
        watch.stop()
        if not stacks.exists():  # it failed before it waited long: the stack of the call that failed will do
            stacks.parent.mkdir(parents=True, exist_ok=True)
            stacks.write_text(f"=== {socket.gethostname()} pid {os.getpid()}: where it failed\n"
                              + "".join(traceback.format_exception(e)))
        write_flight_record(records, rank)
        line = describe_flight_records(records, world_size, wait=min(5.0, cfg.timeout))
        if line:
            sys.stderr.write(f"[rank {rank}] {line}\n")
        if stacks.exists():
            sys.stderr.write(f"[rank {rank}] its stack: {stacks}\n")
        sys.stderr.flush()
        faulthandler.dump_traceback_later(15, exit=True)  # leaving the group after a failure must not hang either
        raise
    finally:
        watch.stop()
        destroy_process_group()  # dist.destroy_process_group(); after an error, common/ranks.py prints it first.


if __name__ == "__main__":
    run_main(main)
