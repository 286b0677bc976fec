"""Started by tests/test_training_flags.py under torchrun: how many all-reduces DDP sends per optimizer step.

A DDP communication hook sees every bucket DDP all-reduces (and passes it on to the default all-reduce); the run
trains one epoch with --accum-steps 1, 2 and 4 through common.engine.train_one_epoch and prints, from rank 0, one
JSON line per K: the optimizer steps, the hook's calls and how many of them closed a backward (the last bucket).
"""
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.config import Config  # noqa: E402
from common.data import TensorImages, make_loader  # noqa: E402
from common.engine import steps_per_epoch, train_one_epoch  # noqa: E402
from common.errors import run_main  # noqa: E402
from common.metrics import MetricsLog  # noqa: E402
from common.model import NeuralNetwork  # noqa: E402
from common.ranks import DistContext  # noqa: E402


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    ctx = DistContext(rank=dist.get_rank(), world_size=dist.get_world_size())
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (192, 1, 28, 28), dtype=torch.uint8, generator=g)
    data = TensorImages(images, torch.randint(0, 10, (192,), generator=g))
    try:
        for k in (1, 2, 4):
            cfg = Config(batch_size=32, accum_steps=k, log_every=1000)
            sampler = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, seed=0)
            loader = make_loader(data, cfg.batch_size // (ctx.world_size * k), sampler)
            torch.manual_seed(0)
            model = DDP(NeuralNetwork())
            buckets = []  # one entry per bucket DDP all-reduced: True for the last bucket of a backward()

            def counting_hook(process_group, bucket):
                buckets.append(bucket.is_last())
                return allreduce_hook(process_group, bucket)

            model.register_comm_hook(None, counting_hook)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            train_one_epoch(model, loader, optimizer, None, 0, cfg, ctx, MetricsLog(None, ctx))
            if ctx.is_main:
                print(json.dumps(dict(accum_steps=k, micro_batches=len(loader), steps=steps_per_epoch(loader, cfg),
                                      all_reduces=len(buckets), backward_syncs=sum(buckets))), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)  # as every entry script: its exit skips the interpreter shutdown that can abort
