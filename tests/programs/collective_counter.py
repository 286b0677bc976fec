"""Started by tests/test_training_flags.py under torchrun: how often the gradients cross the network per step.

One epoch of common.engine.train_one_epoch with --accum-steps 1, 2 and 4, wrapped as DDP, as FSDP2 and by hand (as
the chapters do it), on 192 random images. DDP: a communication hook sees every bucket DDP all-reduces (and passes it
on to the default all-reduce), and which of them closed a backward (the last bucket). FSDP2: every
reduce_scatter_single FSDP2 calls is counted on its way through. By hand (ddp_by_hand.py's average_gradients before
each optimizer step): every all-reduce of a gradient. Rank 0 prints one JSON line per wrap and K: the
optimizer steps, the micro-batches, and the counts.
"""
import json
import math
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, default_convert

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common.cli import Config  # noqa: E402
from common.data import DeviceImages  # noqa: E402
from common.engine import train_one_epoch  # noqa: E402
from common.cli import run_main  # noqa: E402
from common.engine import MetricsLog  # noqa: E402
from common.model import NeuralNetwork  # noqa: E402
from common.ranks import DistContext, destroy_process_group  # noqa: E402
import ddp_by_hand  # noqa: E402


def ddp(counts):
    """NeuralNetwork in DDP, with a hook that records each bucket's all-reduce (True: the backward's last)."""
    model = DDP(NeuralNetwork())

    def counting_hook(process_group, bucket):
        counts.append(bucket.is_last())
        return allreduce_hook(process_group, bucket)

    model.register_comm_hook(None, counting_hook)
    return model


def fsdp(counts):
    """NeuralNetwork sharded as fsdp.py shards it: each Linear a unit, then the root."""
    model = NeuralNetwork()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.linear_relu_stack:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def by_hand(counts):
    """NeuralNetwork as ddp_by_hand.py keeps it (its gradients averaged before each step, below), with rank 0's weights."""
    model = NeuralNetwork()
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    return model


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    ctx = DistContext(rank=dist.get_rank(), world_size=dist.get_world_size())
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (192, 1, 28, 28), dtype=torch.uint8, generator=g)
    data = DeviceImages(images, torch.randint(0, 10, (192,), generator=g))
    counts = []
    reduce_scatter = dist.reduce_scatter_single

    def counting_reduce_scatter(*args, **kwargs):  # FSDP2 calls dist.reduce_scatter_single for each unit's gradients
        counts.append(False)
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counting_reduce_scatter
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):  # by hand: ddp_by_hand.py's dist.all_reduce of a gradient
        counts.extend([False] * any(tensor is p.grad for p in model.parameters()))
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        for wrap in (ddp, fsdp, by_hand):
            for k in (1, 2, 4):
                cfg = Config(batch_size=32, accum_steps=k, log_every=1000)
                sampler = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, seed=0)
                loader = DataLoader(data, batch_size=cfg.batch_size // (ctx.world_size * k), sampler=sampler,
                                    collate_fn=default_convert)
                torch.manual_seed(0)
                counts.clear()
                model = wrap(counts)
                optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
                held_back = dict(no_sync=model.no_sync) if wrap is ddp else dict(
                    gradient_sync=model.set_requires_gradient_sync) if wrap is fsdp else {}  # as the chapters pass them
                if wrap is by_hand:  # ddp_by_hand.py's line
                    optimizer.register_step_pre_hook(lambda *_: ddp_by_hand.average_gradients(model, ctx.world_size))
                train_one_epoch(model, loader, optimizer, None, 0, cfg, ctx, MetricsLog(None, ctx), **held_back)
                if ctx.is_main:
                    print(json.dumps(dict(wrap=wrap.__name__, accum_steps=k, micro_batches=len(loader),
                                          steps=math.ceil(len(loader) / cfg.accum_steps), collectives=len(counts),
                                          backward_ends=sum(counts))), flush=True)
    finally:
        destroy_process_group()


if __name__ == "__main__":
    run_main(main)  # as every entry script: its exit skips the interpreter shutdown that can abort
