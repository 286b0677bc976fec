"""Shared test helpers: tiny IDX datasets in the real format, the real data, and running entry scripts."""
import contextlib
import gzip
import importlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.cli import FatalError  # noqa: E402
from scripts.plot_curves import read_metrics  # noqa: E402

SPLIT_SIZES = {"train": 256, "test": 96}
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


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


def make_fake_fashion_mnist(folder, layout="torchvision", gz=False, seed=0):
    """A small random FashionMNIST in folder (torchvision's layout: FashionMNIST/raw/, or flat as Debian ships it);
    returns {split: (images, labels)} as written."""
    g = torch.Generator().manual_seed(seed)
    written = {}
    base = Path(folder) / "FashionMNIST" / "raw" if layout == "torchvision" else Path(folder)
    for split, n in SPLIT_SIZES.items():
        images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, 10, (n,), dtype=torch.uint8, generator=g)
        img_name, lbl_name = FILES[split]
        suffix = ".gz" if gz else ""
        write_idx(base / (img_name + suffix), images)
        write_idx(base / (lbl_name + suffix), labels)
        written[split] = (images, labels)
    return written


@pytest.fixture
def fake_data(tmp_path):
    """A data folder with a small fake FashionMNIST, as torchvision reads it."""
    folder = tmp_path / "fmnist"
    make_fake_fashion_mnist(folder)
    return folder


def _real_data_dir():
    """./data as torchvision reads it, unpacked from Debian's copy the first time (as `make data` does); None where
    neither has FashionMNIST."""
    from common.data import unpack_debian_copy

    try:
        unpack_debian_copy(REPO / "data")
    except FatalError:
        return None
    return REPO / "data"


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


# `make test`: what a newcomer runs first, under 10 minutes on 2 cores, on any machine (no SLURM, no network
# namespaces, no root): every chapter once through its real launcher on a slice of the real data, training chapter
# 1's model, and the tests that take no more than a few seconds. `make test-all` runs every test (.ci/run does).
# An entry is the start of test ids: a module, a test (all its cases) or one case; docs/tests.md says what each proves.
QUICK = [
    # every chapter, through its launcher, trains chapter 1's model
    "tests/test_scripts.py::test_chapter_trains_and_saves[single_gpu.py]",
    "tests/test_scripts.py::test_dataparallel_trains_the_same_model",
    "tests/test_ddp.py::test_ddp_trains_the_same_model[torchrun-2]",
    "tests/test_ddp.py::test_ddp_trains_the_same_model[mp-2]",
    "tests/test_ddp.py::test_ddp_trains_the_same_model[tcp-2]",
    "tests/test_ddp.py::test_ddp_trains_the_same_model[srun-env-2]",
    "tests/test_ddp.py::test_ddp_trains_the_same_model[by-hand-2]",
    "tests/test_ddp.py::test_leaving_the_group_after_a_collective_never_hangs",
    "tests/test_fsdp.py::test_fsdp_trains_the_same_model[2]",
    "tests/test_debug_hang.py::test_broken_case_fails_soon_naming_the_mismatch[eval-on-rank0]",
    "tests/test_debug_hang.py::test_fix_trains_chapter_1s_model[eval-on-rank0]",
    "tests/test_tensor_parallel.py::test_tensor_parallel_trains_the_same_model[2ranks-dp1]",
    "tests/test_pipeline.py::test_the_pipeline_trains_the_same_model[2stages-1f1b]",
    "tests/test_diloco.py::test_diloco_trains_post_local_sgds_model[2]",
    # the chapters read as the lesson, and refuse what cannot work in one line
    "tests/test_ddp.py::test_each_ddp_chapter_reads_as_the_lesson_top_to_bottom",
    "tests/test_ddp.py::test_chapters_1_and_2_mark_the_steps_they_share",
    "tests/test_ddp.py::test_chapter_diffs_stay_within_their_budget",
    "tests/test_ddp.py::test_spawned_ranks_store_listens_on_loopback_only",
    "tests/test_faults.py::test_bad_flag_exits_2_with_one_line",
    "tests/test_training_flags.py::test_flags_that_cannot_work_are_one_line",
    # the units: data, model and loop, flags, errors, the GPU path played on the CPU
    "tests/test_config.py", "tests/test_errors.py", "tests/test_model_engine.py", "tests/test_cuda_defaults.py",
    "tests/test_gpu_path.py", "tests/test_data.py::test_a_damaged_file_is_one_line", "tests/test_data.py::test_load_from",
    "tests/test_data.py::test_batches_match_torchvision_totensor", "tests/test_data.py::test_union_of_rank_batches",
    "tests/test_data.py::test_shards_of_the_test_set_hold_each_image_once", "tests/test_data.py::test_loader_batches",
    "tests/test_preflight.py::test_bus_bandwidth_is_nccl_tests_busbw", "tests/test_docs.py::test_every_doc_command_is_known",
    # the torch range: what a chapter refuses on a torch too old for it (all of them on the floor, make test-floor)
    "tests/test_torch_range.py", "tests/test_gpu_path.py::test_every_flag_has_a_cuda_twin",
]


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: in `make test` (conftest.QUICK)")


# The tests of a SLURM cluster (those that use the slurm or two_nodes fixture): `make test-all` runs them on one worker.
SLURM_TESTS = ("tests/test_slurm.py", "tests/test_slurm_requeue.py", "tests/test_slurm_cluster.py",
               "tests/test_preflight_slurm.py", "tests/test_training_flags.py::test_16_bits_under_srun")


def group_of(nodeid):
    """The worker group of a test: every SLURM test in one, so one local cluster runs at a time; a document's (or a
    section's) commands in tests/test_docs.py alone, as they share no fixture; else its module, so a module's
    module-wide runs are made once."""
    if nodeid.startswith(SLURM_TESTS):
        return "slurm"
    return nodeid if nodeid.startswith("tests/test_docs.py::test_doc_commands_run[") else nodeid.split("::")[0]


@pytest.hookimpl(optionalhook=True)  # a known hook only where pytest-xdist is installed
def pytest_xdist_make_scheduler(config, log):
    """`make test-all`'s two workers (pytest -n 2 --dist loadgroup) take whole groups (group_of). xdist's own loadgroup
    reads the groups from marks it writes into each test's id, which pytest 9.2 no longer takes (pytest-xdist#1386):
    every test was then scheduled alone, and a module's fixtures ran on both workers."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return group_of(nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(config, items):
    """Mark the tests QUICK names (every entry must name a test that exists); check that SLURM_TESTS holds every test
    of a SLURM cluster."""
    unused = set(QUICK)
    for item in items:
        if {"slurm", "two_nodes"} & set(getattr(item, "fixturenames", ())) and group_of(item.nodeid) != "slurm":
            raise pytest.UsageError(f"{item.nodeid} starts a SLURM cluster: add it to conftest.SLURM_TESTS")
        for entry in QUICK:
            if item.nodeid.startswith(entry):
                item.add_marker(pytest.mark.quick)
                unused.discard(entry)
    if len(items) > 400 and unused:  # the whole suite was collected: a stale entry would drop a test silently
        raise pytest.UsageError(f"conftest.QUICK names tests that do not exist: {sorted(unused)}")


@pytest.fixture(autouse=True)
def _restore_environ():
    """Tests may change os.environ; put it back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# Every process a test starts: no download attempts, the CPU even where a GPU is visible (tests/test_gpu.py asks
# for it), and one thread per process. The thread count alone moves the weights (1 vs 2 threads: 3e-6 after
# 3 epochs of 200 steps on an AMD EPYC, 1.8e-4 with momentum 0.9), so runs that are compared must use the same; with
# it, a resumed run is
# bit for bit the uninterrupted one. CUDA_DEFAULTS on the path makes every process take CUDA's defaults where the
# CPU's differ (the optimizers' foreach, autocast's dtype: tests/cuda_defaults/sitecustomize.py), and so does this one.
CUDA_DEFAULTS = REPO / "tests" / "cuda_defaults"
BASE_ENV = dict(os.environ, PYTHONUNBUFFERED="1", FASHION_MNIST_OFFLINE="1", OMP_NUM_THREADS="1",
                CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(CUDA_DEFAULTS))
if os.environ.get("TUTORIAL_CPU_DEFAULTS") != "1":
    from cuda_defaults.sitecustomize import TARGET, play_cuda_defaults  # noqa: E402

    play_cuda_defaults(importlib.import_module(TARGET))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


# What a process prints when a C++ thread is ended while the interpreter shuts down (see common/cli.py's
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


def run_forked(cases, timeout=120):
    """[(script, args, extra env)] -> [CompletedProcess], as run_script gives them, each case in a process of its own
    forked from one that imported torch once (tests/forkrun.py): for the many short runs that end at a flag."""
    payload = [dict(script=str(REPO / script), args=list(map(str, args)), env={**BASE_ENV, **env}, timeout=timeout)
               for script, args, env in cases]
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "forkrun.py")], input=json.dumps(payload), cwd=REPO,
                          env=BASE_ENV, capture_output=True, text=True, timeout=timeout * len(cases) + 60)
    assert proc.returncode == 0, proc.stderr
    results = [subprocess.CompletedProcess(case["args"], code, out, err)
               for case, (code, out, err) in zip(payload, json.loads(proc.stdout))]
    for result in results:
        no_abort_at_exit(result.stderr)
    return results


def _descendants(pid):
    """The pids of every process below pid (children, their children, ...), from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read()
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


class Procs:
    """Processes started in their own sessions, so a test can kill every one of them and their children."""

    def __init__(self):
        self.procs, self.ended = [], {}  # ended: what wait() read from each process that ended

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
            for pid in [p.pid, *_descendants(p.pid)]:  # each prints its threads' Python stacks (cuda_defaults/)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR2)
            time.sleep(2)
            self.kill(p)
            out, err = p.communicate()
            others = "".join(f"\n--- {q.args} ended with {rc}:\n{o}\n{e}" for q, (rc, o, e) in self.ended.items())
            pytest.fail(f"{p.args} still running after {timeout}s (its stacks, then the other processes of this test):"
                        f"\n{out}\n{err}{others}")
        self.ended[p] = (p.returncode, out, err)
        no_abort_at_exit(err)
        return p.returncode, out, err

    def kill(self, p):
        """p's process group, and every process started under it: torchrun starts each worker in a session of its
        own, so killing torchrun's group alone would leave its workers running."""
        for pid in _descendants(p.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
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


def run_forked_cases(request, test, cases):
    """For a module-scoped fixture: run_forked for the cases (of a list or a dict) that this session runs test with
    (parametrized by "case"), all in one go: {case: result}. A planted bug that lets a flag through then trains
    only in the cases picked, not in every case of the list."""
    wanted = [item.callspec.params["case"] for item in request.session.items if item.path == request.node.path
              and getattr(item, "originalname", None) == test and hasattr(item, "callspec")]
    return dict(zip(wanted, run_forked([cases[case] for case in wanted])))


class Runs(dict):
    """{key: run}, each run made by make(key) when a test first asks for it: a test that needs one world size does
    not wait for the others (`make test` runs one of each chapter's)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        self[key] = run = self.make(key)
        return run


def torchrun_script(script, world, args, procs, timeout=240):
    """script under torchrun --standalone on `world` ranks on this machine: (returncode, stdout, stderr)."""
    p = procs.start([*TORCHRUN, "--standalone", "--nproc-per-node", str(world), script, *map(str, args)])
    return procs.wait(p, timeout=timeout)


# scontrol's stand-in where no SLURM is configured (tests/test_slurm.py runs the real one): `scontrol show hostnames
# LIST` as SLURM answers for a plain comma list and for "localhost,gpu[02-03]", SLURM's own error for anything else.
FAKE_SCONTROL = """#!/bin/sh
[ "$1 $2" = "show hostnames" ] || exit 2
case "$3" in
  "localhost,gpu[02-03]") printf 'localhost\\ngpu02\\ngpu03\\n' ;;
  *[[]*|"") echo "scontrol: error: Unable to create hostlist from $3" >&2; exit 1 ;;
  *) echo "$3" | tr ',' '\\n' ;;
esac
"""


def fake_scontrol(folder):
    """A PATH with scontrol's stand-in first (written into folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "scontrol").write_text(FAKE_SCONTROL)
    (folder / "scontrol").chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


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
