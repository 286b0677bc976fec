"""FashionMNIST's four files on disk: where Debian puts them, their IDX format, and torchvision's download.

The decoder is this project's own: torchvision's reader (torchvision.datasets.mnist.read_sn3_pascalvincent_tensor)
opens the files uncompressed, while Debian's package ships them gzipped in a read-only folder.
"""
import gzip
import math
import os
import socket
import struct
from pathlib import Path

import torch

from common.errors import FatalError

# Debian's dataset-fashion-mnist package installs the four .gz files here.
SYSTEM_DIR = os.environ.get("FASHION_MNIST_SYSTEM_DIR", "/usr/share/datasets/fashion-mnist")
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
HOW_TO_GET = ("get it with `sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu), or run once with internet "
              "access (torchvision downloads it to ./data), or pass --data-dir DIR holding the four IDX files")


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


def find_split_files(folder, split):
    """Paths of a split's (images, labels) in folder, raw or .gz, flat or torchvision layout; None if absent."""
    found = []
    for name in FILES[split]:
        candidates = [d / n for d in (folder / "FashionMNIST" / "raw", folder) for n in (name, name + ".gz")]
        path = next((c for c in candidates if c.is_file()), None)
        if path is None:
            return None
        found.append(path)
    return tuple(found)


def download(root):
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
