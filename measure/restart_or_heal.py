"""A machine's trainer dies mid-run: chapter 3's elastic restart against chapter 12's healing, on two machines.

    python measure/restart_or_heal.py                                  # 3 of each way (about 15 minutes on 2 cores)
    python measure/restart_or_heal.py --repeats 1 --json runs/restart_or_heal.json
    python measure/restart_or_heal.py --from-json docs/restart_or_heal.json      # the table again

Needs root, iproute2 (the two machines of measure/netns.py, one rank each, on the CPU with gloo and one thread) and,
for chapter 12, torchft. Both ways train the same run (RUN_FLAGS: 3 epochs of 800 steps, 24 images per machine a
step, momentum 0.9), once left alone and once with nodeb's trainer killed (SIGKILL) when nodea prints the loss line
of epoch 2's step 400 (KILL_LINE):
- chapter 3: `torchrun --max-restarts 1` on both machines (c10d rendezvous on nodea, a fresh store per restart),
  `ddp_launch.py --snapshot`: nodeb's worker killed, both torchruns stop their workers and start them again, and the
  job resumes from the snapshot of epoch 1: epoch 2's steps before the kill are done again.
- chapter 12: the lighthouse and group 0 on nodea, group 1 on nodeb, each its own torchrun; group 1's torchrun and
  worker killed and its command started again at once (a supervisor's or a user's restart). Group 0 never stops:
  it trains alone (each step with its own 24 images) until group 1 has healed from it and is back in the quorum.
Per run: the wall time of nodea's command; seconds lost (killed minus alone, the same repeat); steps done again;
from the kill until training goes on with both machines (chapter 3: the resumed run's first loss line; chapter
12: group 1's healed line); chapter 12's steps with one group and group 1's skipped steps; the test accuracy.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for measure/ and common/

from common.cli import FatalError, run_main  # noqa: E402
from measure.harness import (IFNAME, NODES, PORT, descendants, env, environment, fail, last_lines, read_json,  # noqa: E402
                             start, two_machines, write_json)

A, B = NODES
LIGHTHOUSE_PORT = 29510
BATCH = 48  # the global batch: 24 images per machine
RUN_FLAGS = ["--epochs", "3", "--batch-size", str(BATCH), "--train-samples", "38400", "--test-samples", "2000",
             "--log-every", "20", "--momentum", "0.9", "--timeout", "60"]
KILL_LINE = "[19200/38400]"  # the loss line of a step 400 (of 800): the kill waits for the second, epoch 2's
LOSS = re.compile(r"^loss: \S+\s+\[\s*(\d+)/\d+\]", re.M)


class Lines:
    """A started command's standard output read line by line in the background, each line with its arrival time."""

    def __init__(self, cmd, env_):
        self.proc = start(cmd, env_, subprocess.PIPE)
        self.lines, self.errors, self.began = [], [], time.monotonic()
        self.readers = [threading.Thread(target=self._read, daemon=True),  # stderr too, or a full pipe stops it
                        threading.Thread(target=lambda: self.errors.extend(self.proc.stderr), daemon=True)]
        for reader in self.readers:
            reader.start()

    def _read(self):
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def when(self, text, nth=1, after=0.0, timeout=600):
        """The time the nth line holding text arrived (after `after`), waiting for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [t for t, line in list(self.lines) if text in line and t >= after]
            if len(found) >= nth:
                return found[nth - 1]
            if self.proc.poll() is not None and not self.readers[0].is_alive():
                break
            time.sleep(0.02)
        fail(f"`{' '.join(map(str, self.proc.args[-12:]))}`", f"printed no line {text!r} ({nth})", self.text()[-3000:])

    def finish(self, what, timeout=600):
        """Its stdout once it ended well, and its wall time from start to end."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise FatalError(f"{what} did not finish in {timeout} s") from None
        ended = time.monotonic()
        for reader in self.readers:
            reader.join()
        if self.proc.returncode:
            output = self.text() + "\n" + "".join(self.errors)
            fail(what, f"failed (exit {self.proc.returncode})", last_lines(output, 30))
        return self.text(), ended - self.began

    def text(self):
        return "\n".join(line for _, line in self.lines)


def kill_below(proc, wanted):
    """SIGKILL to proc (the command itself once the namespace's wrappers exec'ed it) and the processes below it whose
    command line wanted(argv) accepts; how many."""
    killed = 0
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if wanted(argv):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed


def accuracy(text):
    return float(re.findall(r"Accuracy: ([\d.]+)%", text)[-1])


def node_env():
    return env(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=IFNAME)


def chapter_3(net, data, out, killed):
    """ddp_launch.py under restartable torchruns on both machines; nodeb's worker killed at KILL_LINE if killed."""
    def command(node):
        return net.command(node, [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{NODES[A]}:{PORT}", "--rdzv-id",
            "job", "ddp_launch.py", *RUN_FLAGS, "--data-dir", data, "--output", out, "--snapshot", out / "snap.pt"])
    fresh_store = dict(node_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    a, b = Lines(command(A), fresh_store), Lines(command(B), fresh_store)
    result = {}
    if killed:
        kill_at = a.when(KILL_LINE, nth=2)
        is_worker = lambda argv: "ddp_launch.py" in argv and "torch.distributed.run" not in argv
        if kill_below(b.proc, is_worker) != 1:
            raise FatalError("chapter 3: found no single worker of ddp_launch.py on nodeb to kill")
        killed_at = time.monotonic()
        back = a.when("loss:", after=a.when("Resuming from", after=killed_at))
        before = a.text().split("Resuming from")[0]
        result.update(steps_again=int(LOSS.findall(before)[-1]) // BATCH + 1, back_in=back - killed_at,
                      kill_line=kill_at - a.began)
    text, wall = a.finish("chapter 3 on nodea")
    b.finish("chapter 3 on nodeb")
    return dict(result, wall=wall, accuracy=accuracy(text))


def lighthouse_path():
    """torchft's lighthouse: pip puts it beside python and torchrun; `pip install --user` or --target elsewhere, on the
    PATH. Where neither has it, the path beside python (which does not exist)."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    return beside if beside.exists() else Path(shutil.which("torchft_lighthouse") or beside)


def lighthouse_binary():
    found = lighthouse_path()
    if not found.exists():
        raise FatalError("torchft_lighthouse is not installed: `pip install -r requirements-ft.txt` (torch 2.7+)")
    return found


def start_lighthouse(net, min_replicas=1):
    """torchft's lighthouse on nodea, as README starts it, on every interface at LIGHTHOUSE_PORT: the process."""
    return start(net.command(A, [lighthouse_binary(), "--min_replicas", str(min_replicas), "--join_timeout_ms",
                                 "10000", "--bind", f"[::]:{LIGHTHOUSE_PORT}"]), dict(node_env(), RUST_LOG="warn"))


def chapter_12(net, data, out, killed):
    """The lighthouse and group 0 on nodea, group 1 on nodeb; group 1 killed at KILL_LINE and started again if
    killed."""
    lighthouse = start_lighthouse(net)
    group_env = dict(node_env(), TORCHFT_LIGHTHOUSE=f"http://{A}:{LIGHTHOUSE_PORT}")

    def group(g):
        return Lines(net.command((A, B)[g], [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "ddp_ft.py",
            "--replica-group", str(g), *RUN_FLAGS, "--data-dir", data, "--output", out / f"g{g}"]), group_env)
    try:
        a, b = group(0), group(1)
        result = {}
        if killed:
            a.when(KILL_LINE, nth=2)
            if not kill_below(b.proc, lambda argv: "ddp_ft.py" in argv):  # its torchrun and its worker
                raise FatalError("chapter 12: found no ddp_ft.py on nodeb to kill")
            killed_at = time.monotonic()
            b.proc.wait(timeout=60)
            b = group(1)
            back = b.when("healed from a live group")
            healed = re.search(r"step (\d+): healed from a live group at its step \d+ \((\d+) steps skipped here\): "
                               r"state received in ([\d.]+)s", b.text())
            result.update(back_in=back - killed_at, skipped=int(healed[2]), state_seconds=float(healed[3]))
        text, wall = a.finish("chapter 12's group 0 on nodea")
        b.finish("chapter 12's group 1 on nodeb")
        if killed:  # group 0's steps from the quorum of 1 to the quorum of 2 again
            alone, back = (int(re.findall(rf"step (\d+): quorum of {n} replica groups? \(was {3 - n}\)", text)[-1])
                           for n in (1, 2))
            result["one_group_steps"] = back - alone
        retried = int(re.search(r"(\d+) retried", text)[1])
        return dict(result, wall=wall, accuracy=accuracy(text), steps_again=retried)
    finally:
        lighthouse.kill()
        lighthouse.wait()


WAYS = {"chapter 3: torchrun --max-restarts": chapter_3, "chapter 12: torchft heals": chapter_12}


def measure(args):
    runs = []
    with two_machines(None) as net:
        for repeat in range(args.repeats):
            for way, run in WAYS.items():
                pair = {}
                for killed in (False, True):
                    chapter = way.split(":")[0].replace(" ", "")
                    out = Path(args.scratch) / f"{repeat}-{chapter}-{'killed' if killed else 'alone'}"
                    print(f"repeat {repeat + 1}/{args.repeats}: {way}, {'killed' if killed else 'left alone'}",
                          flush=True)
                    pair[killed] = run(net, Path(args.data_dir).resolve(), out.resolve(), killed)
                runs.append(dict(way=way, repeat=repeat, alone=pair[False], killed=pair[True]))
    return runs


def table(runs):
    """The mean of each way's repeats (min-max where there are several), one row each."""
    def cell(values, spec):
        values = [v for v in values if v is not None]
        if not values:
            return "-"
        spread = f" ({min(values):{spec}}-{max(values):{spec}})" if len(values) > 1 else ""
        return f"{mean(values):{spec}}{spread}"

    rows = ["| way | wall, left alone (s) | wall, killed (s) | seconds lost | steps done again | kill to both "
            "training (s) | steps with one machine | accuracy alone / killed (%) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for way in WAYS:
        mine = [r for r in runs if r["way"] == way]
        if not mine:
            continue
        alone, killed = [r["alone"] for r in mine], [r["killed"] for r in mine]
        column = lambda runs, key, spec: cell([r.get(key) for r in runs], spec)
        rows.append(f"| {way} | {column(alone, 'wall', '.1f')} | {column(killed, 'wall', '.1f')} "
                    f"| {cell([k['wall'] - a['wall'] for a, k in zip(alone, killed)], '.1f')} "
                    f"| {column(killed, 'steps_again', '.0f')} | {column(killed, 'back_in', '.1f')} "
                    f"| {column(killed, 'one_group_steps', '.0f')} "
                    f"| {column(alone, 'accuracy', '.1f')} / {column(killed, 'accuracy', '.1f')} |")
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="runs of each way, left alone and killed (default 3)")
    p.add_argument("--data-dir", default="data", help="FashionMNIST's folder (default: ./data)")
    p.add_argument("--scratch", default="runs/restart_or_heal", help="the runs' output folders")
    p.add_argument("--json", help="write the runs here")
    p.add_argument("--from-json", help="print the table of runs written before, run nothing")
    args = p.parse_args()
    if args.from_json:
        print(table(read_json(args.from_json)["runs"]))
        return
    runs = measure(args)
    write_json(args.json, dict(environment=environment(), flags=RUN_FLAGS, kill_line=KILL_LINE, runs=runs))
    print(table(runs))


if __name__ == "__main__":
    run_main(main)
