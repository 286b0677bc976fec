"""The measurement scripts' one harness, the only module they share: a chapter run unchanged inside a rank
(worker_command, worker_args, after_steps, run_chapter), torchrun on this machine or one rank on each of two
(torchrun, run, two_machines, shape, torchrun_on_two, wait_for), the processes below one (descendants, which the
tests use too), one way to fail (fail), JSON and pictures."""
import argparse
import json
import math
import os
import platform
import runpy
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python measure/x.py` puts measure/, not the repo root, on sys.path

from common.cli import FatalError  # noqa: E402
from measure.netns import IFNAME, NODES, TwoMachines, why_not  # noqa: E402

PORT = "29500"  # the rendezvous on nodea: the two machines are namespaces of their own, nothing else listens there
RATES = {"unlimited": None, "1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s", "10mbit": "10 Mbit/s"}  # the links, named
DTYPE_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
               "Byte": 1, "Bool": 1}
PROFILER_DTYPES = {"float": "Float", "c10::BFloat16": "BFloat16", "c10::Half": "Half", "double": "Double"}


# --- Inside a rank: the chapter, unchanged, with hooks around it ---

def worker_command(script, chapter, out, **values):
    """The line that starts script's worker on chapter (its flags follow): worker_args() reads it back."""
    return [str(Path(script).resolve()), "--worker", chapter, "--out", str(out),
            *[x for name, v in values.items() if v is not None for x in (f"--{name.replace('_', '-')}", str(v))], "--"]


def worker_args(**types):
    """Inside the worker: (its --worker, --out and the named values, the chapter's flags), as worker_command wrote."""
    p = argparse.ArgumentParser()
    p.add_argument("--worker")
    p.add_argument("--out")
    for name, type_ in types.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type_)
    known, rest = p.parse_known_args()
    return known, rest[1:] if rest[:1] == ["--"] else rest


def after_steps(hook):
    """hook(n, optimizer) after the chapter's n-th optimizer step (n from 1), whatever optimizer it builds."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    done = [0]

    def after(optimizer, *_):
        done[0] += 1
        hook(done[0], optimizer)

    register_optimizer_step_post_hook(after)
    return done  # done[0]: the steps made so far


def profiler(cuda=False):
    """torch's profiler with shapes, over every thread: gloo runs collectives on its own (torch 2.8 on; before it,
    those go unseen, and PowerSGD starts its second and third all-reduce on gloo's thread)."""
    from torch.profiler import ProfilerActivity, profile

    every_thread = {}
    try:
        from torch._C._profiler import _ExperimentalConfig
        every_thread = dict(experimental_config=_ExperimentalConfig(profile_all_threads=True))
    except TypeError:
        pass
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    return profile(activities=activities, record_shapes=True, **every_thread)


def too_few_steps(chapter, made, needed):
    """An exit code: 1, with one line, when chapter stopped before the steps the measurement needs; else 0."""
    if made >= needed:
        return 0
    print(f"error: {chapter} made {made} optimizer steps; the measurement needs {needed}: give it more "
          f"--train-samples or a smaller --batch-size", file=sys.stderr)
    return 1


def run_chapter(chapter, flags, at_end):
    """Run chapter with flags in this process, as `python chapter` does; at_end(code) is called as it ends (after
    its teardown, before the process exits) and returns the exit code."""
    import common.cli

    end = common.cli.end_process
    common.cli.end_process = lambda code: end(at_end(code))
    sys.argv = [chapter, *flags]
    runpy.run_path(str(REPO / chapter), run_name="__main__")


def rank():
    """This process's rank: torchrun's RANK, 0 alone."""
    return int(os.environ.get("RANK", 0))


# --- The driver: start the ranks, here or on two machines; a failure is one FatalError ---

def env(**more):
    """The ranks' environment: the repository importable, output unbuffered, and more."""
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **more)


def torchrun(ranks, args):
    """torchrun --standalone with ranks processes on this machine; ranks None: args under plain python (alone)."""
    if ranks is None:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *args]


def start(cmd, env_=None, stdout=subprocess.DEVNULL):
    """cmd started in the repository, its standard error kept for wait_for."""
    return subprocess.Popen(cmd, cwd=REPO, env=env_ or env(), stdout=stdout, stderr=subprocess.PIPE, text=True)


def descendants(pid):
    """The pids of every process below pid (children, their children, ...), from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read()
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def fail(what, problem, output):
    """Stop: output (what's last lines) shown, then what and its problem as FatalError's one line (run_main prints a
    message as one line, so the output goes above it, not into it)."""
    sys.stderr.write(f"--- the last lines of {what} ---\n{output.rstrip()}\n---\n")
    raise FatalError(f"{what} {problem}; its last lines of output are above")


def last_lines(text, n=15):
    return "\n".join(text.rstrip().splitlines()[-n:])


def wait_for(procs, what, timeout=600):
    """Wait for procs; their standard outputs, or fail() with what failed and each one's last lines (all killed if
    one outlasts timeout)."""
    outputs, failed = [], []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise FatalError(f"{what} did not finish in {timeout} s") from None
        outputs.append(out)
        if p.returncode:
            failed.append(f"(exit {p.returncode})\n{last_lines(err)}")
    if failed:
        fail(what, "failed", "\n".join(failed))
    return outputs


def records(out, ranks, what):
    """The JSON file each rank's worker wrote in out, in rank order, or FatalError if one is missing."""
    found = [json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json"))]
    if len(found) != ranks:
        raise FatalError(f"{what} left {len(found)} measurements for {ranks} ranks")
    return found


def run(cmd, what, env_=None, timeout=600):
    """cmd run to its end on this machine: its standard output, or fail() with its last lines."""
    return wait_for([start(cmd, env_, subprocess.PIPE)], what, timeout)[0]


@contextmanager
def two_machines(congestion_control):
    """The two machines, their TCP's congestion control set (None: the host's, as it is); one line if they cannot be."""
    if congestion_control is not None:
        kernel, allowed = (Path(f"/proc/sys/net/ipv4/tcp_{which}_congestion_control").read_text().split()
                           for which in ("available", "allowed"))
        if congestion_control not in kernel:
            raise FatalError(f"--congestion-control {congestion_control} is not in this kernel; it has "
                             f"{' '.join(kernel)}")
        if congestion_control not in allowed:  # a namespace other than the host's may only pick from this list
            raise FatalError(f"--congestion-control {congestion_control}: the host allows only {' '.join(allowed)} "
                             f"in a namespace; as root: sysctl -w net.ipv4.tcp_allowed_congestion_control="
                             f"'{' '.join(allowed)} {congestion_control}'")
    reason = why_not()
    if reason:
        raise FatalError(f"cannot make the two machines: {reason}")
    with TwoMachines() as net:
        net.tcp = net.congestion_control(congestion_control)
        yield net


def shape(net, rate):
    """The link shaped to rate ("10mbit"; "unlimited": no limit), or FatalError in one line if tc's tbf cannot."""
    try:
        net.shape(None if rate == "unlimited" else rate)
    except RuntimeError as e:
        raise FatalError(f"cannot shape the link to {rate} with tc's tbf: {e}") from None


def on_two(net, node_cmd, stdout=subprocess.DEVNULL):
    """node_cmd(i, node) started on each machine, one thread per rank: the two machines share this one's cores."""
    return [start(net.command(node, node_cmd(i, node)), env(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=IFNAME), stdout)
            for i, node in enumerate(NODES)]


def torchrun_on_two(net, args):
    """torchrun on each machine, one rank each (nodea hosts the rendezvous): the two launchers, started."""
    return on_two(net, lambda i, node: [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(i),
        "--master-addr", NODES["nodea"], "--master-port", PORT, *args])


# --- What was sent, and what to write ---

def sent_by_ring(c):
    """Bytes one rank sends for one recorded collective, as a ring algorithm moves them."""
    n = c["ranks"]
    size = lambda shapes: sum(math.prod(s) * DTYPE_BYTES.get(d, 4) for s, d in zip(shapes, c["dtypes"]))
    if n < 2:
        return 0
    if c["kind"] in ("all_reduce", "allreduce"):
        return 2 * (n - 1) / n * size(c["sizes"])
    if c["kind"] in ("all_gather", "_allgather_base", "allgather", "all_gather_into_tensor"):
        return (n - 1) / n * size(c["out_sizes"])
    if c["kind"] in ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor"):
        return (n - 1) / n * size(c["sizes"])
    if c["kind"] == "broadcast":
        return size(c["sizes"])
    return 0


def union(intervals, start=-math.inf, end=math.inf):
    """The length of [start, end] covered by at least one of the (a, b) intervals."""
    covered, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return covered


def kib(nbytes):
    return "-" if nbytes is None else f"{nbytes / 1024:,.0f}"


def write_json(path, data):
    """data as JSON at path (nothing without a path)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1) + "\n")


def read_json(path):
    """What write_json wrote at path, or FatalError in one line."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise FatalError(f"cannot read {path}: {e}") from None


def environment():
    """Versions and machine facts that a timing means nothing without."""
    import torch

    found = dict(python=platform.python_version(), torch=torch.__version__, cpu_count=os.cpu_count(),
                 torch_threads=torch.get_num_threads(), machine=platform.machine(), node=platform.node())
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
    return found


def pyplot(path):
    """matplotlib's pyplot, drawing to files; without matplotlib, a note that path is not drawn, and None."""
    try:
        import matplotlib
    except ImportError:
        print(f"note: no chart {path}: matplotlib is not installed (pip install matplotlib); the rest is complete "
              f"without it", file=sys.stderr)
        return None
    matplotlib.use("Agg")  # a file, no window
    import matplotlib.pyplot as plt
    return plt


def save(fig, path):
    """fig as a PNG at path (its folder made), or FatalError in one line."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    except OSError as e:
        raise FatalError(f"cannot write {path}: {e.strerror}; pass another path") from None
    print(f"Wrote {path}")
