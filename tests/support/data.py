"""FashionMNIST for the tests: a small fake one written in the real IDX format, and the real one in ./data."""
import gzip
import struct
from pathlib import Path

import torch

from common.cli import FatalError
from support import REPO

SPLIT_SIZES = {"train": 256, "test": 96}
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def write_idx(path, tensor, compress=None):
    """Write a uint8 tensor as an IDX file (gzip if the name ends in .gz), exactly as the dataset ships."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = bytes([0, 0, 8, tensor.dim()]) + struct.pack(f">{tensor.dim()}I", *tensor.shape)
    payload = header + tensor.contiguous().numpy().tobytes()
    if path.suffix == ".gz":
        payload = gzip.compress(payload)
    path.write_bytes(payload)
    return path


def make_fake_fashion_mnist(folder, layout="torchvision", gz=False, seed=0):
    """A small random FashionMNIST in folder (torchvision's layout: FashionMNIST/raw/, or flat as Debian ships it);
    returns {split: (images, labels)} as written."""
    g = torch.Generator().manual_seed(seed)
    written = {}
    base = Path(folder) / "FashionMNIST" / "raw" if layout == "torchvision" else Path(folder)
    for split, n in SPLIT_SIZES.items():
        images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, 10, (n,), dtype=torch.uint8, generator=g)
        img_name, lbl_name = FILES[split]
        suffix = ".gz" if gz else ""
        write_idx(base / (img_name + suffix), images)
        write_idx(base / (lbl_name + suffix), labels)
        written[split] = (images, labels)
    return written


def real_data_dir():
    """./data as torchvision reads it, unpacked from Debian's copy the first time (as `make data` does); None where
    neither has FashionMNIST."""
    from common.data import unpack_debian_copy

    try:
        unpack_debian_copy(REPO / "data")
    except FatalError:
        return None
    return REPO / "data"
