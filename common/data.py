"""FashionMNIST without internet: find the IDX files, decode them once into tensors, serve them to a DataLoader."""
import gzip
import math
import os
import socket
import struct
from pathlib import Path

import torch
from torch.utils.data import Dataset, Sampler

from common.errors import FatalError

# Debian's dataset-fashion-mnist package installs the four .gz files here.
SYSTEM_DIR = os.environ.get("FASHION_MNIST_SYSTEM_DIR", "/usr/share/datasets/fashion-mnist")
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
HOW_TO_GET = (
    "get it with `sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu), "
    "or run once with internet access (torchvision downloads it to ./data), "
    "or pass --data-dir DIR holding the four IDX files"
)


def read_idx(path):
    """Decode one uint8 IDX file (raw or .gz) into a tensor shaped by its header; damaged files raise FatalError."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            magic = f.read(4)
            if len(magic) != 4 or magic[:3] != b"\x00\x00\x08":
                raise FatalError(f"{path} is not a uint8 IDX file (bad header); delete it and fetch the data again")
            shape = struct.unpack(f">{magic[3]}I", f.read(4 * magic[3]))
            # Read straight into one preallocated buffer, a MiB at a time: gzip decompresses each read into a new
            # bytes object first, so one read of the whole file would hold the 47 MB training images twice.
            buf = bytearray(math.prod(shape))
            view, got = memoryview(buf), 0
            while got < len(buf):
                n = f.readinto(view[got:got + 2**20])
                if not n:
                    break
                got += n
            if got < len(buf) or f.read(1):
                raise FatalError(
                    f"{path} is truncated or has extra bytes (header says {len(buf)} bytes of data, found {got}"
                    f"{'+' if got == len(buf) else ''}); delete it and fetch the data again"
                )
    except (OSError, EOFError, struct.error) as e:  # unreadable, bad gzip, cut-off header or stream
        raise FatalError(f"cannot read {path}: {e}; delete it and fetch the data again") from None
    return torch.frombuffer(buf, dtype=torch.uint8).view(*shape)


def _find_split_files(folder, split):
    """Paths of a split's (images, labels) in folder, raw or .gz, flat or torchvision layout; None if absent."""
    found = []
    for name in FILES[split]:
        candidates = [d / n for d in (folder / "FashionMNIST" / "raw", folder) for n in (name, name + ".gz")]
        path = next((c for c in candidates if c.is_file()), None)
        if path is None:
            return None
        found.append(path)
    return tuple(found)


def _download(root):
    """Let torchvision download FashionMNIST into root; returns None on success, else why it could not."""
    if os.environ.get("FASHION_MNIST_OFFLINE"):
        return "FASHION_MNIST_OFFLINE is set, so no download was tried"
    try:
        from torchvision.datasets import FashionMNIST  # only needed here, so training never imports it
    except ImportError:
        return "torchvision is not installed to download it"
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(30)  # no internet should fail fast, not hang
    made = [d for d in (root, root / "FashionMNIST", root / "FashionMNIST" / "raw") if not d.exists()]
    try:
        for train in (True, False):
            FashionMNIST(root, train=train, download=True)
    except Exception as e:  # torchvision raises RuntimeError, URLError, ... when offline
        for folder in reversed(made):  # leave no empty data/FashionMNIST/raw behind; files that did arrive stay
            try:
                folder.rmdir()
            except OSError:
                break
        return f"the download failed ({type(e).__name__}: {e})"
    finally:
        socket.setdefaulttimeout(previous)
    return None


def locate_fashion_mnist(data_dir=None):
    """Where to read FashionMNIST from: --data-dir, else ./data, the system copy, then a torchvision download."""
    if data_dir is not None:
        root = Path(data_dir)
        if not root.is_dir() or not os.access(root, os.R_OK | os.X_OK):
            raise FatalError(f"--data-dir {data_dir} is not a readable folder; fix the path or leave --data-dir out")
        searched = [root]
    else:
        root = Path("data")
        searched = [root, Path(SYSTEM_DIR)]
    for folder in searched:
        if _find_split_files(folder, "train") and _find_split_files(folder, "test"):
            return folder
    why = _download(root)
    if why is None and _find_split_files(root, "train") and _find_split_files(root, "test"):
        return root
    raise FatalError(f"FashionMNIST not found in {', '.join(map(str, searched))} and {why or 'the download left no files'}; {HOW_TO_GET}")


class TensorImages(Dataset):
    """FashionMNIST's images as the files hold them, uint8 (N, 1, 28, 28), and their int64 labels, both already on the
    training device. An item is (image, label) as torchvision's FashionMNIST with ToTensor gives it, the image float32
    in [0, 1], so the chapters' plain `DataLoader(dataset, batch_size=..., sampler=...)` works on it as on any
    Dataset, and its collate stacks a batch on the device. The labels stay there too: a batch of Python ints would be
    a new CPU tensor every step, whose copy to the GPU from pageable memory waits for the GPU (a host sync per step).
    Kept as uint8, the set takes 55 MB, a quarter of float32's 219 MB; each batch is scaled as it is fetched.
    """

    def __init__(self, images, labels):
        if len(images) != len(labels):
            raise FatalError(f"FashionMNIST files disagree: {len(images)} images but {len(labels)} labels; fetch the data again")
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index].float().div_(255), self.labels[index]  # ToTensor's scaling

    def __getitems__(self, indices):  # the DataLoader's batched fetch: one gather and one scaling per batch
        index = torch.tensor(indices)
        if self.labels.device.type != "cpu":  # from pinned memory a copy to the GPU need not wait for it (pageable: sync)
            index = (index.pin_memory() if self.labels.is_cuda else index).to(self.labels.device, non_blocking=True)
        images = self.images.index_select(0, index).float().div_(255)  # ToTensor's scaling, for the whole batch
        return list(zip(images.unbind(0), self.labels.index_select(0, index).unbind(0)))

    def head(self, n):
        """The first n items (views, no copy); all of them if n is None."""
        return self if n is None else TensorImages(self.images[:n], self.labels[:n])


def load_split(folder, split, device):
    """Decode one split from folder and move it to device once (on CUDA the whole set lives on the GPU)."""
    images_path, labels_path = _find_split_files(Path(folder), split)
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.dim() != 3 or images.shape[1:] != (28, 28) or labels.dim() != 1:
        raise FatalError(f"{images_path} does not hold 28x28 images; is this FashionMNIST?")
    if len(labels) and int(labels.max()) > 9:
        raise FatalError(f"{labels_path} has labels above 9; is this FashionMNIST?")
    return TensorImages(images.unsqueeze(1).to(device), labels.long().to(device))  # scaled per batch (TensorImages)


def load_fashion_mnist(cfg, device):
    """(train_set, test_set, folder): both splits as TensorImages on device, cut to --train/--test-samples."""
    folder = locate_fashion_mnist(cfg.data_dir)
    train_set = load_split(folder, "train", device).head(cfg.train_samples)
    test_set = load_split(folder, "test", device).head(cfg.test_samples)
    return train_set, test_set, folder


class ShardSampler(Sampler):
    """Rank r of w takes items r, r+w, r+2w, ...: disjoint, no padded duplicates, so eval counts add up exactly.

    DistributedSampler(shuffle=False) would pad the last shard with repeats and count them twice.
    """

    def __init__(self, data_source, rank=0, world_size=1):
        self.indices = range(rank, len(data_source), world_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)
