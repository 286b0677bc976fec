"""SLURM for real clusters: a job warned before its time limit requeues itself and resumes; a two-node cluster.

The warning is what `#SBATCH --signal=B:USR1@180` sends: SIGUSR1 to the batch script (`scancel --signal=USR1 --batch`
sends the same, mid-epoch). The two nodes are two network namespaces (measure/netns.py) with their own addresses and
host names, each running a slurmd (tests/support/slurm_cluster.py's TwoNodeSlurm).
"""
import os
import re
import time

import pytest

from scripts.plot_curves import read_metrics
from measure.netns import IFNAME, TwoMachines, why_not
from support.fault_tolerance import needs_torchft
from support.same_model import SAME_MODEL, accuracy_lines, assert_same_curves, load_state, max_abs_diff, slice_args
from support.slurm_jobs import CPU_JOB, CPU_TORCHRUN_JOB, past_torchruns_exit_barrier, submit

# 100 steps of 48 images an epoch (about 2 s here with 2 ranks). The tests act on a line of the log and read from
# the log where the action landed (which epoch a warning stopped, which snapshot a resume found), so a slow machine
# changes which epoch it was, not the outcome.
EPOCHS = 3
REQUEUE_SLICE = ["--train-samples", "4800", "--test-samples", "500", "--batch-size", "48", "--epochs", str(EPOCHS),
                 "--log-every", "25"]
SCRIPTS = [("job.sh", CPU_JOB, {}), ("job_torchrun.sh", CPU_TORCHRUN_JOB, {"NPROC_PER_NODE": "2"})]
IDS = ["srun-tasks", "srun-torchrun"]


def run_args(real_data, out):
    """REQUEUE_SLICE on the real data, saving to out, with a snapshot in out."""
    return [*REQUEUE_SLICE, "--data-dir", str(real_data), "--output", str(out), "--snapshot", str(out / "snap.pt")]


def wait_for_line(slurm, job_id, log_path, line, timeout=120):
    """Block until the job's log holds line (the job still pending or running)."""
    deadline = time.monotonic() + timeout
    while line not in (log_path.read_text() if log_path.exists() else ""):
        state = slurm.job_state(job_id)["state"]
        assert time.monotonic() < deadline and state in ("PENDING", "RUNNING"), (state, log_path.read_text())
        time.sleep(0.1)


@pytest.mark.parametrize("script,opts,env", SCRIPTS, ids=IDS)
def test_a_warned_job_requeues_itself_and_ends_as_if_left_alone(slurm, real_data, tmp_path, script, opts, env):
    straight_id, rc, straight_log = submit(slurm, script, opts, run_args(real_data, tmp_path / "straight"), tmp_path,
                                           env)
    assert rc == 0 and slurm.job_state(straight_id)["state"] == "COMPLETED", straight_log.read_text()

    snapshot = tmp_path / "warned" / "snap.pt"
    job_id, _, log_path = submit(slurm, script, opts, run_args(real_data, tmp_path / "warned"), tmp_path, env,
                                 wait=False)
    wait_for_line(slurm, job_id, log_path, "Epoch 1\n")  # the ranks and job.sh's trap are listening; 2 epochs to go
    signalled = slurm.run("scancel", "--signal=USR1", "--batch", job_id)  # as --signal=B:USR1@180 would, mid-epoch
    assert signalled.returncode == 0, signalled.stderr
    state = slurm.wait_job(job_id, timeout=180)  # the requeued job waits 10 s (cred_expire), then runs
    log = log_path.read_text()
    assert state["state"] == "COMPLETED" and state["fields"]["Restarts"] == "1", (state, log)
    # Both parts in one log (--open-mode=append): stopped after the epoch the warning came in, requeued, resumed.
    stopped = re.findall(rf"^Stopping after epoch (\d) of {EPOCHS} \(SIGUSR1", log, re.M)
    assert len(stopped) == 1 and int(stopped[0]) < EPOCHS, log
    n = int(stopped[0])
    expected = [f"Stopping after epoch {n} of {EPOCHS} (SIGUSR1: the time limit is near); {snapshot} holds it",
                f"{script}: warned before the time limit; requeueing job {job_id}",
                f"Resuming from {snapshot}: {n} of {EPOCHS} epochs done, continuing with epoch {n + 1}",
                "Done!"]
    found = [line for line in log.splitlines() if line in expected]
    assert found == expected, log
    assert [log.count(f"Epoch {e}\n") for e in range(1, EPOCHS + 1)] == [1, 1, 1] and "Traceback" not in log, log
    # The same run as the uninterrupted job: bit for bit at the same thread count, and the same curves.
    diff = max_abs_diff(load_state(tmp_path / "straight" / "model.pth"), load_state(tmp_path / "warned" / "model.pth"))
    print(f"{script}: requeued job vs uninterrupted job, max |difference| = {diff:g}")
    assert diff == 0
    assert_same_curves(read_metrics(tmp_path / "warned"), read_metrics(tmp_path / "straight"))
    assert accuracy_lines(log) == accuracy_lines(straight_log.read_text())


@pytest.mark.parametrize("how", ["cancelled", "preempted"])
def test_a_job_stopped_without_warning_resumes_from_its_last_snapshot(slurm, real_data, tmp_path, how):
    args = run_args(real_data, tmp_path / "run")
    job_id, _, log_path = submit(slurm, "job.sh", CPU_JOB, args, tmp_path, wait=False)
    wait_for_line(slurm, job_id, log_path, "Epoch 2\n")
    if how == "cancelled":
        slurm.run("scancel", job_id)  # SIGTERM to every process, then SIGKILL: no SIGUSR1, so no requeue
        state = slurm.wait_job(job_id, timeout=60)
        assert state["state"] == "CANCELLED" and state["fields"]["Restarts"] == "0", state
        assert "Stopping after" not in log_path.read_text() and "requeueing" not in log_path.read_text()
        job_id, _, log_path = submit(slurm, "job.sh", CPU_JOB, args, tmp_path)  # the user submits it again
        restarts = "0"
    else:
        # What preemption does to a --requeue job under PreemptMode=REQUEUE: SLURM kills it and queues it again.
        slurm.run("scontrol", "requeue", job_id)
        restarts = "1"
    state = slurm.wait_job(job_id, timeout=180)
    log = log_path.read_text()
    # On a failure, the daemons' logs too: who ended which step, and when (once, in CI, a resubmitted job's task 0
    # ended Terminated; not seen again in 56 runs here).
    assert state["state"] == "COMPLETED" and state["fields"]["Restarts"] == restarts, (state, log, slurm._logs())
    # Epoch 1's snapshot was there when the job was stopped; a slow stop may have let epoch 2's be written too.
    resumed = re.findall(rf"^Resuming from {re.escape(str(tmp_path / 'run' / 'snap.pt'))}: (\d) of {EPOCHS} epochs done, "
                         r"continuing with epoch (\d)$", log, re.M)
    assert len(resumed) == 1 and resumed[0][0] in ("1", "2") and int(resumed[0][1]) == int(resumed[0][0]) + 1, log
    assert "Stopping after" not in log and log.count("Done!") == 1 and "Traceback" not in log, log


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A running two-node SLURM cluster (nodea, nodeb). Skips with the reason where it cannot be made (fails in CI)."""
    from support.slurm_cluster import TwoNodeSlurm, ensure_slurm_installed

    reason = why_not() or ensure_slurm_installed()
    if reason:
        pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
    with TwoMachines() as net, TwoNodeSlurm(tmp_path_factory.mktemp("slurm2"), net) as cluster:
        yield cluster


@pytest.mark.parametrize("script,opts,env", [
    ("job.sh", ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0"], {}),
    ("job_torchrun.sh", ["--nodes=2", "--cpus-per-task=1", "--gpus-per-node=0"], {"NPROC_PER_NODE": "1"}),
], ids=IDS)
def test_two_node_job_trains_the_same_model(two_nodes, real_data, reference, tmp_path, script, opts, env):
    env = dict(env, GLOO_SOCKET_IFNAME=IFNAME)  # the interface on the nodes' shared network, as on a real cluster
    job_id, rc, log_path = submit(two_nodes, script, opts, slice_args(real_data, tmp_path / "run"), tmp_path, env)
    log = log_path.read_text()
    state = two_nodes.job_state(job_id)
    assert rc == 0 and state["state"] == "COMPLETED" and state["fields"]["NodeList"] == "nodea,nodeb", log
    # One rank on each node, each under its own host name; rank 0 on the first node, where the ranks met.
    assert sorted(re.findall(r"^\[rank (\d)\] host=(node[ab]) local_rank=0 device=cpu backend=gloo world_size=2 ",
                             log, re.M)) == [("0", "nodea"), ("1", "nodeb")], log
    diff = max_abs_diff(reference[0], load_state(tmp_path / "run" / "model.pth"))
    print(f"{script} on two nodes vs chapter 1: max |difference| = {diff:g}")
    assert diff <= SAME_MODEL
    # torchrun's exit barrier may log a traceback on a node whose agent checked in last, after the job has done
    # its work (docs/troubleshooting.md); it changes nothing the job did, and no other traceback may appear.
    assert accuracy_lines(log) == accuracy_lines(reference[1]) and log.count("Done!") == 1
    assert "Traceback" not in past_torchruns_exit_barrier(log), log


@needs_torchft
def test_a_torchft_job_runs_its_lighthouse_and_a_replica_group_per_node(two_nodes, real_data, reference, tmp_path):
    """scripts/job_ft.sh on two nodes: the lighthouse as a step of its own on nodea, a group on each node; both groups
    in the quorum from step 1 train chapter 1's model, and the job ends (the lighthouse too) once they are done."""
    opts = ["--nodes=2", "--cpus-per-task=1", "--gpus-per-node=0"]
    job_id, rc, log_path = submit(two_nodes, "job_ft.sh", opts, slice_args(real_data, tmp_path / "run"), tmp_path,
                                  {"GLOO_SOCKET_IFNAME": IFNAME})
    log = log_path.read_text()
    state = two_nodes.job_state(job_id)
    assert rc == 0 and state["state"] == "COMPLETED" and state["fields"]["NodeList"] == "nodea,nodeb", log
    assert sorted(re.findall(r"replica group (\d) of at most 2, lighthouse http://nodea:\d+", log)) == ["0", "1"], log
    assert log.count("step 1: quorum of 2 replica groups") == 2, log
    assert log.count("Done! 40 steps committed, 0 retried, 80 group batches") == 2 and "Traceback" not in log, log
    assert sorted(accuracy_lines(log)) == sorted(accuracy_lines(reference[1]) * 2), log
    assert max_abs_diff(reference[0], load_state(tmp_path / "run" / "model.pth")) <= SAME_MODEL
