"""Runs that tests in several modules need, made once per suite and read by all of them.

`make test-all` runs two pytest workers, and a module-scoped fixture runs once per worker that takes one of its
tests, so chapter 1's reference runs were made twice, and runs two modules both need (chapter 1 on 996 images, the
docs' earlier sections) once per module. `made_once` makes a run in a folder under the suite's own temporary
folder (the one both workers' folders are in), holding a file lock while it does: the other worker waits for it
and then reads the same folder. A run that fails leaves no folder behind, so the next test to need it makes it
again and fails with its own message. The folder belongs to this suite run only; nothing carries over to the next.

Each caller reads the folder and never writes to it (copy it first, as tests/test_docs.py and test_fsdp.py do).
"""
import fcntl
import hashlib
import os
import shutil
import time

import pytest

from support.run import run_script, torchrun_script
from support.same_model import load_state, slice_args
from scripts.plot_curves import read_metrics

WAIT = 1200  # seconds a test waits for the other worker to make a run: longer than any one run here takes


def suite_folder(tmp_path_factory):
    """The temporary folder of this suite run that every worker's folder is in (the worker's own without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def made_once(tmp_path_factory, key, make):
    """The folder make(folder) filled for key, made by the first test of this suite run to ask for it."""
    root = suite_folder(tmp_path_factory) / "made-once"
    root.mkdir(exist_ok=True)
    name = key if len(key) <= 60 and key.replace("-", "").isalnum() else hashlib.sha1(key.encode()).hexdigest()
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        deadline = time.monotonic() + WAIT
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"waited {WAIT} s for the other worker to make {key!r}")
                time.sleep(0.2)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                make(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            done.touch()
    return folder


def run_once(tmp_path_factory, key, run):
    """run(output folder) -> its stdout, made once per suite run under key: (the output folder, the stdout)."""
    folder = made_once(tmp_path_factory, key, lambda folder: (folder / "stdout.txt").write_text(run(folder / "run")))
    return folder / "run", (folder / "stdout.txt").read_text()


def chapter_1(tmp_path_factory, real_data, *flags):
    """single_gpu.py on SLICE with flags, made once per suite run: (folder it saved to, its stdout)."""
    def run(out):
        proc = run_script("single_gpu.py", *slice_args(real_data, out), *flags)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    return run_once(tmp_path_factory, "chapter-1 " + " ".join(map(str, flags)), run)


def chapter_1_reference(tmp_path_factory, real_data, *flags):
    """chapter_1's run as the distributed tests compare against it: (state_dict, stdout, metrics)."""
    out, stdout = chapter_1(tmp_path_factory, real_data, *flags)
    return load_state(out / "model.pth"), stdout, read_metrics(out)


def torchrun_once(tmp_path_factory, key, script, world, args_of, procs):
    """script under torchrun --standalone on `world` ranks with args_of(output folder), made once per suite run under
    key: (the folder it saved to, its stdout)."""
    def run(out):
        code, stdout, err = torchrun_script(script, world, args_of(out), procs)
        assert code == 0, err
        return stdout

    return run_once(tmp_path_factory, key, run)


def streaming_at_2_ranks(tmp_path_factory, real_data, procs):
    """Chapter 11 streaming on SLICE at 2 ranks of one copy each (3 fragments, --overlap 2, inner momentum, an fp32
    wire): the model a machine's pair of ranks must train. (folder, stdout)."""
    flags = ["--sync-every", "6", "--fragments", "3", "--overlap", "2", "--momentum", "0.9", "--wire-dtype", "fp32"]
    return torchrun_once(tmp_path_factory, "diloco streaming fp32 at 2 ranks", "diloco.py", 2,
                         lambda out: [*slice_args(real_data, out), "--timeout", "60", *flags], procs)
