"""The DDP chapters through their real launchers train chapter 1's model: mp.spawn, torchrun, tcp:// and file:// by
hand, srun's variables, DDP by hand and chapter 11b without a hook, at world sizes 1-3, at any --seed, and as two torchrun nodes on one machine;
the evaluation is exact."""
import re

import pytest

from scripts.plot_curves import read_metrics
from support.launchers import launch
from support.ports import free_port
from support.run import BASE_ENV, TORCHRUN, run_script, torchrun_script
from support.same_model import (SAME_MODEL, accuracy_lines, assert_same_curves, load_state, max_abs_diff,
                                printed_test_losses, slice_args)

# srun-env: ddp_slurm.py's two tasks started with the variables srun gives them, where no SLURM is installed (`make
# test`); tests/test_slurm.py submits the real job to a real cluster.
CASES = [("mp", 1), ("mp", 2), ("mp", 3), ("torchrun", 1), ("torchrun", 2), ("torchrun", 3),
         ("tcp", 2), ("tcp", 3), ("file", 2), ("file", 3), ("srun-env", 2), ("by-hand", 2), ("by-hand", 3),
         ("hooks", 2)]  # hooks: chapter 11b without a hook (--comm-hook none) is chapter 3


@pytest.mark.parametrize("kind,world", CASES, ids=[f"{k}-{w}" for k, w in CASES])
def test_ddp_trains_the_same_model(kind, world, real_data, reference, tmp_path, procs):
    codes, out, err = launch(kind, world, real_data, tmp_path / "run", procs)
    assert codes == [0] * len(codes), err
    ref_state, ref_log, ref_metrics = reference
    assert max_abs_diff(ref_state, load_state(tmp_path / "run" / "model.pth")) <= SAME_MODEL
    assert_same_curves(read_metrics(tmp_path / "run"), ref_metrics)  # rank 0's metrics.jsonl: the same curve
    # Exact evaluation: the same accuracy over all 500 test images, whatever the world size.
    assert accuracy_lines(out) == accuracy_lines(ref_log)
    assert printed_test_losses(out) == pytest.approx(printed_test_losses(ref_log), abs=2e-6)
    assert "[  336/  960]" in out  # loss lines count global samples: batch 7 * global batch 48
    # Rank 0 alone prints the tutorial lines; each rank prints one setup line.
    assert out.count("Epoch 1\n") == 1 and out.count("Done!") == 1
    assert sorted(re.findall(r"\[rank (\d+)\] host=", out)) == [str(r) for r in range(world)]
    assert "Traceback" not in err and "terminate called" not in err
    if kind == "file":
        assert not (tmp_path / "run.rdzv").exists(), "the rendezvous file is removed at the end"


# Every rank seeded apart (rank r draws its first weights from seed + r), as a rank whose seed or model differed would:
# only the wrap's copy of rank 0's weights (DDP's constructor, chapter 3b's broadcast) brings them back together.
SEEDED_APART = "import os, torch\nseed = torch.manual_seed\ntorch.manual_seed = lambda s: seed(s + int(os.environ['RANK']))\n"


@pytest.mark.parametrize("script", ["ddp_launch.py", "ddp_by_hand.py"])
def test_every_rank_starts_from_rank_0s_weights(script, real_data, reference, tmp_path, procs):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SEEDED_APART)
    p = procs.start([*TORCHRUN, "--standalone", "--nproc-per-node", "2", script,
                     *slice_args(real_data, tmp_path / "run"), "--timeout", "60"], env=dict(BASE_ENV, PYTHONPATH=str(shim)))
    code, out, err = procs.wait(p)
    assert code == 0, err
    assert max_abs_diff(reference[0], load_state(tmp_path / "run" / "model.pth")) <= SAME_MODEL


SEED = 7  # any seed but the default: a chapter whose sampler or weights ignored --seed would still pass at 0


@pytest.fixture(scope="module")
def seeded_reference(real_data, tmp_path_factory):
    """Chapter 1 at --seed 7: (state_dict, stdout)."""
    out = tmp_path_factory.mktemp("single-seed")
    proc = run_script("single_gpu.py", *slice_args(real_data, out), "--seed", SEED)
    assert proc.returncode == 0, proc.stderr
    return load_state(out / "model.pth"), proc.stdout


SEEDED = ["torchrun", "mp", "tcp", "srun-env", "fsdp.py", "tensor_parallel.py", "pipeline.py"]


@pytest.mark.parametrize("kind", SEEDED)
def test_another_seed_trains_chapter_1s_model_at_that_seed(kind, real_data, seeded_reference, tmp_path, procs):
    """Every launcher (and the torchrun chapters with their own samplers) at --seed 7: chapter 1's model at seed 7, so
    both the initial weights and every epoch's shuffle come from --seed (at 0 a chapter that ignored it would pass)."""
    if kind.endswith(".py"):
        code, out, err = torchrun_script(kind, 2, [*slice_args(real_data, tmp_path / "run"), "--seed", SEED], procs)
        codes = [code]
    else:
        codes, out, err = launch(kind, 2, real_data, tmp_path / "run", procs, extra=["--seed", str(SEED)])
    assert set(codes) == {0}, err
    state, log = seeded_reference
    assert max_abs_diff(state, load_state(tmp_path / "run" / "model.pth")) <= SAME_MODEL
    assert accuracy_lines(out) == accuracy_lines(log) and f"seed={SEED}" in out


def test_two_torchrun_nodes_on_one_machine(real_data, reference, tmp_path, procs):
    """Two launchers as two nodes (node ranks 0 and 1) on 127.0.0.1 train together."""
    port = free_port()
    nodes = [procs.start([*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(n),
                          "--master-addr", "127.0.0.1", "--master-port", str(port), "ddp_launch.py",
                          *slice_args(real_data, tmp_path / "run"), "--timeout", "60"]) for n in range(2)]
    results = [procs.wait(p) for p in nodes]
    assert [r[0] for r in results] == [0, 0], results[0][2] + results[1][2]
    assert max_abs_diff(reference[0], load_state(tmp_path / "run" / "model.pth")) <= SAME_MODEL
    assert accuracy_lines(results[0][1]) == accuracy_lines(reference[1])
