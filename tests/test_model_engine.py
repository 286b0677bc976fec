"""The quickstart model and the one training loop."""
import torch

from common.config import Config
from common.data import SeededSampler, ShardSampler, TensorImages, make_loader
from common.distributed import DistContext
from common.engine import evaluate, fit
from common.model import NeuralNetwork


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


def test_fit_lowers_the_loss_and_learns(capsys):
    ds = _learnable_set()
    cfg = Config(epochs=4, batch_size=32, lr=0.1, log_every=1000)
    ctx = DistContext()
    torch.manual_seed(0)
    model = NeuralNetwork()
    history = fit(model, make_loader(ds, 32, SeededSampler(ds)), make_loader(ds, 100, ShardSampler(ds)),
                  torch.optim.SGD(model.parameters(), lr=cfg.lr), cfg, ctx)
    assert history[-1]["train_loss"] < 0.5 * history[0]["train_loss"]
    assert history[-1]["test_accuracy"] > 0.9
    out = capsys.readouterr().out
    assert "Epoch 4\n" in out and "Done!" in out and " Accuracy: " in out


def test_evaluate_is_exact_over_uneven_batches():
    ds = _learnable_set(n=103)
    model = NeuralNetwork()
    acc_a, loss_a = evaluate(model, make_loader(ds, 10, ShardSampler(ds)), DistContext())
    acc_b, loss_b = evaluate(model, make_loader(ds, 103, ShardSampler(ds)), DistContext())
    with torch.no_grad():
        logits = model(ds[list(range(103))][0])
    assert acc_a == acc_b == (logits.argmax(1) == ds.labels).sum().item() / 103
    assert abs(loss_a - loss_b) < 1e-6
