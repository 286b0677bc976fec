"""FashionMNIST as every chapter trains on it: torchvision's dataset from the data folder, kept on the device."""
import gzip
import os
import shutil
import socket
import tempfile
from pathlib import Path

import torch
from torch.utils.data import Dataset, Sampler
from torchvision.datasets import FashionMNIST

from common.cli import FatalError

# Debian's dataset-fashion-mnist package installs the four .gz files here; the first run unpacks them into the data
# folder, as torchvision reads them (recompressed, their bytes are not the ones torchvision's download checks).
SYSTEM_DIR = os.environ.get("FASHION_MNIST_SYSTEM_DIR", "/usr/share/datasets/fashion-mnist")
HOW_TO_GET = ("get it with `sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu), or run once with internet "
              "access (torchvision downloads it to ./data), or pass --data-dir DIR holding FashionMNIST/raw/")


def locate_fashion_mnist(data_dir=None):
    """The folder torchvision's FashionMNIST(root) reads, --data-dir or ./data; the first run fills it, from Debian's
    copy or by torchvision's download."""
    root = Path(data_dir or "data")
    if data_dir is not None and not (root.is_dir() and os.access(root, os.R_OK | os.X_OK)):
        raise FatalError(f"--data-dir {data_dir} is not a readable folder; fix the path or leave --data-dir out")
    raw, names = root / "FashionMNIST" / "raw", [Path(name).stem for name, _ in FashionMNIST.resources]
    if all((raw / name).is_file() for name in names):
        return root
    packed = [Path(SYSTEM_DIR) / f"{name}.gz" for name in names]
    why = unpack(packed, raw) if all(p.is_file() for p in packed) else download(root)
    if why is None:
        return root
    raise FatalError(f"FashionMNIST is not in {raw} and {why}; {HOW_TO_GET}")


def unpack(packed, folder):
    """Each .gz file into folder, written beside under a name of its own and renamed (a process that reads or unpacks
    meanwhile never sees half a file); returns None, or why it could not."""
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for path in packed:
            with gzip.open(path, "rb") as src, tempfile.NamedTemporaryFile(dir=folder, delete=False) as dst:
                tmp = dst.name
                shutil.copyfileobj(src, dst, 2**20)
            os.replace(tmp, folder / path.stem)
    except (OSError, EOFError) as e:  # a read-only or full disk, a damaged .gz
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
        return f"Debian's copy could not be unpacked there ({type(e).__name__}: {e}; pass a writable --data-dir)"
    return None


def download(root):
    """Let torchvision download FashionMNIST into root; returns None, or why it could not (no folder left behind)."""
    if os.environ.get("FASHION_MNIST_OFFLINE"):
        return "FASHION_MNIST_OFFLINE is set, so no download was tried"
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


class DeviceImages(Dataset):
    """torchvision's .data and .targets (uint8 images, int64 labels) on the training device: an item is what ToTensor
    gives (float32 in [0, 1]); a batch is gathered and scaled at once, already there (on a GPU a batch copied from
    the host would wait for it: a host sync per step). The images take 55 MB, a quarter of float32's."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index].float().div_(255), self.labels[index]  # ToTensor's scaling

    def __getitems__(self, indices):  # the DataLoader's batched fetch: one gather and one scaling per batch
        index = torch.tensor(indices)
        if self.labels.is_cuda:  # pinned, so the copy to the GPU need not wait for it (pageable: a sync)
            index = index.pin_memory().to(self.labels.device, non_blocking=True)
        images = self.images.index_select(0, index).float().div_(255)
        return list(zip(images.unbind(0), self.labels.index_select(0, index).unbind(0)))

    def head(self, n):
        """The first n items (views, no copy); all of them if n is None."""
        return self if n is None else DeviceImages(self.images[:n], self.labels[:n])


def load_fashion_mnist(cfg, device):
    """(train_set, test_set, folder): torchvision's FashionMNIST on device, cut to --train/--test-samples."""
    folder = locate_fashion_mnist(cfg.data_dir)
    try:  # the quickstart's datasets.FashionMNIST(root, train=...), without its transform: we scale on the device
        splits = [FashionMNIST(folder, train=train) for train in (True, False)]
    except (RuntimeError, ValueError, TypeError, AssertionError, KeyError, OSError) as e:  # a damaged or foreign file
        raise FatalError(f"cannot read FashionMNIST in {folder / 'FashionMNIST' / 'raw'} ({type(e).__name__}: {e}); "
                         f"delete that folder and run again to fetch the data afresh") from None
    train_set, test_set = (DeviceImages(s.data.unsqueeze(1).to(device), s.targets.to(device)).head(n)
                           for s, n in zip(splits, (cfg.train_samples, cfg.test_samples)))
    return train_set, test_set, folder


class ShardSampler(Sampler):
    """Rank r of w takes items r, r+w, r+2w, ...: disjoint, no padded duplicates, so eval counts add up exactly
    (DistributedSampler(shuffle=False) would pad the last shard with repeats and count them twice)."""

    def __init__(self, data_source, rank=0, world_size=1):
        self.indices = range(rank, len(data_source), world_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)
