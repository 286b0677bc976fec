"""Finding and serving FashionMNIST through torchvision; the samplers that make every chapter see the same batches."""
import http.server
import threading

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset, default_convert

from common import data
from common.cli import Config, FatalError
from support.data import FILES, SPLIT_SIZES, make_fake_fashion_mnist
from support.run import BASE_ENV
from support.same_model import load_state, max_abs_diff


def load(folder, device="cpu"):
    """(train_set, test_set, folder) as a chapter loads them from --data-dir folder."""
    return data.load_fashion_mnist(Config(data_dir=str(folder)), torch.device(device))


def test_load_from_data_dir(tmp_path):
    written = make_fake_fashion_mnist(tmp_path)
    train_set, test_set, folder = load(tmp_path)
    images, labels = written["test"]
    assert folder == tmp_path and len(train_set) == SPLIT_SIZES["train"] and len(test_set) == SPLIT_SIZES["test"]
    assert torch.equal(test_set.images.squeeze(1), images) and torch.equal(test_set.labels, labels.long())
    # an item and a batch are what torchvision's ToTensor gives: float32 in [0, 1]
    image, label = test_set[3]
    assert image.dtype == torch.float32 and torch.equal(image.squeeze(0), images[3].float() / 255) and label == labels[3]
    batch_images, batch_labels = test_set.__getitems__([5, 2])  # a whole batch, as the DataLoader fetches it
    assert torch.equal(batch_images, images[[5, 2]].float().div(255).unsqueeze(1))
    assert torch.equal(batch_labels, labels[[5, 2]].long())


def test_debians_copy_is_unpacked_into_the_data_folder(tmp_path):
    """`make data`: Debian's four .gz files unpacked into ./data/FashionMNIST/raw, where torchvision reads them."""
    system = tmp_path / "usr-share"
    written = make_fake_fashion_mnist(system, layout="flat", gz=True)  # the Debian package's layout
    raw = data.unpack_debian_copy(tmp_path / "data", system)
    assert sorted(p.name for p in raw.iterdir()) == sorted(name for names in FILES.values() for name in names)
    train_set, _, _ = load(tmp_path / "data")  # the four files, and no temporary one left
    assert torch.equal(train_set.images.squeeze(1), written["train"][0])


def test_real_debian_copy_decodes(real_data):
    train_set, test_set, _ = load(real_data)
    assert train_set.images.shape == (60000, 1, 28, 28) and test_set.labels.shape == (10000,)
    assert torch.bincount(test_set.labels).tolist() == [1000] * 10  # FashionMNIST's test set is balanced


def test_no_data_anywhere_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("FASHION_MNIST_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FatalError, match="run `make data`.*apt-get install dataset-fashion-mnist"):
        data.locate_fashion_mnist(None)
    with pytest.raises(FatalError, match="Debian's copy is not in"):
        data.unpack_debian_copy(tmp_path / "data", tmp_path / "nowhere")


def test_a_failed_download_is_one_line(tmp_path, monkeypatch):
    """No data and a download that fails fast (the proxy is a closed port): one line that says so and names the fix."""
    monkeypatch.delenv("FASHION_MNIST_OFFLINE", raising=False)
    for name in ("http_proxy", "https_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FatalError, match="(?s)the download failed.*run `make data`"):
        data.locate_fashion_mnist(None)


@pytest.mark.parametrize("damage", ["truncated", "foreign"])
def test_a_damaged_file_is_one_line(damage, tmp_path):
    make_fake_fashion_mnist(tmp_path)
    path = tmp_path / "FashionMNIST" / "raw" / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100] if damage == "truncated" else b"<html>not found</html>")
    with pytest.raises(FatalError, match=f"cannot read FashionMNIST in {tmp_path}/FashionMNIST/raw .*delete that"):
        load(tmp_path)


def test_a_damaged_debian_file_is_one_line(tmp_path):
    system = tmp_path / "usr-share"
    make_fake_fashion_mnist(system, layout="flat", gz=True)
    path = system / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(FatalError, match="Debian's copy could not be unpacked into"):
        data.unpack_debian_copy(tmp_path / "data", system)
    assert not [p for p in (tmp_path / "data" / "FashionMNIST" / "raw").iterdir() if p.name.startswith(".")]


def test_batches_match_torchvision_totensor(fake_data):
    """The quickstart's pipeline (torchvision's FashionMNIST with ToTensor, a DataLoader's default collate) and the
    chapters' give the same batches, item for item."""
    from torchvision.datasets import FashionMNIST
    from torchvision.transforms import ToTensor

    train = load(fake_data)[0]
    quickstart = FashionMNIST(fake_data, train=True, transform=ToTensor())
    sampler = DistributedSampler(train, num_replicas=1, rank=0, seed=1)
    loader = DataLoader(train, batch_size=100, sampler=sampler, collate_fn=default_convert)  # the chapters' line
    batches = list(loader)
    assert [len(y) for _, y in batches] == [100, 100, 56] and len(loader) == 3  # the last partial batch is kept
    reference = list(DataLoader(quickstart, batch_size=100, sampler=sampler))
    for (x, y), (x_ref, y_ref) in zip(batches, reference):
        assert x.dtype == torch.float32 and x.shape[1:] == (1, 28, 28)
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_union_of_rank_batches_is_the_single_process_batch(world):
    items, global_batch = list(range(960)), 48
    # Chapter 1's sampler: DistributedSampler with one replica.
    single = torch.utils.data.BatchSampler(DistributedSampler(items, num_replicas=1, rank=0, seed=3), global_batch,
                                           drop_last=False)
    per_rank = [
        torch.utils.data.BatchSampler(DistributedSampler(items, num_replicas=world, rank=r, seed=3),
                                      global_batch // world, drop_last=False)
        for r in range(world)
    ]
    for k, (whole, *parts) in enumerate(zip(single, *per_rank)):
        assert sorted(whole) == sorted(i for part in parts for i in part), f"batch {k}"


@pytest.mark.parametrize("n,world", [(10, 3), (96, 3), (7, 8), (12, 4)])
def test_shards_of_the_test_set_hold_each_image_once(n, world, fake_data):
    """The DDP chapters' test loader: rank r of w evaluates images r, r+w, ... (no padded repeat counted twice)."""
    test_set = load(fake_data)[1]
    test_set = data.DeviceImages(test_set.images[:n], test_set.labels[:n])
    shards = [Subset(test_set, range(r, len(test_set), world)) for r in range(world)]  # the chapters' line
    assert sorted(i for shard in shards for i in shard.indices) == list(range(n))  # every image once
    loaders = [DataLoader(shard, batch_size=1000, collate_fn=default_convert) for shard in shards]
    labels = torch.cat([y for loader in loaders for _, y in loader])
    assert sorted(labels.tolist()) == sorted(test_set.labels.tolist())


def test_loader_batches_follow_the_sampler_and_its_epoch(fake_data):
    """The chapters' DataLoader serves exactly the sampler's order, anew per epoch."""
    train = load(fake_data)[0]
    sampler = DistributedSampler(train, num_replicas=2, rank=1, seed=5)
    loader = DataLoader(train, batch_size=16, sampler=sampler, collate_fn=default_convert)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        order = list(sampler)
        labels = torch.cat([y for _, y in loader])
        assert torch.equal(labels, train.labels[order])


class _Mirror(http.server.BaseHTTPRequestHandler):
    """A web proxy on 127.0.0.1 that answers torchvision's requests for FashionMNIST's mirror from a local folder."""

    folder = None
    fetched = None  # file name -> how many times its bytes were asked for

    def do_GET(self):
        name = self.path.rsplit("/", 1)[-1]
        path = self.folder / name
        if not path.is_file():
            self.send_error(404)
            return
        if self.headers.get("Method") != "HEAD":  # torchvision's redirect probe is a GET with a Method: HEAD header
            self.fetched[name] = self.fetched.get(name, 0) + 1
        body = path.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the probe reads the headers only
            pass

    def log_message(self, *args):
        pass


def test_the_ranks_of_one_machine_download_the_data_once(real_data, reference, tmp_path, procs):
    """No ./data and no system copy: three torchrun ranks start together. Local rank 0 downloads FashionMNIST with
    torchvision (its mirror played by a proxy on 127.0.0.1 serving Debian's files) while the others wait; every file
    is fetched once, not three times into one folder, and the ranks train chapter 1's model."""
    from support import REPO
    from support.run import TORCHRUN
    from support.same_model import SAME_MODEL, SLICE, accuracy_lines

    handler = type("Mirror", (_Mirror,), dict(folder=data.Path("/usr/share/datasets/fashion-mnist"), fetched={}))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # Debian's .gz files hold the same images as the originals, compressed again: other bytes, so not the md5 sums
    # torchvision checks. The shim drops those sums in the ranks (torchvision still checks the files exist).
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("from torchvision.datasets import FashionMNIST\n"
                                           "FashionMNIST.resources = [(f, None) for f, _ in FashionMNIST.resources]\n")
    work = tmp_path / "work"  # the folder the ranks start in: ./data does not exist yet
    work.mkdir()
    env = {k: v for k, v in BASE_ENV.items() if k != "FASHION_MNIST_OFFLINE"}
    env.update(http_proxy=f"http://127.0.0.1:{server.server_address[1]}", no_proxy="", PYTHONPATH=str(shim),
               FASHION_MNIST_SYSTEM_DIR=str(tmp_path / "no-system-copy"))
    try:
        p = procs.start([*TORCHRUN, "--standalone", "--nproc-per-node", "3", str(REPO / "ddp_launch.py"), *SLICE,
                         "--output", str(tmp_path / "run")], cwd=work, env=env)
        code, out, err = procs.wait(p)
    finally:
        server.shutdown()
    assert code == 0, err
    assert handler.fetched == {name: 1 for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                                                    "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
    assert "Data: data (960 train / 500 test images)" in out  # ./data, which local rank 0 filled
    assert max_abs_diff(reference[0], load_state(tmp_path / "run" / "model.pth")) <= SAME_MODEL
    assert accuracy_lines(out) == accuracy_lines(reference[1])
