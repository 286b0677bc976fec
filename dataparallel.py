"""Chapter 2: the same training, the model wrapped in nn.DataParallel over all visible GPUs.

    CUDA_VISIBLE_DEVICES=0,1,2,3 python dataparallel.py   # one process splits each batch over 4 GPUs
    python dataparallel.py                                 # no GPU: runs the model on the CPU as chapter 1

One process, one optimizer: each step DataParallel copies the model to every GPU, scatters the batch, gathers the
outputs on the first GPU and sums the gradients there. Simple, but one process, bottlenecked on GPU 0.
"""
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, default_convert

from common.checkpoint import load_snapshot, prepare_output, save_snapshot, save_weights
from common.cli import parse_config, run_main
from common.data import load_fashion_mnist
from common.engine import MetricsLog, evaluate, train_one_epoch
from common.model import NeuralNetwork
from common.ranks import DistContext, choose_device, print0


def main():
    cfg = parse_config(description=__doc__)
    # Step 2, device: this process's GPU, or the CPU (--device cpu, or no GPU visible).
    device = choose_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Pin this process's GPU before anything else touches one.
    ctx = DistContext(device=device)
    train(cfg, ctx)


def train(cfg, ctx):
    print0(ctx, cfg.describe())
    print0(ctx, f"Using {ctx.device} device")
    output = prepare_output(cfg.output)

    # Step 4, data: a seeded shuffle, new each epoch, all of it for the one process (DistributedSampler, 1 replica).
    train_set, test_set, folder = load_fashion_mnist(cfg, ctx.device)
    print0(ctx, f"Data: {folder} ({len(train_set)} train / {len(test_set)} test images)")
    train_sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=cfg.seed)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size // cfg.accum_steps,
                              sampler=train_sampler, collate_fn=default_convert)
    test_loader = DataLoader(test_set, batch_size=1000, collate_fn=default_convert)  # The dataset gives whole batches.

    torch.manual_seed(cfg.seed)  # the same initial weights in every chapter
    model = NeuralNetwork().to(ctx.device)
    # Step 5, wrap: DataParallel scatters each batch over GPUs first, first+1, ...; with no CUDA at all it just calls
    # the model. (This file's nn.DataParallel, below: its replicas, one thread per GPU, keep --precision's dtype.)
    first = ctx.device.index or 0
    n_gpu = torch.cuda.device_count() - first if ctx.device.type == "cuda" else 0
    print0(ctx, f"n_gpu: {n_gpu}")
    if n_gpu < 2:
        print0(ctx, f"With {n_gpu} GPU(s) DataParallel has nothing to split: it falls back to running the model on "
                    f"{ctx.device}")
    if n_gpu or not torch.cuda.is_available():  # (it refuses a CPU model when GPUs exist, as with --device cpu)
        model = DataParallel(model, device_ids=list(range(first, first + n_gpu)) or None)
    if cfg.compile:  # In place, after any wrap, so state_dict() keeps its keys (docs/training_options.md).
        model.compile()
    print0(ctx, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    # --precision fp16: scale the loss up so float16's small gradients do not round to zero.
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.precision == "fp16")

    first_epoch = load_snapshot(model, optimizer, scaler, cfg, ctx)  # 0, or the epochs a --snapshot file holds.
    metrics = MetricsLog(output, ctx, first_epoch)
    # Step 6, epochs: each draws its own shuffle from seed + epoch.
    for epoch in range(first_epoch, cfg.epochs):
        print0(ctx, f"Epoch {epoch + 1}\n-------------------------------")
        train_sampler.set_epoch(epoch)  # without it, every epoch would repeat epoch 0's order
        train_one_epoch(model, train_loader, optimizer, scaler, epoch, cfg, ctx, metrics)
        evaluate(model, test_loader, epoch, ctx, metrics)
        if save_snapshot(model, optimizer, scaler, epoch + 1, cfg, ctx):  # Every --save-every epochs, with --snapshot.
            return  # SLURM warned of its time limit (docs/slurm.md): the snapshot holds the run.
    print0(ctx, "Done!")

    # Step 7, save: the plain model's weights, once, without DDP's `module.` prefix, so every chapter loads them.
    if ctx.is_main:
        save_weights(getattr(model, "module", model), output / "model.pth")
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")


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


if __name__ == "__main__":
    run_main(main)
