"""Overlay the loss and accuracy curves of several runs in one PNG, from the metrics.jsonl each chapter writes.

    python single_gpu.py && python ddp_mp.py --nprocs 2 && torchrun --standalone --nproc-per-node 2 ddp_launch.py
    python scripts/plot_curves.py runs/single_gpu runs/ddp_mp runs/ddp_launch --out curves.png

With the same seed and global batch every chapter trains the same model, so the curves lie on top of each
other; the script also prints how far each run is from the first one. Needs matplotlib (pip install matplotlib).
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/ is on sys.path, not the repo root

from common.cli import FatalError, run_main  # noqa: E402

def read_metrics(folder):
    """The records of FOLDER/metrics.jsonl (or of the file itself), in order; damaged lines are skipped."""
    path = Path(folder)
    path = path / "metrics.jsonl" if path.is_dir() else path
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise FatalError(f"cannot read {path}: {e.strerror}; pass a run's --output folder (it holds metrics.jsonl)") from None
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


STYLES = [dict(lw=5, alpha=0.35), dict(lw=2.5, ls="--"), dict(lw=1.5, ls=":"), dict(lw=1, ls="-."), dict(lw=0.8)]


def curves(records):
    """(train x, train loss, epochs, test accuracy in %) of one run; x is in epochs (step / steps per epoch)."""
    epochs = [r for r in records if r["kind"] == "epoch"]
    train = [r for r in records if r["kind"] == "train"]
    if not epochs:
        raise FatalError("a metrics.jsonl without a finished epoch (did the run stop early?)")
    per_epoch = epochs[0]["step"] / epochs[0]["epoch"]
    return ([r["step"] / per_epoch for r in train], [r["loss"] for r in train],
            [r["epoch"] for r in epochs], [100 * r["test_accuracy"] for r in epochs])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="--output folders of finished runs (or their metrics.jsonl files)")
    parser.add_argument("--out", default="curves.png", help="the PNG to write (default %(default)s)")
    parser.add_argument("--title", default="FashionMNIST MLP, same seed and global batch")
    args = parser.parse_args()
    try:
        import matplotlib
    except ImportError:
        raise FatalError("plot_curves.py needs matplotlib, which is not installed: pip install matplotlib") from None
    matplotlib.use("Agg")  # a file, no window: works over ssh and in CI
    import matplotlib.pyplot as plt

    runs = {}
    for run in args.runs:
        try:
            runs[Path(run).name if Path(run).is_dir() else Path(run).parent.name] = curves(read_metrics(run))
        except FatalError as e:
            raise FatalError(f"{run}: {e}") from None

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4), dpi=80)
    for i, (name, (x, loss, epochs, acc)) in enumerate(runs.items()):
        style = STYLES[i % len(STYLES)]
        loss_ax.plot(x, loss, label=name, **style)
        acc_ax.plot(epochs, acc, marker="o", label=name, **style)
    loss_ax.set(xlabel="epoch", ylabel="training loss (global batch)", title="training loss")
    acc_ax.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy (all test images)")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    try:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.out)
    except OSError as e:
        raise FatalError(f"cannot write {args.out}: {e.strerror}; pass another --out") from None
    print(f"Wrote {args.out} ({len(runs)} runs)")

    (first, (_, ref_loss, _, ref_acc)), *others = runs.items()
    for name, (_, loss, epochs, acc) in others:
        if len(loss) != len(ref_loss) or len(acc) != len(ref_acc):
            print(f"  {name}: {len(loss)} loss points, {first} has {len(ref_loss)} (other flags?)")
            continue
        gap = max((abs(a - b) for a, b in zip(loss, ref_loss)), default=0.0)
        differ = [(epoch, abs(a - b)) for epoch, a, b in zip(epochs, acc, ref_acc) if a != b]
        same = "the same test accuracy every epoch" if not differ else (
            f"test accuracy differs in epoch {', '.join(str(e) for e, _ in differ)} "
            f"(by up to {max(d for _, d in differ):.2f} points)")
        print(f"  {name} vs {first}: largest loss difference {gap:.1e}, {same}")


if __name__ == "__main__":
    run_main(main)
