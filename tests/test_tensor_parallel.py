"""Chapter 9 through torchrun: tensor parallel (and 2-D with FSDP2) trains chapter 1's model; its snapshots reshard."""
import re

import pytest
import torch

from scripts.plot_curves import read_metrics
from support import REPO
from support.launchers import TORCHRUN_ENV
from support.long_runs import freeze_a_rank_mid_training
from support.run import Runs, run_forked_cases, torchrun_script
from support.same_model import SAME_MODEL, accuracy_lines, assert_same_curves, load_state, max_abs_diff, slice_args

# Measured on torch 2.14.1, 1 thread per rank, SLICE's 40 steps: 3.7e-9 at tp 2, tp 4 and dp 2 x tp 2 (the second
# Linear's products are summed in tp parts by the all-reduce, chapter 1 sums them in one): the DDP chapters' bound.
# A snapshot saved at tp 2 and resumed at dp 2 x tp 2: DCP cuts the slices anew, the same steps follow.
RESHARDED = 1e-6
# 2-D needs FSDP2 on the CPU (torch.cpu.Stream.record_event: torch 2.14.1 has it, 2.6.0 does not; the chapter says so)
FSDP2_HERE = hasattr(torch.cpu.Stream, "record_event")
SHAPES = [(2, 1), (4, 1), *([(4, 2)] if FSDP2_HERE else [])]  # (ranks, --dp): tp 2, tp 4, and 2-D dp 2 x tp 2


def torchrun(world, args, procs, timeout=240):
    """tensor_parallel.py under torchrun --standalone on `world` ranks: (returncode, stdout, stderr)."""
    return torchrun_script("tensor_parallel.py", world, args, procs, timeout)


@pytest.fixture(scope="module")
def tp_runs(real_data, tmp_path_factory, procs_module):
    """tensor_parallel.py on SLICE, each shape run when first asked for: {(ranks, dp): (folder, stdout, stderr)}."""
    def run(shape):
        world, dp = shape
        out = tmp_path_factory.mktemp(f"tp{world}x{dp}")
        code, stdout, err = torchrun(world, [*slice_args(real_data, out), "--dp", dp, "--timeout", "60"], procs_module)
        assert code == 0, err
        return out, stdout, err

    return Runs(run)


@pytest.mark.parametrize("world,dp", SHAPES, ids=[f"{w}ranks-dp{d}" for w, d in SHAPES])
def test_tensor_parallel_trains_the_same_model(world, dp, tp_runs, reference):
    out, log, err = tp_runs[world, dp]
    ref_state, ref_log, ref_metrics = reference
    state = load_state(out / "model.pth")  # a plain full state_dict: chapter 1's keys, whole tensors, on the CPU
    assert state.keys() == ref_state.keys() and all(state[k].shape == ref_state[k].shape for k in state)
    assert max_abs_diff(ref_state, state) <= SAME_MODEL
    assert_same_curves(read_metrics(out), ref_metrics)
    assert accuracy_lines(log) == accuracy_lines(ref_log)
    # the tp ranks of a row are neighbours (rank 0's group: ranks 0 .. tp - 1), as they are on one machine's fast links
    assert (f"Mesh: {dp} data-parallel group(s) (dp) x {world // dp} ranks splitting each layer (tp); rank 0 splits its "
            f"layers with ranks {list(range(world // dp))}") in log
    # the images per second count each image once: the sums run over one rank per batch (ctx.data_group), not tp
    # times over every rank of its row
    for epoch in (r for r in read_metrics(out) if r["kind"] == "epoch"):
        assert epoch["samples_per_second"] * epoch["train_seconds"] == pytest.approx(960, rel=1e-6), epoch
    assert log.count("Done!") == 1 and sorted(re.findall(r"\[rank (\d+)\] host=", log)) == [str(r) for r in range(world)]
    # torch 2.14's two notices for every rank of a 2-D run are hidden (hide_2d_notices, in the chapter)
    assert "returned a view tensor" not in err and "sequential all_gather" not in err and "Traceback" not in err, err


def held_by_plan(tp, dp):
    """The bytes one rank holds under the chapter's plan: the first Linear's rows and the second's columns cut tp
    ways, the second's bias and the last Linear whole; then all of it cut dp ways by FSDP2."""
    numbers = (512 * 784 + 512) // tp + 512 * 512 // tp + 512 + 10 * 512 + 10
    return numbers * 4 // dp


def test_each_rank_holds_the_slices_of_the_plan(tp_runs):
    """The bytes line: the whole model's 669,706 fp32 numbers, and each rank's share as the plan cuts them (a rank that
    held the whole model, an unsplit layer, or FSDP2 left out, shows here)."""
    for (world, dp), (_, log, _) in ((shape, tp_runs[shape]) for shape in SHAPES):
        (line,) = [x for x in log.splitlines() if x.startswith("Parameter bytes:")]
        full, *held = [int(n.replace(",", "")) for n in re.findall(r"(?<![\w])(\d[\d,]{3,})", line)]
        assert full == 669_706 * 4 and held == [held_by_plan(world // dp, dp)] * world, line


@pytest.fixture(scope="module")
def momentum_run(real_data, tmp_path_factory, procs_module):
    """tensor_parallel.py on SLICE at tp 2 with momentum, uninterrupted: (model.pth's state_dict, metrics)."""
    out = tmp_path_factory.mktemp("tp-momentum")
    code, _, err = torchrun(2, [*slice_args(real_data, out), "--momentum", "0.9"], procs_module)
    assert code == 0, err
    return load_state(out / "model.pth"), read_metrics(out)


@pytest.mark.skipif(not FSDP2_HERE, reason="2-D needs FSDP2 on the CPU (torch.cpu.Stream.record_event)")
def test_a_snapshot_saved_at_tp_2_resumes_in_2d(momentum_run, real_data, tmp_path, procs):
    """Epoch 1 at tp 2 with --snapshot, epoch 2 at dp 2 x tp 2: DCP cuts the weights and the momentum anew, and the
    run ends where the uninterrupted one does."""
    out, snap = tmp_path / "run", tmp_path / "snap"
    args = [*slice_args(real_data, out), "--momentum", "0.9", "--snapshot", snap, "--timeout", "60"]
    code, _, err = torchrun(2, [*args, "--epochs", "1"], procs)
    assert code == 0, err
    code, log, err = torchrun(4, [*args, "--dp", "2"], procs)
    assert code == 0, err
    assert "Resuming from" in log and "(saved by 2 ranks, loaded by 4)" in log and log.count("Epoch 2\n") == 1, log
    diff = max_abs_diff(momentum_run[0], load_state(out / "model.pth"))
    print(f"saved at tp 2, resumed at dp 2 x tp 2, against the uninterrupted run: max |difference| = {diff:g}")
    assert diff <= RESHARDED
    assert_same_curves(read_metrics(out), momentum_run[1])


BAD_FLAGS = {
    "dp-3-of-2": (["--dp", "3"], TORCHRUN_ENV, "--dp 3 does not divide the 2 ranks"),
    "fp16": (["--precision", "fp16"], TORCHRUN_ENV, "tensor_parallel.py trains in --precision fp32 or bf16"),
    "batch-63": (["--batch-size", "63", "--dp", "2"], TORCHRUN_ENV, "split evenly over 2"),
    "dp-0": (["--dp", "0"], TORCHRUN_ENV, "argument --dp: must be a positive integer"),
    "nprocs": (["--nprocs", "2"], TORCHRUN_ENV, "unrecognized arguments"),
    "no-torchrun": ([], {}, "start this script with torchrun"),
}


@pytest.fixture(scope="module")
def bad_flag_runs(request):
    cases = {name: ("tensor_parallel.py", flag, env) for name, (flag, env, _) in BAD_FLAGS.items()}
    return run_forked_cases(request, "test_bad_flag_exits_2_with_one_line", cases)


@pytest.mark.parametrize("case", [
    pytest.param(name, marks=pytest.mark.skipif(name == "batch-63" and not FSDP2_HERE,
                                                reason="--dp 2 is refused first without FSDP2 on the CPU"))
    for name in BAD_FLAGS])
def test_bad_flag_exits_2_with_one_line(case, bad_flag_runs):
    needle, proc = BAD_FLAGS[case][2], bad_flag_runs[case]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_three_ranks_cannot_split_the_hidden_layer(real_data, tmp_path, procs):
    """tp 3 does not divide 512 hidden units: the one line, before any rendezvous (torchrun stops the other ranks as
    soon as the first one exits, so one, two or three of them print it)."""
    code, out, err = torchrun(3, [*slice_args(real_data, tmp_path), "--timeout", "30"], procs, timeout=120)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code != 0 and out == "", err
    assert 1 <= len(lines) <= 3 and all("do not split the 512 hidden units evenly" in line for line in lines), err


def test_the_chapter_shows_every_tensor_parallel_line():
    """The lesson is in the file, in the order a reader follows it; chapter 7 is the diff."""
    source = (REPO / "tensor_parallel.py").read_text()
    train = source.split("def train(cfg, ctx):")[1]
    calls = ["DeviceMesh.from_group(", 'mesh_dim_names=("dp", "tp")', "DistributedSampler(train_set, num_replicas=cfg.dp",
             'parallelize_module(model.linear_relu_stack, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})',
             'fully_shard(layer, mesh=mesh["dp"]', 'fully_shard(model, mesh=mesh["dp"]', "torch.optim.SGD(",
             "set_epoch(", "get_model_state_dict(", "if ctx.is_main:"]
    where = [train.find(call) for call in calls]
    assert -1 not in where and where == sorted(where), list(zip(calls, where))


def test_each_layer_shows_what_the_plan_made_of_it(tp_runs):
    """The chapter prints each weight's DTensor placements and the slice rank 0 holds: at tp 2 the first Linear cut by
    its rows, the second by its columns, the last replicated; in 2-D each also cut by FSDP2 on dp."""
    _, log, _ = tp_runs[2, 1]
    assert "linear_relu_stack.0.weight: [512, 784] (Shard(dim=0),) on ('tp',), rank 0 holds [256, 784]" in log, log
    assert "linear_relu_stack.2.weight: [512, 512] (Shard(dim=1),) on ('tp',), rank 0 holds [512, 256]" in log
    assert "linear_relu_stack.4.weight: [10, 512] (Replicate(),) on ('tp',), rank 0 holds [10, 512]" in log
    if FSDP2_HERE:
        _, log, _ = tp_runs[4, 2]
        assert "linear_relu_stack.2.weight: [512, 512] (Shard(dim=0), Shard(dim=1)) on ('dp', 'tp'), rank 0 holds " \
               "[256, 256]" in log, log


@pytest.mark.skipif(not FSDP2_HERE, reason="2-D needs FSDP2 on the CPU")
def test_2d_with_uneven_test_shards_runs_as_many_test_batches_on_every_row(real_data, tmp_path, procs):
    """2001 test images over 2 rows: shards of 1001 and 1000. Every forward is collective, so both rows must run as
    many test batches: sized from the largest shard (2 of 501), not a fixed 1000 (2 batches against 1)."""
    code, out, err = torchrun(4, [*slice_args(real_data, tmp_path), "--dp", "2", "--epochs", "1", "--test-samples",
                                  "2001", "--timeout", "30"], procs, timeout=180)
    assert code == 0 and "Accuracy:" in out, err


@pytest.mark.parametrize("flags", [["--precision", "bf16"], ["--accum-steps", "2"], ["--compile"]],
                         ids=["bf16", "accum-2", "compile"])
def test_the_training_flags_run_under_tensor_parallel(flags, real_data, reference, tmp_path, procs):
    """The flags docs/tensor_parallel.md says chapter 9 takes, at tp 2: --accum-steps and --compile train chapter 1's
    model; bf16 learns as much as fp32 (its losses are bf16's, the weights cannot tell)."""
    code, out, err = torchrun(2, [*slice_args(real_data, tmp_path), *flags, "--timeout", "120"], procs, timeout=300)
    assert code == 0, err
    if flags[0] == "--precision":
        fp32, bf16 = (float(re.findall(r"Accuracy: ([\d.]+)%", log)[-1]) for log in (reference[1], out))
        assert abs(fp32 - bf16) <= 1.0, (fp32, bf16)
    else:
        assert max_abs_diff(reference[0], load_state(tmp_path / "model.pth")) <= SAME_MODEL


@pytest.mark.skipif(not FSDP2_HERE, reason="2-D needs FSDP2 on the CPU")
def test_a_2d_rank_whose_peer_stops_answering_ends_within_the_timeout(real_data, tmp_path, procs):
    """Rank 2 (row 1) frozen (SIGSTOP) mid-training at --dp 2: rank 0, in its row's all-gather or all-reduce with it,
    waits no longer than --timeout and stops with one line. The mesh's groups are the chapter's own, each made with
    the timeout: a device mesh's default groups wait torch's default, 30 minutes on gloo."""
    seconds, code, out, err = freeze_a_rank_mid_training(procs, "tensor_parallel.py", 4,
                                                         [*slice_args(real_data, tmp_path), "--dp", "2"], tmp_path,
                                                         frozen=2, grace=30, first_test_within=180)
    print(f"rank 0 ended {seconds:.1f} s after rank 2 froze (--timeout 10)")
    assert code != 0 and "Done!" not in out and seconds >= 9, (seconds, err)
    assert len([line for line in err.splitlines() if line.startswith("error: [rank 0]")]) == 1, err
