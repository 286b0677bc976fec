"""Shared test helpers: tiny IDX datasets in the real format, the real data, and running entry scripts."""
import gzip
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import data  # noqa: E402

SPLIT_SIZES = {"train": 256, "test": 96}


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


def make_fake_fashion_mnist(folder, layout="torchvision", gz=True, seed=0):
    """A small random FashionMNIST in folder; returns {split: (images, labels)} as written."""
    g = torch.Generator().manual_seed(seed)
    written = {}
    base = Path(folder) / "FashionMNIST" / "raw" if layout == "torchvision" else Path(folder)
    for split, n in SPLIT_SIZES.items():
        images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, 10, (n,), dtype=torch.uint8, generator=g)
        img_name, lbl_name = data.FILES[split]
        suffix = ".gz" if gz else ""
        write_idx(base / (img_name + suffix), images)
        write_idx(base / (lbl_name + suffix), labels)
        written[split] = (images, labels)
    return written


@pytest.fixture
def fake_data(tmp_path):
    """Folder with a small fake FashionMNIST in torchvision layout (.gz files)."""
    folder = tmp_path / "fmnist"
    make_fake_fashion_mnist(folder)
    return folder


def _real_data_dir():
    for folder in (REPO / "data", Path(data.SYSTEM_DIR)):
        if data._find_split_files(folder, "train") and data._find_split_files(folder, "test"):
            return folder
    return None


@pytest.fixture(scope="session")
def real_data():
    """The real FashionMNIST folder. Skips where it is absent, except in CI, which installs it and must use it."""
    folder = _real_data_dir()
    if folder is None:
        msg = "real FashionMNIST not found (make test installs dataset-fashion-mnist)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return folder


@pytest.fixture(autouse=True)
def _restore_environ():
    """Tests may change os.environ; put it back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def run_script(script, *args, cwd=None, env=None, timeout=600):
    """Run an entry script as a user would (its own process), returning the CompletedProcess."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", FASHION_MNIST_OFFLINE="1", **(env or {}))
    return subprocess.run(
        [sys.executable, str(REPO / script), *map(str, args)],
        cwd=cwd or REPO, env=full_env, capture_output=True, text=True, timeout=timeout,
    )


def load_state(path):
    """A saved state_dict, loaded the safe way."""
    return torch.load(path, map_location="cpu", weights_only=True)


def max_abs_diff(a, b):
    """Largest |a - b| over all tensors of two state_dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
