"""DDP's communication hooks (--comm-hook, the DDP chapters): torch's own, their state kept in --snapshot."""
import argparse
import math
import re
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

from common.cli import FatalError, flag

# PowerSGD's start_powerSGD_iter: it all-reduces the whole gradient for its first steps, then compresses. torch
# needs at least 2 (DDP rebuilds its buckets after step 1, and the residuals it keeps are per bucket); a later start
# spares the first steps the compression, and on a slow link costs the whole gradient's bytes in each of them. For
# this model 2 trains as well as torch's default, 1,000: 64.8% and 64.9% after 5 epochs at rank 1, chapter 1 64.9%
# (measured by the sweep's accuracy runs, since replaced by measure/scaling.py --whole; docs/scaling.md).
POWERSGD_START = 2
# With PowerSGD the chapters ask DDP for one bucket of up to 25 MiB (the whole 2.6 MB gradient) from the first step.
# PowerSGD keeps its residuals and factors per bucket index, and DDP's default buckets change after the first step
# (one becomes two here), so a run resumed from a --snapshot would meet, in its first step, residuals kept for other
# buckets. One bucket also keeps gloo from aborting: PowerSGD starts a bucket's second and third all-reduce from a
# callback, which gloo runs on its own thread, so with two buckets the ranks could start them in different orders.
ONE_BUCKET_MB = 25


def comm_hook_type(text):
    """--comm-hook's type: none, bf16, fp16, powersgd[:RANK[:START]] or localsgd:H[:START] (see COMM_HOOK)."""
    if not re.fullmatch(r"none|bf16|fp16|powersgd(:[1-9]\d*(:([2-9]|[1-9]\d+))?)?|localsgd:([2-9]|[1-9]\d+)(:\d+)?",
                        text):
        raise argparse.ArgumentTypeError(f"must be none, bf16, fp16, powersgd[:RANK[:START]] or localsgd:H[:START] "
                                         f"(RANK >= 1, START >= 2, H >= 2; e.g. powersgd:4, localsgd:16), got {text}")
    return text


def check_comm_hook(cfg):
    """What a hook cannot train with, in one line before any rendezvous (or None)."""
    if cfg.comm_hook.startswith("powersgd") and cfg.device == "cpu" and torch.cuda.is_available():  # torch's hook
        return ("--comm-hook powersgd cannot train with --device cpu where a GPU is visible: torch's PowerSGD hook "
                "then calls torch.cuda.synchronize() on the CPU's gradients and fails at its first compressed step; "
                "train on the GPUs, or hide them to train on the CPU (CUDA_VISIBLE_DEVICES=)")
    if cfg.comm_hook.startswith("powersgd") and cfg.precision == "fp16":  # Torch's residuals keep an overflow's NaN.
        return ("--comm-hook powersgd cannot train with --precision fp16: one overflowed step leaves NaN in PowerSGD's "
                "residuals for good, and the GradScaler then skips every later step; use --precision bf16")
    if cfg.comm_hook.startswith("localsgd") and cfg.precision == "fp16":  # each rank's own overflows skip its steps
        return ("--comm-hook localsgd cannot train with --precision fp16: each rank's GradScaler would skip the steps "
                "its own gradients overflowed in, and the ranks would average at different steps; use --precision bf16")


COMM_HOOK = flag("none", comm_hook_type, "what DDP's all-reduces send: bf16/fp16 half the bytes; after START steps of "
                 "whole gradients (default 2), powersgd[:R[:START]] rank-R factors (R: 1), localsgd:H[:START] "
                 "nothing, the weights averaged every H steps of an epoch and at its end", check=check_comm_hook)


def register_comm_hook(model, cfg, optimizer, loader):
    """--comm-hook: torch's hook for what each bucket's all-reduce sends; its state (for snapshots), or None."""
    name, *numbers = cfg.comm_hook.split(":")
    if name in ("bf16", "fp16"):
        model.register_comm_hook(None, getattr(default_hooks, f"{name}_compress_hook"))
    if name == "powersgd":
        return PowerSGD(model, *map(int, numbers))
    if name == "localsgd":
        return LocalSGD(model, optimizer, math.ceil(len(loader) / cfg.accum_steps), *map(int, numbers))


class LocalSGD:
    """Post-local SGD: START steps as DDP, then each rank steps on its own gradients, and every H steps of an epoch
    and at its end the ranks average their weights (at the end SGD's momentum too: one model to test and snapshot)."""

    def __init__(self, model, optimizer, steps_per_epoch, period, start=2):
        self.optimizer, self.steps_per_epoch, self.period, self.step = optimizer, steps_per_epoch, period, 0
        self.state = post_localSGD_hook.PostLocalSGDState(None, None, start, post_local_gradient_allreduce=False)
        model.register_comm_hook(self.state, post_localSGD_hook.post_localSGD_hook)  # after START: no all-reduce
        optimizer.register_step_post_hook(self.after_step)  # what torch's PostLocalSGDOptimizer adds to step()

    @torch.no_grad()
    def after_step(self, *_):
        """After each optimizer step past START: at steps H, 2H, ... of the epoch and its last, one all-reduce."""
        self.step += 1
        if self.step > self.state.start_localSGD_iter and self.step % self.steps_per_epoch % self.period == 0:
            end = self.step % self.steps_per_epoch == 0
            momentum = [s["momentum_buffer"] for s in self.optimizer.state.values() if end and "momentum_buffer" in s]
            tensors = [p for g in self.optimizer.param_groups for p in g["params"]] + momentum
            # torch's average_parameters, less two faults: it leaves each tensor a view into one flat buffer (model.pth
            # then holds the momentum too), and syncs the GPU for CPU tensors too (each CPU rank opens a CUDA context)
            flat = torch.cat([t.reshape(-1) for t in tensors]) / dist.get_world_size()
            if flat.device.type != "cpu":  # Torch waits for the device here, before its all-reduce.
                torch.accelerator.synchronize()
            dist.all_reduce(flat)
            for t, mean in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(mean.view_as(t))

    def all_gather(self, ctx):  # for rank 0's snapshot: at an epoch's end every rank's weights and momentum are equal
        return dict(step=self.step, iter=self.state.iter)

    def load(self, saved, ctx, where):
        self.step, self.state.iter = saved["step"], saved["iter"]


class PowerSGD:
    """torch's PowerSGD hook, with its state in --snapshot and its residuals met in the order they were kept in."""

    def __init__(self, model, rank=1, start=POWERSGD_START):
        self.state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=start)
        self.orders = {}  # It maps each bucket to its parameters' order, as indices into the model's.
        self.index = {id(p): i for i, p in enumerate(model.parameters())}
        model.register_comm_hook(self.state, self.in_bucket_order)

    def in_bucket_order(self, state, bucket):
        """torch's hook; on a resumed first step, on a copy laid out as before (MKL rounds by address mod 16 bytes)."""
        order, b = [self.index[id(p)] for p in bucket.parameters()], bucket.index()
        if self.orders.get(b, order) == order or b not in state.error_dict:
            self.orders[b] = order
            return powerSGD_hook.powerSGD_hook(state, bucket)
        at = {i: k for k, i in enumerate(order)}
        own = [bucket.gradients()[at[i]] for i in self.orders[b]]  # These are views of DDP's buffer, in the kept order.
        flat = torch.cat([g.reshape(-1) for g in own])  # This new buffer is aligned as DDP's is.
        grads = [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in own]), own)]
        laid = SimpleNamespace(index=bucket.index, is_last=bucket.is_last, buffer=lambda: flat, gradients=lambda: grads,
                               parameters=lambda: [bucket.parameters()[at[i]] for i in self.orders[b]])

        def copy_back(future):  # It copies the hook's result (in flat) back to each gradient, where DDP keeps it.
            for g, new in zip(own, grads):
                g.copy_(new)
            return bucket.buffer()

        return powerSGD_hook.powerSGD_hook(state, laid).then(copy_back)

    def all_gather(self, ctx):
        """Every rank's state for rank 0's snapshot: step, factors, residuals (no rng: warm_start draws Q once)."""
        cpu = lambda tensors: {b: t.cpu() for b, t in tensors.items()}  # noqa: E731
        mine = dict(iter=self.state.iter, orders=self.orders, error=cpu(self.state.error_dict),
                    p=cpu(self.state.p_memory_dict), q=cpu(self.state.q_memory_dict))
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
        return everyone

    def load(self, saved, ctx, where):
        """This rank's part of a snapshot's state; one line if it holds another number of ranks' (each keeps its own)."""
        if saved is None or len(saved) != ctx.world_size:
            raise FatalError(f"snapshot {where} holds PowerSGD's residuals of {len(saved or [])} ranks, this run has "
                             f"{ctx.world_size}: resume with {len(saved or [])} ranks (each keeps its own), or delete it")
        mine, state = saved[ctx.rank], self.state
        state.iter, self.orders = mine["iter"], mine.get("orders", {})
        state.error_dict, state.p_memory_dict, state.q_memory_dict = (
            {b: t.to(ctx.device) for b, t in mine[k].items()} for k in ("error", "p", "q"))
