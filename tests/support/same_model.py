"""What "chapter 1's model" means for the distributed tests: the slice they train on, how far their weights may be
from chapter 1's (SAME_MODEL), and the same accuracy lines, test losses and metrics curve."""
import re

import pytest
import torch

# Chapter 1 and the DDP chapters at 1 thread per process differ only in how the gradients are summed (one
# 48-image batch, or 2-3 shards averaged by all_reduce): measured at most 3.7e-9 after SLICE's 40 steps (one float32
# step of a weight near 0.03). Allowed: 1e-6, room for other CPUs' summation orders, and 30x below what a step with
# its micro-batches weighted wrongly moves (3.4e-5, tests/bugs/planted.py accum-one-over-k).
SAME_MODEL = 1e-6

# The slice the distributed tests train on: 960 = 20 global batches of 48, and 48 splits over 1, 2 and 3 ranks;
# 500 test images make uneven eval shards.
SLICE = ["--train-samples", "960", "--test-samples", "500", "--batch-size", "48", "--epochs", "2", "--log-every", "7"]


def slice_args(real_data, out):
    """SLICE on the real data, saving to out."""
    return [*SLICE, "--data-dir", str(real_data), "--output", str(out)]


def load_state(path):
    """A saved state_dict, loaded the safe way."""
    return torch.load(path, map_location="cpu", weights_only=True)


def max_abs_diff(a, b):
    """Largest |a - b| over all tensors of two state_dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def accuracy_lines(log):
    """The `Accuracy: N%` of every test a run printed: exact evaluation prints the same ones at any world size."""
    return re.findall(r"Accuracy: [\d.]+%", log)


def printed_test_losses(log):
    """The `Avg loss` of every test a run printed, as numbers."""
    return [float(x) for x in re.findall(r"Avg loss: ([\d.]+)", log)]


def assert_same_curves(metrics, reference):
    """Two runs' metrics.jsonl draw one curve: the same records at the same steps, losses within float noise."""
    def where(records):
        return [(r["kind"], r["epoch"], r["step"], r.get("samples")) for r in records]

    assert where(metrics) == where(reference) and len(metrics) > 0
    for mine, ref in zip(metrics, reference):
        for key in ("loss", "train_loss", "test_loss"):
            if key in ref:
                assert mine[key] == pytest.approx(ref[key], abs=1e-4), (key, mine, ref)
        assert mine.get("test_accuracy") == ref.get("test_accuracy")
