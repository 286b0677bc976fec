"""The quickstart model and the one training loop."""
import torch

from torch.utils.data import DistributedSampler

from common.config import Config
from common.data import ShardSampler, TensorImages, make_loader
from common.engine import evaluate, train_one_epoch
from common.metrics import MetricsLog, read_metrics
from common.model import NeuralNetwork
from common.ranks import DistContext


def test_model_shapes():
    model = NeuralNetwork()
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    assert sum(p.numel() for p in model.parameters()) == 669_706  # 784*512+512 + 512*512+512 + 512*10+10


def _learnable_set(n=512, seed=0):
    """Noise images with a bright band at rows 2k..2k+2 for class k: a set the MLP learns in a few epochs."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randint(0, 60, (n, 1, 28, 28), generator=g, dtype=torch.uint8)
    for i, k in enumerate(labels.tolist()):
        images[i, 0, 2 * k:2 * k + 3] = 255
    return TensorImages(images, labels)


def test_the_epoch_loop_learns_and_logs(tmp_path, capsys):
    """The chapters' loop (train_one_epoch, evaluate) on a learnable set: the loss falls, the metrics are written."""
    ds = _learnable_set()
    cfg = Config(epochs=4, batch_size=32, lr=0.1, log_every=8)
    ctx = DistContext()
    torch.manual_seed(0)
    model = NeuralNetwork()
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, seed=0)
    train_loader, test_loader = make_loader(ds, 32, sampler), make_loader(ds, 100, ShardSampler(ds))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    metrics = MetricsLog(tmp_path, ctx)
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        train_one_epoch(model, train_loader, optimizer, None, epoch, cfg, ctx, metrics)
        accuracy, _ = evaluate(model, test_loader, epoch, ctx, metrics)
    assert accuracy > 0.9
    epochs = [r for r in read_metrics(tmp_path) if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2, 3, 4] and [r["step"] for r in epochs] == [16, 32, 48, 64]
    assert epochs[-1]["train_loss"] < 0.5 * epochs[0]["train_loss"] and epochs[-1]["test_accuracy"] == accuracy
    train = [r for r in read_metrics(tmp_path) if r["kind"] == "train"]
    assert [r["step"] for r in train[:3]] == [1, 9, 17] and train[1]["samples"] == 9 * 32
    out = capsys.readouterr().out
    assert out.count("Train time: ") == 4 and " Accuracy: " in out and "loss: " in out


def test_evaluate_is_exact_over_uneven_batches():
    ds = _learnable_set(n=103)
    model = NeuralNetwork()
    ctx = DistContext()
    acc_a, loss_a = evaluate(model, make_loader(ds, 10, ShardSampler(ds)), 0, ctx, MetricsLog(None, ctx))
    acc_b, loss_b = evaluate(model, make_loader(ds, 103, ShardSampler(ds)), 0, ctx, MetricsLog(None, ctx))
    with torch.no_grad():
        logits = model(ds[list(range(103))][0])
    assert acc_a == acc_b == (logits.argmax(1) == ds.labels).sum().item() / 103
    assert abs(loss_a - loss_b) < 1e-6
