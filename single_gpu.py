"""Chapter 1: train the quickstart MLP on FashionMNIST on one device (CUDA if visible, else CPU).

    python single_gpu.py                          # 5 epochs, batch 64, lr 1e-3, seed 0
    CUDA_VISIBLE_DEVICES=0 python single_gpu.py   # pick the GPU
    python single_gpu.py --device cpu --epochs 1 --train-samples 6400

Every later chapter is this file plus the lines its strategy needs: `diff single_gpu.py ddp_mp.py`.
"""
import torch

from common.checkpoint import prepare_output, save_weights
from common.config import parse_config
from common.data import SeededSampler, ShardSampler, load_fashion_mnist, make_loader
from common.distributed import print0, single_process
from common.engine import fit
from common.errors import run_main
from common.model import NeuralNetwork


def train(cfg, ctx):
    print0(ctx, cfg.describe())
    print0(ctx, f"Using {ctx.device} device")
    output = prepare_output(cfg.output)

    train_set, test_set, folder = load_fashion_mnist(cfg, ctx.device)
    print0(ctx, f"Data: {folder} ({len(train_set)} train / {len(test_set)} test images)")
    train_sampler = SeededSampler(train_set, seed=cfg.seed)
    train_loader = make_loader(train_set, cfg.batch_size, train_sampler)
    test_loader = make_loader(test_set, 1000, ShardSampler(test_set))

    torch.manual_seed(cfg.seed)  # the same initial weights in every chapter
    model = NeuralNetwork().to(ctx.device)
    print0(ctx, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)

    fit(model, train_loader, test_loader, optimizer, cfg, ctx)

    save_weights(model, output / "model.pth", ctx)
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")


def main():
    cfg = parse_config(description=__doc__)
    ctx = single_process(cfg)
    train(cfg, ctx)


if __name__ == "__main__":
    run_main(main)
