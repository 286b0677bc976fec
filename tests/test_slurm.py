"""Chapter 6 on a real SLURM cluster: scripts/job.sh and job_torchrun.sh submitted with sbatch, as a user does."""
import os
import re
import signal
import time
from pathlib import Path

import pytest

from scripts.plot_curves import read_metrics
from support.same_model import accuracy_lines, assert_same_curves, load_state, max_abs_diff, slice_args
from support.slurm_jobs import CPU_JOB, CPU_TORCHRUN_JOB, submit


@pytest.mark.parametrize("script,opts,env", [
    ("job.sh", CPU_JOB, {}),
    ("job_torchrun.sh", CPU_TORCHRUN_JOB, {"NPROC_PER_NODE": "2"}),
], ids=["srun-tasks", "srun-torchrun"])
def test_job_trains_the_same_model(slurm, real_data, reference, tmp_path, script, opts, env):
    job_id, rc, log_path = submit(slurm, script, opts, slice_args(real_data, tmp_path / "run"), tmp_path, env)
    log = log_path.read_text()
    assert rc == 0 and slurm.job_state(job_id)["state"] == "COMPLETED", log
    assert max_abs_diff(reference[0], load_state(tmp_path / "run" / "model.pth")) <= 1e-5
    assert accuracy_lines(log) == accuracy_lines(reference[1])  # over all 500 test images, from 2 shards
    assert_same_curves(read_metrics(tmp_path / "run"), reference[2])
    assert sorted(re.findall(r"^\[rank (\d)\] host=\S+ local_rank=\1 device=cpu backend=gloo world_size=2 threads=1$",
                             log, re.M)) == ["0", "1"]
    assert log.count("Done!") == 1 and "Traceback" not in log


def test_a_torchrun_job_runs_the_chapter_named_first(slurm, real_data, reference, tmp_path):
    """`sbatch scripts/job_torchrun.sh diloco.py ...` runs chapter 11 instead of chapter 3: the node's 2 ranks as one
    DiLoCo copy (--ranks-per-replica 2), which at outer lr 1 without momentum steps to the copy's weights: chapter
    1's model."""
    flags = ["--ranks-per-replica", "2", "--sync-every", "5", "--outer-lr", "1", "--outer-momentum", "0",
             "--wire-dtype", "fp32"]
    job_id, rc, log_path = submit(slurm, "job_torchrun.sh", CPU_TORCHRUN_JOB,
                                  ["diloco.py", *slice_args(real_data, tmp_path / "run"), *flags], tmp_path,
                                  {"NPROC_PER_NODE": "2"})
    log = log_path.read_text()
    assert rc == 0 and slurm.job_state(job_id)["state"] == "COMPLETED", log
    assert "ranks_per_replica=2" in log, log  # diloco.py's Config line
    assert max_abs_diff(reference[0], load_state(tmp_path / "run" / "model.pth")) <= 1e-5
    assert accuracy_lines(log) == accuracy_lines(reference[1]) and log.count("Done!") == 1


def _task_pid(job_id, rank):
    """The pid of the Python process of task `rank` of a job (found by its SLURM environment), or None."""
    wanted = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={rank}".encode()}
    for entry in Path("/proc").iterdir():
        try:
            if b"ddp_slurm.py" in (entry / "cmdline").read_bytes() and wanted <= set((entry / "environ").read_bytes().split(b"\0")):
                return int(entry.name)
        except (OSError, ValueError):
            continue
    return None


def test_a_killed_task_fails_the_job_instead_of_hanging(slurm, real_data, tmp_path):
    args = [*slice_args(real_data, tmp_path / "run"), "--epochs", "200", "--timeout", "30"]
    job_id, _, log_path = submit(slurm, "job.sh", CPU_JOB, args, tmp_path, wait=False)
    deadline = time.monotonic() + 120
    while "Epoch 2\n" not in (log_path.read_text() if log_path.exists() else ""):
        assert time.monotonic() < deadline and slurm.job_state(job_id)["state"] in ("PENDING", "RUNNING")
        time.sleep(0.2)
    pid = _task_pid(job_id, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)  # rank 1 dies mid-training, as on a node that fails
    killed = time.monotonic()
    state = slurm.wait_job(job_id, timeout=60)
    assert state["state"] == "FAILED" and time.monotonic() - killed < 30
    assert "Done!" not in log_path.read_text()


def batch(*lines):
    """A one-node, 2-core batch script running lines (srun steps)."""
    return "\n".join(["#!/bin/bash", "#SBATCH --nodes=1 --ntasks=1 --cpus-per-task=1", *lines, ""])


@pytest.mark.parametrize("step,code,needle", [
    # SLURM_NTASKS says 2 but only one task arrives: rank 0 waits --timeout seconds for rank 1, then says so.
    ("srun bash -c 'SLURM_NTASKS=2 exec python ddp_slurm.py --timeout 5'", 1, "start every rank"),
    # a first node no one can resolve: torch's rendezvous gives up after --timeout, and its line says the address
    ("srun env SLURM_STEP_NODELIST='nosuchnode[1-2]' python ddp_slurm.py --timeout 5", 1, "no rendezvous at nosuchnode1:"),
    ("python ddp_slurm.py", 2, "srun python ddp_slurm.py"),  # no srun: the batch script is no task of a step
], ids=["fewer-tasks-than-SLURM_NTASKS", "unresolvable-head-node", "no-srun"])
def test_bad_slurm_environment_fails_the_job_with_one_line(slurm, tmp_path, step, code, needle):
    start = time.monotonic()
    job_id, rc, log_path = submit(slurm, batch(step), [], [], tmp_path, timeout=90)
    log = log_path.read_text()
    assert rc == code and slurm.job_state(job_id)["state"] == "FAILED", log
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0] and "Traceback" not in log, log
    assert time.monotonic() - start < 60
