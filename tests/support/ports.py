"""Ports for the suite's commands: each xdist worker draws from a block of its own, each port once per run, so no
two tests (nor any outgoing connection: common.ranks.free_port stays below the ephemeral range) share one."""
import os

from common.ranks import free_port as _free_port

BLOCK = 2000  # ports per worker, more than a whole run uses
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
_NEXT = iter(range(10000 + BLOCK * _WORKER, 10000 + BLOCK * (_WORKER + 1)))  # each port handed out once


def free_port(host="127.0.0.1"):
    """The next free port of this worker's block."""
    return _free_port(host, candidates=_NEXT)
