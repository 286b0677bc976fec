"""How each launcher starts the ranks: the checks a chapter makes before its rendezvous, and a free port."""
import os
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import torch

from common.errors import NO_RANK0, FatalError, UsageError


def default_nprocs(requested=None):
    """ddp_mp.py's default: one process per visible GPU; 2 on the CPU, so the chapter still shows two ranks."""
    if requested != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


def check_torchrun_worker():
    """One line unless this process is a torchrun worker whose restarts (--max-restarts) each get a fresh store.

    torchrun --max-restarts starts a new group after a failure. Sharing torchrun's own key-value store (its
    default) the new workers would meet among the dead ones' keys and could dial their addresses (on torch 2.14
    the store keeps every attempt's keys), and on several nodes they need not agree which attempt they are in.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes rank 0 open a fresh store for every attempt instead.
    """
    if not {"RANK", "LOCAL_RANK", "WORLD_SIZE"} <= os.environ.keys():
        raise UsageError(f"RANK/LOCAL_RANK/WORLD_SIZE are not set: start this script with torchrun, e.g. "
                         f"`torchrun --standalone --nproc-per-node 2 {Path(sys.argv[0]).name}`")
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise UsageError("torchrun --max-restarts needs a fresh store per restart: run it as "
                         "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ...` with a c10d rendezvous (--standalone, "
                         "or --rdzv-backend c10d --rdzv-endpoint HOST:PORT), not --master-addr/--node-rank")


def free_port(host="127.0.0.1"):
    """A port the OS says is free right now (instead of a hard-coded 12355 that a second job would collide on)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_global_batch(batch_size, world_size, accum_steps=1):
    """--batch-size is the global batch, so it must split evenly over the ranks and their --accum-steps micro-batches."""
    parts = world_size * accum_steps
    if batch_size % parts:
        split = f"{world_size} ranks" + (f" x {accum_steps} micro-batches" if accum_steps > 1 else "")
        raise UsageError(f"--batch-size {batch_size} is the global batch and must split evenly over {split}; "
                         f"use a multiple of {parts}, e.g. {batch_size // parts * parts or parts}")


def check_rendezvous(init_method, rank, timeout):
    """Before init_process_group(init_method=tcp:// or file://): a stale file or a missing rank 0 fails at --timeout.

    file://: a file older than --timeout was left by a crashed run (a clean run's ranks delete it); its keys
    would mix two jobs' rendezvous. tcp://, ranks > 0: wait here until rank 0's port answers. torch's own store client
    retries once more after its deadline with a grown back-off (torch 2.14.1: --timeout 10 ended after 16-21 s,
    --timeout 20 after 43 s; the retry loop came with pytorch/pytorch#129261), so a missing rank 0 is reported here.
    """
    url = urlparse(init_method)
    if url.scheme == "file":
        path = Path(url.path)
        if not path.parent.is_dir():
            raise FatalError(f"rendezvous folder {path.parent} does not exist; create it on a filesystem every "
                             f"machine shares")
        if path.exists() and time.time() - path.stat().st_mtime > timeout:
            raise FatalError(f"rendezvous file {path} is left over from an earlier run "
                             f"({time.time() - path.stat().st_mtime:.0f}s old); delete it or pass a new file:// name")
    elif rank > 0:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection((url.hostname, url.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise FatalError(f"no rendezvous at {url.hostname}:{url.port} within {timeout:g}s: "
                                     f"{NO_RANK0}") from None
                time.sleep(0.2)
