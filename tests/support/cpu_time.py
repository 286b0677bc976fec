"""TESTS_CPU_LOG=FILE: each test's CPU seconds (its own and its finished subprocesses', torchrun's workers among them,
those the zygote forked included) and wall seconds, appended to FILE as `cpu<TAB>wall<TAB>torch<TAB>test id<TAB>
start time<TAB>xdist worker`. Most of `make test-all`'s time is CPU: processes starting and training. The rest is the
tests that wait on purpose (a link cut, a rank frozen, a SLURM job queued), during which the other worker has the
cores. A module's fixture counts in its first test; a SLURM job's processes, which slurmd starts, are not counted.
docs/tests.md has a run's sums per file."""
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
    log, cpu, wall, since = os.environ.get("TESTS_CPU_LOG"), cpu_seconds(), time.monotonic(), time.time()
    yield
    if log:
        from support import zygote

        warm = sum(cpu for _, event, _, cpu, test in zygote.forks(since)
                   if event == "end" and test.rsplit(" (", 1)[0] == item.nodeid)
        with open(log, "a") as f:
            f.write(f"{cpu_seconds() - cpu + warm:.1f}\t{time.monotonic() - wall:.1f}\t{torch.__version__}\t"
                    f"{item.nodeid}\t{since:.1f}\t{os.environ.get('PYTEST_XDIST_WORKER', '')}\n")


def group_seconds(log):
    """{group: wall seconds} of a TESTS_CPU_LOG, each group's tests' walls summed (a worker runs a group's tests one
    after another)."""
    from conftest import group_of

    seconds = {}
    for line in open(log):
        _, wall, _, nodeid, *_ = line.rstrip("\n").split("\t")
        seconds[group_of(nodeid)] = seconds.get(group_of(nodeid), 0) + float(wall)
    return seconds


if __name__ == "__main__":  # python tests/support/cpu_time.py LOG: tests/recorded/group_seconds.tsv from a run's log
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    sys.path[0] = str(tests)  # conftest and support as pytest imports them
    rows = sorted(group_seconds(sys.argv[1]).items(), key=lambda row: -row[1])
    (tests / "recorded" / "group_seconds.tsv").write_text("".join(f"{s:.0f}\t{g}\n" for g, s in rows))
