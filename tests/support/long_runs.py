"""Runs long enough to interrupt, and the means to interrupt them: LONG's epochs, a process read line by line
(Watched), the worker of a given rank below its launcher, a rank frozen mid-training."""
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from measure.harness import descendants
from support import zygote
from support.run import TORCHRUN, no_abort_at_exit

# Long enough epochs (200 steps) that a kill lands inside one; short enough to keep the suite quick. With momentum,
# the optimizer has state of its own (a velocity per weight) that a resume must restore, not only the weights.
LONG = ["--train-samples", "9600", "--test-samples", "500", "--batch-size", "48", "--epochs", "3", "--log-every", "50",
        "--momentum", "0.9"]


def args_for(real_data, out, *extra):
    return [*LONG, "--data-dir", str(real_data), "--output", str(out), *extra]


class Watched:
    """A process whose stdout is read line by line in the background, so a test can act on a given line."""

    def __init__(self, procs, cmd, **kw):
        self.procs, self.proc = procs, procs.start(cmd, **kw)
        self.lines = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")))
        self._reader.start()

    def wait_for(self, text, after=0, timeout=120):
        """Wait until a line from line number `after` on holds text; returns that line's number."""
        deadline = time.monotonic() + timeout
        while True:
            found = next((i for i, line in enumerate(self.lines[after:], after) if text in line), None)
            if found is not None:
                return found
            ended = not self._reader.is_alive()  # stdout closed: the line will never come
            assert not ended and time.monotonic() < deadline, f"no {text!r} within {timeout}s:\n{''.join(self.lines)}"
            time.sleep(0.01)

    def wait_mid_epoch_2(self):
        """Until the run is a quarter into epoch 2 (epoch 1's snapshot is written before "Epoch 2" is printed)."""
        self.wait_for("[ 2400/ 9600]", after=self.wait_for("Epoch 2"))

    def finish(self, timeout=300):
        """(returncode, stdout, stderr) once the process has ended."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # torchrun's workers run in sessions of their own: killing its group alone would leave them holding
            # stdout, and the test waiting on it for good.
            self.procs.kill(self.proc)
            pytest.fail(f"still running after {timeout}s:\n{''.join(self.lines)}")
        self._reader.join()
        err = self.proc.stderr.read()
        no_abort_at_exit(err)
        return self.proc.returncode, "".join(self.lines), err


def children(pid):
    """PIDs whose parent is pid (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def environ_of(pid):
    """The environment process pid started with, from /proc: {name: value}."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def worker_with_rank(launcher_pid, rank):
    """The training process below a launcher (torchrun or mp.spawn) whose environment or argv says this rank."""
    zygote.must_be_cold("signals a worker")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for pid in descendants(launcher_pid):
            try:
                environ, cmdline = environ_of(pid), Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if environ.get("RANK") == str(rank) and b"ddp_launch.py" in cmdline:
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} worker below {launcher_pid}")


def freeze_a_rank_mid_training(procs, script, nprocs, args, run_dir, frozen, grace, first_test_within=120):
    """Start script under torchrun with --timeout 10 for 50 epochs; once its first test is written, freeze rank
    `frozen` (SIGSTOP) and time how long rank 0 goes on (at most 10 + grace seconds). The frozen rank is let go
    (SIGCONT) once rank 0 has ended, so that torchrun's SIGTERM reaches it at once rather than its SIGKILL 30 s
    later. Returns (seconds, exit code, stdout, stderr)."""
    zygote.must_be_cold("signals a worker")
    args = [*map(str, args), "--epochs", "50", "--timeout", "10"]
    p = procs.start([*TORCHRUN, "--standalone", "--nproc-per-node", str(nprocs), script, *args])
    deadline = time.monotonic() + first_test_within
    while not (run_dir / "metrics.jsonl").exists() or "epoch" not in (run_dir / "metrics.jsonl").read_text():
        assert time.monotonic() < deadline and p.poll() is None, "the run did not reach its first test"
        time.sleep(0.2)
    rank0, victim = (next(int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _is_rank(int(pid), r, p.pid))
                     for r in (0, frozen))
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    while _running(rank0):
        assert time.monotonic() - stopped < 10 + grace, "rank 0 still waits on its frozen peer"
        time.sleep(0.1)
    seconds = time.monotonic() - stopped
    os.kill(victim, signal.SIGCONT)
    code, out, err = procs.wait(p, timeout=120)
    return seconds, code, out, err


def _running(pid):
    """Whether pid is alive and not a zombie."""
    try:
        return "\nState:\tZ" not in open(f"/proc/{pid}/status").read()
    except OSError:
        return False


def _is_rank(pid, rank, torchrun_pid):
    """Whether process pid is a worker of the torchrun torchrun_pid with RANK=rank."""
    try:
        status, environ = open(f"/proc/{pid}/status").read(), environ_of(pid)
    except OSError:
        return False
    parent = int(re.search(r"PPid:\s+(\d+)", status)[1])
    return parent == torchrun_pid and environ.get("RANK") == str(rank)
