"""FashionMNIST as every chapter trains on it: torchvision's dataset from the data folder, kept on the device."""
import os
import shutil
import socket
from pathlib import Path

import torch
from torch.utils.data import Dataset
from torchvision.datasets import FashionMNIST
from torchvision.datasets.utils import extract_archive

from common.cli import FatalError

HOW_TO_GET = ("run `make data` (it unpacks Debian's dataset-fashion-mnist there: `sudo apt-get install "
              "dataset-fashion-mnist`), or run once with internet access (torchvision downloads it), or pass --data-dir "
              "DIR holding FashionMNIST/raw/")


def locate_fashion_mnist(data_dir=None):
    """The folder torchvision's FashionMNIST(root) reads: --data-dir or ./data, downloaded there if it is empty."""
    root, names = Path(data_dir or "data"), [Path(name).stem for name, _ in FashionMNIST.resources]
    if data_dir is not None and not (root.is_dir() and os.access(root, os.R_OK | os.X_OK)):
        raise FatalError(f"--data-dir {data_dir} is not a readable folder; fix the path or leave --data-dir out")
    if not all((root / "FashionMNIST" / "raw" / name).is_file() for name in names) and (why := download(root)):
        raise FatalError(f"FashionMNIST is not in {root / 'FashionMNIST' / 'raw'} and {why}; {HOW_TO_GET}")
    return root


def download(root):
    """torchvision's download into root; None, or why it could not."""
    if os.environ.get("FASHION_MNIST_OFFLINE"):
        return "FASHION_MNIST_OFFLINE is set, so no download was tried"
    socket.setdefaulttimeout(30)  # Without internet the download should fail fast, not hang.
    try:
        FashionMNIST(root, download=True)  # Its download() fetches all four files, the test split's too.
    except Exception as e:  # Offline, torchvision raises RuntimeError, URLError, and others.
        return f"the download failed ({type(e).__name__}: {e})"
    finally:
        socket.setdefaulttimeout(None)


class DeviceImages(Dataset):
    """torchvision's uint8 .data/.targets on the device: a batch is one gather there, scaled as ToTensor scales."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index].float().div_(255), self.labels[index]  # This is ToTensor's scaling.

    def __getitems__(self, indices):  # the DataLoader's batched fetch: the whole batch (collate_fn=default_convert)
        index = torch.tensor(indices)
        if self.labels.device.type != "cpu":  # pinned on CUDA, so the copy need not wait for the GPU (pageable: a sync)
            index = (index.pin_memory() if self.labels.is_cuda else index).to(self.labels.device, non_blocking=True)
        return self.images.index_select(0, index).float().div_(255), self.labels.index_select(0, index)


def load_fashion_mnist(cfg, device):
    """(train_set, test_set, folder): torchvision's FashionMNIST on device, cut to --train/--test-samples."""
    folder = locate_fashion_mnist(cfg.data_dir)
    try:  # the quickstart's datasets.FashionMNIST(root, train=...), without its transform: we scale on the device
        splits = [FashionMNIST(folder, train=train) for train in (True, False)]
    except (RuntimeError, ValueError, TypeError, AssertionError, KeyError, OSError) as e:  # a damaged or foreign file
        raise FatalError(f"cannot read FashionMNIST in {folder / 'FashionMNIST' / 'raw'} ({type(e).__name__}: {e}); "
                         f"delete that folder and run again to fetch the data afresh") from None
    train_set, test_set = (DeviceImages(s.data[:n].unsqueeze(1).to(device), s.targets[:n].to(device))  # n: all if None
                           for s, n in zip(splits, (cfg.train_samples, cfg.test_samples)))
    return train_set, test_set, folder


def unpack_debian_copy(root="data", packed=os.environ.get("FASHION_MNIST_SYSTEM_DIR", "/usr/share/datasets/fashion-mnist")):
    """`make data`: Debian's recompressed .gz files unpacked into root/FashionMNIST/raw, renamed in whole."""
    raw = Path(root) / "FashionMNIST" / "raw"
    names = [Path(name).stem for name, _ in FashionMNIST.resources]
    if all((raw / name).is_file() for name in names):
        return raw
    if not all((Path(packed) / f"{name}.gz").is_file() for name in names):
        raise FatalError(f"Debian's copy is not in {packed}: `sudo apt-get install dataset-fashion-mnist`")
    tmp = raw / f".unpacking.{os.getpid()}"
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        for name in names:
            os.replace(extract_archive(Path(packed) / f"{name}.gz", tmp), raw / name)
    except (OSError, EOFError) as e:  # Raised by a read-only or full disk, or by a damaged .gz.
        raise FatalError(f"Debian's copy could not be unpacked into {raw} ({type(e).__name__}: {e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return raw


if __name__ == "__main__":  # What `make data` runs is `python -m common.data [ROOT]`.
    import sys

    from common.cli import run_main

    run_main(lambda: print(f"FashionMNIST: {unpack_debian_copy(*sys.argv[1:2])}"))
