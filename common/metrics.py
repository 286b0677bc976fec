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


class MetricsLog:
    """Appends records to FOLDER/metrics.jsonl on global rank 0; elsewhere (other ranks, folder None) it writes nothing."""

    def __init__(self, folder, ctx, epochs_done=0):
        self.path, self.pending, self.started = None, {}, time.perf_counter()
        if folder is None or not ctx.is_main:
            return
        self.path = Path(folder) / FILENAME
        kept = []
        if epochs_done and self.path.exists():  # resuming: keep the epochs the snapshot holds, drop the lost ones
            kept = [line + "\n" for line in self.path.read_text().splitlines() if _epoch_of(line) <= epochs_done]
        self._put(kept, "w")

    def note(self, **fields):
        """Fields for this epoch's "epoch" record, written with it."""
        self.pending.update(fields)

    def write(self, kind, epoch, **fields):
        """One record; an "epoch" record also takes the fields noted since the last one."""
        extra, self.pending = (self.pending, {}) if kind == "epoch" else ({}, self.pending)
        record = dict(kind=kind, epoch=epoch, **extra, **fields, time=round(time.perf_counter() - self.started, 3))
        if self.path is not None:
            self._put([json.dumps(record) + "\n"], "a")

    def _put(self, lines, mode):
        try:
            with open(self.path, mode) as f:
                f.writelines(lines)
        except OSError as e:
            raise FatalError(f"cannot write {self.path}: {e.strerror}; free some space or pass another --output") from None


def _epoch_of(line):
    """A record's epoch; a line cut off by a kill counts as never written."""
    try:
        return json.loads(line)["epoch"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


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
