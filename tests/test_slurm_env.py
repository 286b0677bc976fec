"""Chapter 6 without a cluster: the SLURM environment, the job's first node, and the errors outside SLURM."""
import json
import subprocess
import sys

import pytest

from common.cli import FatalError
from common.ranks import cpu_threads
from ddp_slurm import first_node
from support import REPO
from support.launchers import fake_scontrol
from support.run import BASE_ENV, run_script

TASK = dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="1",
            SLURM_JOB_NODELIST="localhost,gpu[02-03]", SLURM_STEP_NODELIST="localhost,gpu[02-03]")


@pytest.fixture
def task_env(monkeypatch, tmp_path):
    """An srun task's environment: rank 3 of 4, second task on its node; scontrol's stand-in first on PATH."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "SLURM_CPUS_PER_TASK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in TASK.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PATH", fake_scontrol(tmp_path / "bin"))
    return monkeypatch


# An init_process_group that prints what the chapter asked it for, and ends the process there.
RECORD_INIT = """import json, os, torch.distributed
def init_process_group(backend=None, **kwargs):
    print("init " + json.dumps(dict(init_method=kwargs["init_method"], rank=kwargs["rank"],
                                    world_size=kwargs["world_size"])), flush=True)
    os._exit(0)
torch.distributed.init_process_group = init_process_group
"""


def _rendezvous(tmp_path, **env):
    """What ddp_slurm.py, in this environment, passes to init_process_group."""
    (tmp_path / "sitecustomize.py").write_text(RECORD_INIT)
    proc = subprocess.run([sys.executable, "ddp_slurm.py", "--device", "cpu"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=dict(BASE_ENV, PYTHONPATH=str(tmp_path), **env))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.split("init ", 1)[1])


def test_the_ranks_meet_on_the_first_node_on_a_port_from_the_job_id(tmp_path):
    env = dict(TASK, PATH=fake_scontrol(tmp_path / "bin"))
    assert _rendezvous(tmp_path, **env) == dict(init_method="tcp://localhost:24242", rank=3, world_size=4)
    assert _rendezvous(tmp_path, **env, MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")["init_method"] == \
        "tcp://127.0.0.1:29555"  # both override


def test_a_step_on_some_of_the_jobs_nodes_meets_on_its_own_first_node(tmp_path):
    """A job on localhost and gpu[02-03] whose srun step runs on gpu02 and gpu03 only (srun --nodes 2 --relative 1):
    its ranks meet on gpu02, where its rank 0 is; nobody listens on the job's first node for them."""
    env = dict(TASK, SLURM_STEP_NODELIST="gpu02,gpu03", PATH=fake_scontrol(tmp_path / "bin"))
    assert _rendezvous(tmp_path, **env)["init_method"] == "tcp://gpu02:24242"


def test_the_first_node_is_slurms_expansion(task_env):
    assert first_node("localhost,gpu[02-03]") == "localhost"


def test_a_host_list_scontrol_cannot_read_is_named(task_env):
    with pytest.raises(FatalError, match=r"`scontrol show hostnames gpu\[01` failed \(scontrol: error: Unable to create"):
        first_node("gpu[01")


def test_without_scontrol_master_addr_is_named(task_env):
    task_env.setenv("PATH", "/nonexistent")
    with pytest.raises(FatalError, match="cannot run `scontrol show hostnames`.*set MASTER_ADDR"):
        first_node("localhost")


def test_threads_follow_the_cores_this_rank_may_use(monkeypatch):
    for name in ("SLURM_CPUS_PER_TASK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert cpu_threads(4) == 4  # four ranks share this machine's 16 cores
    assert cpu_threads(1) == 16  # one rank per machine gets all of them, however many machines
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "3")
    assert cpu_threads(4) == 3  # srun gave this task 3 cores of its own
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")
    assert cpu_threads(2) == 4  # torchrun's 2 workers share the 8 cores of its task


def test_outside_slurm_says_how_to_submit():
    proc = run_script("ddp_slurm.py", "--epochs", "1", env={"SLURM_JOB_ID": ""})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "sbatch scripts/job.sh" in proc.stderr and "Traceback" not in proc.stderr


# ---- The batch scripts' signal handling, with a stand-in srun on PATH (no cluster needed) ----

FAKE_SRUN = """#!/bin/bash
# srun's stand-in: drop srun's own options, then run the task as srun would, in the foreground.
while [ "${1#-}" != "$1" ]; do shift; done
echo started > "$STARTED"
exec "$@"
"""


# coreutils 8.30's env (RHEL/Rocky 8): no --ignore-signal.
ENV_8_30 = """#!/bin/bash
case "$1" in --ignore-signal*) echo "env: unrecognized option '$1'" >&2; exit 125 ;; esac
exec /usr/bin/env "$@"
"""


def _batch_script(procs, tmp_path, script, task, old_env=False, args=(), **job):
    """Start scripts/SCRIPT as the batch shell would, with an srun that runs `task` (a bash snippet) as its task;
    job: more of the batch script's environment (SLURM_CPUS_PER_TASK, ...). procs kills it and its steps at the
    test's end, should it still run (a script that waits for good)."""
    import os

    from support import REPO

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("python", f"#!/bin/bash\n{task}\n"), ("torchrun", f"#!/bin/bash\n{task}\n"),
                       ("scontrol", "#!/bin/bash\necho node1\n"), ("torchft_lighthouse", "#!/bin/bash\nexec sleep 60\n"),
                       *((("env", ENV_8_30),) if old_env else ())):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", STARTED=str(tmp_path / "started"),
               SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node1", SLURM_NNODES="1", **job)
    for name in ("OMP_NUM_THREADS", "SRUN_CPUS_PER_TASK", "NPROC_PER_NODE"):
        if name not in job:
            env.pop(name, None)
    proc = procs.start(["bash", str(REPO / "scripts" / script), *args], cwd=tmp_path, env=env)
    return proc, tmp_path / "started"


def _wait_for(path, proc, seconds=20):
    import time

    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


@pytest.mark.parametrize("script,task", [
    ("job.sh", "exec sleep 30"),  # a task without a handler: SIGUSR1's default action ends it, status 138
    ("job_torchrun.sh", "sleep 2; exit 138"),  # torchrun ignores the signal; here the step ends 138 all the same
])
def test_a_step_that_ends_with_138_ends_the_job_with_its_status(script, task, tmp_path, procs):
    """The warning reaches the batch script, which passes it on; the step then ends with status 138 (128 + SIGUSR1).
    The script must end with that status, not wait again for a step that is gone (which gives 127)."""
    import signal
    import subprocess
    import time

    proc, started = _batch_script(procs, tmp_path, script, task)
    _wait_for(started, proc)
    # The step has started, but the script may not have its pid yet (`step=$!` comes after the fork, and a warning
    # before it is remembered, not passed on): warn again every half second until the script has passed one on and
    # ended. It must end with the step's 138 all the same.
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(signal.SIGUSR1)
        try:
            proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
    out, err = proc.communicate(timeout=5)
    assert proc.returncode == 138, (out, err)
    assert "requeueing" not in out


def test_torchrun_starts_with_the_warning_ignored_without_coreutils_8_31(tmp_path, procs):
    """job_torchrun.sh's torchrun must ignore SIGUSR1 (its agent has no handler and would die), on any cluster:
    `env --ignore-signal` (coreutils 8.31) is not on RHEL 8's 8.30. The stand-in torchrun reports its ignored
    signals (SigIgn in /proc/self/status: bit 9 is SIGUSR1)."""
    proc, _ = _batch_script(procs, tmp_path, "job_torchrun.sh", "grep SigIgn /proc/self/status; exit 0", old_env=True)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    mask = int(out.split("SigIgn:")[1].split()[0], 16)
    assert mask & (1 << 9), out


@pytest.mark.parametrize("script", ["job.sh", "job_torchrun.sh"])
def test_the_warning_trap_is_set_before_the_step_starts(script):
    """A SIGUSR1 that reached the script before its trap would end it (the default action): the trap comes first."""
    from support import REPO

    lines = (REPO / "scripts" / script).read_text().splitlines()
    trap = next(i for i, line in enumerate(lines) if line.startswith("trap ") and line.endswith(" USR1"))
    step = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert trap < step


SHOW_CORES = 'echo "cores=$SRUN_CPUS_PER_TASK threads=$OMP_NUM_THREADS"'


@pytest.mark.parametrize("script,job,threads", [
    ("job.sh", {}, "8"),  # a task per GPU: its 8 cores, 8 threads
    ("job_torchrun.sh", {"NPROC_PER_NODE": "4"}, "2"),  # torchrun's 4 workers share the task's 8 cores
    ("job_torchrun.sh", {"SLURM_GPUS_ON_NODE": "2"}, "4"),  # a worker per GPU (NPROC_PER_NODE unset): 2 of them
    ("job_ft.sh", {}, ""),  # one rank per group: ddp_ft.py takes the task's cores itself
], ids=["job.sh", "job_torchrun.sh-4-workers", "job_torchrun.sh-a-worker-per-gpu", "job_ft.sh"])
def test_each_step_asks_for_the_jobs_cores_per_task(script, job, threads, tmp_path, procs):
    """Since Slurm 22.05 srun does not take --cpus-per-task from the job: a step started without SRUN_CPUS_PER_TASK
    gives each task one core (bound to it where the cluster binds tasks: task/affinity, task/cgroup), while the task
    runs OMP_NUM_THREADS of them. Every batch script passes the job's 8 on to its steps, and sets the threads each
    process starts with. (The local test cluster has 2 cores, too few to show the binding itself.)"""
    proc, _ = _batch_script(procs, tmp_path, script, SHOW_CORES, SLURM_CPUS_PER_TASK="8", **job)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"cores=8 threads={threads}\n" in out, out
