"""Ports for the suite's commands: each xdist worker draws from a block of its own, each port once per run, so no
two tests (nor any outgoing connection: the blocks, like common.ranks.free_port's ports, lie below the ephemeral range)
share one."""
import os

from common.ranks import ephemeral_low, free_port as _free_port


def block(worker, workers, low):
    """Worker number `worker`'s ports of `workers`, all between 10000 and low (the first ephemeral port): up to 2000,
    more than a whole run uses (1423 each for 16 workers and Linux's 32768)."""
    size = min(2000, (low - 10000) // workers)
    return range(10000 + size * worker, 10000 + size * (worker + 1))


_NEXT = iter(block(int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")),
                   int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), ephemeral_low()))  # each port handed out once


def free_port(host="127.0.0.1"):
    """The next free port of this worker's block."""
    return _free_port(host, candidates=_NEXT)
