"""DDP's communication hooks (--comm-hook, the DDP chapters): torch's own, and PowerSGD's state kept in --snapshot."""
import argparse
import re
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from common.cli import FatalError, flag

# PowerSGD's start_powerSGD_iter: it all-reduces the whole gradient for its first steps, then compresses. torch
# needs at least 2 (DDP rebuilds its buckets after step 1, and the residuals it keeps are per bucket); a later start
# spares the first steps the compression, and on a slow link costs the whole gradient's bytes in each of them. For
# this model 2 trains as well as torch's default, 1,000: 64.8% and 64.9% after 5 epochs at rank 1, chapter 1 64.9%
# (scripts/scaling.py --accuracy, docs/scaling.md).
POWERSGD_START = 2
# With PowerSGD the chapters ask DDP for one bucket of up to 25 MiB (the whole 2.6 MB gradient) from the first step:
# PowerSGD keeps its residuals and factors per bucket index, and DDP's default buckets change after the first step
# (one becomes two here), so a run resumed from a --snapshot would meet, in its first step, residuals kept for other
# buckets. One bucket also keeps gloo from aborting: PowerSGD starts a bucket's second and third all-reduce from a
# callback, which gloo runs on its own thread, so with two buckets the ranks could start them in different orders.
ONE_BUCKET_MB = 25


def comm_hook_type(text):
    """--comm-hook's type: none, bf16, fp16, or powersgd[:RANK[:START]] (PowerSGD's rank and first compressed step)."""
    if not re.fullmatch(r"none|bf16|fp16|powersgd(:[1-9]\d*(:([2-9]|[1-9]\d+))?)?", text):
        raise argparse.ArgumentTypeError(f"must be none, bf16, fp16 or powersgd[:RANK[:START]] (RANK >= 1, START >= 2; "
                                         f"e.g. powersgd:4), got {text}")
    return text


def gpu_machines_cpu(cfg):
    """torch's PowerSGD hook syncs CUDA on the gradients' device wherever CUDA exists: on --device cpu it fails."""
    if cfg.comm_hook.startswith("powersgd") and cfg.device == "cpu" and torch.cuda.is_available():
        return ("--comm-hook powersgd cannot train with --device cpu where a GPU is visible: torch's PowerSGD hook "
                "then calls torch.cuda.synchronize() on the CPU's gradients and fails at its first compressed step; "
                "train on the GPUs, or hide them to train on the CPU (CUDA_VISIBLE_DEVICES=)")


COMM_HOOK = flag("none", comm_hook_type, "what DDP's all-reduces send: bf16/fp16 halve the bytes; powersgd[:R[:START]]:"
                 " whole gradients for START steps (default 2), then rank-R factors (R: 1)", check=gpu_machines_cpu)


def register_comm_hook(model, cfg):
    """--comm-hook: torch's hook for what each bucket's all-reduce sends; PowerSGD's state (for snapshots), or None."""
    name, *numbers = cfg.comm_hook.split(":")
    if name in ("bf16", "fp16"):
        model.register_comm_hook(None, getattr(default_hooks, f"{name}_compress_hook"))
    if name != "powersgd":
        return None
    rank, start = [int(n) for n in numbers] + [1, POWERSGD_START][len(numbers):]  # powersgd[:RANK[:START]]
    hook = PowerSGD(powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=start), model)
    model.register_comm_hook(hook.state, hook.in_bucket_order)
    return hook


class PowerSGD:
    """torch's PowerSGD hook, with its state in --snapshot and its residuals met in the order they were kept in."""

    def __init__(self, state, model):
        self.state, self.orders = state, {}  # orders: per bucket, its parameters' order (indices into the model's)
        self.index = {id(p): i for i, p in enumerate(model.parameters())}

    def in_bucket_order(self, state, bucket):
        """torch's hook; on a resumed first step, on a copy laid out as before (MKL rounds by address mod 16 bytes)."""
        order, b = [self.index[id(p)] for p in bucket.parameters()], bucket.index()
        if self.orders.get(b, order) == order or b not in state.error_dict:
            self.orders[b] = order
            return powerSGD_hook.powerSGD_hook(state, bucket)
        at = {i: k for k, i in enumerate(order)}
        own = [bucket.gradients()[at[i]] for i in self.orders[b]]  # views of DDP's buffer, in the kept order
        flat = torch.cat([g.reshape(-1) for g in own])  # a new buffer, aligned as DDP's
        grads = [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in own]), own)]
        laid = SimpleNamespace(index=bucket.index, is_last=bucket.is_last, buffer=lambda: flat, gradients=lambda: grads,
                               parameters=lambda: [bucket.parameters()[at[i]] for i in self.orders[b]])

        def copy_back(future):  # the hook's result (in flat), each gradient back where DDP keeps it
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
