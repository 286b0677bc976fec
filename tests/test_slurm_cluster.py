"""The local SLURM cluster the SLURM tests run on: multi-task jobs with srun, failing tasks, clean shutdown."""
import time

import pytest

from support.slurm_cluster import LocalSlurm, _alive


def job_script(tmp_path, *lines):
    """A batch script whose output goes to tmp_path/<job id>.out."""
    return "\n".join(["#!/bin/bash", f"#SBATCH --output={tmp_path}/%j.out", *lines, ""])


@pytest.mark.parametrize("shape", [
    ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"],
    ["--ntasks=1", "--cpus-per-task=2"],
])
def test_srun_starts_every_task(slurm, tmp_path, shape):
    script = job_script(tmp_path, "#SBATCH " + " ".join(shape),
                        "srun bash -c 'echo task $SLURM_PROCID of $SLURM_NTASKS local $SLURM_LOCALID on $SLURM_JOB_NODELIST'")
    job_id, rc = slurm.sbatch(script, cwd=tmp_path, timeout=60)
    out = (tmp_path / f"{job_id}.out").read_text()
    assert rc == 0, out
    ntasks = 2 if "--ntasks-per-node=2" in shape else 1
    assert sorted(out.split("\n")[:-1]) == [f"task {i} of {ntasks} local {i} on localhost" for i in range(ntasks)]
    assert slurm.job_state(job_id)["state"] == "COMPLETED"


def test_failing_task_fails_the_job(slurm, tmp_path):
    script = job_script(tmp_path, "#SBATCH --nodes=1 --ntasks-per-node=2 --cpus-per-task=1",
                        "srun bash -c 'if [ $SLURM_PROCID = 1 ]; then exit 3; fi'")
    job_id, rc = slurm.sbatch(script, cwd=tmp_path, timeout=60)
    state = slurm.job_state(job_id)
    assert (rc, state["state"], state["exit_code"]) == (3, "FAILED", 3)
    assert "task 1: Exited with exit code 3" in (tmp_path / f"{job_id}.out").read_text()


def test_kill_on_bad_exit_stops_the_other_tasks(slurm, tmp_path):
    script = job_script(tmp_path, "#SBATCH --nodes=1 --ntasks-per-node=2 --cpus-per-task=1",
                        "srun --kill-on-bad-exit=1 bash -c 'if [ $SLURM_PROCID = 1 ]; then exit 3; fi; sleep 60'")
    start = time.monotonic()
    job_id, rc = slurm.sbatch(script, cwd=tmp_path, timeout=30)
    assert time.monotonic() - start < 20
    # srun ends with the killed task's status (143 = SIGTERM), not the failing task's 3.
    assert (rc, slurm.job_state(job_id)["state"]) == (143, "FAILED")


def test_stop_leaves_no_process(slurm, tmp_path):
    """A second cluster beside the first (own ports), stopped with a job running: nothing of it survives."""
    other = LocalSlurm(tmp_path / "other")
    other.start()
    try:
        job_id, _ = other.sbatch(job_script(tmp_path, "#SBATCH --ntasks=2", "srun sleep 300"), cwd=tmp_path, wait=False)
        deadline = time.monotonic() + 60  # a busy machine (two test workers) starts it in 20-40 s
        while other.job_state(job_id)["state"] != "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.2)
        ours = {p.pid: None for p in other.procs.values()}
        deadline = time.monotonic() + 30
        # Wait for both tasks' sleeps under the step's slurmstepd, so there is something to clean up.
        while time.monotonic() < deadline and len(other.stray_processes()) < 8:
            time.sleep(0.2)
        ours.update(other.stray_processes())
        seen = f"job {job_id}: {other.job_state(job_id)['fields']}\n{other._logs()}"
    finally:
        other.stop()
    other.stop()  # a second stop is harmless
    assert len(ours) >= 9, seen  # munged, slurmctld, slurmd, slurmscriptd, 2 slurmstepd, script, sruns, sleeps
    assert [pid for pid, started in ours.items() if _alive(pid, started)] == []
    assert slurm.run("sinfo", "-h", "-o", "%T").stdout.strip() == "idle"  # the first cluster is untouched
