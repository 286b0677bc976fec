"""Time one training epoch of every way to train the model that runs here, the quickstart and compute floors.

    python measure/benchmark.py                                        # 2 epochs of each case on the CPU
    python measure/benchmark.py --epochs 3 --json runs/benchmark.json  # also write every measurement as JSON
    python measure/benchmark.py --device cuda --cases single_gpu,floor,ddp_mp_1   # a subset, on the GPU
    python measure/benchmark.py --rounds 3                             # a b c a b c a b c: steadier on a busy machine
    python measure/benchmark.py --before ../main --cases single_gpu,floor --rounds 5   # a change against main, one run

Cases (each in its own subprocess, so each has a fresh interpreter and its own peak RSS):
  (a) single_gpu   the real `single_gpu.py`, timed by the "Train time:" lines it prints
  (b) quickstart   the PyTorch quickstart: torchvision FashionMNIST + ToTensor, DataLoader(batch_size=64)
  (c) floor        the same model stepping over pre-made float32 slices: no DataLoader, no per-step sync
  (d) ddp_mp_1     the real `ddp_mp.py --nprocs 1`: DDP's cost with nobody to talk to
  (e) ddp_mp_2     the real `ddp_mp.py --nprocs 2`
  (f) torchrun_2   the real `ddp_launch.py` under `torchrun --standalone --nproc-per-node 2`
  (g) ddp_compute  2 ranks, each stepping over its shard's pre-made slices (batch 64/2), no communication
  (h) allreduce    2 ranks, nothing but one all_reduce of the gradient's size (2.7 MB) per step
  (i) ddp_manual   the real `ddp_by_hand.py` (chapter 3b: DDP's job by hand) under torchrun, 2 processes
  (j) dataparallel the real `dataparallel.py` (one process; on a CPU-only machine the plain model)
  (k) torchrun_1   the real `ddp_launch.py` under `torchrun --standalone --nproc-per-node 1`
  (l) tcp_2        the real `ddp_tcp_manual.py`, ranks 0 and 1 started by hand on 127.0.0.1
  (m) tcp_1        the real `ddp_tcp_manual.py --world-size 1`
  (n) bf16         the real `single_gpu.py --precision bf16` (bf16 autocast)
  (o) compile      the real `single_gpu.py --compile`; the best epoch is after the compiling one
  (p) torchrun_2_compile  the real `ddp_launch.py --compile` under torchrun, 2 processes
  (q) fsdp_2       the real `fsdp.py` (FSDP2) under `torchrun --standalone --nproc-per-node 2`
  (a0) before      with --before DIR: DIR's own single_gpu.py (another checkout: a worktree of main, say) in the
                   same rounds, on the data it finds itself, so a change is measured against the code before it
The DDP floor is (g) + (h): what a 2-rank step costs if DDP added nothing to compute and communication.
On a GPU the 2-rank rows need 2 GPUs and are skipped with a line otherwise.

The best (shortest) epoch of --epochs (times --rounds) counts. Peak RSS is the subprocess's ru_maxrss from
os.wait4 (for launchers: the largest single process of the tree): it includes the ~0.5 GiB of torch's own
libraries and whatever the interpreter's exit touches, so only differences well above ~10 MiB between rows
mean something. The target checks are a report: the exit code is 0 even when one fails, and 1 only when a
case could not run. To add a row, append one Case to CASES: a name, label, ranks, command builder, parser.
"""
import argparse
import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for measure/ and common/

import torch  # noqa: E402
from torch import nn  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from common import data  # noqa: E402
from common.cli import Config, FatalError, device_type, run_main  # noqa: E402
from common.ranks import cpu_threads, destroy_process_group, free_port  # noqa: E402
from common.model import NeuralNetwork  # noqa: E402
from measure import harness  # noqa: E402

BATCH_SIZE, LR, SEED = 64, 1e-3, 0  # the quickstart's settings, which single_gpu.py also defaults to


# ---------------------------------------------------------------------------------------------------------
# Cases (b) and (c): run inside the subprocess via the hidden --case flag.
# ---------------------------------------------------------------------------------------------------------

def _sync(device):
    """Wait for queued GPU work before reading the clock (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def report_epoch(epoch, seconds, samples):
    """Print one epoch's timing in the machine-readable form parse_bench_lines reads."""
    print("BENCH " + json.dumps(dict(epoch=epoch, seconds=seconds, samples=samples)), flush=True)


def quickstart_train(dataloader, model, loss_fn, optimizer, device):
    """The quickstart's train(), line for line: copy each batch to the device, loss.item() every 100 batches."""
    size = len(dataloader.dataset)
    model.train()
    for batch, (X, y) in enumerate(dataloader):
        X, y = X.to(device), y.to(device)
        pred = model(X)
        loss = loss_fn(pred, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if batch % 100 == 0:
            loss, current = loss.item(), (batch + 1) * len(X)
            print(f"loss: {loss:>7f}  [{current:>5d}/{size:>5d}]")


def case_quickstart(args):
    """(b) The PyTorch quickstart pipeline: PIL images through ToTensor, collated by a default DataLoader."""
    from torchvision import datasets  # only this case needs torchvision
    from torchvision.transforms import ToTensor

    device = torch.device(args.device)
    training_data = datasets.FashionMNIST(root=args.data_dir, train=True, download=False, transform=ToTensor())
    # As the quickstart: no shuffle, no workers, pin_memory=False (the default), also on CUDA.
    train_dataloader = DataLoader(training_data, batch_size=BATCH_SIZE)
    torch.manual_seed(SEED)
    model = NeuralNetwork().to(device)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for epoch in range(1, args.epochs + 1):
        _sync(device)
        start = time.perf_counter()
        quickstart_train(train_dataloader, model, loss_fn, optimizer, device)
        _sync(device)
        report_epoch(epoch, time.perf_counter() - start, len(training_data))


def case_floor(args):
    """(c) The compute floor: forward/backward/step over slices of one float32 tensor, nothing else per step."""
    device = torch.device(args.device)
    train_set = data.load_fashion_mnist(Config(data_dir=args.data_dir), device)[0]
    X, y = train_set.images.float().div_(255), train_set.labels  # float32 in [0, 1], before any clock starts
    n = len(y)
    torch.manual_seed(SEED)
    model = NeuralNetwork().to(device)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    for epoch in range(1, args.epochs + 1):
        _sync(device)
        start = time.perf_counter()
        for i in range(0, n, BATCH_SIZE):
            loss = loss_fn(model(X[i:i + BATCH_SIZE]), y[i:i + BATCH_SIZE])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        _sync(device)
        report_epoch(epoch, time.perf_counter() - start, n)


def _floor_worker(rank, args, port):
    """One rank of the DDP floor: this rank's shard as pre-made slices, timed between barriers on every rank."""
    world = args.nprocs
    # The chapters' setup: a GPU per rank or the CPU, the same backend, the cores split between the ranks.
    device = torch.device("cuda", rank) if args.device.startswith("cuda") else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpu_threads(world))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))  # case_ddp_floor's
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        train_set = data.load_fashion_mnist(Config(data_dir=args.data_dir), device)[0]
        # Rank r's share of the first epoch, in DistributedSampler's order, converted before any clock starts.
        shard = torch.tensor(list(DistributedSampler(train_set, num_replicas=world, rank=rank, seed=SEED)),
                             device=device)
        X, y = train_set.images[shard].float().div_(255), train_set.labels[shard]
        per_rank = BATCH_SIZE // world
        torch.manual_seed(SEED)
        model = NeuralNetwork().to(device)
        params = list(model.parameters())
        loss_fn = nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(params, lr=LR)
        grads = torch.zeros(sum(p.numel() for p in params), device=device)  # the gradient's size
        steps = range(0, len(y), per_rank)

        def compute():  # what each rank computes, with no communication at all
            for i in steps:
                loss_fn(model(X[i:i + per_rank]), y[i:i + per_rank]).backward()
                optimizer.step()
                optimizer.zero_grad()

        def allreduce():  # nothing but the gradient-sized all-reduce, once per step
            for _ in steps:
                dist.all_reduce(grads)

        part = dict(ddp_compute=compute, allreduce=allreduce)[args.case]
        for epoch in range(1, args.epochs + 1):
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            part()
            _sync(device)
            dist.barrier()  # the epoch ends when the slowest rank is done
            if rank == 0:
                report_epoch(epoch, time.perf_counter() - start, len(train_set))
    finally:
        destroy_process_group()


def case_ddp_floor(args):
    """(g), (h) The parts of a DDP step on --nprocs ranks, each timed alone: compute, all-reduce."""
    import torch.multiprocessing as mp

    # As ddp_mp.py: the store is bound here, before the ranks start, so nothing can take its port in between, and on
    # loopback alone (a store that binds its own port listens on every interface).
    listener = socket.create_server(("127.0.0.1", 0))
    store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120), master_listen_fd=listener.detach(), use_libuv=False)
    mp.spawn(_floor_worker, args=(args, store.port), nprocs=args.nprocs)


INNER_CASES = {"quickstart": case_quickstart, "floor": case_floor, "ddp_compute": case_ddp_floor,
               "allreduce": case_ddp_floor}


# ---------------------------------------------------------------------------------------------------------
# The table of cases: how to start each one and how to read its epoch timings.
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Epoch:
    """One timed training epoch."""

    seconds: float
    samples: int


def parse_fit_log(text):
    """Epochs from a chapter's log: `Data: ... (N train` and `Train time: 2.63s (22799 samples/s)` lines."""
    found = re.search(r"^Data: .* \((\d+) train /", text, re.M)
    epochs = []
    for seconds, rate in re.findall(r"^Train time: ([\d.]+)s \((\d+) samples/s\)", text, re.M):
        if found and int(rate) > 0:
            # The rate has ~5 significant digits, the seconds only 2 decimals: recover the finer time from it.
            samples = int(found.group(1))
            epochs.append(Epoch(samples / int(rate), samples))
        else:
            epochs.append(Epoch(float(seconds), round(float(seconds) * int(rate))))
    return epochs


def parse_bench_lines(text):
    """Epochs from the `BENCH {...}` lines that report_epoch prints."""
    return [Epoch(d["seconds"], d["samples"]) for d in
            (json.loads(line[len("BENCH "):]) for line in text.splitlines() if line.startswith("BENCH "))]


class Workspace:
    """What command builders need: the flags, the data folder, and a scratch folder for this run."""

    def __init__(self, args, data_dir, tmp):
        self.args, self.data_dir, self.tmp = args, Path(data_dir), Path(tmp)

    def inner(self, case):
        """Command that runs one of this file's INNER_CASES in a fresh interpreter."""
        return [sys.executable, str(Path(__file__).resolve()), "--case", case, "--epochs", str(self.args.epochs),
                "--device", self.args.device, "--data-dir", str(self.data_dir)]


@dataclass(frozen=True)
class Case:
    """One row of the table: --cases name, label, processes, argv builder (Workspace -> list), log parser."""

    key: str
    label: str
    ranks: int
    command: Callable[[Workspace], list]
    parse: Callable[[str], list]
    cwd: Path = harness.REPO  # where it runs (another checkout's case runs in that checkout)


def chapter(launcher, script, *flags):
    """Command builder for a real chapter script started by launcher, writing its model to the scratch folder."""

    def command(ws):
        return [*launcher, script, *flags, "--epochs", str(ws.args.epochs), "--device", ws.args.device,
                "--data-dir", str(ws.data_dir), "--output", str(ws.tmp / "-".join([script, *flags]))]

    return command


def inner(case, *extra):
    """Command builder for one of this file's INNER_CASES."""
    return lambda ws: ws.inner(case) + list(extra)


PY, TORCHRUN, TORCHRUN_1 = harness.torchrun(None, []), harness.torchrun(2, []), harness.torchrun(1, [])


def tcp_ranks(ws, world):
    """Chapter 5's commands for ranks 0 .. world-1, meeting at a free port on 127.0.0.1, each with its own --output."""
    init = f"tcp://127.0.0.1:{free_port()}"
    ranks = [chapter(PY, "ddp_tcp_manual.py", "--init-method", init, "--world-size", str(world), "--rank", str(r),
                     "--local-rank", str(r))(ws) for r in range(world)]
    for r, command in enumerate(ranks[1:], 1):
        command[-1] += f"-rank{r}"  # only rank 0 writes, but keep the folders apart anyway
    return ranks


def tcp_pair(ws):
    """Chapter 5 as a user runs it: rank 1 started in the background, rank 0 in front (its log is the one parsed)."""
    rank0, rank1 = tcp_ranks(ws, 2)
    return ["sh", "-c", f"{shlex.join(rank1)} >/dev/null & {shlex.join(rank0)}; status=$?; wait $! && exit $status"]


CASES = [
    Case("single_gpu", "(a) single_gpu.py", 1, chapter(PY, "single_gpu.py"), parse_fit_log),
    Case("quickstart", "(b) quickstart", 1, inner("quickstart"), parse_bench_lines),
    Case("floor", "(c) compute floor", 1, inner("floor"), parse_bench_lines),
    Case("ddp_mp_1", "(d) ddp_mp.py --nprocs 1", 1, chapter(PY, "ddp_mp.py", "--nprocs", "1"), parse_fit_log),
    Case("ddp_mp_2", "(e) ddp_mp.py --nprocs 2", 2, chapter(PY, "ddp_mp.py", "--nprocs", "2"), parse_fit_log),
    Case("torchrun_2", "(f) torchrun ddp_launch.py", 2, chapter(TORCHRUN, "ddp_launch.py"), parse_fit_log),
    Case("ddp_compute", "(g) DDP compute only", 2, inner("ddp_compute", "--nprocs", "2"), parse_bench_lines),
    Case("allreduce", "(h) all_reduce only", 2, inner("allreduce", "--nprocs", "2"), parse_bench_lines),
    Case("ddp_manual", "(i) torchrun ddp_by_hand.py", 2, chapter(TORCHRUN, "ddp_by_hand.py"), parse_fit_log),
    Case("dataparallel", "(j) dataparallel.py", 1, chapter(PY, "dataparallel.py"), parse_fit_log),
    Case("torchrun_1", "(k) torchrun ddp_launch.py, 1 process", 1, chapter(TORCHRUN_1, "ddp_launch.py"), parse_fit_log),
    Case("tcp_2", "(l) ddp_tcp_manual.py, 2 by hand", 2, tcp_pair, parse_fit_log),
    Case("tcp_1", "(m) ddp_tcp_manual.py, 1 rank", 1, lambda ws: tcp_ranks(ws, 1)[0], parse_fit_log),
    Case("bf16", "(n) single_gpu.py --precision bf16", 1, chapter(PY, "single_gpu.py", "--precision", "bf16"),
         parse_fit_log),
    Case("compile", "(o) single_gpu.py --compile", 1, chapter(PY, "single_gpu.py", "--compile"), parse_fit_log),
    Case("torchrun_2_compile", "(p) torchrun ddp_launch.py --compile", 2,
         chapter(TORCHRUN, "ddp_launch.py", "--compile"), parse_fit_log),
    Case("fsdp_2", "(q) torchrun fsdp.py", 2, chapter(TORCHRUN, "fsdp.py"), parse_fit_log),
]
CASES_BY_KEY = {case.key: case for case in CASES}
# A row that is not run but added up: the 2-rank DDP floor = (g) compute + (h) all-reduce, each measured alone.
DDP_FLOOR = ("ddp_floor", "(g)+(h) DDP floor", ("ddp_compute", "allreduce"))
FLOOR_KEYS = {"floor", "ddp_compute", "allreduce", "ddp_floor"}  # measurements, not chapters

# Targets: (numerator, denominator, at most) on best epoch time; None: the ratio is shown, with no target. (No
# target against the quickstart: on one 2-core machine the floor itself was 0.48x the quickstart, so that ratio
# measures the machine as much as the chapter.)
TIME_TARGETS = [("single_gpu", "quickstart", None), ("single_gpu", "floor", 1.10), ("before", "floor", None), ("ddp_mp_2", "ddp_floor", 1.15),
                ("torchrun_2", "ddp_floor", 1.15), ("ddp_manual", "torchrun_2", None), ("bf16", "single_gpu", None),
                ("compile", "single_gpu", None), ("torchrun_2_compile", "torchrun_2", None),
                ("fsdp_2", "torchrun_2", None)]  # FSDP's gathers and reduce-scatters against DDP's one all-reduce
RSS_TARGETS = [("single_gpu", "quickstart")]


# ---------------------------------------------------------------------------------------------------------
# Running cases, the table and the target checks.
# ---------------------------------------------------------------------------------------------------------

def run_case(case, ws, progress):
    """Run one case's subprocess to completion: (command, [Epoch], peak RSS MiB, wall s, accuracy). FatalError if it fails."""
    cmd = case.command(ws)
    print(f"{progress} {case.label}: running {ws.args.epochs} epoch(s) on {ws.args.device} ...",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=case.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()  # to EOF before waiting: a child blocked on a full pipe would never exit
    proc.stdout.close()
    # wait4, not proc.wait(): it also returns the child's rusage. ru_maxrss is KiB on Linux, and for a child
    # that starts processes itself (torchrun) it is the largest single process of the tree, not their sum.
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so Popen must not wait on it again
    wall = time.perf_counter() - start
    shown = f"$ {' '.join(cmd)}\n{harness.last_lines(output)}"
    if proc.returncode != 0:
        harness.fail(case.label, f"failed with exit code {proc.returncode}", shown)
    epochs = case.parse(output)
    if len(epochs) != ws.args.epochs:
        harness.fail(case.label, f"printed {len(epochs)} epoch timing(s), expected {ws.args.epochs}", shown)
    rss = usage.ru_maxrss / 1024
    print(f"{progress} {case.label}: done in {wall:.1f}s, best epoch {min(e.seconds for e in epochs):.3f}s, "
          f"peak RSS {rss:.0f} MiB", file=sys.stderr, flush=True)
    return cmd, epochs, rss, wall, final_accuracy(output)


def final_accuracy(output):
    """The last `Accuracy: 64.9%` a chapter printed, as a fraction; None for the inner cases, which do not test."""
    found = re.findall(r"Accuracy: ([\d.]+)%", output)
    return float(found[-1]) / 100 if found else None


def summarize(case, runs, device):
    """One table row from a case's runs (one per round): best epoch over all of them, largest peak RSS."""
    epochs = [e for run in runs for e in run[1]]
    best = min(epochs, key=lambda e: e.seconds)
    return dict(key=case.key, label=case.label, tag=case.label.split()[0], ranks=case.ranks, device=device,
                command=runs[0][0], epoch_seconds=[e.seconds for e in epochs], best_seconds=best.seconds,
                samples=best.samples, peak_rss_mib=max(run[2] for run in runs),
                peak_rss_mib_per_round=[run[2] for run in runs], wall_seconds=sum(run[3] for run in runs),
                accuracy=runs[-1][4])


def add_derived(results):
    """The DDP floor row (sum of its parts' best epochs), then rates and ratios for every row."""
    key, label, parts = DDP_FLOOR
    if all(part in results for part in parts):
        first = results[parts[0]]
        results[key] = dict(key=key, label=label, tag=label.split()[0], ranks=first["ranks"], device=first["device"],
                            command=None, best_seconds=sum(results[part]["best_seconds"] for part in parts),
                            samples=first["samples"], peak_rss_mib=None, accuracy=None)
    for r in results.values():
        r["samples_per_second"] = r["samples"] / r["best_seconds"]
        r["ms_per_step"] = 1000 * r["best_seconds"] / math.ceil(r["samples"] / BATCH_SIZE)  # global batches
        for ref in ("single_gpu", "floor"):
            base = results.get(ref)
            r[f"x_{ref}"] = r["best_seconds"] / base["best_seconds"] if base else None


def checks(results):
    """The target checks whose cases all ran, as dicts with a printable line."""
    out = []
    for num, den, limit in TIME_TARGETS:
        if num in results and den in results:
            a, b = results[num], results[den]
            value = a["best_seconds"] / b["best_seconds"]
            passed = None if limit is None else value <= limit
            verdict = "no target" if limit is None else f"target <= {limit:.2f}): {'PASS' if passed else 'FAIL'}"
            out.append(dict(name=f"{num}/{den} epoch time", value=value, target=limit, passed=passed,
                            line=f"{a['label']} / {b['label']} = {value:.2f} ({verdict}"
                                 f"{')' if limit is None else ''}"))
    for small, big in RSS_TARGETS:
        if small in results and big in results:
            a, b = results[small], results[big]
            passed = a["peak_rss_mib"] <= b["peak_rss_mib"]
            out.append(dict(name=f"{small} <= {big} peak RSS", value=a["peak_rss_mib"], target=b["peak_rss_mib"],
                            passed=passed,
                            line=f"peak RSS {a['tag']} {a['peak_rss_mib']:.0f} MiB <= {b['tag']} {b['peak_rss_mib']:.0f} MiB: "
                                 f"{'PASS' if passed else 'FAIL'}"))
    return out


def _fmt(x, spec):
    """x formatted with spec, or "-" when there is nothing to show."""
    return "-" if x is None else format(x, spec)


def table(results, epochs):
    """The results as a Markdown table, one row per case in CASES order (the DDP floor after its parts)."""
    rows = [f"| case | ranks | epoch s (best of {epochs}) | ms / step | samples/s | speed-up vs (a) | × (c) floor | "
            f"test accuracy | peak RSS MiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results.values():
        speedup = None if r["x_single_gpu"] is None else 1 / r["x_single_gpu"]
        accuracy = None if r["accuracy"] is None else 100 * r["accuracy"]
        rows.append(f"| {r['label']} | {r['ranks']} | {r['best_seconds']:.3f} | {r['ms_per_step']:.2f} | "
                    f"{r['samples_per_second']:,.0f} | {_fmt(speedup, '.2f')} | {_fmt(r['x_floor'], '.2f')} | "
                    f"{_fmt(accuracy, '.1f')} | {_fmt(r['peak_rss_mib'], '.0f')} |")
    return "\n".join(rows)


def chart(results, path, title):
    """A horizontal bar chart of samples/s per row, as a PNG at path. Without matplotlib: a note, no chart."""
    plt = harness.pyplot(path)
    if plt is None:
        return
    from matplotlib.patches import Patch

    rows = list(results.values())
    kinds = {"chapter, 1 process": "tab:blue", "chapter, 2 ranks": "tab:orange", "quickstart": "tab:green",
             "floor or its parts (not a chapter)": "tab:gray"}
    names = list(kinds)
    colors = [kinds[names[3] if r["key"] in FLOOR_KEYS else names[2] if r["key"] == "quickstart" else
                    names[0] if r["ranks"] == 1 else names[1]] for r in rows]
    values = [r["samples_per_second"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(rows) + 1.8), dpi=80)
    ax.barh(range(len(rows)), values, color=colors)
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=9)
    ax.invert_yaxis()  # first row on top, as in the table
    for i, (value, r) in enumerate(zip(values, rows)):
        ax.text(value, i, f"  {value:,.0f}/s, {r['best_seconds']:.2f} s/epoch", va="center", fontsize=8)
    ax.set_xlim(0, 1.45 * max(values))
    ax.set_xlabel("training samples per second (higher is better)")
    ax.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=9)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in kinds.items()], fontsize=8, ncol=4,
              loc="upper center", bbox_to_anchor=(0.4, -0.12))
    fig.tight_layout()
    harness.save(fig, path)


def _positive_int(text):
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def parse_args(argv=None):
    """The benchmark's flags, plus the hidden ones its own subprocesses use."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=_positive_int, default=2, help="epochs per case; the best one counts (default %(default)s)")
    p.add_argument("--rounds", type=_positive_int, default=1,
                   help="run every case this many times, interleaved; the best epoch of all counts (default %(default)s)")
    p.add_argument("--device", default="cpu", type=device_type, help="cpu, cuda or cuda:N (default %(default)s)")
    p.add_argument("--data-dir", default=None, help="FashionMNIST folder (default: as single_gpu.py finds it)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write all measurements to PATH as JSON")
    p.add_argument("--png", default=None, metavar="PATH", help="also draw samples/s per row as a bar chart (needs matplotlib)")
    p.add_argument("--from-json", default=None, metavar="PATH",
                   help="run nothing: print the table and checks of a saved --json file again (and --png its chart)")
    p.add_argument("--cases", default=",".join(CASES_BY_KEY),
                   help=f"comma list of cases to run, from {', '.join(CASES_BY_KEY)} (default: all)")
    p.add_argument("--before", default=None, metavar="DIR",
                   help="also run DIR's single_gpu.py (another checkout) in the same rounds, as row (a0)")
    p.add_argument("--case", choices=sorted(INNER_CASES), help=argparse.SUPPRESS)  # inside a case's subprocess
    p.add_argument("--nprocs", type=_positive_int, default=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.cases = [key.strip() for key in args.cases.split(",") if key.strip()]
    unknown = [key for key in args.cases if key not in CASES_BY_KEY]
    if unknown or not args.cases:
        p.error(f"--cases: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(CASES_BY_KEY)}")
    if args.before and not (Path(args.before) / "single_gpu.py").is_file():
        p.error(f"--before {args.before}: no single_gpu.py there; pass the folder of another checkout")
    return args


def before_case(folder):
    """(a0): another checkout's single_gpu.py, on the data it finds itself (its --data-dir may mean another layout)."""
    script = Path(folder).resolve() / "single_gpu.py"

    def command(ws):
        return [sys.executable, str(script), "--epochs", str(ws.args.epochs), "--device", ws.args.device,
                "--output", str(ws.tmp / "before")]

    return Case("before", f"(a0) {script.parent.name}/single_gpu.py", 1, command, parse_fit_log, script.parent)


def main():
    """Run the chosen cases one after another, then print the table and the target checks."""
    args = parse_args()
    if args.case:
        return INNER_CASES[args.case](args)
    if args.from_json:
        return report(*load_report(args.from_json), args)
    data_dir = data.locate_fashion_mnist(args.data_dir)  # once, so every case reads the same files
    selected = [case for case in CASES if case.key in args.cases]  # CASES order, whatever order --cases has
    if args.before:
        selected.insert(0, before_case(args.before))
    if args.device.startswith("cuda"):  # one process per GPU: rows with more ranks than GPUs cannot run here
        gpus = torch.cuda.device_count()
        for case in selected:
            if case.ranks > gpus:
                print(f"skipping {case.label}: it needs {case.ranks} GPUs, {gpus} visible", file=sys.stderr)
        selected = [case for case in selected if case.ranks <= gpus]
    runs = {case.key: [] for case in selected}
    total = len(selected) * args.rounds
    with tempfile.TemporaryDirectory(prefix="benchmark-") as tmp:
        ws = Workspace(args, data_dir, tmp)
        # Rounds interleave the cases (a b c a b c), so a slow spell of a shared machine hits every case alike.
        for round_ in range(args.rounds):
            for i, case in enumerate(selected):
                runs[case.key].append(run_case(case, ws, f"[{round_ * len(selected) + i + 1}/{total}]"))
    results = {case.key: summarize(case, runs[case.key], args.device) for case in selected}
    add_derived(results)
    payload = dict(epochs=args.epochs, rounds=args.rounds, device=args.device, data_dir=str(data_dir),
                   environment=harness.environment(), cases=list(results.values()), checks=checks(results))
    report(results, payload, args)
    if args.json:
        harness.write_json(args.json, payload)
        print(f"Wrote {args.json}")


def load_report(path):
    """(results, payload) from a file that --json wrote."""
    try:
        payload = json.loads(Path(path).read_text())
        return {case["key"]: case for case in payload["cases"]}, payload
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FatalError(f"{path} is not a benchmark --json file ({type(e).__name__}: {e})") from None


def report(results, payload, args):
    """The table, the target checks, and the chart if --png."""
    env = payload["environment"]
    heading = (f"One training epoch, best of {payload['epochs']} epoch(s) x {payload['rounds']} round(s) per case; "
               f"device {payload['device']}; torch {env['torch']}, {env['torch_threads']} threads, "
               f"{env['cpu_count']} cores{', ' + env['gpu'] if env.get('gpu') else ''}")
    print(f"\n{heading}; data {payload['data_dir']}\n")
    print(table(results, payload["epochs"] * payload["rounds"]))
    print()
    for check in checks(results):
        print(check["line"])
    print()
    if args.png:
        chart(results, args.png, heading)

if __name__ == "__main__":
    run_main(main)
