"""scripts/preflight.py with the launchers the jobs use: torchrun, mp.spawn, and torchrun on two machines."""
import importlib.util
import re
import sys
import time

import pytest
import torch

from measure.netns import IFNAME, NODES, TwoMachines
from support import REPO
from support.run import TORCHRUN
from support.two_machines import NODE_ENV, PORT, need_namespaces

OK = re.compile(r"^preflight: OK: 2 ranks on (\d) hosts? \((.+)\); 16 MiB all_reduce (\d+\.\d+) GB/s, broadcast "
                r"(\d+\.\d+) GB/s \(bus bandwidth, gloo\)$", re.M)


def rank_lines(out):
    return re.findall(r"^\[rank (\d)\] host=(\S+) local_rank=(\d) device=cpu backend=gloo world_size=2 iface=(\S+) ",
                      out, re.M)


def load_preflight():
    spec = importlib.util.spec_from_file_location("preflight", REPO / "scripts" / "preflight.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bus_bandwidth_is_nccl_tests_busbw():
    """By hand: 16 MiB in 10 ms is 1.6777 GB/s of algorithm bandwidth; an all-reduce over 4 ranks moves 2*3/4 of it."""
    bus_bandwidth = load_preflight().bus_bandwidth
    assert bus_bandwidth("all_reduce", 16 * 2**20, 0.010, 4) == pytest.approx(2.5165824e9)
    assert bus_bandwidth("all_reduce", 16 * 2**20, 0.010, 2) == pytest.approx(1.6777216e9)  # 2*(2-1)/2 = 1
    assert bus_bandwidth("broadcast", 16 * 2**20, 0.010, 4) == pytest.approx(1.6777216e9)
    assert bus_bandwidth("all_reduce", 4096, 0.001, 8) == pytest.approx(7.168e6)  # 4.096 MB/s x 2*7/8
    assert load_preflight().algorithm_bandwidth(16 * 2**20, 0.010) == pytest.approx(1.6777216e9)


def test_the_sweep_is_nccl_tests_on_gpus_and_shorter_on_the_cpu():
    sizes = load_preflight().sizes
    assert sizes(torch.device("cpu")) == [4096 * 4**k for k in range(7)]  # 4 KiB .. 16 MiB
    assert sizes(torch.device("cuda", 0))[-1] == 256 * 2**20 and len(sizes(torch.device("cuda", 0))) == 9


def check_ok(out, hosts, where):
    """The OK line as the last line, and every timed row's algbw and busbw what its time gives (2 ranks: both bus
    factors are 1, 2 * (2 - 1) / 2 for the all-reduce and 1 for the broadcast)."""
    match = OK.search(out)
    assert match and match[1] == str(hosts) and match[2] == where, out
    assert out.rstrip().splitlines()[-1] == match[0]  # the last line
    sizes = {"4 KiB": 4096, "16 KiB": 2**14, "64 KiB": 2**16, "256 KiB": 2**18, "1 MiB": 2**20, "4 MiB": 2**22,
             "16 MiB": 16 * 2**20}
    printed = {}
    for op in ("all_reduce", "broadcast"):
        rows = re.findall(rf"^ *{op} +(\d+ [KM]iB): +(\d+\.\d+) ms +(\d+\.\d+) GB/s +(\d+\.\d+) GB/s$", out, re.M)
        assert [size for size, *_ in rows] == list(sizes), out  # every size, timed
        for size, ms, algbw, busbw in rows:
            ms, algbw, busbw = float(ms), float(algbw), float(busbw)
            expected = sizes[size] / (ms / 1e3) / 1e9
            for gbs in (algbw, busbw):
                assert abs(gbs - expected) <= expected * 0.0005 / ms + 0.0005 + 1e-9, (op, size, ms, gbs)  # rounding
            printed[op, size] = busbw
    assert (float(match[3]), float(match[4])) == (printed["all_reduce", "16 MiB"], printed["broadcast", "16 MiB"])


@pytest.mark.parametrize("launcher", ["torchrun", "mp.spawn"])
def test_preflight_on_one_machine(launcher, procs):
    cmd = ([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "scripts/preflight.py"] if launcher == "torchrun"
           else [sys.executable, "scripts/preflight.py", "--nprocs", "2"])
    code, out, err = procs.wait(procs.start([*cmd, "--timeout", "30"]), timeout=120)
    assert code == 0, err
    lines = rank_lines(out)
    assert sorted((r, lr) for r, _, lr, _ in lines) == [("0", "0"), ("1", "1")], out
    host = lines[0][1]
    assert all(iface == "lo" for *_, iface in lines), out  # the host name resolves to a loopback address here
    check_ok(out, 1, f"{host}: 0,1")


def test_preflight_on_two_machines(procs):
    """One rank per namespace, GLOO_SOCKET_IFNAME=eth1 as the docs say: two hosts, each on eth1."""
    need_namespaces()
    with TwoMachines() as net:
        started = [procs.start(net.command(node, [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
                                                  str(i), "--master-addr", NODES["nodea"], "--master-port", PORT,
                                                  "scripts/preflight.py", "--timeout", "30"]), env=NODE_ENV)
                   for i, node in enumerate(NODES)]
        (code_a, out_a, err_a), (code_b, out_b, err_b) = [procs.wait(p, timeout=120) for p in started]
    assert (code_a, code_b) == (0, 0), err_a + err_b
    assert rank_lines(out_a) == [("0", "nodea", "0", IFNAME)] and rank_lines(out_b) == [("1", "nodeb", "0", IFNAME)]
    check_ok(out_a, 2, "nodea: 0, nodeb: 1")
    assert "preflight:" not in out_b  # rank 0 speaks for the job


def test_preflight_names_the_rank_that_cannot_join(procs):
    """nodeb names an interface it does not have: its rank says so, and nodea's rank stops within --timeout."""
    need_namespaces()
    with TwoMachines() as net:
        envs = {"nodea": NODE_ENV, "nodeb": dict(NODE_ENV, GLOO_SOCKET_IFNAME="eth9")}
        start = time.monotonic()
        started = [procs.start(net.command(node, [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
                                                  str(i), "--master-addr", NODES["nodea"], "--master-port", PORT,
                                                  "scripts/preflight.py", "--timeout", "10"]), env=envs[node])
                   for i, node in enumerate(NODES)]
        (code_a, out_a, err_a), (code_b, _, err_b) = [procs.wait(p, timeout=120) for p in started]
        seconds = time.monotonic() - start
    assert code_a != 0 and code_b != 0 and seconds < 10 + 40, (seconds, err_a, err_b)
    (line,) = [x for x in err_b.splitlines() if x.startswith("error:")]
    assert line.startswith("error: [rank 1] preflight: FAILED: rank 1 on nodeb could not meet the others at env://: "
                           "GLOO_SOCKET_IFNAME=eth9 is not a network interface of this machine"), line
    (line,) = [x for x in err_a.splitlines() if x.startswith("error:")]
    assert line.startswith("error: [rank 0] preflight: FAILED: rank 0 on nodea could not meet the others"), line
    assert "preflight: OK" not in out_a
