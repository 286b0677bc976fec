"""Weights on disk: written atomically, loaded safely (weights_only=True), without DDP's `module.` prefix."""
import os
import tempfile
from pathlib import Path

import torch

from common.errors import FatalError


def unwrap(model):
    """The plain model inside DataParallel or DDP (their state_dict keys start with `module.`)."""
    return getattr(model, "module", model)


def prepare_output(folder):
    """Create the output folder now and check it is writable, so a bad --output fails before training."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FatalError(f"cannot create output folder {folder}: {e.strerror}; pass a writable --output") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise FatalError(f"output folder {folder} is not writable; pass a writable --output")
    return path


def atomic_save(obj, path):
    """torch.save to a temporary file in the same folder, fsync, then rename: a crash never leaves half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError):
            raise FatalError(f"cannot write {path}: {e.strerror}; free some space or pass another --output") from None
        raise


def save_weights(model, path, ctx):
    """Global rank 0 writes the unwrapped model's state_dict (loads into a plain NeuralNetwork anywhere)."""
    if ctx.is_main:
        atomic_save(unwrap(model).state_dict(), path)


def load_weights(path, map_location="cpu"):
    """Read a state_dict saved by any chapter; tolerates a `module.` prefix; damaged files raise FatalError."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise FatalError(f"{path} does not exist") from None
    except Exception as e:  # truncated zip, pickle refused by weights_only, ...
        raise FatalError(f"{path} is not a readable PyTorch weights file ({type(e).__name__}); was it cut off or made by something else?") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise FatalError(f"{path} holds no state_dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}
