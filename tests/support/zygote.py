"""Warm workers for the torchrun runs whose launcher a test does not examine (tests/programs/zygote.py): one zygote per
pytest process, started on first use; warm(env) gives a torchrun command's environment its PYTHON_EXEC.

Which tests must start cold, and why, is conftest.must_start_cold (docs/tests.md, "Warm starts"); conftest sets
`allowed` before each test, and checks after each cold one that the zygote forked nothing while it ran.
"""
import atexit
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from support import REPO

SERVER = REPO / "tests" / "programs" / "zygote.py"
allowed = False  # whether the test running now may start warm (conftest's autouse fixture sets it)
_zygote = {}  # the one zygote of this process: its Popen and folder


def start(env):
    """The zygote, started once with the suite's environment (what its children would have had at import)."""
    if "proc" not in _zygote or _zygote["proc"].poll() is not None:
        folder = Path(tempfile.mkdtemp(prefix="zygote-"))
        proc = subprocess.Popen([sys.executable, str(SERVER), str(folder)], cwd=REPO, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=open(folder / "zygote.err", "w"), text=True,
                                start_new_session=True)
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the zygote did not start: {(folder / 'zygote.err').read_text()}")
        _zygote.update(proc=proc, folder=folder)
        atexit.register(proc.stdin.close)  # its stdin closed: it ends (its children end with their requests)
    return _zygote["folder"]


def warm(cmd, env):
    """env for cmd, with PYTHON_EXEC naming the zygote's executable if cmd is torchrun and this test may start warm."""
    from support.run import BASE_ENV, TORCHRUN

    if not allowed or list(cmd[:len(TORCHRUN)]) != TORCHRUN or "--no-python" in cmd or "PYTHON_EXEC" in env:
        return env
    folder = start(BASE_ENV)
    return dict(env, PYTHON_EXEC=str(folder / "python"), TESTS_WARM_TEST=os.environ.get("PYTEST_CURRENT_TEST", ""))


def must_be_cold(why):
    """Fail a warm test that does what only a cold start shows (a signal to a worker reaches the zygote's executable,
    not the worker): it belongs in conftest.COLD."""
    if allowed:
        raise AssertionError(f"{os.environ.get('PYTEST_CURRENT_TEST')} {why}: it must start cold (conftest.COLD)")


def forks(since):
    """[(time, event, pid, cpu, test)] of the children the zygote forked (event "fork") or reaped ("end") since `since`."""
    if "folder" not in _zygote:
        return []
    rows = [line.split("\t") for line in (_zygote["folder"] / "forks.log").read_text().splitlines()]
    return [(float(t), event, int(pid), float(cpu), test) for t, event, pid, cpu, test in rows if float(t) >= since]
