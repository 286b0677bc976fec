"""Draw what DDP does in one training step, for two ranks: README's picture beside the 8 steps.

    python measure/draw_ddp.py                       # writes docs/ddp.png
    python measure/draw_ddp.py --out /tmp/ddp.png

The buckets are not drawn from memory. The script wraps the chapters' model in a real DDP (one gloo process on this
machine), runs three steps so DDP rebuilds its buckets in the order the gradients arrive and records them, and
reads the buckets back.
It prints them, then draws them. The boxes grow with each layer's weights and each bucket's bytes, but their
lengths are a sketch of the order of events, not a measurement: the measured step is docs/timeline_ddp.png
(python measure/timeline.py ddp_launch.py). Needs matplotlib.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # measure/ is on sys.path, not the repo root

from common.cli import FatalError, run_main  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def real_buckets():
    """The buckets DDP makes for the chapters' model, as [(layer names, bytes)], in the order DDP all-reduces them."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from common.model import NeuralNetwork

    # One process, its own store: no port to choose, nothing listening beyond this process.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DDP(NeuralNetwork())
        for _ in range(3):  # the buckets are rebuilt after the first backward, in the order gradients arrived
            model(torch.zeros(2, 1, 28, 28)).sum().backward()
        data = model._get_ddp_logging_data()
        names = [name for name, _ in model.module.named_parameters()]
        layers = {name: linear_name(model.module.get_submodule(name.rsplit(".", 1)[0])) for name in names}
        sizes = [int(s) for s in data["rebuilt_bucket_sizes"].split(",")]
        indices = [[int(i) for i in group.split()] for group in data["rebuilt_per_bucket_param_indices"].split(",")]
    finally:
        dist.destroy_process_group()
    return [(list(dict.fromkeys(layers[names[i]] for i in group)), size) for group, size in zip(indices, sizes)]


def linear_name(layer):
    """'Linear 784->512' for the model's first Linear."""
    return f"Linear {layer.in_features}->{layer.out_features}"


def draw(buckets, out):
    """Two ranks' lanes and the network's between them: the broadcast, then one step whose backward hands DDP its
    buckets in the order the gradients are ready, each all-reduced while the backward goes on."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FatalError("draw_ddp.py needs matplotlib: pip install matplotlib (requirements-dev.txt has it)") from None
    from torch import nn

    from common.model import NeuralNetwork

    # The backward runs from the last layer to the first; a layer's box grows with its weights (a sketch, not a clock).
    linears = [m for m in NeuralNetwork().modules() if isinstance(m, nn.Linear)][::-1]
    most = max(m.weight.numel() for m in linears)
    width = {linear_name(m): 1.5 + 1.4 * m.weight.numel() / most for m in linears}
    layers = list(width)
    rank_y, net_y = {0: 2.6, 1: 0.4}, 1.5
    colors = dict(forward="#8fb8de", backward="#f4a261", comm="#2a9d8f", step="#b5838d", bcast="#bbbbbb")
    fig, ax = plt.subplots(figsize=(12, 4.6))

    def box(x, y, w, label, color, h=0.55):
        ax.broken_barh([(x, w)], (y - h / 2, h), facecolors=color, edgecolor="black", linewidth=0.6)
        ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=8)

    ax.text(-0.15, net_y, "the network", ha="right", va="center", fontsize=9, style="italic")
    box(0, net_y, 1.6, "broadcast:\nrank 0's weights", colors["bcast"])
    ends = {}
    for rank, y in rank_y.items():
        ax.text(-0.15, y, f"rank {rank}\ncuda:{rank} (or the CPU)", ha="right", va="center", fontsize=9)
        box(0, y, 1.6, "DDP(model)", colors["bcast"])
        x = 1.8
        box(x, y, 2.6, "forward:\nits 32 of the\n64 images", colors["forward"])
        x += 2.6
        for name in layers:
            box(x, y, width[name], f"backward\n{name}", colors["backward"])
            x += width[name]
            ends[name] = x
    ax.annotate("", xy=(0.8, rank_y[1] + 0.3), xytext=(0.8, rank_y[0] - 0.3),
                arrowprops=dict(arrowstyle="-|>", color="black", lw=0.8))
    free = 0.0
    for i, (names, size) in enumerate(buckets):
        start = max(max(ends[name] for name in names), free)
        w = 1.2 + 1.2 * size / max(s for _, s in buckets)
        short = " +\n".join(name.replace("Linear ", "") for name in names)
        box(start, net_y, w, f"all-reduce bucket {i + 1}\nLinear {short}\n{size / 2**20:.2f} MiB", colors["comm"])
        for y in rank_y.values():  # both ranks hand the bucket over when its last gradient is ready
            ax.plot([start, start], [y + (-0.28 if y > net_y else 0.28), net_y + (0.28 if y > net_y else -0.28)],
                    ls=":", color="black", lw=0.9)
        free = start + w
    for y in rank_y.values():
        box(free + 0.2, y, 1.6, "optimizer.step():\nthe same weights", colors["step"])
    ax.text(0, -0.35, "Each rank computes its own half of the batch; DDP sends a bucket as soon as its last gradient "
            "is ready,\nso bucket 1 crosses the network while the backward of the first layer still runs. After "
            "the last all-reduce every rank holds\nthe same averaged gradient, and takes the same step.", fontsize=8.5)
    ax.set_xlim(-2.2, free + 2.0)
    ax.set_ylim(-0.6, 3.1)
    ax.axis("off")
    ax.set_title("One DDP step on two ranks (lengths sketched; the measured step: docs/timeline_ddp.png)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "ddp.png", help="the PNG to write (docs/ddp.png)")
    args = p.parse_args()
    buckets = real_buckets()
    for i, (layers, size) in enumerate(buckets):
        print(f"bucket {i + 1}: {', '.join(layers)} ({size:,} bytes)")
    draw(buckets, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_main(main)
