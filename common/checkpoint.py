"""Weights and snapshots on disk: written atomically, loaded safely (weights_only=True), without `module.`."""
import contextlib
import io
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import torch

from common.config import flag_text
from common.errors import FatalError
from common.ranks import all_reduce_sum, print0

SNAPSHOT_FORMAT = "fashion-mnist-ddp-tutorial snapshot v2"
# The flags that decide the weights at every step: a run may only resume a snapshot made with the same ones.
# The world size, device, data folder and --epochs may change: the same global batch trains the same model.
# --accum-steps may change too (the same global batch), --precision may not (bf16 steps are not fp32 steps).
TRAJECTORY_FLAGS = ("batch_size", "lr", "momentum", "seed", "train_samples", "precision")


def prepare_output(folder, flag="--output"):
    """Create the output folder now and check it is writable, so a bad --output fails before training."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FatalError(f"cannot create folder {folder}: {e.strerror}; pass a writable {flag}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise FatalError(f"folder {folder} is not writable; pass a writable {flag}")
    return path


def atomic_save(obj, path):
    """torch.save to a temporary file in the same folder, fsync, then rename: a crash never leaves half a file.

    The bytes are made in memory first, so a full disk shows up as a plain OSError from write() (torch's own
    zip writer reports it as an obscure RuntimeError), and the old file stays in place until the rename.
    """
    path = Path(path)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise FatalError(f"cannot write {path}: {e.strerror}; free some space or write to another folder "
                         f"(--output / --snapshot)") from None


def save_weights(model, path):
    """Write a model's state_dict atomically; pass the plain model (DDP's model.module), so keys have no `module.`."""
    atomic_save(model.state_dict(), path)


def save_snapshot(model, optimizer, scaler, epochs_done, cfg, ctx):
    """With --snapshot, every --save-every epochs and after the last: rank 0 writes one, every rank waits for it.

    The wait is a sum of "written" flags, so when rank 0 cannot write (full disk, read-only folder) all ranks
    stop with an error instead of training on without a snapshot. The data order needs no state of its own:
    each epoch's shuffle is drawn from seed + epoch, so the number of epochs done is enough.
    """
    if not cfg.snapshot or (epochs_done % cfg.save_every and epochs_done != cfg.epochs):
        return
    error = None
    if ctx.is_main:
        snapshot = dict(format=SNAPSHOT_FORMAT, epochs_done=epochs_done,
                        model=getattr(model, "module", model).state_dict(),  # DDP's plain model: no `module.`
                        optimizer=optimizer.state_dict(), config={k: getattr(cfg, k) for k in TRAJECTORY_FLAGS},
                        scaler=scaler.state_dict() if scaler else None)  # fp16's loss scale, grown over the steps
        try:
            atomic_save(snapshot, cfg.snapshot)
        except FatalError as e:
            error = e
    (written,) = all_reduce_sum([error is None], ctx)
    if error is not None:
        raise error
    if written < ctx.world_size:
        raise FatalError(f"rank 0 could not write the snapshot {cfg.snapshot} (see its error)")


class StopAtTimeLimit:
    """SIGUSR1, which SLURM sends ahead of a job's time limit (scripts/job.sh: --signal=B:USR1@180): the ranks stop
    after the epoch it came in, once a --snapshot holds it, and the requeued job resumes from there.

    Made before the first epoch, in the main thread (it installs the handler). Why at an epoch's end: snapshots hold
    whole epochs, and each epoch's data order comes from seed + epoch (docs/slurm.md).
    """

    def __init__(self):
        self.warned = threading.Event()
        signal.signal(signal.SIGUSR1, lambda signum, frame: self.warned.set())

    def reached(self, epochs_done, cfg, ctx):
        """After each epoch, on every rank: True (and one line) when any rank was warned and the snapshot holds it.

        Every rank adds its flag, so all stop after the same epoch, or none does. Without --snapshot there is nothing
        to resume from: go on.
        """
        (warned,) = all_reduce_sum([self.warned.is_set()], ctx)
        if warned and cfg.snapshot and epochs_done % cfg.save_every == 0 and epochs_done < cfg.epochs:
            print0(ctx, f"Stopping after epoch {epochs_done} of {cfg.epochs} (SIGUSR1: the time limit is near); "
                        f"{cfg.snapshot} holds it")
            return True
        return False


def check_resumable(made_with, epochs_done, cfg, where, fix):
    """A snapshot made with these trajectory flags and epochs_done can continue this run; else one line saying why."""
    made_with = {"precision": "fp32", "momentum": 0.0, **made_with}  # older snapshots: from before these flags
    different = [name for name in TRAJECTORY_FLAGS if made_with.get(name) != getattr(cfg, name)]
    if different:
        theirs = " ".join(flag_text(n, made_with.get(n)) for n in different)
        ours = " ".join(flag_text(n, getattr(cfg, n)) for n in different)
        raise FatalError(f"snapshot {where} was made with {theirs}, this run has {ours}; resume with the "
                         f"snapshot's flags, or {fix}")
    if epochs_done > cfg.epochs:
        raise FatalError(f"snapshot {where} has {epochs_done} epochs done, more than --epochs {cfg.epochs}; pass "
                         f"--epochs {epochs_done} or more, or {fix}")


def load_snapshot(model, optimizer, scaler, cfg, ctx):
    """With --snapshot FILE and FILE there: load it into model and optimizer, return the epochs it holds; else 0."""
    if not cfg.snapshot:
        return 0
    path = Path(cfg.snapshot)
    prepare_output(path.parent, "--snapshot")  # fail now, not after the first epoch
    if not path.exists():
        return 0
    fix = "delete it to start afresh, or pass another --snapshot"
    try:
        # weights_only: tensors and plain containers only, no pickled code. map_location: straight onto this
        # rank's device, so the ranks of one machine do not all pile their copies onto GPU 0 first.
        snapshot = torch.load(path, map_location=ctx.device, weights_only=True)
    except Exception as e:  # truncated zip, a pickle weights_only refuses, not a torch file at all
        raise FatalError(f"snapshot {path} cannot be read ({type(e).__name__}): is it cut off or another kind "
                         f"of file? {fix}") from None
    if not isinstance(snapshot, dict) or snapshot.get("format") != SNAPSHOT_FORMAT:
        raise FatalError(f"{path} is not a snapshot of this tutorial (a model.pth or another program's file?); {fix}")
    check_resumable(snapshot["config"], snapshot["epochs_done"], cfg, path, fix)
    try:
        getattr(model, "module", model).load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        if scaler and snapshot.get("scaler"):
            scaler.load_state_dict(snapshot["scaler"])
    except (RuntimeError, ValueError, KeyError) as e:
        reason = str(e).strip().splitlines()[0]
        raise FatalError(f"snapshot {path} holds a different model ({reason}); {fix}") from None
    print_resumed(ctx, path, snapshot["epochs_done"], cfg)
    return snapshot["epochs_done"]


def print_resumed(ctx, where, epochs_done, cfg):
    """Rank 0's line for a resumed run: where from, how many epochs were done, what comes next."""
    left = f"continuing with epoch {epochs_done + 1}" if epochs_done < cfg.epochs else "nothing left to train"
    print0(ctx, f"Resuming from {where}: {epochs_done} of {cfg.epochs} epochs done, {left}")


# Chapter 7's sharded snapshots: fsdp.py makes the four torch.distributed.checkpoint calls (get_state_dict, dcp.save,
# dcp.load, set_state_dict); the folders, the flags file and the errors around them are kept here.
SHARDED_FORMAT = "fashion-mnist-ddp-tutorial sharded snapshot v2"  # v2: the optimizer state flattened


def flat_optimizer():
    """get_state_dict's options for sharded snapshots: the optimizer's state as one entry per weight and setting (its
    momentum, its lr, ...). Chapter 10's stages hold different weights, and each must find its own settings in a
    snapshot, whichever stage saved them (unflattened, param_groups list the saving rank's weights)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # a second of imports chapter 1 need not pay

    return StateDictOptions(flatten_optimizer_state_dict=True)
SHARDED_FIX = "delete it to start afresh, or pass another --snapshot"


def sharded_snapshot_due(epochs_done, cfg):
    """The folder to write this epoch's sharded snapshot to (DIR/epoch-N), or None when no snapshot is due."""
    if not cfg.snapshot or (epochs_done % cfg.save_every and epochs_done != cfg.epochs):
        return None
    return Path(cfg.snapshot) / f"epoch-{epochs_done}"


@contextlib.contextmanager
def sharded_snapshot_errors(what, fix):
    """Around dcp.save / dcp.load: torch's CheckpointException (raised on every rank when any rank failed) becomes
    one line naming the first failing rank's reason."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        failures = getattr(e, "failures", None) or {}
        first = next(iter(failures.values()), (e, None))[0]
        sentence = re.split(r"(?<=\.)\s|;\s", str(first).strip())[0]  # torch's messages run on for several sentences
        reason = f"{type(first).__name__}: {sentence}" if sentence else type(first).__name__
        raise FatalError(f"{what} ({reason}): {fix}") from None


def finish_sharded_snapshot(folder, epochs_done, cfg, ctx):
    """After every rank wrote its slices to folder: rank 0 writes folder/snapshot.pt (the flags, the epochs done, the
    world size), which makes the snapshot count, then removes the older epoch-* folders. A run killed before this
    leaves the previous snapshot to resume from. Every rank learns whether rank 0 managed."""
    error = None
    if ctx.is_main:
        about = dict(format=SHARDED_FORMAT, epochs_done=epochs_done, world_size=ctx.world_size,
                     config={k: getattr(cfg, k) for k in TRAJECTORY_FLAGS})
        try:
            atomic_save(about, folder / "snapshot.pt")
            for old in Path(cfg.snapshot).glob("epoch-*"):
                if old != folder:
                    shutil.rmtree(old)
        except (FatalError, OSError) as e:
            error = e
    (written,) = all_reduce_sum([error is None], ctx)
    if error is not None:
        raise error if isinstance(error, FatalError) else FatalError(f"cannot remove an old snapshot: {error}")
    if written < ctx.world_size:
        raise FatalError(f"rank 0 could not finish the snapshot {folder} (see its error)")


def find_sharded_snapshot(cfg):
    """(folder, epochs done, world size that saved it) of the newest finished snapshot under --snapshot DIR, checked
    against this run's flags; None when there is none (or no --snapshot)."""
    if not cfg.snapshot:
        return None
    root = Path(cfg.snapshot)
    if root.exists() and not root.is_dir():
        raise FatalError(f"--snapshot {root} is a file; sharded snapshots are folders (one file per rank, written "
                         f"by torch.distributed.checkpoint): pass a folder name, e.g. --snapshot runs/snap-fsdp")
    prepare_output(root, "--snapshot")  # fail now, not after the first epoch
    finished = sorted((p.parent for p in root.glob("epoch-*/snapshot.pt")), key=_epoch_number)
    if not finished:
        return None
    folder = finished[-1]
    try:
        about = torch.load(folder / "snapshot.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # cut off, not a torch file, a pickle weights_only refuses
        raise FatalError(f"snapshot {folder} cannot be read ({type(e).__name__} in snapshot.pt): {SHARDED_FIX}") from None
    if not isinstance(about, dict) or about.get("format") != SHARDED_FORMAT:
        raise FatalError(f"{folder} is not a sharded snapshot of this tutorial; {SHARDED_FIX}")
    check_resumable(about["config"], about["epochs_done"], cfg, folder, SHARDED_FIX)  # same flags, not ahead
    return folder, about["epochs_done"], about["world_size"]


def _epoch_number(folder):
    """N of an epoch-N folder (-1 for a name that has no number)."""
    number = folder.name.removeprefix("epoch-")
    return int(number) if number.isdigit() else -1
