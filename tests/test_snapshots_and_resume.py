"""Nothing lost: a run killed, stopped or given more epochs resumes from its --snapshot to the uninterrupted run's
weights (torchrun --max-restarts too); damaged or foreign snapshots are refused in one line; a full or read-only disk
leaves the previous snapshot whole and no half-written file."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.plot_curves import read_metrics
from support.long_runs import Watched, args_for, worker_with_rank
from support.run import BASE_ENV, TORCHRUN, run_script
from support.same_model import load_state, max_abs_diff
from support.shared_runs import torchrun_once

# torchrun --max-restarts as the docs show it: every restart meets in a fresh store (see ddp_launch.py).
ELASTIC_ENV = dict(BASE_ENV, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


@pytest.fixture(scope="module")
def uninterrupted(real_data, tmp_path_factory):
    """single_gpu.py for all 3 epochs in one go: what every interrupted-and-resumed run must end with."""
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = run_script("single_gpu.py", *args_for(real_data, out))
    assert proc.returncode == 0, proc.stderr
    return load_state(out / "model.pth")


def test_single_gpu_killed_mid_epoch_resumes_to_the_same_weights(real_data, uninterrupted, tmp_path, procs):
    snap = tmp_path / "snap.pt"
    cmd = [sys.executable, "single_gpu.py", *args_for(real_data, tmp_path / "run", "--snapshot", snap)]
    run = Watched(procs, cmd)
    run.wait_mid_epoch_2()
    os.kill(run.proc.pid, signal.SIGKILL)
    code, _, _ = run.finish()
    assert code == -signal.SIGKILL and not (tmp_path / "run" / "model.pth").exists()

    code, out, err = Watched(procs, cmd).finish()
    assert code == 0, err
    assert f"Resuming from {snap}: 1 of 3 epochs done, continuing with epoch 2" in out
    assert "Epoch 1\n" not in out and out.count("Epoch 2\n") == 1 and out.count("Epoch 3\n") == 1
    # Bit for bit: the same thread count (support/run.py's BASE_ENV) and the same batches from seed + epoch.
    assert max_abs_diff(uninterrupted, load_state(tmp_path / "run" / "model.pth")) == 0
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    # metrics.jsonl keeps epoch 1 from the killed run, drops its part of epoch 2, and goes on once per step.
    metrics = read_metrics(tmp_path / "run")
    assert [r["epoch"] for r in metrics if r["kind"] == "epoch"] == [1, 2, 3]
    steps = [r["step"] for r in metrics if r["kind"] == "train"]
    assert steps == sorted(set(steps)) and steps[:2] == [1, 51] and len(steps) == 3 * 4


def test_more_epochs_continue_a_finished_run(real_data, uninterrupted, tmp_path):
    """--epochs 2 then --epochs 3 with the same snapshot: the same weights as 3 epochs at once."""
    snap = tmp_path / "snap.pt"
    first = run_script("single_gpu.py", *args_for(real_data, tmp_path / "a", "--snapshot", snap, "--epochs", "2"))
    assert first.returncode == 0, first.stderr
    second = run_script("single_gpu.py", *args_for(real_data, tmp_path / "b", "--snapshot", snap))
    assert second.returncode == 0, second.stderr
    assert "2 of 3 epochs done, continuing with epoch 3" in second.stdout
    assert max_abs_diff(uninterrupted, load_state(tmp_path / "b" / "model.pth")) == 0


def test_torchrun_restarts_a_killed_worker_and_resumes(real_data, tmp_path, tmp_path_factory, procs):
    """torchrun --max-restarts: SIGKILL rank 1 mid-epoch; the group restarts from the last snapshot."""
    straight, _ = torchrun_once(tmp_path_factory, "ddp_launch LONG at 2 ranks", "ddp_launch.py", 2,
                                lambda out: args_for(real_data, out, "--timeout", 60), procs)  # test_partition's too
    base = [*TORCHRUN, "--standalone", "--nproc-per-node", "2"]

    snap = tmp_path / "snap.pt"
    run = Watched(procs, [*base, "--max-restarts", "1", "ddp_launch.py",
                          *args_for(real_data, tmp_path / "run", "--snapshot", snap, "--timeout", "30")], env=ELASTIC_ENV)
    run.wait_mid_epoch_2()
    os.kill(worker_with_rank(run.proc.pid, 1), signal.SIGKILL)
    code, out, err = run.finish()
    assert code == 0, err
    assert f"Resuming from {snap}: 1 of 3 epochs done, continuing with epoch 2" in out
    assert out.count("Done!") == 1
    # 2 ranks add their gradients in one order, so the restarted run is bit for bit the uninterrupted one.
    assert max_abs_diff(load_state(straight / "model.pth"), load_state(tmp_path / "run" / "model.pth")) == 0


def test_sigusr1_to_one_rank_stops_every_rank_after_the_same_epoch(real_data, tmp_path, procs):
    """SLURM's warning may reach one rank first: the ranks sum their flags, so all stop after one epoch, at a snapshot."""
    snap = tmp_path / "snap.pt"
    run = Watched(procs, [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "ddp_launch.py",
                          *args_for(real_data, tmp_path / "run", "--snapshot", snap, "--timeout", "30")])
    run.wait_for("Epoch 2")
    os.kill(worker_with_rank(run.proc.pid, 1), signal.SIGUSR1)  # rank 1 only; rank 0 hears of it from the sum
    code, out, err = run.finish()
    stopped = re.findall(rf"^Stopping after epoch (\d) of 3 \(SIGUSR1: the time limit is near\); {re.escape(str(snap))} "
                         r"holds it$", out, re.M)
    assert code == 0 and len(stopped) == 1 and "Done!" not in out, out + err
    assert torch.load(snap, weights_only=True)["epochs_done"] == int(stopped[0])  # the epoch it stopped after
    assert not (tmp_path / "run" / "model.pth").exists()  # not finished: the requeued job writes it


def test_sigusr1_stops_chapter_1_after_the_epoch_at_its_snapshot(real_data, tmp_path, procs):
    """One process under SLURM (sbatch of chapter 1) is warned the same way: it stops after the epoch, at a snapshot
    that holds it, and writes no model.pth; without --snapshot SIGUSR1 would have ended it."""
    snap = tmp_path / "snap.pt"
    run = Watched(procs, [sys.executable, "single_gpu.py", *args_for(real_data, tmp_path / "run", "--snapshot", snap)])
    run.wait_for("Epoch 2")
    os.kill(run.proc.pid, signal.SIGUSR1)
    code, out, err = run.finish()
    stopped = re.findall(rf"^Stopping after epoch (\d) of 3 \(SIGUSR1: the time limit is near\); {re.escape(str(snap))} "
                         r"holds it$", out, re.M)
    assert code == 0 and len(stopped) == 1 and "Done!" not in out, out + err
    assert torch.load(snap, weights_only=True)["epochs_done"] == int(stopped[0])
    assert not (tmp_path / "run" / "model.pth").exists()


def test_restartable_torchrun_without_a_fresh_store_is_refused(procs):
    """--max-restarts with torchrun's shared store would restart into the dead workers' keys: one line, exit."""
    p = procs.start([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "ddp_launch.py"])
    code, _, err = procs.wait(p, timeout=120)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code != 0 and lines, err
    assert all("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line for line in lines), err


# ---- damaged or foreign snapshots: one line, exit 1, the file left as it was ----

@pytest.fixture(scope="module")
def good_snapshot(real_data, tmp_path_factory):
    """A snapshot after 1 epoch of the LONG run."""
    folder = tmp_path_factory.mktemp("good")
    snap = folder / "snap.pt"
    proc = run_script("single_gpu.py", *args_for(real_data, folder, "--snapshot", snap, "--epochs", "1"))
    assert proc.returncode == 0, proc.stderr
    return snap


def _truncated(good, path):
    path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])


def _weights_file(good, path):
    torch.save(torch.load(good, weights_only=True)["model"], path)


def _other_model(good, path):
    snap = torch.load(good, weights_only=True)
    snap["model"]["linear_relu_stack.4.weight"] = torch.zeros(7, 512)
    torch.save(snap, path)


def _pickled_code(good, path):
    torch.save({"format": "x", "payload": Path("/")}, path)  # a Path pickles as code weights_only refuses


@pytest.mark.parametrize("make,extra,needle", [
    (_truncated, [], "cannot be read"),
    (_pickled_code, [], "cannot be read"),
    (_weights_file, [], "is not a snapshot of this tutorial"),
    (_other_model, [], "holds a different model"),
    (lambda good, path: path.write_bytes(good.read_bytes()), ["--batch-size", "96", "--lr", "0.01"],
     "was made with --batch-size 48 --lr 0.001, this run has --batch-size 96 --lr 0.01"),
    (lambda good, path: path.write_bytes(good.read_bytes()), ["--epochs", "0"], "must be a positive integer"),
], ids=["truncated", "pickled-code", "weights-not-snapshot", "other-model", "other-flags", "bad-flag-first"])
def test_bad_snapshot_is_refused_with_one_line(make, extra, needle, good_snapshot, real_data, tmp_path):
    snap = tmp_path / "snap.pt"
    make(good_snapshot, snap)
    before = snap.read_bytes()
    proc = run_script("single_gpu.py", *args_for(real_data, tmp_path / "run", "--snapshot", snap, *extra))
    assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr
    assert snap.read_bytes() == before and not (tmp_path / "run" / "model.pth").exists()


def test_snapshot_ahead_of_epochs_is_refused(good_snapshot, real_data, tmp_path):
    snap = tmp_path / "snap.pt"
    snap.write_bytes(good_snapshot.read_bytes())
    snapshot = torch.load(snap, weights_only=True)
    snapshot["epochs_done"] = 5
    torch.save(snapshot, snap)
    proc = run_script("single_gpu.py", *args_for(real_data, tmp_path / "run", "--snapshot", snap))
    assert proc.returncode == 1 and "has 5 epochs done, more than --epochs 3" in proc.stderr, proc.stderr


# ---- full and read-only disks: a real small tmpfs (root only; the tests run as root in CI) ----

@pytest.fixture
def small_disk(tmp_path):
    """mount(size, read_only=False) -> a fresh tmpfs folder; all are unmounted at the end."""
    mounted = []

    def mount(size, read_only=False, name="disk"):
        point = tmp_path / name
        point.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            reason = f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}"
            pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def _remount_read_only(point):
    subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)


def test_full_disk_at_save_leaves_no_half_file(real_data, small_disk):
    out = small_disk("1m")  # model.pth is 2.7 MB
    proc = run_script("single_gpu.py", *args_for(real_data, out, "--epochs", "1"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and f"cannot write {out / 'model.pth'}: No space left on device" in proc.stderr
    assert [p.name for p in out.iterdir()] == ["metrics.jsonl"]  # neither model.pth nor a temporary file


def test_full_disk_keeps_the_previous_snapshot(good_snapshot, real_data, small_disk, tmp_path):
    size = good_snapshot.stat().st_size
    disk = small_disk(f"{size * 3 // 2 // 1024}k")  # room for one snapshot, not for a second one beside it
    snap = disk / "snap.pt"
    snap.write_bytes(good_snapshot.read_bytes())
    proc = run_script("single_gpu.py", *args_for(real_data, tmp_path / "run", "--snapshot", snap))
    assert proc.returncode == 1 and "No space left on device" in proc.stderr, proc.stderr
    assert "Resuming from" in proc.stdout and "Traceback" not in proc.stderr
    assert snap.read_bytes() == good_snapshot.read_bytes() and [p.name for p in disk.iterdir()] == ["snap.pt"]


def test_read_only_disk(good_snapshot, real_data, small_disk, tmp_path):
    from common.checkpoint import atomic_save
    from common.cli import FatalError

    disk = small_disk("16m")
    snap = disk / "snap.pt"
    snap.write_bytes(good_snapshot.read_bytes())
    _remount_read_only(disk)
    # At start: the snapshot's folder is checked before any training.
    proc = run_script("single_gpu.py", *args_for(real_data, tmp_path / "run", "--snapshot", snap))
    assert proc.returncode == 1 and "is not writable; pass a writable --snapshot" in proc.stderr, proc.stderr
    assert "Epoch" not in proc.stdout
    # At save time (a disk that turned read-only mid-run): one line, the old file untouched.
    with pytest.raises(FatalError, match="Read-only file system"):
        atomic_save({"w": torch.zeros(3)}, snap)
    assert snap.read_bytes() == good_snapshot.read_bytes()
