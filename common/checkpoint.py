"""Weights and snapshots on disk: written atomically, loaded safely (weights_only=True), without `module.`."""
import io
import os
import tempfile
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
    epochs_done = snapshot["epochs_done"]
    left = f"continuing with epoch {epochs_done + 1}" if epochs_done < cfg.epochs else "nothing left to train"
    print0(ctx, f"Resuming from {path}: {epochs_done} of {cfg.epochs} epochs done, {left}")
    return epochs_done
