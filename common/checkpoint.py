"""Weights and snapshots on disk: written atomically by rank 0, loaded safely (weights_only=True), without `module.`.
A snapshot holds whole epochs (each epoch's order comes from seed + epoch); chapter 7's sharded ones are folders."""
import contextlib
import io
import os
import re
import shutil
import signal
import socket
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from common.cli import FatalError, flag_text
from common.ranks import all_reduce_sum, print0

SNAPSHOT_FORMAT = "fashion-mnist-ddp-tutorial snapshot v2"
SHARDED_FORMAT = "fashion-mnist-ddp-tutorial sharded snapshot v2"  # In v2 the optimizer state is flattened.
FIX = "delete it to start afresh, or pass another --snapshot"
# The flags that decide the weights at every step. A run may only resume a snapshot made with the same ones. The
# world size, device, data folder, --epochs and --accum-steps may change, since the same global batch trains the
# same model. --precision and --comm-hook may not, since bf16 steps are not fp32 steps.
TRAJECTORY_FLAGS = ("batch_size", "lr", "momentum", "seed", "train_samples", "precision", "comm_hook")


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
    """torch.save to a temporary file beside path, fsync, then rename: a crash never leaves half a file."""
    path, buffer = Path(path), io.BytesIO()
    torch.save(obj, buffer)  # in memory first: a full disk is then write()'s plain OSError, not torch's zip error
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # this process's own
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):  # A read-only disk refuses even the unlink.
            tmp.unlink(missing_ok=True)
        raise FatalError(f"cannot write {path}: {e.strerror}; free some space or pass another --output / --snapshot") \
            from None


def save_weights(model, path):
    """Write a model's state_dict atomically; pass the plain model (DDP's model.module), so keys have no `module.`."""
    atomic_save(model.state_dict(), path)


def snapshot_due(epochs_done, cfg):
    """With --snapshot: every --save-every epochs and after the last one."""
    return cfg.snapshot and (epochs_done % cfg.save_every == 0 or epochs_done == cfg.epochs)


def on_rank0_then_all_reduce(write, ctx, what):
    """Rank 0 runs write(); an all-reduce of the ranks' success flags then stops every rank if it failed."""
    error = None
    try:
        if ctx.is_main:
            write()
    except (FatalError, OSError) as e:
        error = e if isinstance(e, FatalError) else FatalError(f"cannot {what}: {e}")
    if all_reduce_sum([error is None], ctx)[0] < ctx.world_size:
        raise error or FatalError(f"rank 0 could not {what} (see its error)")


def save_snapshot(model, optimizer, scaler, epochs_done, cfg, ctx, hook_state=None):
    """With --snapshot, when due: rank 0 writes it, all learn if it could (hook_state: PowerSGD's); True: stop now."""
    if snapshot_due(epochs_done, cfg):
        hook = hook_state.all_gather(ctx) if hook_state else None
        on_rank0_then_all_reduce(lambda: atomic_save(dict(
            format=SNAPSHOT_FORMAT, epochs_done=epochs_done, config={k: getattr(cfg, k, "none") for k in TRAJECTORY_FLAGS},
            model=getattr(model, "module", model).state_dict(),  # DDP's plain model, so the keys have no `module.`.
            optimizer=optimizer.state_dict(),
            scaler=scaler.state_dict() if scaler else {},  # fp16's loss scale ({} when off, or no scaler)
            comm_hook=hook), cfg.snapshot), ctx, f"write the snapshot {cfg.snapshot}")
    return time_limit_near(epochs_done, cfg, ctx)


def read_snapshot(path, kind, device="cpu"):
    """A snapshot file of this tutorial's `kind` format, loaded with weights_only (no pickled code); else one line."""
    try:
        snapshot = torch.load(path, map_location=device, weights_only=True)  # Loads straight onto this rank's device.
    except Exception as e:  # A file cut off, not a torch file, or a pickle that weights_only refuses.
        raise FatalError(f"snapshot {path} cannot be read ({type(e).__name__}): is it cut off or another kind of "
                         f"file? {FIX}") from None
    if not isinstance(snapshot, dict) or snapshot.get("format") != kind:
        raise FatalError(f"{path} is not a snapshot of this tutorial (a model.pth or another program's file?); {FIX}")
    return snapshot


def check_resumable(about, cfg, where):
    """A snapshot made with these trajectory flags and epochs done can continue this run; else one line saying why."""
    made_with, epochs_done = about["config"], about["epochs_done"]
    ours = {name: getattr(cfg, name, "none") for name in TRAJECTORY_FLAGS}  # a chapter without --comm-hook: none
    different = [name for name in TRAJECTORY_FLAGS if made_with.get(name) != ours[name]]
    if different:
        raise FatalError(f"snapshot {where} was made with {' '.join(flag_text(n, made_with.get(n)) for n in different)}"
                         f", this run has {' '.join(flag_text(n, ours[n]) for n in different)}; resume with the "
                         f"snapshot's flags, or {FIX}")
    if epochs_done > cfg.epochs:
        raise FatalError(f"snapshot {where} has {epochs_done} epochs done, more than --epochs {cfg.epochs}; pass "
                         f"--epochs {epochs_done} or more, or {FIX}")


def load_snapshot(model, optimizer, scaler, cfg, ctx, hook_state=None):
    """With --snapshot FILE there: it loaded into model, optimizer (and the hook's state); the epochs it holds, or 0."""
    signal.signal(signal.SIGUSR1, lambda signum, frame: TIME_LIMIT_WARNING.set())
    path = Path(cfg.snapshot or ".")
    if cfg.snapshot:
        prepare_output(path.parent, "--snapshot")  # Fail now, not after the first epoch.
    if not cfg.snapshot or not path.exists():
        return 0
    snapshot = read_snapshot(path, SNAPSHOT_FORMAT, ctx.device)
    check_resumable(snapshot, cfg, path)
    try:
        getattr(model, "module", model).load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        if snapshot.get("scaler"):  # Only fp16 saves one, and a snapshot's flags match this run's --precision.
            scaler.load_state_dict(snapshot["scaler"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise FatalError(f"snapshot {path} holds a different model ({str(e).strip().splitlines()[0]}); {FIX}") from None
    if hook_state:
        hook_state.load(snapshot.get("comm_hook"), ctx, path)
    print_resumed(ctx, path, snapshot["epochs_done"], cfg)
    return snapshot["epochs_done"]


def print_resumed(ctx, where, epochs_done, cfg):
    """Rank 0's line for a resumed run: where from, how many epochs were done, what comes next."""
    left = f"continuing with epoch {epochs_done + 1}" if epochs_done < cfg.epochs else "nothing left to train"
    print0(ctx, f"Resuming from {where}: {epochs_done} of {cfg.epochs} epochs done, {left}")


# Set by SIGUSR1, SLURM's warning before the job's time limit (scripts/job.sh), once load_snapshot has set the handler.
TIME_LIMIT_WARNING = threading.Event()


def time_limit_near(epochs_done, cfg, ctx):
    """After each epoch (an all-reduce): True, and one line, when any rank was warned and a snapshot holds the run."""
    warned = all_reduce_sum([TIME_LIMIT_WARNING.is_set()], ctx)[0]  # The sum over the ranks: did any of them hear it?
    if stop := bool(warned) and snapshot_due(epochs_done, cfg) and epochs_done < cfg.epochs:
        print0(ctx, f"Stopping after epoch {epochs_done} of {cfg.epochs} (SIGUSR1: the time limit is near); "
                    f"{cfg.snapshot} holds it")
    return bool(stop)


class StopAtTimeLimit:
    """For chapters whose snapshots are their own (7, 9, 10): SIGUSR1 stops the run after an epoch, once saved."""

    def __init__(self):
        signal.signal(signal.SIGUSR1, lambda signum, frame: TIME_LIMIT_WARNING.set())

    def any_rank_warned(self, epochs_done, cfg, ctx):
        return time_limit_near(epochs_done, cfg, ctx)


def flat_optimizer_options():
    """Sharded snapshots' optimizer state flattened, so a pipeline stage finds its own whichever stage saved it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # a second of imports chapter 1 need not pay

    return StateDictOptions(flatten_optimizer_state_dict=True)


def sharded_snapshot_due(epochs_done, cfg):
    """The folder to write this epoch's sharded snapshot to (DIR/epoch-N), or None when no snapshot is due."""
    return Path(cfg.snapshot) / f"epoch-{epochs_done}" if snapshot_due(epochs_done, cfg) else None


@contextlib.contextmanager
def sharded_snapshot_errors(what, fix=FIX):
    """Around dcp.save / dcp.load: torch's CheckpointException (on every rank when any failed) as one line."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        first = next(iter((getattr(e, "failures", None) or {}).values()), (e, None))[0]  # the first failing rank's
        sentence = re.split(r"(?<=\.)\s|;\s", str(first).strip())[0]  # torch's messages run on for several sentences
        raise FatalError(f"{what} ({type(first).__name__}{f': {sentence}' if sentence else ''}): {fix}") from None


def finish_sharded_snapshot(folder, epochs_done, cfg, ctx):
    """Rank 0's folder/snapshot.pt makes the sharded snapshot count (older epoch-* go); every rank must see it."""
    def write():
        atomic_save(dict(format=SHARDED_FORMAT, epochs_done=epochs_done, world_size=ctx.world_size,
                         config={k: getattr(cfg, k, "none") for k in TRAJECTORY_FLAGS}), folder / "snapshot.pt")
        for old in Path(cfg.snapshot).glob("epoch-*"):
            if old != folder:
                shutil.rmtree(old)

    on_rank0_then_all_reduce(write, ctx, f"finish the snapshot {folder}")
    seen = (folder / "snapshot.pt").exists()
    check_one_folder(f"{'sees' if seen else 'does not see'} rank 0's {folder.name}/snapshot.pt", ctx, cfg)


def check_one_folder(view, ctx, cfg):
    """Every rank's view of the --snapshot folder compared (an all-gather): one line on every rank if they differ."""
    dist.all_gather_object(everyone := [None] * ctx.world_size, (socket.gethostname(), view))
    for rank, (host, theirs) in enumerate(everyone):
        if theirs != view:
            raise FatalError(f"--snapshot {cfg.snapshot}: rank {ctx.rank} (on {socket.gethostname()}) {view}, rank "
                             f"{rank} (on {host}) {theirs}: every rank writes and reads its part of a sharded snapshot "
                             f"there, so it must be a folder all the machines share (NFS, Lustre, ...)")


def find_sharded_snapshot(cfg, ctx):
    """(folder, epochs done, saving world size) of the newest finished snapshot, the same on every rank and checked
    against this run; or None."""
    if not cfg.snapshot:
        return None
    root = Path(cfg.snapshot)
    if root.exists() and not root.is_dir():
        raise FatalError(f"--snapshot {root} is a file; sharded snapshots are folders (one file per rank, written "
                         f"by torch.distributed.checkpoint): pass a folder name, e.g. --snapshot runs/snap-fsdp")
    prepare_output(root, "--snapshot")  # Fail now, not after the first epoch.
    number = lambda folder: int(folder.name[6:]) if folder.name[6:].isdigit() else -1  # noqa: E731  (epoch-N)
    finished = sorted((p.parent for p in root.glob("epoch-*/snapshot.pt")), key=number)
    check_one_folder(f"finds {finished[-1].name}" if finished else "finds no finished snapshot", ctx, cfg)
    if not finished:
        return None
    about = read_snapshot(finished[-1] / "snapshot.pt", SHARDED_FORMAT)
    check_resumable(about, cfg, finished[-1])  # It checks the flags match and the snapshot is not ahead of --epochs.
    return finished[-1], about["epochs_done"], about["world_size"]
