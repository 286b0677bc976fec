"""scripts/compare_models.py: same model or not, from the files every chapter writes."""
import subprocess
import sys

import torch

from common.checkpoint import SNAPSHOT_FORMAT
from common.model import NeuralNetwork
from conftest import REPO


def compare(*args):
    return subprocess.run([sys.executable, "scripts/compare_models.py", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def weights(seed=0):
    torch.manual_seed(seed)
    return NeuralNetwork().state_dict()


def test_equal_files_agree_even_with_a_module_prefix_or_as_a_snapshot(tmp_path):
    torch.save(weights(), tmp_path / "a.pth")
    torch.save({"module." + k: v for k, v in weights().items()}, tmp_path / "dp.pth")  # DataParallel/DDP keys
    torch.save({"format": SNAPSHOT_FORMAT, "model": weights(), "epochs_done": 1}, tmp_path / "snap.pt")
    for other in ("dp.pth", "snap.pt"):
        proc = compare(tmp_path / "a.pth", tmp_path / other, "--atol", "0")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "every tensor is bit-for-bit equal" in proc.stdout and "same model" in proc.stdout


def test_a_difference_is_named_and_judged_against_atol(tmp_path):
    a, b = weights(), weights()
    b["linear_relu_stack.2.bias"][3] += 3e-4
    torch.save(a, tmp_path / "a.pth")
    torch.save(b, tmp_path / "b.pth")
    loose = compare(tmp_path / "a.pth", tmp_path / "b.pth", "--atol", "1e-3")
    assert loose.returncode == 0 and "linear_relu_stack.2.bias" in loose.stdout and "ok" in loose.stdout
    strict = compare(tmp_path / "a.pth", tmp_path / "b.pth")  # default --atol 1e-4
    assert strict.returncode == 1, strict.stdout
    (line,) = [x for x in strict.stdout.splitlines() if "DIFFERS" in x]
    assert line.split()[0] == "linear_relu_stack.2.bias" and "3.0" in line
    assert "linear_relu_stack.0.weight" not in strict.stdout  # equal tensors are not listed
    assert compare(tmp_path / "a.pth", tmp_path / "b.pth", "--atol", "-1").returncode == 2


def test_other_models_differ(tmp_path):
    torch.save(weights(0), tmp_path / "a.pth")
    torch.save(weights(1), tmp_path / "seed1.pth")
    torch.save({k: v for k, v in weights().items() if "4." not in k}, tmp_path / "short.pth")
    assert compare(tmp_path / "a.pth", tmp_path / "seed1.pth").returncode == 1
    proc = compare(tmp_path / "a.pth", tmp_path / "short.pth")
    assert proc.returncode == 1 and "linear_relu_stack.4.weight: only in the first file" in proc.stdout


def test_missing_or_foreign_files_are_one_line_and_exit_2(tmp_path):
    torch.save(weights(), tmp_path / "a.pth")
    (tmp_path / "notes.txt").write_text("not weights")
    torch.save({"fn": print}, tmp_path / "code.pth")  # weights_only refuses pickled functions
    for other, needle in [("missing.pth", "does not exist"), ("notes.txt", "not a readable PyTorch weights file"),
                          ("code.pth", "not a readable PyTorch weights file")]:
        proc = compare(tmp_path / "a.pth", tmp_path / other)
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error:") and needle in proc.stderr, proc.stderr
