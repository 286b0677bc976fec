"""TESTS_CPU_LOG=FILE: each test's CPU seconds (its own and its finished subprocesses', torchrun's workers among them)
and wall seconds, appended to FILE as `cpu<TAB>wall<TAB>torch<TAB>test id`. What makes `make test-all` long is CPU:
its two workers keep both cores busy (0.5% idle in a measured run), so a test's waits cost little and its processes'
start-ups and steps cost all. A module's fixture counts in its first test; a SLURM job's processes, which slurmd starts,
are not counted. docs/tests.md has a run's sums per file."""
import os
import resource
import time

import pytest
import torch


def cpu_seconds():
    mine, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    log, cpu, wall = os.environ.get("TESTS_CPU_LOG"), cpu_seconds(), time.monotonic()
    yield
    if log:
        with open(log, "a") as f:
            f.write(f"{cpu_seconds() - cpu:.1f}\t{time.monotonic() - wall:.1f}\t{torch.__version__}\t{item.nodeid}\n")
