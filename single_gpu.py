"""Chapter 1: the quickstart MLP on FashionMNIST, on one device (the GPU if one is visible, else the CPU).

    python single_gpu.py                          # 5 epochs, batch 64, lr 1e-3, seed 0
    CUDA_VISIBLE_DEVICES=0 python single_gpu.py   # pick the GPU

Every later chapter is chapter 1 plus the lines its strategy needs: `diff single_gpu.py ddp_launch.py`.
"""
import torch
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
        save_weights(model, output / "model.pth")
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")


if __name__ == "__main__":
    run_main(main)
