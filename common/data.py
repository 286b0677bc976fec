"""FashionMNIST as every chapter trains on it: found offline, already on the device, served to a DataLoader."""
import os
from pathlib import Path

import torch
from torch.utils.data import Dataset, Sampler

from common.errors import FatalError
from common.idx import HOW_TO_GET, SYSTEM_DIR, download, find_split_files, read_idx


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
        if find_split_files(folder, "train") and find_split_files(folder, "test"):
            return folder
    why = download(root)
    if why is None and find_split_files(root, "train") and find_split_files(root, "test"):
        return root
    raise FatalError(f"FashionMNIST not found in {', '.join(map(str, searched))} and "
                     f"{why or 'the download left no files'}; {HOW_TO_GET}")


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
            raise FatalError(f"FashionMNIST files disagree: {len(images)} images but {len(labels)} labels; fetch the "
                             f"data again")
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index].float().div_(255), self.labels[index]  # ToTensor's scaling

    def __getitems__(self, indices):  # the DataLoader's batched fetch: one gather and one scaling per batch
        index = torch.tensor(indices)
        if self.labels.device.type != "cpu":  # pinned, so the copy to the GPU need not wait for it (pageable: a sync)
            index = (index.pin_memory() if self.labels.is_cuda else index).to(self.labels.device, non_blocking=True)
        images = self.images.index_select(0, index).float().div_(255)  # ToTensor's scaling, for the whole batch
        return list(zip(images.unbind(0), self.labels.index_select(0, index).unbind(0)))

    def head(self, n):
        """The first n items (views, no copy); all of them if n is None."""
        return self if n is None else TensorImages(self.images[:n], self.labels[:n])


def load_split(folder, split, device):
    """Decode one split from folder and move it to device once (on CUDA the whole set lives on the GPU)."""
    images_path, labels_path = find_split_files(Path(folder), split)
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
