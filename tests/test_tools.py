"""scripts/compare_models.py and plot_curves.py: same model or not, from the files every chapter writes."""
import json
import os
import subprocess
import sys

import pytest
import torch

from common.checkpoint import SNAPSHOT_FORMAT
from common.model import NeuralNetwork
from support import REPO


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
    b["linear_relu_stack.2.bias"][3] += 3e-3
    torch.save(a, tmp_path / "a.pth")
    torch.save(b, tmp_path / "b.pth")
    loose = compare(tmp_path / "a.pth", tmp_path / "b.pth", "--atol", "1e-2")
    assert loose.returncode == 0 and "linear_relu_stack.2.bias" in loose.stdout and "ok" in loose.stdout
    strict = compare(tmp_path / "a.pth", tmp_path / "b.pth")  # default --atol 1e-3
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


def write_metrics(folder, losses, accuracies, steps_per_epoch=4):
    """A metrics.jsonl as the chapters write it: train lines every step, one epoch line per epoch."""
    folder.mkdir()
    lines = []
    for e, acc in enumerate(accuracies, 1):
        for s in range(steps_per_epoch):
            step = (e - 1) * steps_per_epoch + s + 1
            lines.append(dict(kind="train", epoch=e, step=step, samples=step * 48, loss=losses[step - 1], time=0.1))
        lines.append(dict(kind="epoch", epoch=e, step=e * steps_per_epoch, train_loss=1.0, test_accuracy=acc,
                          test_loss=1.0, time=1.0))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def plot(*args, env=None):
    return subprocess.run([sys.executable, "scripts/plot_curves.py", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=env)


def test_plot_curves_draws_one_png_and_measures_the_gap(tmp_path):
    if not os.environ.get("CI"):  # make test installs matplotlib; in CI this test must run, not skip
        pytest.importorskip("matplotlib")
    losses = [2.3 - 0.1 * i for i in range(8)]
    write_metrics(tmp_path / "single_gpu", losses, [0.5, 0.6])
    write_metrics(tmp_path / "ddp_mp", [x + 2e-6 for x in losses], [0.5, 0.6])
    write_metrics(tmp_path / "seed1", [x + 0.05 for x in losses], [0.4, 0.6])
    out = tmp_path / "curves.png"
    proc = plot(tmp_path / "single_gpu", tmp_path / "ddp_mp", tmp_path / "seed1", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert "ddp_mp vs single_gpu: largest loss difference 2.0e-06, the same test accuracy every epoch" in proc.stdout
    assert "seed1 vs single_gpu: largest loss difference 5.0e-02, test accuracy differs in epoch 1 (by up to 10.00 " \
           "points)" in proc.stdout


def test_plot_curves_without_matplotlib_or_metrics_says_so(tmp_path):
    shim = tmp_path / "shim" / "matplotlib"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    write_metrics(tmp_path / "run", [1.0] * 4, [0.5])
    proc = plot(tmp_path / "run", env=dict(os.environ, PYTHONPATH=str(shim.parent)))
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert "needs matplotlib, which is not installed: pip install matplotlib" in proc.stderr
    proc = plot(tmp_path / "nothing-here")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "cannot read" in proc.stderr, proc.stderr


def bench(*args, env=None):
    return subprocess.run([sys.executable, "measure/benchmark.py", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=env)


def test_benchmark_table_json_and_chart(real_data, tmp_path):
    """Two real rows (the chapter and the compute floor), one epoch each: table, JSON, PNG, and the JSON replayed."""
    if not os.environ.get("CI"):
        pytest.importorskip("matplotlib")
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    proc = bench("--epochs", "1", "--cases", "single_gpu,floor", "--data-dir", real_data, "--json", js, "--png", png)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[1/2] (a) single_gpu.py: running 1 epoch(s) on cpu" in proc.stderr  # a progress line per run
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| (")]
    assert [row.split("|")[1].strip() for row in rows] == ["(a) single_gpu.py", "(c) compute floor"]
    a, c = json.loads(js.read_text())["cases"]
    assert (a["key"], c["key"], a["samples"], c["samples"]) == ("single_gpu", "floor", 60000, 60000)
    # (a) ran the real chapter: one epoch of the quickstart lands near 50% (50.5% here).
    assert 0.40 <= a["accuracy"] <= 0.60 and c["accuracy"] is None
    assert rows[0].split("|")[8].strip() == f"{100 * a['accuracy']:.1f}" and rows[1].split("|")[8].strip() == "-"
    # The ratios are the measured times' ratios: in the table, and in the target line.
    ratio = a["best_seconds"] / c["best_seconds"]
    assert rows[1].split("|")[6].strip() == f"{ratio:.2f}"  # (c)'s speed-up over (a)
    assert f"(a) single_gpu.py / (c) compute floor = {ratio:.2f} (target <= 1.10)" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = bench("--from-json", js)
    assert again.returncode == 0 and [x for x in again.stdout.splitlines() if x.startswith("| (")] == rows


def test_benchmark_times_chapter_3b_itself_beside_ddp(real_data, tmp_path):
    """Row (i) is ddp_by_hand.py under torchrun, as a reader runs chapter 3b (no copy of its step): it trains DDP's
    model (row (f)'s test accuracy), and its time is shown against DDP's."""
    js = tmp_path / "b.json"
    proc = bench("--epochs", "1", "--cases", "torchrun_2,ddp_manual", "--data-dir", real_data, "--json", js)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    f, i = json.loads(js.read_text())["cases"]
    assert (f["key"], i["key"], i["ranks"]) == ("torchrun_2", "ddp_manual", 2)
    assert "ddp_by_hand.py" in i["command"] and "torch.distributed.run" in i["command"], i["command"]
    assert i["accuracy"] == f["accuracy"] and i["accuracy"] is not None
    assert (f"(i) torchrun ddp_by_hand.py / (f) torchrun ddp_launch.py = {i['best_seconds'] / f['best_seconds']:.2f} "
            f"(no target)") in proc.stdout, proc.stdout


def test_benchmark_without_matplotlib_still_reports(tmp_path):
    shim = tmp_path / "shim" / "matplotlib"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    saved = tmp_path / "b.json"
    saved.write_text(json.dumps(dict(epochs=1, rounds=1, device="cpu", data_dir="d", checks=[],
                                     environment=dict(torch="2.x", torch_threads=2, cpu_count=2),
                                     cases=[dict(key="single_gpu", label="(a) single_gpu.py", ranks=1, best_seconds=2.0,
                                                 samples=60000, samples_per_second=30000.0, ms_per_step=2.1,
                                                 x_single_gpu=1.0, x_floor=None, accuracy=0.649, peak_rss_mib=800.0,
                                                 command=["python"])])))
    proc = bench("--from-json", saved, "--png", tmp_path / "b.png", env=dict(os.environ, PYTHONPATH=str(shim.parent)))
    assert proc.returncode == 0 and "| (a) single_gpu.py | 1 | 2.000 |" in proc.stdout, proc.stdout + proc.stderr
    assert "no chart" in proc.stderr and "pip install matplotlib" in proc.stderr and not (tmp_path / "b.png").exists()
    bad = bench("--from-json", tmp_path / "missing.json")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "is not a benchmark --json file" in bad.stderr


def test_the_ddp_picture_draws_the_buckets_a_real_ddp_makes(tmp_path):
    """measure/draw_ddp.py, as README says to run it: it reads DDP's buckets back from a real DDP and draws them. They
    are the model's layers in the order the backward reaches them: the last two Linears (1 MiB, DDP's first bucket
    cap), then the first."""
    linears = [m for m in NeuralNetwork().modules() if isinstance(m, torch.nn.Linear)]
    nbytes = [4 * (m.weight.numel() + m.bias.numel()) for m in linears]
    out = tmp_path / "ddp.png"
    proc = subprocess.run([sys.executable, "measure/draw_ddp.py", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"bucket 1: Linear 512->10, Linear 512->512 ({nbytes[2] + nbytes[1]:,} bytes)",
        f"bucket 2: Linear 784->512 ({nbytes[0]:,} bytes)",
        f"wrote {out}"], proc.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
