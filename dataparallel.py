"""Chapter 2: the same training, the model wrapped in nn.DataParallel over all visible GPUs.

    CUDA_VISIBLE_DEVICES=0,1,2,3 python dataparallel.py   # one process splits each batch over 4 GPUs
    python dataparallel.py                                 # no GPU: runs the model on the CPU as chapter 1

One process, one optimizer: each step DataParallel copies the model to every GPU, scatters the batch,
gathers the outputs on the first GPU and sums the gradients there. Simple, but single-process and
bottlenecked on GPU 0; the DDP chapters do better.
"""
import torch
from torch import nn

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
    # DataParallel scatters each batch over GPUs first, first+1, ...; with no CUDA at all it just calls the model.
    first = ctx.device.index or 0
    n_gpu = torch.cuda.device_count() - first if ctx.device.type == "cuda" else 0
    print0(ctx, f"n_gpu: {n_gpu}")
    if n_gpu < 2:
        print0(ctx, f"With {n_gpu} GPU(s) DataParallel has nothing to split: it falls back to running the model on {ctx.device}")
    if n_gpu or not torch.cuda.is_available():  # (it refuses a CPU model when GPUs exist, as with --device cpu)
        model = nn.DataParallel(model, device_ids=list(range(first, first + n_gpu)) or None)
    print0(ctx, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)

    fit(model, train_loader, test_loader, optimizer, cfg, ctx)

    save_weights(model, output / "model.pth", ctx)  # saves model.module: no `module.` prefix
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")


def main():
    cfg = parse_config(description=__doc__)
    ctx = single_process(cfg)
    train(cfg, ctx)


if __name__ == "__main__":
    run_main(main)
