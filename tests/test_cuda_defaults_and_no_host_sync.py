"""Where CUDA and the CPU differ, the CPU suite takes CUDA's side: its defaults, and a device the host cannot touch.

docs/tests.md lists each difference, what the suite does about it, and what only tests/test_gpu.py can show.
"""
import contextlib
import inspect
import re
import subprocess
import sys
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, DistributedSampler, default_convert

from common import engine
from common.cli import Config
from common.comm_hooks import LocalSGD
from common.data import load_fashion_mnist
from common.engine import MetricsLog
from common.model import NeuralNetwork
from common.ranks import DistContext
from support import REPO
from support.run import BASE_ENV

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


# What a training step reads back from the device, by mode: docs/benchmark.md's table says the same. bf16 steps as fp32
# does here (autocast is off on the meta device; neither has a scaler); tests/test_gpu.py runs all three on CUDA.
HOST_SYNCS = {"fp32": None, "fp16": "_maybe_opt_step"}  # fp16: GradScaler.step() reads whether any gradient overflowed


@pytest.mark.parametrize("precision", HOST_SYNCS)
def test_a_training_step_reads_and_copies_nothing_on_the_host(precision, fake_data, monkeypatch):
    """Chapter 1's data, model and loop on the meta device, which holds no values: a step that reads a value back
    (.item(), a float of a loss) fails there, as it would wait for a GPU, and a CPU tensor copied into a step (a
    batch of labels made from Python ints) is seen by HostToDevice. Only the loss lines may read back, on purpose,
    and fp16's GradScaler, which reads back each step whether the gradients overflowed."""
    ctx = DistContext(device=torch.device("meta"))
    cfg = Config(batch_size=32, log_every=10**6, data_dir=str(fake_data), precision=precision)  # a loss line at 0
    monkeypatch.setattr(engine, "all_reduce_sum", lambda values, ctx, group=None: [0.0] * (len(values) - 1) + [1.0])
    monkeypatch.setattr(engine, "autocast", lambda cfg, device: contextlib.nullcontext())  # no autocast on meta
    train_set, _, _ = load_fashion_mnist(cfg, ctx.device)
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=cfg.seed)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, collate_fn=default_convert)  # chapters'
    model = NeuralNetwork().to(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    scaler = torch.amp.GradScaler("meta") if precision == "fp16" else None
    with HostToDevice() as mode:
        try:
            engine.train_one_epoch(model, loader, optimizer, scaler, 0, cfg, ctx, MetricsLog(None, ctx))
            read_back_in = None
        except RuntimeError as e:
            assert "cannot be called on meta tensors" in str(e), e
            frames = [frame.name for frame in traceback.extract_tb(e.__traceback__)]
            read_back_in = next((name for name in frames if name == HOST_SYNCS[precision]), frames)
    assert read_back_in == HOST_SYNCS[precision]
    assert len(loader) == 8 and mode.copies == [], mode.copies


def test_the_docs_say_which_modes_read_back_each_step():
    """docs/benchmark.md's table of host syncs per step matches what the test above finds, and what torch's PowerSGD
    hook does on CUDA (it calls torch.cuda.synchronize(device) after every compressed step), and post-local SGD's
    averages (which synchronize the device before their all-reduce, as torch's average_parameters does)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.distributed.algorithms.model_averaging import utils

    rows = dict(re.findall(r"^\| `([^`]+)` \| ([^|]+) \|", (REPO / "docs" / "benchmark.md").read_text(), re.M))
    assert rows["--precision fp32"].startswith("none") and rows["--precision bf16"].startswith("none"), rows
    assert rows["--precision fp16"].startswith("one") and HOST_SYNCS["fp16"] in rows["--precision fp16"], rows
    assert "torch.cuda.synchronize(device)" in inspect.getsource(powerSGD_hook.powerSGD_hook)
    assert "torch.cuda.synchronize" in rows["--comm-hook powersgd"], rows
    assert "torch.accelerator.synchronize()" in inspect.getsource(utils.average_parameters)
    assert "torch.accelerator.synchronize()" in inspect.getsource(LocalSGD.after_step)
    assert "torch.accelerator.synchronize()" in rows["--comm-hook localsgd:H"], rows
