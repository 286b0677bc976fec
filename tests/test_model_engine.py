"""The quickstart model and the one training loop."""
import inspect
import sys

import pytest
import torch

from torch.utils.data import DataLoader, DistributedSampler, default_convert

from common.cli import Config
from common.data import DeviceImages
from common.engine import evaluate, train_one_epoch
from common.engine import MetricsLog
from scripts.plot_curves import read_metrics
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
    return DeviceImages(images, labels)


def test_the_epoch_loop_learns_and_logs(tmp_path, capsys):
    """The chapters' loop (train_one_epoch, evaluate) on a learnable set: the loss falls, the metrics are written."""
    ds = _learnable_set()
    cfg = Config(epochs=4, batch_size=32, lr=0.1, log_every=8)
    ctx = DistContext()
    torch.manual_seed(0)
    model = NeuralNetwork()
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, seed=0)
    train_loader = DataLoader(ds, batch_size=32, sampler=sampler, collate_fn=default_convert)
    test_loader = DataLoader(ds, batch_size=100, collate_fn=default_convert)
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
    loaders = [DataLoader(ds, batch_size=b, collate_fn=default_convert) for b in (10, 103)]
    (acc_a, loss_a), (acc_b, loss_b) = (evaluate(model, loader, 0, ctx, MetricsLog(None, ctx)) for loader in loaders)
    with torch.no_grad():
        logits = model(ds.images.float() / 255)
    assert acc_a == acc_b == (logits.argmax(1) == ds.labels).sum().item() / 103
    assert abs(loss_a - loss_b) < 1e-6


def test_fp16_scaler_skips_an_overflowing_step_then_steps_at_the_lower_scale(capsys):
    """--precision fp16 on the CPU: a step whose scaled gradients overflow float16 leaves the weights alone and halves
    the scale; the next steps train. (A loss scale of 2**40 overflows: |gradients| x 2**40 > 65504, float16's max.)"""
    ds = _learnable_set(n=96)
    cfg = Config(batch_size=32, lr=0.1, log_every=100, precision="fp16")
    ctx = DistContext()
    torch.manual_seed(0)
    model = NeuralNetwork()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    loader = DataLoader(ds, batch_size=32, sampler=sampler, collate_fn=default_convert)
    head = DeviceImages(ds.images[:32], ds.labels[:32])
    one_step = DataLoader(head, batch_size=32, collate_fn=default_convert)  # one step of 32 images
    train_one_epoch(model, one_step, optimizer, scaler, 0, cfg, ctx, MetricsLog(None, ctx))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # skipped: inf in the gradients
    assert scaler.get_scale() == 2.0 ** 39
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    train_one_epoch(model, loader, optimizer, scaler, 0, cfg, ctx, MetricsLog(None, ctx))
    assert scaler.get_scale() == 2.0 ** 10  # three steps, none skipped
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert capsys.readouterr().out.count("fp16 loss scale: ") == 2


def test_dataparallel_replicas_compute_in_the_dtype_precision_names(monkeypatch):
    """Chapter 2 on two GPUs, played on the CPU: torch's own parallel_apply runs each replica in a thread of its own
    (its device calls made CPU no-ops here). It enters autocast there without the dtype, so a thread computes in the
    device's default: float16 on CUDA under --precision bf16; bfloat16 on the CPU under fp16, which this shows."""
    import contextlib
    import copy

    from torch import nn

    from common.engine import autocast
    from dataparallel import DataParallel

    import torch.nn.parallel.parallel_apply  # noqa: F401 (the module, for its source)
    if "torch.accelerator" not in inspect.getsource(sys.modules["torch.nn.parallel.parallel_apply"]):
        pytest.skip(f"torch {torch.__version__}'s parallel_apply calls torch.cuda itself: it cannot play on the CPU")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: torch.device("cpu"))
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(torch.accelerator, "device_index", lambda *a: contextlib.nullcontext())
    is_enabled = torch.is_autocast_enabled  # without an argument it reads CUDA's switch; the CPU's is the one here
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type="cpu": is_enabled(device_type))
    model = NeuralNetwork()
    replicas, inputs = [model, copy.deepcopy(model)], [(torch.rand(4, 1, 28, 28),), (torch.rand(4, 1, 28, 28),)]
    for wrap, expected in ((nn.DataParallel, torch.bfloat16), (DataParallel, torch.float16)):
        dp = wrap(model)  # no GPU: a plain wrapper; given two "devices" below, as on a machine with two GPUs
        dp.src_device_obj, dp.device_ids = torch.device("cpu"), [0, 1]
        with autocast(Config(precision="fp16"), torch.device("cpu")):
            outputs = dp.parallel_apply(replicas, inputs, [{}, {}])
        assert [out.dtype for out in outputs] == [expected, expected], wrap  # torch's own: the thread's default
