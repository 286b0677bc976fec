"""Where CUDA and the CPU differ, the CPU suite takes CUDA's side: its defaults, and a device the host cannot touch.

docs/tests.md lists each difference, what the suite does about it, and what only tests/test_gpu.py can show.
"""
import contextlib
import subprocess
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, DistributedSampler

from common import engine
from common.config import Config
from common.data import load_fashion_mnist
from common.metrics import MetricsLog
from common.model import NeuralNetwork
from common.ranks import DistContext
from conftest import BASE_ENV, REPO

DEFAULTS = """
import torch
from torch.optim.optimizer import _default_to_fused_or_foreach
cpu_weight = torch.nn.Parameter(torch.zeros(2))
print("foreach", _default_to_fused_or_foreach([cpu_weight], differentiable=False)[1])
print("autocast", torch.get_autocast_dtype("cpu"))
"""


def test_every_process_the_suite_starts_takes_cudas_defaults():
    """On CUDA an optimizer steps all its weights in one foreach call, and autocast defaults to float16: a process the
    suite starts (and the suite itself) does the same on the CPU, so code that only breaks there breaks here."""
    proc = subprocess.run([sys.executable, "-c", DEFAULTS], cwd=REPO, env=BASE_ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["foreach", "True", "autocast", "torch.float16"], proc.stdout
    from torch.optim.optimizer import _default_to_fused_or_foreach

    assert _default_to_fused_or_foreach([torch.nn.Parameter(torch.zeros(2))], differentiable=False)[1]


class HostToDevice(TorchDispatchMode):
    """Records every blocking copy of a CPU tensor to another device: on a GPU, such a copy waits for the GPU. (A copy
    with non_blocking=True from pinned memory does not; the meta device cannot pin, so that half is test_gpu.py's.)"""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            non_blocking = (kwargs or {}).get("non_blocking", args[2] if func is torch.ops.aten.copy_.default
                                              and len(args) > 2 else False)
            if source.device.type == "cpu" and out.device.type != "cpu" and not non_blocking:
                self.copies.append(f"{func} {tuple(source.shape)}")
        return out


def test_a_training_step_reads_and_copies_nothing_on_the_host(fake_data, monkeypatch):
    """Chapter 1's data, model and loop on the meta device, which holds no values: a step that reads a value back
    (.item(), a float of a loss) fails there, as it would wait for a GPU, and a CPU tensor copied into a step (a
    batch of labels made from Python ints) is seen by HostToDevice. Only the loss lines may read back, on purpose."""
    ctx = DistContext(device=torch.device("meta"))
    cfg = Config(batch_size=32, log_every=10**6, data_dir=str(fake_data))  # one loss line, at step 0
    monkeypatch.setattr(engine, "all_reduce_sum", lambda values, ctx, group=None: [0.0] * (len(values) - 1) + [1.0])
    monkeypatch.setattr(engine, "autocast", lambda cfg, device: contextlib.nullcontext())  # fp32: autocast is off
    train_set, _, _ = load_fashion_mnist(cfg, ctx.device)
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=cfg.seed)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler)  # the chapters' line
    model = NeuralNetwork().to(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    with HostToDevice() as mode:
        engine.train_one_epoch(model, loader, optimizer, None, 0, cfg, ctx, MetricsLog(None, ctx))
    assert len(loader) == 8 and mode.copies == [], mode.copies
