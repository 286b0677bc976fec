"""--comm-hook: torch's DDP communication hooks in the DDP chapters, PowerSGD's state in --snapshot, and the refusals.

What each hook sends on the wire is counted by tests/test_scaling.py (the bytes per step on the shaped link).
"""
import pytest

from conftest import load_state, max_abs_diff, run_forked_cases
from test_ddp import _accuracy_lines, launch

RESUMED = 1e-6  # a resumed run against the uninterrupted one: the same steps in the same order (measured 7.5e-9)


def train(kind, world, real_data, out, procs, *flags):
    codes, log, err = launch(kind, world, real_data, out, procs, extra=flags)
    assert set(codes) == {0}, err
    return log


@pytest.mark.parametrize("kind,hook", [("mp", "powersgd"), ("torchrun", "powersgd:2:5")])
def test_powersgd_resumes_as_the_uninterrupted_run(kind, hook, real_data, tmp_path, procs):
    """PowerSGD's residuals (each rank's own), factors, step count and random state go into --snapshot: epoch 2 of a
    resumed run is epoch 2 of the uninterrupted one. A new DDP's first step holds its bucket in the model's order,
    later steps in the reverse: the residuals kept in the one are put in the order of the other."""
    straight = train(kind, 2, real_data, tmp_path / "straight", procs, "--comm-hook", hook)
    snap = ["--comm-hook", hook, "--snapshot", str(tmp_path / "snap.pt")]
    train(kind, 2, real_data, tmp_path / "resumed", procs, *snap, "--epochs", "1")
    log = train(kind, 2, real_data, tmp_path / "resumed", procs, *snap)
    assert "Resuming from" in log and "1 of 2 epochs done" in log, log
    assert max_abs_diff(load_state(tmp_path / "straight" / "model.pth"),
                        load_state(tmp_path / "resumed" / "model.pth")) <= RESUMED
    assert _accuracy_lines(log)[-1] == _accuracy_lines(straight)[-1]


def each_rank_line_says(err, world, needle):
    """Every rank reads the snapshot itself, so each may print the line, tagged [rank N]; mp.spawn stops the others
    as soon as one has failed, so at least one does. Each says needle, and nothing prints a traceback."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    ranks = [line[:15] for line in lines]
    assert lines and len(set(ranks)) == len(ranks), err
    assert set(ranks) <= {f"error: [rank {r}]" for r in range(world)}, err
    assert all(needle in line for line in lines) and "Traceback" not in err, err


def test_powersgd_snapshot_at_another_world_size_is_one_line_per_rank(real_data, tmp_path, procs):
    snap = ["--comm-hook", "powersgd", "--snapshot", str(tmp_path / "snap.pt"), "--batch-size", "48"]
    train("mp", 2, real_data, tmp_path / "run", procs, *snap, "--epochs", "1")
    codes, _, err = launch("mp", 3, real_data, tmp_path / "run", procs, extra=snap)
    assert codes == [1], err
    each_rank_line_says(err, 3, f"snapshot {tmp_path / 'snap.pt'} holds PowerSGD's residuals of 2 ranks, this run has 3")


def test_resuming_with_another_hook_is_one_line_per_rank(real_data, tmp_path, procs):
    snap = ["--snapshot", str(tmp_path / "snap.pt")]
    train("mp", 2, real_data, tmp_path / "run", procs, *snap, "--epochs", "1")
    codes, _, err = launch("mp", 2, real_data, tmp_path / "run", procs, extra=[*snap, "--comm-hook", "bf16"])
    assert codes == [1], err
    each_rank_line_says(err, 2, "was made with --comm-hook none, this run has --comm-hook bf16")


REFUSED = {
    "not-ddp": (["single_gpu.py", "--comm-hook", "bf16"], "unrecognized arguments: --comm-hook bf16; --comm-hook is a "
                "flag of the DDP chapters (ddp_launch.py, ddp_mp.py, ddp_tcp_manual.py, ddp_slurm.py) only"),
    "fsdp": (["fsdp.py", "--comm-hook", "powersgd"], "--comm-hook is a flag of the DDP chapters"),
    "rank-0": (["ddp_mp.py", "--comm-hook", "powersgd:0"],
               "argument --comm-hook: must be none, bf16, fp16 or powersgd[:RANK[:START]]"),
    "start-1": (["ddp_launch.py", "--comm-hook", "powersgd:1:1"], "(RANK >= 1, START >= 2; e.g. powersgd:4), got "
                "powersgd:1:1"),
}


@pytest.fixture(scope="module")
def refused_runs(request):
    return run_forked_cases(request, "test_a_hook_that_cannot_work_is_one_line",
                            {case: (argv[0], argv[1:], {}) for case, (argv, _) in REFUSED.items()})


@pytest.mark.parametrize("case", REFUSED)
def test_a_hook_that_cannot_work_is_one_line(case, refused_runs):
    proc = refused_runs[case]
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert REFUSED[case][1] in proc.stderr, proc.stderr
