"""A template to copy: DDP started by torchrun, on the CPU or GPUs, in plain torch + torchvision (chapter 3's 8 steps).
Put yours at YOUR MODEL HERE and YOUR DATA HERE; as it stands, it trains chapter 1's model (single_gpu.py) at any size.

    torchrun --standalone --nproc-per-node 2 template.py    # one machine, 2 processes (GPUs or the CPU); gpu: 1 per GPU
    python template.py                                      # without torchrun: a world of one process"""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms


class NeuralNetwork(nn.Module):  # the quickstart's MLP, with common/model.py's names: model.pth loads in every chapter
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28 * 28, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x):
        return self.linear_relu_stack(self.flatten(x))


def build_model():  # YOUR MODEL HERE
    return NeuralNetwork()


def build_datasets(args, local_rank):  # YOUR DATA HERE: (train set, test set) of (input, label) pairs
    if local_rank == 0:  # One process per machine finds the data (downloading it if it must), then the rest.
        datasets.FashionMNIST(args.data_dir, download=True)  # Its download fetches both splits' files.
    dist.barrier()  # The others wait here until local rank 0 has the files; then every rank reads them.
    sets = [datasets.FashionMNIST(args.data_dir, train=t, transform=transforms.ToTensor()) for t in (True, False)]
    return [Subset(s, range(n or len(s))) for s, n in zip(sets, (args.train_samples, args.test_samples))]  # first n


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, kind, default in [("--epochs", int, 5), ("--batch-size", int, 64), ("--lr", float, 1e-3),
                                ("--seed", int, 0), ("--data-dir", str, "data"), ("--output", str, "runs/template"),
                                ("--log-every", int, 100), ("--timeout", float, 120.0),
                                ("--train-samples", int, None), ("--test-samples", int, None)]:  # None: all images
        p.add_argument(flag, type=kind, default=default, help=f"default: {default}")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if a GPU is visible, else cpu")
    args = p.parse_args()
    # Step 1, who am I: torchrun sets RANK (global: rank 0 prints and saves), LOCAL_RANK (it picks the GPU), WORLD_SIZE.
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))  # No torchrun: 1 process.
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if args.batch_size % world_size:
        raise SystemExit(f"error: --batch-size {args.batch_size} must split evenly over {world_size} processes")
    # Step 2, device: this process's GPU, or the CPU (--device cpu, or no GPU visible).
    cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # Pin this process's GPU before anything else touches one.
    # Step 3, init: env:// reads torchrun's MASTER_ADDR and MASTER_PORT. A peer missing for --timeout is an error.
    store = None if "RANK" in os.environ else dist.HashStore()  # Without torchrun: a store in memory, for one process.
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout), device_id=device if cuda else None)
    try:
        train(args, rank, local_rank, world_size, device)  # steps 4 to 7, below
    finally:  # Step 8, teardown: it runs after an error too. The other ranks stop (gloo at once, NCCL at --timeout).
        dist.destroy_process_group()


def train(args, rank, local_rank, world_size, device):
    print0 = lambda *line: print(*line, flush=True) if rank == 0 else None  # noqa: E731  (global rank 0 alone prints)
    print0(f"Using {device} device, {world_size} processes, backend {dist.get_backend()}")
    # Step 4, data: chapter 1's shuffle dealt to the ranks in turn; each rank tests its own part of the test set.
    train_set, test_set = build_datasets(args, local_rank)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=train_sampler)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=1000)
    torch.manual_seed(args.seed)  # the same initial weights in every chapter
    model = build_model().to(device)
    # Step 5, wrap: DDP copies rank 0's weights to every rank, then averages the gradients in each backward().
    model = DDP(model, device_ids=[device] if device.type == "cuda" else None)  # The GPU this rank computes on.
    loss_fn, optimizer = nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=args.lr)
    # Step 6, epochs: each draws its own shuffle from seed + epoch.
    for epoch in range(args.epochs):
        print0(f"Epoch {epoch + 1}\n-------------------------------")
        train_sampler.set_epoch(epoch)  # without it, every epoch would repeat epoch 0's order
        model.train()
        for step, (X, y) in enumerate(train_loader):
            X, y = X.to(device), y.to(device)
            loss = loss_fn(model(X), y)
            loss.backward()  # DDP: the gradients are averaged over the ranks here
            optimizer.step()
            optimizer.zero_grad()
            if step % args.log_every == 0:  # the global batch's mean loss: every rank's share of it, summed
                t = torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64, device=device)
                dist.all_reduce(t)
                print0(f"loss: {t[0] / t[1]:>7f}  [{step * args.batch_size:>5d}/{len(train_set):>5d}]")
        model.eval()
        loss_sum, correct, seen = 0.0, 0, 0
        with torch.no_grad():  # each rank's sums over its shard of the test set
            for X, y in test_loader:
                pred, y = model(X.to(device)), y.to(device)
                loss_sum += nn.functional.cross_entropy(pred, y, reduction="sum").item()
                correct, seen = correct + (pred.argmax(1) == y).sum().item(), seen + len(y)
        t = torch.tensor([loss_sum, correct, seen], dtype=torch.float64, device=device)
        dist.all_reduce(t)  # all ranks' sums: the whole test set's
        print0(f"Test Error: \n Accuracy: {100 * t[1] / t[2]:>0.1f}%, Avg loss: {t[0] / t[2]:>8f} \n")
    print0("Done!")
    # Step 7, save: the plain model's weights, once, without DDP's `module.` prefix, so every chapter loads them.
    path = os.path.join(args.output, "model.pth")
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        torch.save(model.module.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)  # whole or not at all: a crash mid-write leaves no half file
    print0(f"Saved PyTorch Model State to {path}")


if __name__ == "__main__":
    main()
