"""Two machines for real: two network namespaces (nodea 10.77.0.1, nodeb 10.77.0.2, measure/netns.py), each node
running its launcher as the README tells users to, with GLOO_SOCKET_IFNAME set to the interface on the shared network.
conftest.py's two_machines fixture gives the namespaces."""
import os
import sys

import pytest

from measure.netns import IFNAME, NODES, why_not
from support.run import BASE_ENV, TORCHRUN

NODE_ENV = dict(BASE_ENV, GLOO_SOCKET_IFNAME=IFNAME)
A, B = NODES  # "nodea", "nodeb"
PORT = "29500"  # each node has its own network stack, so the README's port is free on both


def need_namespaces():
    """A skip with the reason where namespaces cannot be made here (a failure under CI)."""
    reason = why_not()
    if reason:
        pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)


def cannot_shape(reason):
    """A test that needs a shaped link says in one line why it cannot have one: a skip, a failure under CI."""
    pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)


def run_on_both(net, procs, commands, env=NODE_ENV, timeout=240):
    """Start commands[node] on each node, wait for both; [(returncode, stdout, stderr)] in node order."""
    started = [procs.start(net.command(node, cmd), env=env) for node, cmd in commands.items()]
    return [procs.wait(p, timeout=timeout) for p in started]


def torchrun_nodes(rendezvous, script_args, *more, script="ddp_launch.py", nproc=1):
    """The torchrun command of each node: nproc processes per node, 2 nodes, meeting as `rendezvous` says."""
    static = rendezvous == "static"
    return {node: [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", str(nproc), *more,
                   *(["--node-rank", str(i), "--master-addr", NODES[A], "--master-port", PORT] if static else
                     ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{NODES[A]}:{PORT}", "--rdzv-id", "job1"]),
                   script, *script_args] for i, node in enumerate(NODES)}


def tcp_nodes(script_args):
    """Chapter 5 by hand: rank 0 on nodea listening at its address, rank 1 on nodeb."""
    return {node: [sys.executable, "ddp_tcp_manual.py", "--init-method", f"tcp://{NODES[A]}:{PORT}", "--rank", str(i),
                   "--world-size", "2", *script_args] for i, node in enumerate(NODES)}
