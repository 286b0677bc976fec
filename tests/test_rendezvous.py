"""How the ranks meet and part: a rendezvous that cannot happen ends in one line within the timeout (a lone rank, a
busy port, a wrong interface, a leftover file, ranks started with different flags), no other program can take or join
the ranks' store, and leaving the group never hangs."""
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from support import REPO
from support.launchers import stale_rendezvous_file
from support.ports import block, free_port
from support.run import BASE_ENV, CUDA_DEFAULTS, one_error_line
from support.same_model import slice_args


@pytest.mark.parametrize("rank,needles", [
    (1, ["no rendezvous at 127.0.0.1:{port} (torch's tries timed out after 10s each)",  # nobody at the master
         "GLOO_SOCKET_IFNAME", "firewall"]),
    (0, ["only 1 of 2 processes reached the rendezvous", "start every rank"]),  # the master's peer never comes
], ids=["unreachable-master", "missing-peer"])
def test_lone_rank_fails_within_the_timeout(rank, needles, procs):
    """The rendezvous gives up after torch's TCPStore has tried twice for --timeout (with a pause about as long as the
    timeout between the tries, torch 2.6 to 2.14), never later.

    The start-up (importing torch) is measured here, at this moment's load: the chapter's own `--help` exits right
    after its imports. A loaded machine stretches both alike.
    """
    start = time.monotonic()
    code, _, err = procs.wait(procs.start([sys.executable, "ddp_tcp_manual.py", "--help"]), timeout=120)
    assert code == 0, err
    startup = time.monotonic() - start
    port = free_port()
    start = time.monotonic()
    p = procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", f"tcp://127.0.0.1:{port}",
                     "--rank", str(rank), "--world-size", "2", "--timeout", "10"])
    code, _, err = procs.wait(p, timeout=120)
    seconds = time.monotonic() - start
    assert code == 1 and seconds < startup + 3 * 10 + 5, (seconds, startup, err)
    one_error_line(err, f"[rank {rank}]", *(n.format(port=port) for n in needles))


def test_busy_port_is_named(procs):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", f"tcp://127.0.0.1:{port}",
                         "--rank", "0", "--world-size", "2", "--timeout", "5"])
        code, _, err = procs.wait(p, timeout=60)
    # torch's own words name the port and the cause (torch 2.6 and 2.14 alike), so they stay as torch wrote them
    assert code == 1 and "Traceback" in err, err
    assert err.strip().splitlines()[-1].startswith("error: [rank 0] ") and f"port: {port}," in err, err
    assert "EADDRINUSE, message: address already in use" in err.strip().splitlines()[-1], err


@pytest.mark.parametrize("workers", [1, 2, 12, 16, 64])
def test_the_suites_ports_lie_below_the_ephemeral_range_for_any_worker_count(workers):
    """Each xdist worker's block of ports lies below the first ephemeral port, where any outgoing connection may take
    one between its choice and its bind, and no two blocks share a port. With a block of 2000 for every count, 16
    workers on a GPU machine gave gw13 port 36008, and a connection took it first (EADDRINUSE)."""
    for low in (32768, 49152):  # Linux's first ephemeral port, macOS's
        blocks = [block(worker, workers, low) for worker in range(workers)]
        assert all(len(b) >= 300 and b.start >= 10000 and b.stop <= low for b in blocks), (low, blocks)
        assert len(set().union(*map(set, blocks))) == sum(map(len, blocks))


# Imported by every process this test starts: in mp.spawn's workers (spawn_main's command line), take the rendezvous
# port before the workers go on, as another program on the machine may between a port's choice and its bind.
PORT_THIEF = """
import os, socket, sys
if "--multiprocessing-fork" in sys.argv and "MASTER_PORT" in os.environ:
    thief = socket.socket()
    try:
        thief.bind((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
        thief.listen()
        print(f"took port {os.environ['MASTER_PORT']}", file=sys.stderr, flush=True)
    except OSError:
        thief.close()  # held already: by the chapter's store, or by the other worker's thief
import runpy
runpy.run_path(SUITE_SITECUSTOMIZE, run_name="sitecustomize")  # the suite's own sitecustomize, as in every test
"""


def test_mp_port_cannot_be_taken_while_the_workers_start(real_data, tmp_path, procs):
    """ddp_mp.py binds its rendezvous port before it spawns: a program that takes the port meanwhile gets none.
    (A port picked free by the parent and bound by rank 0 seconds later failed once in CI with EADDRINUSE.)"""
    (tmp_path / "sitecustomize.py").write_text(PORT_THIEF.replace("SUITE_SITECUSTOMIZE", repr(str(CUDA_DEFAULTS / "sitecustomize.py"))))
    env = dict(BASE_ENV, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    p = procs.start([sys.executable, "ddp_mp.py", "--nprocs", "2", *slice_args(real_data, tmp_path / "out"),
                     "--epochs", "1", "--timeout", "30"], env=env)
    code, out, err = procs.wait(p, timeout=120)
    assert code == 0 and "took port" not in err and "Done!" in out, err


def listening_addresses(port):
    """The local addresses of this machine's sockets that listen on TCP `port`, IPv4 and IPv6 (/proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN; the address in the kernel's byte order
                raw = bytes.fromhex(address)
                found.add(socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6,
                                           b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))
    return found


def spawn_ddp_mp(monkeypatch):
    import ddp_mp
    monkeypatch.setattr(sys, "argv", ["ddp_mp.py", "--nprocs", "2", "--device", "cpu"])
    ddp_mp.main()


def spawn_preflight(monkeypatch):
    from scripts import preflight
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["preflight.py", "--nprocs", "2", "--device", "cpu"])
    preflight.main()


def spawn_benchmark_floor(monkeypatch):
    from argparse import Namespace
    from measure import benchmark
    benchmark.case_ddp_floor(Namespace(nprocs=2))


# Each parent that holds a store for the ranks mp.spawn starts on this machine, and where it tells them the port.
STORE_HOLDERS = {"ddp_mp": (spawn_ddp_mp, lambda args: args[2]),  # worker(i, cfg, world_size, port)
                 "preflight": (spawn_preflight, lambda args: int(os.environ["MASTER_PORT"])),
                 "benchmark-floor": (spawn_benchmark_floor, lambda args: args[1])}  # _floor_worker(i, args, port)


@pytest.mark.parametrize("holder", STORE_HOLDERS)
def test_spawned_ranks_store_listens_on_loopback_only(holder, monkeypatch):
    """mp.spawn's ranks all run on this machine, so the store their parent holds listens on 127.0.0.1 alone (a store
    that binds its own port listens on every interface: anyone on the network could join or feed the rendezvous)."""
    start, port_of = STORE_HOLDERS[holder]
    seen = []

    def spawn(fn, args, nprocs):  # instead of starting the ranks: what listens on the store's port as they would start
        seen.extend(listening_addresses(port_of(args)))

    monkeypatch.setattr("torch.multiprocessing.spawn", spawn)
    start(monkeypatch)
    assert seen == ["127.0.0.1"], seen


def test_no_hand_built_store_on_the_default_path():
    """The chapters meet through torch's own rendezvous for their init_method: no rank builds a TCPStore itself.
    ddp_mp.py is its own launcher: its parent holds the store, as torchrun's agent does
    (test_mp_port_cannot_be_taken_while_the_workers_start)."""
    for path in [*REPO.glob("*.py"), *REPO.glob("common/*.py")]:
        source = path.read_text()
        if path.name == "ddp_mp.py":
            main_body = source[source.index("def main("):source.index("mp.spawn(")]
            assert "is_master=True" in main_body and source.count("is_master=True") == 1, "one store, before spawn"
        else:
            assert "TCPStore(" not in source, path


def test_wrong_interface_is_named(procs):
    env = dict(BASE_ENV, GLOO_SOCKET_IFNAME="nosuch0")
    p = procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", f"tcp://127.0.0.1:{free_port()}",
                     "--rank", "0", "--world-size", "1", "--timeout", "5"], env=env)
    code, _, err = procs.wait(p, timeout=60)
    assert code == 1
    one_error_line(err, "GLOO_SOCKET_IFNAME=nosuch0 is not a network interface of this machine")


def test_leftover_rendezvous_file_is_refused(tmp_path, procs):
    stale = stale_rendezvous_file(tmp_path)
    p = procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", f"file://{stale}",
                     "--rank", "0", "--world-size", "2", "--timeout", "5"])
    code, _, err = procs.wait(p, timeout=60)
    assert code == 1
    one_error_line(err, "left over", str(stale))


def test_ranks_started_with_different_flags_stop_with_one_line(procs):
    """Different --train-samples give the ranks different step counts; gloo would abort on the first mismatch."""
    init = f"tcp://127.0.0.1:{free_port()}"
    ranks = [procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", init, "--rank", str(r), "--world-size",
                          "2", "--train-samples", str(samples), "--timeout", "30"]) for r, samples in ((0, 960), (1, 480))]
    for rank, p in enumerate(ranks):
        code, out, err = procs.wait(p, timeout=90)
        assert code == 1 and "Epoch" not in out, err
        one_error_line(err, f"[rank {rank}] rank {1 - rank} was started with --train-samples",
                       "start every rank with the same flags")


# A chapter's teardown right after a collective, as rank 1 meets it (it has nothing to save): the collective's tensor
# is freed as the call returns, and its last owner may be gloo's worker thread, which needs Python's GIL to free it.
LEAVE_AFTER_A_COLLECTIVE = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
from common.ranks import destroy_process_group
rank, port, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
for i in range(rounds):
    dist.init_process_group("gloo", store=dist.PrefixStore(str(i), store), rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    dist.all_reduce(torch.ones(1))
    destroy_process_group()
print("left", rounds, "groups", flush=True)
"""


def test_leaving_the_group_after_a_collective_never_hangs(procs):
    """The chapters' teardown, 100 times in a row straight after an all-reduce. On torch 2.6 (the floor, make
    test-floor), dist.destroy_process_group() alone deadlocked within 10 rounds in 5 runs of 5 (ddp_slurm.py's rank 1
    hung so in CI); on torch 2.14 it would pass either way: torch frees the group without the GIL there."""
    port = free_port()
    ps = [procs.start([sys.executable, "-c", LEAVE_AFTER_A_COLLECTIVE, str(rank), str(port), "100"]) for rank in (0, 1)]
    for p in ps:
        code, out, err = procs.wait(p, timeout=120)
        assert code == 0 and out == "left 100 groups\n", err
