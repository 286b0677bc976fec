"""Shared test helpers: tiny IDX datasets in the real format, the real data, and running entry scripts."""
import gzip
import importlib
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import data  # noqa: E402
from common.metrics import read_metrics  # noqa: E402

SPLIT_SIZES = {"train": 256, "test": 96}


def write_idx(path, tensor, compress=None):
    """Write a uint8 tensor as an IDX file (gzip if the name ends in .gz), exactly as the dataset ships."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = bytes([0, 0, 8, tensor.dim()]) + struct.pack(f">{tensor.dim()}I", *tensor.shape)
    payload = header + tensor.contiguous().numpy().tobytes()
    if path.suffix == ".gz":
        payload = gzip.compress(payload)
    path.write_bytes(payload)
    return path


def make_fake_fashion_mnist(folder, layout="torchvision", gz=True, seed=0):
    """A small random FashionMNIST in folder; returns {split: (images, labels)} as written."""
    g = torch.Generator().manual_seed(seed)
    written = {}
    base = Path(folder) / "FashionMNIST" / "raw" if layout == "torchvision" else Path(folder)
    for split, n in SPLIT_SIZES.items():
        images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, 10, (n,), dtype=torch.uint8, generator=g)
        img_name, lbl_name = data.FILES[split]
        suffix = ".gz" if gz else ""
        write_idx(base / (img_name + suffix), images)
        write_idx(base / (lbl_name + suffix), labels)
        written[split] = (images, labels)
    return written


@pytest.fixture
def fake_data(tmp_path):
    """Folder with a small fake FashionMNIST in torchvision layout (.gz files)."""
    folder = tmp_path / "fmnist"
    make_fake_fashion_mnist(folder)
    return folder


def _real_data_dir():
    for folder in (REPO / "data", Path(data.SYSTEM_DIR)):
        if data._find_split_files(folder, "train") and data._find_split_files(folder, "test"):
            return folder
    return None


@pytest.fixture(scope="session")
def real_data():
    """The real FashionMNIST folder. Skips where it is absent, except in CI, which installs it and must use it."""
    folder = _real_data_dir()
    if folder is None:
        msg = "real FashionMNIST not found (make test installs dataset-fashion-mnist)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return folder


@pytest.fixture(autouse=True)
def _restore_environ():
    """Tests may change os.environ; put it back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# Every process a test starts: no download attempts, the CPU even where a GPU is visible (tests/test_gpu.py asks
# for it), and one thread per process. The thread count alone moves the weights (1 vs 2 threads: 3e-6 after
# 3 epochs of 200 steps on an AMD EPYC), so runs that are compared must use the same; with it, a resumed run is
# bit for bit the uninterrupted one. CUDA_DEFAULTS on the path makes every process take CUDA's defaults where the
# CPU's differ (the optimizers' foreach, autocast's dtype: tests/cuda_defaults/sitecustomize.py), and so does this one.
CUDA_DEFAULTS = REPO / "tests" / "cuda_defaults"
BASE_ENV = dict(os.environ, PYTHONUNBUFFERED="1", FASHION_MNIST_OFFLINE="1", OMP_NUM_THREADS="1",
                CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(CUDA_DEFAULTS))
if os.environ.get("TUTORIAL_CPU_DEFAULTS") != "1":
    from cuda_defaults.sitecustomize import TARGET, play_cuda_defaults  # noqa: E402

    play_cuda_defaults(importlib.import_module(TARGET))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


# What a process prints when a C++ thread is ended while the interpreter shuts down (see common/errors.py's
# end_process); no process of this project may ever print it, whatever the test expects otherwise.
ABORT_AT_EXIT = "terminate called without an active exception"


def no_abort_at_exit(err):
    """Fail the test if a process's stderr shows the abort at exit."""
    if ABORT_AT_EXIT in (err or ""):
        pytest.fail(f"a process aborted at exit ({ABORT_AT_EXIT}):\n{err}")


def run_script(script, *args, cwd=None, env=None, timeout=600):
    """Run an entry script as a user would (its own process), returning the CompletedProcess."""
    proc = subprocess.run(
        [sys.executable, str(REPO / script), *map(str, args)],
        cwd=cwd or REPO, env={**BASE_ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout,
    )
    no_abort_at_exit(proc.stderr)
    return proc


class Procs:
    """Processes started in their own sessions, so a test can kill every one of them and their children."""

    def __init__(self):
        self.procs = []

    def start(self, cmd, **kw):
        p = subprocess.Popen(cmd, cwd=kw.pop("cwd", REPO), env=kw.pop("env", BASE_ENV), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def wait(self, p, timeout=300):
        """(returncode, stdout, stderr) of p, killing it if it overruns."""
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(p)
            out, err = p.communicate()
            pytest.fail(f"{p.args} still running after {timeout}s:\n{out}\n{err}")
        no_abort_at_exit(err)
        return p.returncode, out, err

    def kill(self, p):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                self.kill(p)
            p.communicate()


@pytest.fixture
def procs():
    """Start processes with procs.start(cmd); every one still running at the end is killed with its children."""
    ps = Procs()
    yield ps
    ps.close()


@pytest.fixture(scope="module")
def procs_module():
    """procs for module-scoped fixtures: every process still running at the end of the module is killed."""
    ps = Procs()
    yield ps
    ps.close()


def torchrun_script(script, world, args, procs, timeout=240):
    """script under torchrun --standalone on `world` ranks on this machine: (returncode, stdout, stderr)."""
    p = procs.start([*TORCHRUN, "--standalone", "--nproc-per-node", str(world), script, *map(str, args)])
    return procs.wait(p, timeout=timeout)


def one_error_line(err, *needles):
    """err holds exactly one `error:` line, no traceback, and the line holds every needle."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def load_state(path):
    """A saved state_dict, loaded the safe way."""
    return torch.load(path, map_location="cpu", weights_only=True)


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


def max_abs_diff(a, b):
    """Largest |a - b| over all tensors of two state_dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# The slice the distributed tests train on: 960 = 20 global batches of 48, and 48 splits over 1, 2 and 3 ranks;
# 500 test images make uneven eval shards.
SLICE = ["--train-samples", "960", "--test-samples", "500", "--batch-size", "48", "--epochs", "2", "--log-every", "7"]


def slice_args(real_data, out):
    """SLICE on the real data, saving to out."""
    return [*SLICE, "--data-dir", str(real_data), "--output", str(out)]


@pytest.fixture(scope="session")
def reference(real_data, tmp_path_factory):
    """single_gpu.py on SLICE: (state_dict, stdout, metrics), the model every distributed run must reproduce."""
    out = tmp_path_factory.mktemp("single")
    proc = run_script("single_gpu.py", *slice_args(real_data, out))
    assert proc.returncode == 0, proc.stderr
    return load_state(out / "model.pth"), proc.stdout, read_metrics(out)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A running one-node SLURM cluster. Skips where SLURM cannot be installed, except in CI, which must have it."""
    from slurm_cluster import LocalSlurm, ensure_slurm_installed

    reason = ensure_slurm_installed()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    with LocalSlurm(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
