"""Chapter 12's runs (ddp_ft.py under torchft): whether torchft is here, its lighthouse, a replica group as a user
starts it, and a run long enough that a group can be killed or cut off and come back before the other one ends."""
import os
import socket

import pytest
import torch
from torch.torch_version import TorchVersion

from measure.restart_or_heal import lighthouse_path
from support.long_runs import Watched
from support.run import BASE_ENV, TORCHRUN

try:
    import torchft  # noqa: F401
    HAS_TORCHFT = True
except ImportError:
    HAS_TORCHFT = False
TORCH_2_7 = TorchVersion(torch.__version__) >= (2, 7)
LIGHTHOUSE = lighthouse_path()

# Skipped without torchft, except in CI where torch can run it: make setup must have installed it there.
needs_torchft = pytest.mark.skipif(not HAS_TORCHFT and not (os.environ.get("CI") and TORCH_2_7),
                                   reason="torchft is not installed (make setup installs it where torch is 2.7+)")
# A group killed at step 21 and started again (imports, Manager, quorum: 10-25 s on 2 busy cores) must rejoin well
# before the end: 3 epochs of 400 steps, 24 images per group, with momentum (state that healing must send, not only the
# weights), each step made 40 ms longer (a bigger model's; alone, this one's takes 12 ms): 50 s after the kill.
LONG_FT = ["--train-samples", "19200", "--test-samples", "1000", "--batch-size", "48", "--epochs", "3",
           "--log-every", "20", "--momentum", "0.9"]
SLOWER = {"TESTS_STEP_SECONDS": "0.04"}  # tests/programs/cuda_defaults/sitecustomize.py
STEP_21 = "[  960/19200]"  # the loss line of LONG_FT's step 21 (epoch 1)


def lighthouse_command(bind, min_replicas=1):
    """The lighthouse as docs/fault_tolerance.md starts it, listening at bind (host:port)."""
    return [str(LIGHTHOUSE), "--min_replicas", str(min_replicas), "--join_timeout_ms", "10000", "--bind", bind]


def group_command(number, args):
    """One replica group: torchrun (one rank) running ddp_ft.py."""
    return [*TORCHRUN, "--standalone", "--nproc-per-node", "1", "ddp_ft.py", "--replica-group", str(number), *args]


def start_group(procs, lighthouse, number, args, env=None, on=lambda cmd: cmd):
    """A replica group started (on a machine: `on` wraps its command) and read line by line; env: more of its
    environment, a variable given None left out (USERS_SHELL: no OMP_NUM_THREADS, as a user starts it)."""
    given = {**BASE_ENV, "TORCHFT_LIGHTHOUSE": lighthouse, **(env or {})}
    return Watched(procs, on(group_command(number, args)), env={k: v for k, v in given.items() if v is not None})


USERS_SHELL = {"OMP_NUM_THREADS": None}


def share_line(groups=2):
    """The line a group on the CPU prints when it takes its share of this machine's cores (ddp_ft.py's CoreShare)."""
    threads = max(1, len(os.sched_getaffinity(0)) // groups)
    return f"{groups} replica groups on {socket.gethostname()}: {threads} CPU thread{'s' * (threads > 1)} each"


def finished(run, timeout=300):
    """A group's stdout once it ended well."""
    code, out, err = run.finish(timeout=timeout)
    assert code == 0, out + err
    return out
