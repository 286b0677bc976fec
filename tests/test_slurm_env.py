"""Chapter 6 without a cluster: SLURM host lists, the SLURM environment, and the errors outside SLURM."""
import pytest

from common.errors import FatalError, UsageError
from common.ranks import cpu_threads
from common.slurm import check_srun_task, expand_hostlist, slurm_master
from conftest import run_script


@pytest.mark.parametrize("hostlist,hosts", [
    ("node1", ["node1"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("n[9-11]", ["n9", "n10", "n11"]),  # no padding: the width of the low bound
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("rack[1-2]-gpu[1,3]", ["rack1-gpu1", "rack1-gpu3", "rack2-gpu1", "rack2-gpu3"]),
    ("a[1-2]x,b", ["a1x", "a2x", "b"]),
    ("localhost", ["localhost"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-03", "gpu01-03]", "gpu[3-1]", "gpu[a-b]", "n[[1]]", ""])
def test_expand_hostlist_rejects_garbage(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


TASK = dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="1",
            SLURM_JOB_NODELIST="localhost,gpu[02-03]")


@pytest.fixture
def task_env(monkeypatch):
    """An srun task's environment: rank 3 of 4, second task on its node."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "SLURM_CPUS_PER_TASK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in TASK.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def test_the_master_is_the_first_node_on_a_port_from_the_job_id(task_env):
    check_srun_task()  # a good task environment passes
    assert slurm_master() == ("localhost", 24242)  # the same in every task of the job


def test_master_addr_and_port_override(task_env):
    task_env.setenv("MASTER_ADDR", "127.0.0.1")
    task_env.setenv("MASTER_PORT", "29555")
    assert slurm_master() == ("127.0.0.1", 29555)


@pytest.mark.parametrize("change,error,needle", [
    (dict(SLURM_JOB_ID=None), UsageError, "sbatch scripts/job.sh"),
    (dict(SLURM_PROCID=None), UsageError, "SLURM_PROCID not set"),
    (dict(SLURM_STEP_ID=None), UsageError, "srun python ddp_slurm.py"),
    (dict(SLURM_NTASKS="two"), UsageError, "cannot read the SLURM environment"),
    (dict(SLURM_PROCID="4"), UsageError, "SLURM_PROCID=4 is not below SLURM_NTASKS=4"),
    (dict(SLURM_JOB_NODELIST="gpu[01"), UsageError, "cannot read the SLURM environment"),
])
def test_bad_slurm_environments_say_why(task_env, change, error, needle):
    for name, value in change.items():
        if value is None:
            task_env.delenv(name)
        else:
            task_env.setenv(name, value)
    with pytest.raises(error, match=needle.replace("[", r"\[")):
        check_srun_task()


def test_an_unresolvable_head_node_is_named(task_env):
    task_env.setenv("SLURM_JOB_NODELIST", "no-such-node.invalid,gpu1")
    with pytest.raises(FatalError, match="head node 'no-such-node.invalid' .* does not resolve"):
        slurm_master()


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
