"""metrics.jsonl: what the run printed, one JSON object per line, for plots (scripts/plot_curves.py) and scripts.

Global rank 0 writes it into the --output folder, next to model.pth, one line as soon as it is known (a killed
run keeps what it logged). Two kinds of line, both with "epoch" (from 1), "step" (optimizer steps since the
start of training, the same at every world size) and "time" (seconds since this process started training):

    {"kind": "train", "epoch": 1, "step": 100, "samples": 6400, "loss": 2.13, ...}          every --log-every steps
    {"kind": "epoch", "epoch": 1, "step": 938, "train_loss": 2.2, "test_accuracy": 0.505, "test_loss": 2.16, ...}

"loss" is the loss of that global batch and "train_loss" the epoch's mean, both reduced over the ranks.
"""
import json
import time
from pathlib import Path

from common.errors import FatalError

FILENAME = "metrics.jsonl"


def _epoch_of(line):
    try:
        return json.loads(line)["epoch"]
    except (ValueError, KeyError, TypeError):
        return None  # a line cut off by a kill: dropped


class MetricsLog:
    """Appends records to OUTPUT/metrics.jsonl on global rank 0; on other ranks (or without a folder) does nothing."""

    def __init__(self, folder, ctx, epochs_done=0):
        self.file = None
        self.started = time.perf_counter()
        if folder is None or not ctx.is_main:
            return
        self.path = Path(folder) / FILENAME
        kept = []
        if epochs_done and self.path.exists():  # resuming: keep the epochs the snapshot holds, drop the lost ones
            kept = [line for line in self.path.read_text().splitlines() if (_epoch_of(line) or epochs_done + 1) <= epochs_done]
        try:
            self.file = open(self.path, "w")
            self.file.writelines(line + "\n" for line in kept)
        except OSError as e:
            raise FatalError(f"cannot write {self.path}: {e.strerror}; pass a writable --output") from None

    def write(self, kind, **fields):
        if self.file is None:
            return
        record = dict(kind=kind, **fields, time=round(time.perf_counter() - self.started, 3))
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:
            raise FatalError(f"cannot write {self.path}: {e.strerror}; free some space or pass another --output") from None

    def close(self):
        if self.file is not None:
            self.file.close()
            self.file = None


def read_metrics(folder):
    """The records of FOLDER/metrics.jsonl (or of the file itself), in order; damaged lines are skipped."""
    path = Path(folder)
    path = path / FILENAME if path.is_dir() else path
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise FatalError(f"cannot read {path}: {e.strerror}; pass a run's --output folder (it holds {FILENAME})") from None
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
