"""Jobs submitted to the test cluster (support/slurm_cluster.py) as a user submits them: sbatch from the repository
root, with the CPU-only overrides the README gives."""
import os
import sys
from pathlib import Path

from support import REPO
from support.run import no_abort_at_exit

# The CPU-only overrides README gives: one node, 2 tasks of one core each, no GPUs.
CPU_JOB = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0"]
CPU_TORCHRUN_JOB = ["--nodes=1", "--cpus-per-task=2", "--gpus-per-node=0"]


def job_env(**extra):
    """What the submitting shell has: the venv's python and torchrun on PATH, no download attempts."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return dict(PATH=path, FASHION_MNIST_OFFLINE="1", PYTHONUNBUFFERED="1", **extra)


def submit(slurm, script, opts, args, tmp_path, env=None, timeout=240, wait=True):
    """sbatch script (a file in scripts/ or a script's text) from the repository root; (job id, rc, log path)."""
    if "\n" not in script:
        script = REPO / "scripts" / script
    job_id, rc = slurm.sbatch(script, *opts, f"--output={tmp_path}/%j.out", script_args=args, cwd=REPO,
                              env=job_env(**(env or {})), timeout=timeout, wait=wait)
    assert job_id is not None, f"sbatch refused the job: {rc}"
    log = tmp_path / f"{job_id}.out"
    if wait and log.exists():
        no_abort_at_exit(log.read_text())
    return job_id, rc, log


def past_torchruns_exit_barrier(log):
    """log without torchrun's own `Error waiting on exit barrier` record, its traceback included. Once every node's
    agent has checked in to that barrier, the torchrun that hosts the rendezvous store may exit and take the store with
    it before the last agent to check in has asked for its answer (docs/troubleshooting.md): the workers have ended,
    and so does the job, with 0. Any other traceback stays in the log."""
    heads = {head + "] " for head, _, text in (line.partition("] ") for line in log.splitlines())
             if "Error waiting on exit barrier" in text and "elastic/agent/server/api.py:" in head}
    return "\n".join(line for line in log.splitlines() if not any(line.startswith(head) for head in heads))
