"""Chapters 1 and 2 end to end, as a user runs them: output, saved weights, agreement, errors."""
import re

import pytest
import torch

from common.model import NeuralNetwork
from scripts.plot_curves import read_metrics
from support.run import run_script
from support.same_model import assert_same_curves, load_state, max_abs_diff

SLICE = ["--train-samples", "1280", "--test-samples", "500", "--epochs", "2", "--log-every", "5"]
CHAPTERS = ["single_gpu.py", "dataparallel.py"]


@pytest.fixture(scope="module")
def slice_runs(real_data, tmp_path_factory):
    """Each chapter trained once on the same slice: {script: (CompletedProcess, output folder)}."""
    runs = {}
    for script in CHAPTERS:
        out = tmp_path_factory.mktemp(script.removesuffix(".py"))
        runs[script] = (run_script(script, *SLICE, "--data-dir", real_data, "--output", out), out)
    return runs


@pytest.mark.parametrize("script", CHAPTERS)
def test_chapter_trains_and_saves(slice_runs, script):
    proc, out = slice_runs[script]
    assert proc.returncode == 0, proc.stderr
    log = proc.stdout
    assert "Using cpu device" in log or "Using cuda" in log
    assert log.count("-------------------------------") == 2
    assert re.search(r"loss: \d\.\d{6}  \[    0/ 1280\]", log)
    assert re.search(r"Test Error: \n Accuracy: \d+\.\d%, Avg loss: \d\.\d{6} \n", log)
    assert re.search(r"Train time: [\d.]+s \(\d+ samples/s\)", log)
    assert f"Saved PyTorch Model State to {out / 'model.pth'}" in log
    NeuralNetwork().load_state_dict(load_state(out / "model.pth"))  # plain keys, no `module.`


def test_dataparallel_prints_its_fallback(slice_runs):
    log = slice_runs["dataparallel.py"][0].stdout
    assert "n_gpu: 0" in log and "falls back" in log and "DataParallel(" in log


def test_dataparallel_trains_the_same_model(slice_runs):
    (single, single_out), (dp, dp_out) = slice_runs["single_gpu.py"], slice_runs["dataparallel.py"]
    assert max_abs_diff(load_state(single_out / "model.pth"), load_state(dp_out / "model.pth")) <= 1e-6
    accuracy = re.compile(r"Accuracy: .*")
    assert accuracy.findall(single.stdout) == accuracy.findall(dp.stdout)
    assert_same_curves(read_metrics(dp_out), read_metrics(single_out))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu_is_a_usage_error():
    proc = run_script("single_gpu.py", "--device", "cuda")
    assert proc.returncode == 2 and "of the 0 GPU(s) visible here" in proc.stderr and proc.stderr.count("\n") == 1


def _runtime_error(proc, *needles):
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    for needle in needles:
        assert needle in proc.stderr


def test_missing_data_dir(tmp_path):
    _runtime_error(run_script("single_gpu.py", "--data-dir", tmp_path / "nope", cwd=tmp_path), "not a readable folder")


def test_data_dir_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    _runtime_error(run_script("single_gpu.py", "--data-dir", tmp_path / "f", cwd=tmp_path), "not a readable folder")


def test_empty_data_dir_names_the_fix(tmp_path):
    _runtime_error(run_script("single_gpu.py", "--data-dir", tmp_path, cwd=tmp_path),
                   "apt-get install dataset-fashion-mnist", "--data-dir")


def test_no_data_anywhere_names_the_fix(tmp_path):
    proc = run_script("dataparallel.py", cwd=tmp_path)  # no ./data here, and no download (FASHION_MNIST_OFFLINE)
    _runtime_error(proc, "run `make data`", "apt-get install dataset-fashion-mnist")


def test_truncated_idx_file(tmp_path, fake_data):
    victim = fake_data / "FashionMNIST" / "raw" / "train-images-idx3-ubyte"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    _runtime_error(run_script("single_gpu.py", "--data-dir", fake_data, cwd=tmp_path), "cannot read FashionMNIST in",
                   "delete that folder")


def test_unwritable_output(tmp_path, fake_data):
    (tmp_path / "file").write_text("x")
    _runtime_error(run_script("single_gpu.py", "--data-dir", fake_data, "--output", tmp_path / "file" / "sub", cwd=tmp_path),
                   "--output")


def test_default_run_reaches_the_quickstart_accuracy(real_data, tmp_path):
    """The full data, the quickstart's 5 epochs: the published run ends at 64.1%."""
    proc = run_script("single_gpu.py", "--data-dir", real_data, "--output", tmp_path)
    assert proc.returncode == 0, proc.stderr
    accuracies = [float(a) for a in re.findall(r"Accuracy: ([\d.]+)%", proc.stdout)]
    assert len(accuracies) == 5 and accuracies == sorted(accuracies)
    assert 60.0 <= accuracies[-1] <= 70.0
    assert "[57600/60000]" in proc.stdout
