"""Two machines on one: network namespaces joined by a veth pair, each with its own address and host name.

    with TwoMachines() as net:                       # nodea 10.77.0.1 and nodeb 10.77.0.2, interface eth1 on each
        p = procs.start(net.command("nodea", ["python", "ddp_tcp_manual.py", ...]))   # the tests' Procs
        net.shape("100mbit")                         # the link now carries 100 Mbit/s each way (None: unlimited)

Each node is a namespace with loopback and eth1 (the two ends of one veth pair), its own /etc/hosts (through
/etc/netns/NAME/hosts, which `ip netns exec` mounts over /etc/hosts) naming both nodes, and its own host name
(`unshare --uts`), so torch sees two machines: different host names, different addresses, one network. Traffic
stays between the two namespaces. Both are removed on exit; the processes belong to whoever started them (the
tests' `procs` fixture kills them). Needs root and iproute2.

shape(rate) puts a token bucket (`tc qdisc ... tbf`) on eth1 in both namespaces: a qdisc shapes what leaves an
interface, so one on each end limits each direction of the link to the rate. Only the rate: netem, the qdisc that
adds delay, is a kernel module that not every kernel has (this project's machine has none), so a shaped link here is
a slow one, not a distant one.
"""
import os
import shutil
import subprocess
import time
from pathlib import Path

NODES = {"nodea": "10.77.0.1", "nodeb": "10.77.0.2"}
IFNAME = "eth1"  # the interface on the nodes' shared network, as GLOO_SOCKET_IFNAME names it


def why_not():
    """None where namespaces can be made here, else the reason."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2 / util-linux)"
    probe = f"fmprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if made.returncode == 0 else f"cannot make a network namespace: {made.stderr.strip()}"


def _run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")


def _ip(*args):
    _run(["ip", *args])


UNITS = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
QUEUE = 4 * 1024 * 1024  # bytes a shaped link holds before it drops a packet


def burst_bytes(bits):
    """tbf's burst at a rate (bit/s): the bytes that may leave at once after the link was idle, as few as this kernel
    allows while the link still carries its rate. Measured here (a 1 MB all-reduce between the two nodes): one full
    frame (1,600 bytes) carries 10 Mbit/s (1.07x the wire time); 100 Mbit/s needs 0.32 ms of the link (4,000 bytes:
    1.07x, where 1,600 gave 1.27x); 1 Gbit/s needs 1 ms (125,000 bytes: 0.99-1.48x; 40,000 gave 1.75x). So at 10 and
    100 Mbit/s a 15 KB all-reduce after an idle gap sends at most a third of its bytes at once, and the rest at the
    rate (tests/test_scaling.py), instead of leaving whole in a 32 KiB burst; at 1 Gbit/s its wire time, 0.12 ms, is
    below gloo's own latency."""
    return max(1600, bits // 8 // 1000 if bits >= 10**9 else bits // 8 * 32 // 100_000)


def tc_bits(rate):
    """Bits per second of a tc rate such as "10mbit" (tc's SI units: 1 mbit is 10**6 bit/s)."""
    for unit, scale in UNITS.items():
        if rate.endswith(unit):
            return int(float(rate[:-len(unit)]) * scale)
    raise ValueError(f"{rate!r} is not a rate like 10mbit, 100mbit or 1gbit")


class TwoMachines:
    """nodea and nodeb as namespaces; command(node, cmd) is cmd as it runs on one of them."""

    def __init__(self, extra_addresses=None, hosts=None):
        tag = f"{os.getpid() % 100000}"
        self.ns = {node: f"fm{node[-1]}{tag}" for node in NODES}  # fma12345, fmb12345
        self.extra = extra_addresses or {}  # node -> more addresses on its eth1, e.g. a second "network card"
        self.hosts = hosts or NODES  # the names every node's /etc/hosts gives

    def __enter__(self):
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _make(self):
        a, b = (self.ns[node] for node in NODES)
        for ns in (a, b):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", f"v{a}", "type", "veth", "peer", "name", f"v{b}")
        for node, ns in self.ns.items():
            _ip("link", "set", f"v{ns}", "netns", ns)
            _ip("-n", ns, "link", "set", f"v{ns}", "name", IFNAME)
            for address in [NODES[node], *self.extra.get(node, [])]:
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            names = "".join(f"{address} {name}\n" for name, address in self.hosts.items())
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
        self._wait_until_they_see_each_other()

    def _wait_until_they_see_each_other(self, timeout=10):
        deadline = time.monotonic() + timeout
        while subprocess.run(["ip", "netns", "exec", self.ns["nodea"], "ping", "-c1", "-W1", NODES["nodeb"]],
                             capture_output=True).returncode != 0:
            if shutil.which("ping") is None or time.monotonic() > deadline:
                return  # no ping here: the first connection will wait for the link instead
            time.sleep(0.1)

    def command(self, node, cmd):
        """cmd as it runs on node: in its namespace, under its own host name."""
        return ["ip", "netns", "exec", self.ns[node], "unshare", "--uts", "sh", "-c",
                f'hostname {node} && exec "$@"', "sh", *map(str, cmd)]

    def shape(self, rate):
        """Limit each direction of the link to rate (tc's units: "10mbit", "1gbit"); None takes the limit away."""
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", IFNAME, "root"],
                           capture_output=True)
            if rate is not None:
                # limit: the queue, 4 MiB, room for what TCP lets a connection queue (net.ipv4.tcp_limit_output_bytes,
                # 4 MiB here), so TCP waits for the link, as behind a slow card of its own, instead of losing packets:
                # with a 50 ms queue, every run of DDP at 10 Mbit/s lost some (reno resent about 200 segments a run,
                # BBR 15,000-24,000). burst: burst_bytes(), the least that still carries the rate.
                burst = burst_bytes(tc_bits(rate))
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME, "root", "tbf", "rate", rate,
                      "burst", str(burst), "limit", str(QUEUE)])

    def link(self, node, up):
        """Take node's end of the link down (a pulled cable: both ends lose carrier) or bring it back up."""
        _run(["ip", "-n", self.ns[node], "link", "set", IFNAME, "up" if up else "down"])

    def sent_bytes(self):
        """Bytes both nodes have sent over the link so far, as their interfaces count them (headers and resends too)."""
        return sum(int(subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{IFNAME}/statistics/tx_bytes"],
                                      capture_output=True, text=True, check=True).stdout) for ns in self.ns.values())

    def congestion_control(self, name=None):
        """TCP's congestion control on both nodes: set it to name first, if given; the name in use. A namespace takes
        only the algorithms the host allows (net.ipv4.tcp_allowed_congestion_control); it starts with the host's."""
        if name is not None:
            for ns in self.ns.values():
                _run(["ip", "netns", "exec", ns, "sysctl", "-q", f"net.ipv4.tcp_congestion_control={name}"])
        return subprocess.run(["ip", "netns", "exec", self.ns["nodea"], "sysctl", "-n",
                               "net.ipv4.tcp_congestion_control"], capture_output=True, text=True).stdout.strip()

    def close(self):
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes its end of the veth pair along
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
