"""Compare two weight files tensor by tensor: are they the same model?

    python scripts/compare_models.py runs/single_gpu/model.pth runs/ddp_mp/model.pth [--atol 1e-5]

Reads model.pth from any chapter (a `module.` prefix is ignored) or a --snapshot file, with
torch.load(weights_only=True), so a file from elsewhere cannot run code. Prints every tensor that is not
bit-for-bit equal with its largest |difference|. Exit status as diff(1): 0 when every tensor is within
--atol, 1 when some tensor is not (or the two files hold different tensors), 2 when a file cannot be read.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/ is on sys.path, not the repo root

import torch  # noqa: E402

from common.checkpoint import SNAPSHOT_FORMAT  # noqa: E402
from common.cli import FatalError  # noqa: E402


def load_weights(path, map_location="cpu"):
    """Read a state_dict saved by any chapter (or a snapshot's); tolerates a `module.` prefix; damaged files raise FatalError."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise FatalError(f"{path} does not exist") from None
    except Exception as e:  # truncated zip, pickle refused by weights_only, ...
        raise FatalError(f"{path} is not a readable PyTorch weights file ({type(e).__name__}); was it cut off or made by something else?") from None
    if isinstance(state, dict) and state.get("format") == SNAPSHOT_FORMAT:
        state = state["model"]  # a --snapshot file: its weights
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise FatalError(f"{path} holds no state_dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def compare(a, b, atol):
    """Lines describing how state_dicts a and b differ, and whether they agree within atol."""
    lines, agree = [], True
    for name in sorted(a.keys() - b.keys()):
        lines.append(f"  {name}: only in the first file")
    for name in sorted(b.keys() - a.keys()):
        lines.append(f"  {name}: only in the second file")
    agree = not lines
    largest = 0.0
    for name in (k for k in a if k in b):
        x, y = a[name], b[name]
        if x.shape != y.shape:
            lines.append(f"  {name}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
            agree = False
            continue
        diff = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
        largest = max(largest, diff)
        if diff > 0:
            verdict = "ok" if diff <= atol else f"DIFFERS (more than --atol {atol:g})"
            lines.append(f"  {name:<28} max |Δ| = {diff:.3e}  {verdict}")
            agree = agree and diff <= atol
    return lines, agree, largest


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", help="a model.pth or snapshot")
    parser.add_argument("second", help="another one")
    parser.add_argument("--atol", type=float, default=1e-3, help="largest |difference| still called equal (default %(default)g)")
    args = parser.parse_args()
    if not args.atol >= 0:
        parser.error(f"--atol must be 0 or more, got {args.atol:g}")
    try:
        a, b = load_weights(args.first), load_weights(args.second)
    except FatalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lines, agree, largest = compare(a, b, args.atol)
    numbers = sum(t.numel() for t in a.values())
    print(f"{args.first} vs {args.second}: {len(a)} tensors, {numbers} numbers")
    print("\n".join(lines) if lines else "  every tensor is bit-for-bit equal")
    if agree:
        print(f"same model: every tensor within --atol {args.atol:g} (largest |Δ| {largest:.3e})")
        return 0
    print(f"different models (largest |Δ| {largest:.3e}, --atol {args.atol:g})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
