"""Time one training epoch of the project's pipeline, the PyTorch quickstart and a compute floor, side by side.

    python scripts/benchmark.py                                        # 2 epochs of each case on the CPU
    python scripts/benchmark.py --epochs 3 --json runs/benchmark.json  # also write every measurement as JSON
    python scripts/benchmark.py --device cuda --cases single_gpu,floor # a subset, on the GPU
    python scripts/benchmark.py --rounds 3                             # a b c a b c a b c: steadier on a busy machine

Cases (each in its own subprocess, so each has a fresh interpreter and its own peak RSS):
  (a) single_gpu   the real `single_gpu.py`, timed by the "Train time:" lines it prints
  (b) quickstart   the PyTorch quickstart: torchvision FashionMNIST + ToTensor, DataLoader(batch_size=64)
  (c) floor        the same model stepping over pre-made float32 slices: no DataLoader, no per-step sync

The best (shortest) epoch of --epochs (times --rounds) counts. Peak RSS is the subprocess's ru_maxrss from
os.wait4: it includes the ~0.5 GiB of torch's own libraries and whatever the interpreter's exit touches,
so only differences well above ~10 MiB between rows mean something. The target checks are a report: the exit code is 0 even when
one fails, and 1 only when a case could not run. To add a row (e.g. DDP under torchrun), append one Case
to CASES: a name, a command builder and an output parser.
"""
import argparse
import gzip
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python scripts/benchmark.py` puts scripts/, not the repo root, on sys.path

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from common import data  # noqa: E402
from common.config import check_device  # noqa: E402
from common.errors import FatalError, run_main  # noqa: E402
from common.model import NeuralNetwork  # noqa: E402

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
    training_data = datasets.FashionMNIST(root=args.torchvision_root, train=True, download=False, transform=ToTensor())
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
    train_set = data.load_split(data.locate_fashion_mnist(args.data_dir), "train", device)
    X, y = train_set.images.float() / 255, train_set.labels  # converted once, before any clock starts
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


INNER_CASES = {"quickstart": case_quickstart, "floor": case_floor}


# ---------------------------------------------------------------------------------------------------------
# The table of cases: how to start each one and how to read its epoch timings.
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Epoch:
    """One timed training epoch."""

    seconds: float
    samples: int


def parse_fit_log(text):
    """Epochs from common.engine.fit's log: `Data: ... (N train` and `Train time: 2.63s (22799 samples/s)` lines."""
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
        self._torchvision_root = None

    def inner(self, case):
        """Command that runs one of this file's INNER_CASES in a fresh interpreter."""
        return [sys.executable, str(Path(__file__).resolve()), "--case", case, "--epochs", str(self.args.epochs),
                "--device", self.args.device, "--data-dir", str(self.data_dir)]

    def torchvision_root(self):
        """A root torchvision's FashionMNIST(download=False) accepts: the four raw IDX files in FashionMNIST/raw/."""
        if self._torchvision_root is None:
            root = self.tmp / "torchvision"
            raw = root / "FashionMNIST" / "raw"
            raw.mkdir(parents=True)
            # The loader's own search, so both pipelines read the very same files (raw or .gz, either layout).
            for split in data.FILES:
                for src in data._find_split_files(self.data_dir, split):
                    dst = raw / src.name.removesuffix(".gz")
                    # torchvision reads only uncompressed files when it does not download.
                    try:
                        with (gzip.open if src.suffix == ".gz" else open)(src, "rb") as fin, open(dst, "wb") as fout:
                            shutil.copyfileobj(fin, fout)
                    except (OSError, EOFError) as e:  # bad gzip, cut-off file, full disk
                        raise FatalError(f"cannot decompress {src} for the quickstart case: {e}") from None
            self._torchvision_root = root
        return self._torchvision_root


@dataclass(frozen=True)
class Case:
    """One row of the table: --cases name, label, argv builder (Workspace -> list) and log parser (str -> [Epoch])."""

    key: str
    label: str
    command: Callable[[Workspace], list]
    parse: Callable[[str], list]


def single_gpu_command(ws):
    """(a) The real chapter-1 script, on the same data folder, writing its model.pth to the scratch folder."""
    return [sys.executable, "single_gpu.py", "--epochs", str(ws.args.epochs), "--device", ws.args.device,
            "--data-dir", str(ws.data_dir), "--output", str(ws.tmp / "single_gpu")]


def quickstart_command(ws):
    """(b) case_quickstart in a subprocess, on the decompressed copy torchvision needs."""
    return ws.inner("quickstart") + ["--torchvision-root", str(ws.torchvision_root())]


def floor_command(ws):
    """(c) case_floor in a subprocess."""
    return ws.inner("floor")


CASES = [
    Case("single_gpu", "(a) single_gpu.py", single_gpu_command, parse_fit_log),
    Case("quickstart", "(b) quickstart", quickstart_command, parse_bench_lines),
    Case("floor", "(c) compute floor", floor_command, parse_bench_lines),
]
CASES_BY_KEY = {case.key: case for case in CASES}

# Targets: (numerator, denominator, at most) on best epoch time; peak RSS of a must not exceed that of b.
TIME_TARGETS = [("single_gpu", "quickstart", 0.35), ("single_gpu", "floor", 1.10)]
RSS_TARGETS = [("single_gpu", "quickstart")]


# ---------------------------------------------------------------------------------------------------------
# Running cases, the table and the target checks.
# ---------------------------------------------------------------------------------------------------------

def fail(case, cmd, output, problem):
    """Show the last lines of a case's output, then stop with one error line (FatalError: exit 1)."""
    lines = output.rstrip().splitlines()[-15:]
    print(f"--- last {len(lines)} lines of {case.label} ({' '.join(cmd)}) ---", file=sys.stderr)
    print("\n".join(lines), file=sys.stderr)
    print("---", file=sys.stderr, flush=True)
    # run_main prints a FatalError as exactly one line, so the output goes above, not into the message.
    raise FatalError(f"{case.label} {problem}; its last lines of output are above")


def run_case(case, ws, progress):
    """Run one case's subprocess to completion: (command, [Epoch], peak RSS MiB, wall s). FatalError if it fails."""
    cmd = case.command(ws)
    print(f"{progress} {case.label}: running {ws.args.epochs} epoch(s) on {ws.args.device} ...",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()  # to EOF before waiting: a child blocked on a full pipe would never exit
    proc.stdout.close()
    # wait4, not proc.wait(): it also returns the child's rusage. ru_maxrss is KiB on Linux, and for a child
    # that starts processes itself (torchrun) it is the largest single process of the tree, not their sum.
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so Popen must not wait on it again
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        fail(case, cmd, output, f"failed with exit code {proc.returncode}")
    epochs = case.parse(output)
    if len(epochs) != ws.args.epochs:
        fail(case, cmd, output, f"printed {len(epochs)} epoch timing(s), expected {ws.args.epochs}")
    rss = usage.ru_maxrss / 1024
    print(f"{progress} {case.label}: done in {wall:.1f}s, best epoch {min(e.seconds for e in epochs):.3f}s, "
          f"peak RSS {rss:.0f} MiB", file=sys.stderr, flush=True)
    return cmd, epochs, rss, wall


def summarize(case, runs, device):
    """One table row from a case's runs (one per round): best epoch over all of them, largest peak RSS."""
    epochs = [e for _, run_epochs, _, _ in runs for e in run_epochs]
    best = min(epochs, key=lambda e: e.seconds)
    return dict(key=case.key, label=case.label, tag=case.label.split()[0], device=device, command=runs[0][0],
                epoch_seconds=[e.seconds for e in epochs], best_seconds=best.seconds, samples=best.samples,
                samples_per_second=best.samples / best.seconds, peak_rss_mib=max(run[2] for run in runs),
                peak_rss_mib_per_round=[run[2] for run in runs], wall_seconds=sum(run[3] for run in runs))


def add_ratios(results):
    """Each result's best epoch time relative to the quickstart's and the floor's (None when not run)."""
    for ref in ("quickstart", "floor"):
        base = results.get(ref)
        for r in results.values():
            r[f"x_{ref}"] = r["best_seconds"] / base["best_seconds"] if base else None


def checks(results):
    """The target checks whose cases all ran, as dicts with a printable line."""
    out = []
    for num, den, limit in TIME_TARGETS:
        if num in results and den in results:
            a, b = results[num], results[den]
            value = a["best_seconds"] / b["best_seconds"]
            passed = value <= limit
            out.append(dict(name=f"{num}/{den} epoch time", value=value, target=limit, passed=passed,
                            line=f"{a['label']} / {b['label']} = {value:.2f} (target <= {limit:.2f}): "
                                 f"{'PASS' if passed else 'FAIL'}"))
    for small, big in RSS_TARGETS:
        if small in results and big in results:
            a, b = results[small], results[big]
            passed = a["peak_rss_mib"] <= b["peak_rss_mib"]
            out.append(dict(name=f"{small} <= {big} peak RSS", value=a["peak_rss_mib"], target=b["peak_rss_mib"],
                            passed=passed,
                            line=f"peak RSS {a['tag']} {a['peak_rss_mib']:.0f} MiB <= {b['tag']} {b['peak_rss_mib']:.0f} MiB: "
                                 f"{'PASS' if passed else 'FAIL'}"))
    return out


def _ratio(x):
    """A ratio with 2 decimals, or "-" when its reference case did not run."""
    return "-" if x is None else f"{x:.2f}"


def table(results, epochs):
    """The results as a Markdown table, one row per case in CASES order."""
    rows = [f"| case | device | epoch s (best of {epochs}) | samples/s | × quickstart | × floor | peak RSS MiB |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for r in results.values():
        rows.append(f"| {r['label']} | {r['device']} | {r['best_seconds']:.3f} | {r['samples_per_second']:,.0f} | "
                    f"{_ratio(r['x_quickstart'])} | {_ratio(r['x_floor'])} | {r['peak_rss_mib']:.0f} |")
    return "\n".join(rows)


def environment():
    """Versions and machine facts that a timing means nothing without."""
    env = dict(python=platform.python_version(), torch=torch.__version__, cpu_count=os.cpu_count(),
               torch_threads=torch.get_num_threads(), machine=platform.machine(), node=platform.node())
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


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
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default %(default)s)")
    p.add_argument("--data-dir", default=None, help="FashionMNIST folder (default: as single_gpu.py finds it)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write all measurements to PATH as JSON")
    p.add_argument("--cases", default=",".join(CASES_BY_KEY),
                   help=f"comma list of cases to run, from {', '.join(CASES_BY_KEY)} (default: all)")
    p.add_argument("--case", choices=sorted(INNER_CASES), help=argparse.SUPPRESS)  # inside a case's subprocess
    p.add_argument("--torchvision-root", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.cases = [key.strip() for key in args.cases.split(",") if key.strip()]
    unknown = [key for key in args.cases if key not in CASES_BY_KEY]
    if unknown or not args.cases:
        p.error(f"--cases: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(CASES_BY_KEY)}")
    check_device(p, args.device)
    return args


def main():
    """Run the chosen cases one after another, then print the table and the target checks."""
    args = parse_args()
    if args.case:
        return INNER_CASES[args.case](args)
    data_dir = data.locate_fashion_mnist(args.data_dir)  # once, so every case reads the same files
    selected = [case for case in CASES if case.key in args.cases]  # CASES order, whatever order --cases has
    runs = {case.key: [] for case in selected}
    total = len(selected) * args.rounds
    with tempfile.TemporaryDirectory(prefix="benchmark-") as tmp:
        ws = Workspace(args, data_dir, tmp)
        # Rounds interleave the cases (a b c a b c), so a slow spell of a shared machine hits every case alike.
        for round_ in range(args.rounds):
            for i, case in enumerate(selected):
                runs[case.key].append(run_case(case, ws, f"[{round_ * len(selected) + i + 1}/{total}]"))
    results = {case.key: summarize(case, runs[case.key], args.device) for case in selected}
    add_ratios(results)
    found = checks(results)
    env = environment()
    print(f"\nOne training epoch, best of {args.epochs} epoch(s) x {args.rounds} round(s) per case; device {args.device}; "
          f"torch {env['torch']}, {env['torch_threads']} threads, {env['cpu_count']} cores; data {data_dir}\n")
    print(table(results, args.epochs * args.rounds))
    print()
    for check in found:
        print(check["line"])
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = dict(epochs=args.epochs, rounds=args.rounds, device=args.device, data_dir=str(data_dir), environment=env,
                       cases=list(results.values()), checks=found)
        path.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nWrote {path}")


if __name__ == "__main__":
    run_main(main)
