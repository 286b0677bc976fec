"""Chapter 10 through torchrun: 2 and 3 pipeline stages, GPipe and 1F1B, train chapter 1's model; snapshots recut."""
import re

import pytest

from pipeline import pipelining_missing
from scripts.plot_curves import read_metrics
from support import REPO
from support.launchers import TORCHRUN_ENV
from support.run import Runs, run_forked_cases, torchrun_script
from support.long_runs import freeze_a_rank_mid_training
from support.same_model import (SAME_MODEL, accuracy_lines, assert_same_curves, load_state, max_abs_diff,
                                printed_test_losses, slice_args)
from support.shared_runs import chapter_1

pytestmark = pytest.mark.skipif(bool(pipelining_missing()), reason=str(pipelining_missing()))  # torch 2.6: refused
# Measured on torch 2.14.1, 1 thread per rank: 3.7e-9 at 2 and 3 stages, both schedules, on SLICE and on 996 images
# (a short last step, padded): the micro-batches' gradients are summed in 4 parts where chapter 1 has one batch.
# A snapshot saved by 2 stages and resumed by 3 (momentum 0.9): measured 0.0, the same steps on the same numbers.
RESHARDED = 1e-6
CASES = [(2, "gpipe"), (2, "1f1b"), (3, "gpipe"), (3, "1f1b")]
SHORT_STEP = ["--train-samples", "996"]  # 20 steps of 48 and one of 36: padded to 48, its padding counts nothing
# The weights each stage holds: 2 stages cut after the first ReLU, 3 after each ReLU (pipeline.py's CUTS).
LINEAR_BYTES = [(784 * 512 + 512) * 4, (512 * 512 + 512) * 4, (512 * 10 + 10) * 4]
HELD = {2: [LINEAR_BYTES[0], LINEAR_BYTES[1] + LINEAR_BYTES[2]], 3: LINEAR_BYTES}


def torchrun(world, args, procs, timeout=240):
    """pipeline.py under torchrun --standalone on `world` ranks: (returncode, stdout, stderr)."""
    return torchrun_script("pipeline.py", world, args, procs, timeout)


@pytest.fixture(scope="module")
def pipeline_runs(real_data, tmp_path_factory, procs_module):
    """pipeline.py on SLICE, each case run when first asked for: {(stages, schedule): (folder, stdout, stderr)}."""
    def run(case):
        world, schedule = case
        out = tmp_path_factory.mktemp(f"pp{world}{schedule}")
        code, stdout, err = torchrun(world, [*slice_args(real_data, out), "--schedule", schedule, "--timeout", "60"],
                                     procs_module)
        assert code == 0, err
        return out, stdout, err

    return Runs(run)


@pytest.mark.parametrize("world,schedule", CASES, ids=[f"{w}stages-{s}" for w, s in CASES])
def test_the_pipeline_trains_the_same_model(world, schedule, pipeline_runs, reference):
    out, log, err = pipeline_runs[world, schedule]
    ref_state, ref_log, ref_metrics = reference
    state = load_state(out / "model.pth")  # chapter 1's keys in chapter 1's order, whole tensors, on the CPU
    assert list(state) == list(ref_state) and all(state[k].shape == ref_state[k].shape for k in state)
    assert max_abs_diff(ref_state, state) <= SAME_MODEL
    assert_same_curves(read_metrics(out), ref_metrics)
    assert accuracy_lines(log) == accuracy_lines(ref_log)  # every test image once: 500 in 11 batches, the last padded
    assert printed_test_losses(log) == pytest.approx(printed_test_losses(ref_log), abs=2e-6)
    assert f"Pipeline: {world} stage(s), 4 micro-batches of 12 images per step, schedule {schedule}" in log
    assert log.count("Done!") == 1 and sorted(re.findall(r"\[rank (\d+)\] host=", log)) == [str(r) for r in range(world)]


# What each stage did in one step, in order (F2: micro-batch 2's forward, B2: its backward), 4 micro-batches: GPipe
# runs every forward, then every backward; 1F1B starts backwards as soon as the last stage has a loss, so a stage
# keeps at most (stages - its index) micro-batches' activations waiting instead of 4.
TIMETABLES = {
    (2, "gpipe"): ["F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 F3 B0 B1 B2 B3"],
    (2, "1f1b"): ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"],
    (3, "gpipe"): ["F0 F1 F2 F3 B0 B1 B2 B3"] * 3,
    (3, "1f1b"): ["F0 F1 F2 B0 F3 B1 B2 B3", "F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"],
}


@pytest.mark.parametrize("world,schedule", CASES, ids=[f"{w}stages-{s}" for w, s in CASES])
def test_the_timetable_shows_the_schedule(world, schedule, pipeline_runs):
    _, log, _ = pipeline_runs[world, schedule]
    shown = re.findall(r"^  stage \d: (.*)$", log, re.M)
    assert shown == TIMETABLES[world, schedule], log


def test_each_stage_holds_its_layers(pipeline_runs):
    """The bytes line: the whole model, and each rank only the Linear layers of its stage."""
    for (world, _), (_, log, _) in ((case, pipeline_runs[case]) for case in CASES):
        (line,) = [x for x in log.splitlines() if x.startswith("Parameter bytes:")]
        full, *held = [int(n.replace(",", "")) for n in re.findall(r"(?<![\w])(\d[\d,]{3,})", line)]
        assert full == 669_706 * 4 and held == HELD[world], line


@pytest.mark.parametrize("world,schedule", [(2, "gpipe"), (3, "1f1b")])
def test_a_short_last_step_is_padded_and_counts_only_its_images(world, schedule, real_data, tmp_path, procs,
                                                                 tmp_path_factory):
    """996 images: the last step has 36, padded to the 48 the stages exchange; the padding adds no loss, no gradient."""
    single, single_log = chapter_1(tmp_path_factory, real_data, *SHORT_STEP)  # test_training_flags.py's too
    code, log, err = torchrun(world, [*slice_args(real_data, tmp_path / "pp"), *SHORT_STEP, "--schedule", schedule,
                                      "--timeout", "60"], procs)
    assert code == 0, err
    assert max_abs_diff(load_state(single / "model.pth"), load_state(tmp_path / "pp" / "model.pth")) <= SAME_MODEL
    assert accuracy_lines(log) == accuracy_lines(single_log)
    assert_same_curves(read_metrics(tmp_path / "pp"), read_metrics(single))


def test_a_snapshot_of_2_stages_resumes_on_3(real_data, tmp_path, procs):
    """Epoch 1 on 2 stages with --snapshot and momentum, epoch 2 on 3: each stage loads its layers and their velocities
    (the optimizer state is flattened per weight, so a stage finds them whichever stage saved them)."""
    args = [*slice_args(real_data, tmp_path / "whole"), "--momentum", "0.9", "--timeout", "60"]
    code, _, err = torchrun(2, args, procs)
    assert code == 0, err
    args = [*slice_args(real_data, tmp_path / "run"), "--momentum", "0.9", "--snapshot", tmp_path / "snap",
            "--timeout", "60"]
    code, _, err = torchrun(2, [*args, "--epochs", "1"], procs)
    assert code == 0, err
    code, log, err = torchrun(3, args, procs)
    assert code == 0, err
    assert "(saved by 2 ranks, loaded by 3)" in log and log.count("Epoch 2\n") == 1 and "Epoch 1\n" not in log, log
    diff = max_abs_diff(load_state(tmp_path / "whole" / "model.pth"), load_state(tmp_path / "run" / "model.pth"))
    print(f"saved by 2 stages, resumed by 3, against the uninterrupted run: max |difference| = {diff:g}")
    assert diff <= RESHARDED
    assert_same_curves(read_metrics(tmp_path / "run"), read_metrics(tmp_path / "whole"))


def test_a_stage_whose_peer_stops_answering_ends_within_the_timeout(real_data, tmp_path, procs):
    """Rank 1 frozen (SIGSTOP) in the middle of training: rank 0 waits for its peer no longer than --timeout, then
    stops with one line, and torchrun ends the job (no hang)."""
    seconds, code, out, err = freeze_a_rank_mid_training(procs, "pipeline.py", 2, slice_args(real_data, tmp_path),
                                                         tmp_path, frozen=1, grace=20)
    print(f"rank 0 ended {seconds:.1f} s after its peer froze (--timeout 10)")
    assert code != 0 and "Done!" not in out, err
    assert seconds >= 9, seconds  # it did wait for its peer: the timeout, not something else, ended it
    lines = [line for line in err.splitlines() if line.startswith("error: [rank 0]")]
    assert len(lines) == 1, err


BAD_FLAGS = [
    (["--microbatches", "5"], TORCHRUN_ENV, "--batch-size 64 must split into --microbatches 5"),
    (["--precision", "fp16"], TORCHRUN_ENV, "pipeline.py trains in --precision fp32 or bf16"),
    (["--accum-steps", "2"], TORCHRUN_ENV, "pipeline.py takes no --accum-steps"),
    (["--compile"], TORCHRUN_ENV, "pipeline.py takes no --compile"),
    (["--schedule", "zb"], TORCHRUN_ENV, "argument --schedule: invalid choice"),
    ([], dict(TORCHRUN_ENV, WORLD_SIZE="4"), "4 ranks but pipeline.py cuts the model into at most 3 stages"),
    (["--schedule", "1f1b", "--microbatches", "2"], dict(TORCHRUN_ENV, WORLD_SIZE="3", LOCAL_WORLD_SIZE="3"),
     "--schedule 1f1b with 3 stages needs at least 3 --microbatches"),  # torch's ValueError, after the rendezvous
    ([], {}, "start this script with torchrun"),
]


@pytest.fixture(scope="module")
def bad_flag_runs(request):
    cases = [("pipeline.py", flag, env) for flag, env, _ in BAD_FLAGS]
    return run_forked_cases(request, "test_bad_flag_exits_2_with_one_line", cases)


@pytest.mark.parametrize("case", range(len(BAD_FLAGS)), ids=["microbatches-5", "fp16", "accum", "compile", "schedule-zb",
                                                             "4-ranks", "1f1b-too-few", "no-torchrun"])
def test_bad_flag_exits_2_with_one_line(case, bad_flag_runs):
    needle, proc = BAD_FLAGS[case][2], bad_flag_runs[case]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_the_chapter_shows_every_pipeline_line():
    """The lesson is in the file, in the order a reader follows it."""
    source = (REPO / "pipeline.py").read_text()
    train = source.split("def train(cfg, ctx):")[1]
    calls = ["DistributedSampler(train_set, num_replicas=1, rank=0", "nn.Identity()", "PipelineStage(model, ctx.rank",
             "SCHEDULES[cfg.schedule](stage, n_microbatches=cfg.microbatches", "torch.optim.SGD(", "set_epoch(",
             "train_stage_epoch(schedule", "gather_stage_weights(", "if ctx.is_main:"]
    where = [train.find(call) for call in calls]
    assert -1 not in where and where == sorted(where), list(zip(calls, where))


def test_bf16_runs_through_the_stages(real_data, reference, tmp_path, procs):
    """--precision bf16, which docs/pipeline.md says chapter 10 takes: 2 stages learn as much as chapter 1 in fp32."""
    code, out, err = torchrun(2, [*slice_args(real_data, tmp_path), "--precision", "bf16", "--timeout", "60"], procs)
    assert code == 0, err
    fp32, bf16 = (float(accuracy_lines(log)[-1].split()[1].rstrip("%")) for log in (reference[1], out))
    assert abs(fp32 - bf16) <= 1.0, (fp32, bf16)
