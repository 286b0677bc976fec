"""Every Python process the suite starts (tests/support/run.py's BASE_ENV puts this folder on PYTHONPATH) takes CUDA's defaults
where they differ from the CPU's and torch lets the CPU take them, so the CPU suite runs the code path a GPU runs:

- the optimizers' foreach kernels: on CUDA, SGD and friends default to foreach=True (one _foreach_add_ over all
  weights of a device and dtype); on the CPU to a loop over the weights. A chapter whose weights cannot share one
  foreach call (DTensors beside plain tensors) fails on the GPU only, unless the CPU takes foreach too.
- autocast's default dtype: float16 on CUDA, bfloat16 on the CPU; code that enters autocast without a dtype (as
  nn.DataParallel's replica threads do) computes in float16 on a GPU.

What only a GPU can show (a copy from pageable memory that blocks, NCCL) is listed in docs/tests.md. Nothing is
imported until torch itself is: the patch runs when torch.optim.optimizer has loaded.

TESTS_STEP_SECONDS=S (unset: nothing) makes every optimizer step S seconds longer, as a bigger model's would be: for a
test that must act while a run goes on (chapter 12's restarted group must rejoin before the live one ends).

And on SIGUSR2 every thread's Python stack goes to stderr: tests/support/run.py's Procs sends it to a process that overran,
before it kills it, so a hang in CI shows where each process waited.
"""
import faulthandler
import importlib.abc
import importlib.util
import os
import signal
import sys

faulthandler.register(signal.SIGUSR2, all_threads=True)

TARGET = "torch.optim.optimizer"


def play_cuda_defaults(optimizer_module):
    """Make the CPU count as a foreach device for the optimizers, and autocast on the CPU default to float16."""
    import torch

    if os.environ.get("TESTS_STEP_SECONDS"):
        import time

        seconds = float(os.environ["TESTS_STEP_SECONDS"])
        optimizer_module.register_optimizer_step_post_hook(lambda *_: time.sleep(seconds))
    supported = optimizer_module._get_foreach_kernels_supported_devices
    optimizer_module._get_foreach_kernels_supported_devices = lambda: [*supported(), "cpu"]
    torch.set_autocast_dtype("cpu", torch.float16)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the real loader of TARGET so play_cuda_defaults runs once the module exists."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            play_cuda_defaults(module)

        spec.loader.exec_module = exec_then_patch
        return spec


# As a process's sitecustomize (not when tests/conftest.py imports play_cuda_defaults); TUTORIAL_CPU_DEFAULTS=1 keeps
# the CPU's own defaults.
if __name__ == "sitecustomize" and os.environ.get("TUTORIAL_CPU_DEFAULTS") != "1":
    sys.meta_path.insert(0, _AfterImport())
