"""The DDP chapters through their real launchers: same model as chapter 1 at world sizes 1-3, exact eval, errors."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.distributed import free_port
from common.metrics import read_metrics
from conftest import REPO, assert_same_curves, load_state, max_abs_diff, slice_args
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
BASE_ENV = dict(os.environ, PYTHONUNBUFFERED="1", FASHION_MNIST_OFFLINE="1", OMP_NUM_THREADS="1")


class Procs:
    """Processes started in their own sessions, so a test can kill every one of them and their children."""

    def __init__(self):
        self.procs = []

    def start(self, cmd, **kw):
        p = subprocess.Popen(cmd, cwd=REPO, env=kw.pop("env", BASE_ENV), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def wait(self, p, timeout=300):
        """(returncode, stdout, stderr) of p, killing it if it overruns."""
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(p)
            out, err = p.communicate()
            pytest.fail(f"{p.args} still running after {timeout}s:\n{out}\n{err}")
        return p.returncode, out, err

    def kill(self, p):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                self.kill(p)
            p.communicate()


@pytest.fixture
def procs():
    ps = Procs()
    yield ps
    ps.close()


def launch(kind, world, real_data, out, procs, timeout=60):
    """Train with chapter `kind` on `world` ranks; returns (returncodes, stdout of all, stderr of all)."""
    args = [*slice_args(real_data, out), "--timeout", str(timeout)]
    port = free_port()
    if kind == "mp":
        ps = [procs.start([sys.executable, "ddp_mp.py", "--nprocs", str(world), *args])]
    elif kind == "torchrun":
        ps = [procs.start([*TORCHRUN, "--standalone", "--nproc-per-node", str(world), "ddp_launch.py", *args])]
    else:
        init = f"tcp://127.0.0.1:{port}" if kind == "tcp" else f"file://{out}.rdzv"
        ps = [procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", init, "--rank", str(r),
                           "--world-size", str(world), *args]) for r in range(world)]
    results = [procs.wait(p) for p in ps]
    return [r[0] for r in results], "".join(r[1] for r in results), "".join(r[2] for r in results)


def _accuracy_lines(log):
    return re.findall(r"Accuracy: [\d.]+%", log)


def _test_losses(log):
    return [float(x) for x in re.findall(r"Avg loss: ([\d.]+)", log)]


CASES = [("mp", 1), ("mp", 2), ("mp", 3), ("torchrun", 1), ("torchrun", 2), ("torchrun", 3),
         ("tcp", 2), ("tcp", 3), ("file", 2), ("file", 3)]


@pytest.mark.parametrize("kind,world", CASES, ids=[f"{k}-{w}" for k, w in CASES])
def test_ddp_trains_the_same_model(kind, world, real_data, reference, tmp_path, procs):
    codes, out, err = launch(kind, world, real_data, tmp_path / "run", procs)
    assert codes == [0] * len(codes), err
    ref_state, ref_log, ref_metrics = reference
    assert max_abs_diff(ref_state, load_state(tmp_path / "run" / "model.pth")) <= 1e-5
    assert_same_curves(read_metrics(tmp_path / "run"), ref_metrics)  # rank 0's metrics.jsonl: the same curve
    # Exact evaluation: the same accuracy over all 500 test images, whatever the world size.
    assert _accuracy_lines(out) == _accuracy_lines(ref_log)
    assert _test_losses(out) == pytest.approx(_test_losses(ref_log), abs=2e-6)
    assert "[  336/  960]" in out  # loss lines count global samples: batch 7 * global batch 48
    # Rank 0 alone prints the tutorial lines; each rank prints one setup line.
    assert out.count("Epoch 1\n") == 1 and out.count("Done!") == 1
    assert sorted(re.findall(r"\[rank (\d+)\] host=", out)) == [str(r) for r in range(world)]
    assert "Traceback" not in err and "terminate called" not in err
    if kind == "file":
        assert not (tmp_path / "run.rdzv").exists(), "the rendezvous file is removed at the end"


def test_two_torchrun_nodes_on_one_machine(real_data, reference, tmp_path, procs):
    """Two launchers as two nodes (node ranks 0 and 1) on 127.0.0.1 train together."""
    port = free_port()
    nodes = [procs.start([*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(n),
                          "--master-addr", "127.0.0.1", "--master-port", str(port), "ddp_launch.py",
                          *slice_args(real_data, tmp_path / "run"), "--timeout", "60"]) for n in range(2)]
    results = [procs.wait(p) for p in nodes]
    assert [r[0] for r in results] == [0, 0], results[0][2] + results[1][2]
    assert max_abs_diff(reference[0], load_state(tmp_path / "run" / "model.pth")) <= 1e-5
    assert _accuracy_lines(results[0][1]) == _accuracy_lines(reference[1])


def _one_error_line(err, *needles):
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.parametrize("rank,needles", [
    (1, ["GLOO_SOCKET_IFNAME", "firewall"]),  # nobody listens at the master's address
    (0, ["start every rank"]),  # the master listens, but its peer never comes
], ids=["unreachable-master", "missing-peer"])
def test_lone_rank_fails_within_the_timeout(rank, needles, procs):
    port = free_port()
    start = time.monotonic()
    p = procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", f"tcp://127.0.0.1:{port}",
                     "--rank", str(rank), "--world-size", "2", "--timeout", "5"])
    code, _, err = procs.wait(p, timeout=60)
    assert code == 1 and time.monotonic() - start < 5 + 20
    _one_error_line(err, f"127.0.0.1:{port}", *needles)


def test_busy_port_is_named(procs):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", f"tcp://127.0.0.1:{port}",
                         "--rank", "0", "--world-size", "2", "--timeout", "5"])
        code, _, err = procs.wait(p, timeout=60)
    assert code == 1
    _one_error_line(err, f"port {port} is busy")


def _listening(port):
    """Local addresses (as hex, from /proc/net/tcp and tcp6) with a socket listening on port."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                found.append(local.rsplit(":", 1)[0])
    return found


def test_rank0_listens_only_on_the_address_it_was_given(procs):
    """tcp://127.0.0.1:PORT: the store listens on loopback only, not on every interface (TCPStore's default)."""
    port = free_port()
    p = procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", f"tcp://127.0.0.1:{port}",
                     "--rank", "0", "--world-size", "2", "--timeout", "5"])
    deadline = time.monotonic() + 60
    while not _listening(port) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _listening(port) == ["0100007F"]  # 127.0.0.1, and no 0.0.0.0 or :: entry
    code, _, err = procs.wait(p, timeout=60)  # rank 1 never comes: the rendezvous times out
    assert code == 1 and "no rendezvous at 127.0.0.1" in err, err


def test_an_address_of_another_machine_is_refused(procs):
    """Rank 0 told to listen on an address it does not have (192.0.2.1 is a documentation-only address)."""
    p = procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", f"tcp://192.0.2.1:{free_port()}",
                     "--rank", "0", "--world-size", "2", "--timeout", "5"])
    code, _, err = procs.wait(p, timeout=60)
    assert code == 1
    _one_error_line(err, "192.0.2.1 is not an address of this machine")


def test_wrong_interface_is_named(procs):
    env = dict(BASE_ENV, GLOO_SOCKET_IFNAME="nosuch0")
    p = procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", f"tcp://127.0.0.1:{free_port()}",
                     "--rank", "0", "--world-size", "1", "--timeout", "5"], env=env)
    code, _, err = procs.wait(p, timeout=60)
    assert code == 1
    _one_error_line(err, "GLOO_SOCKET_IFNAME=nosuch0 is not a network interface of this machine")


def stale_rendezvous_file(folder):
    """A file:// rendezvous file left by a run an hour ago."""
    stale = folder / "rdzv"
    stale.write_text("old")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    return stale


def test_leftover_rendezvous_file_is_refused(tmp_path, procs):
    stale = stale_rendezvous_file(tmp_path)
    p = procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", f"file://{stale}",
                     "--rank", "0", "--world-size", "2", "--timeout", "5"])
    code, _, err = procs.wait(p, timeout=60)
    assert code == 1
    _one_error_line(err, "left over", str(stale))


@pytest.mark.parametrize("script", ["ddp_launch.py", "ddp_mp.py", "ddp_tcp_manual.py"])
def test_chapter_diff_stays_small(script):
    """`diff single_gpu.py ddp_X.py` is the lesson: only the strategy's lines may differ."""
    diff = subprocess.run(["diff", "single_gpu.py", script], cwd=REPO, capture_output=True, text=True).stdout
    changed = [line for line in diff.splitlines() if line[:2] in ("< ", "> ")]
    assert len(changed) <= 60, diff
