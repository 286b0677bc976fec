"""--accum-steps, --precision and --compile: each proved against chapter 1, through the real launchers."""
import json
import re
import subprocess
import sys

import pytest

from scripts.plot_curves import read_metrics
from support import REPO
from support.launchers import launch
from support.run import BASE_ENV, TORCHRUN, one_error_line, run_forked_cases, run_script
from support.same_model import SAME_MODEL, accuracy_lines, assert_same_curves, load_state, max_abs_diff, slice_args
from support.shared_runs import chapter_1, chapter_1_reference

# --accum-steps K at 1, 2 and 3 ranks (K = 1 is test_ddp's): the same 48-image global batch as chapter 1, on 996
# images: 20 full steps and a short last one of 36, which splits into uneven micro-batches (24 + 12 at 1 rank, K = 2)
# or into fewer than K (12 + 12 + 12 at K = 4). Only such a step tells a micro-batch weighted by its share of the
# step's images from one weighted 1/K; 996 still splits over 1, 2 and 3 ranks without DistributedSampler's padding.
ACCUM_SAMPLES = ["--train-samples", "996"]
ACCUM = [("single", 1, 2), ("single", 1, 4), ("mp", 1, 4), ("torchrun", 2, 2), ("tcp", 2, 4), ("mp", 3, 2),
         ("torchrun", 3, 4), ("fsdp", 2, 2), ("by-hand", 3, 2)]


def train(kind, world, real_data, out, procs, *flags):
    """One run of chapter 1 (kind "single", "dataparallel") or a DDP chapter; returns its stdout (asserts exit 0)."""
    if kind == "fsdp":
        p = procs.start([*TORCHRUN, "--standalone", "--nproc-per-node", str(world), "fsdp.py",
                         *slice_args(real_data, out), "--timeout", "60", *flags])
        code, log, err = procs.wait(p)
        assert code == 0, err
        return log
    if kind in ("single", "dataparallel"):
        script = "single_gpu.py" if kind == "single" else "dataparallel.py"
        p = procs.start([sys.executable, script, *slice_args(real_data, out), *flags])
        code, log, err = procs.wait(p)
        assert code == 0, err
        return log
    codes, log, err = launch(kind, world, real_data, out, procs, extra=flags)
    assert codes == [0] * len(codes), err
    return log


@pytest.fixture(scope="module")
def accum_reference(real_data, tmp_path_factory):
    """Chapter 1 on the 996 images without accumulation: (state_dict, stdout, metrics); test_pipeline.py's too."""
    return chapter_1_reference(tmp_path_factory, real_data, *ACCUM_SAMPLES)


@pytest.mark.parametrize("kind,world,k", ACCUM, ids=[f"{kind}-{world}-K{k}" for kind, world, k in ACCUM])
def test_accumulation_trains_the_same_model(kind, world, k, real_data, accum_reference, tmp_path, procs):
    log = train(kind, world, real_data, tmp_path / "run", procs, *ACCUM_SAMPLES, "--accum-steps", str(k))
    ref_state, ref_log, ref_metrics = accum_reference
    assert max_abs_diff(ref_state, load_state(tmp_path / "run" / "model.pth")) <= SAME_MODEL
    assert accuracy_lines(log) == accuracy_lines(ref_log)
    assert "[  336/  996]" in log  # loss lines count optimizer steps of the global batch, as without accumulation
    assert_same_curves(read_metrics(tmp_path / "run"), ref_metrics)  # metrics.jsonl: the same steps and losses
    assert f"accum_steps={k}" in log.splitlines()[0]


@pytest.fixture(scope="module")
def collective_counts():
    """tests/programs/collective_counter.py under torchrun on 2 ranks: its JSON lines, one per wrap and --accum-steps."""
    proc = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "tests/programs/collective_counter.py"], cwd=REPO,
                          env=BASE_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp", "by_hand"])
def test_one_gradient_sync_per_optimizer_step(wrap, collective_counts):
    """Counted on the wire: accumulating 2 or 4 micro-batches sends the gradients as often as 1 does."""
    runs = [r for r in collective_counts if r["wrap"] == wrap]
    assert [r["accum_steps"] for r in runs] == [1, 2, 4]
    for r in runs:
        assert r["micro_batches"] == 6 * r["accum_steps"] and r["steps"] == 6
        assert r["collectives"] == runs[0]["collectives"]  # the same gradients sent once per step, not K times
        if wrap == "ddp":
            assert r["backward_ends"] == r["steps"]  # all micro-batches but the last ran in no_sync()
        elif wrap == "fsdp":
            assert r["collectives"] == 3 * r["steps"]  # one reduce-scatter per Linear unit per optimizer step
        else:
            assert r["collectives"] == 6 * r["steps"]  # by hand: one all-reduce per tensor (3 weights, 3 biases)


CANNOT_WORK = [
    (["single_gpu.py", "--batch-size", "48", "--accum-steps", "5"], "--batch-size 48 must split into --accum-steps 5"),
    (["ddp_mp.py", "--nprocs", "3", "--batch-size", "48", "--accum-steps", "3"],
     "--batch-size 48 is the global batch and must split evenly over 3 ranks x 3 micro-batches; use a multiple of 9"),
    (["fsdp.py", "--precision", "fp16"], "fsdp.py trains in --precision fp32 or bf16"),
    (["single_gpu.py", "--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    (["single_gpu.py", "--accum-steps", "0"], "argument --accum-steps: must be a positive integer, got 0"),
    (["single_gpu.py", "--momentum", "1"], "argument --momentum: must be at least 0 and below 1, got 1"),
    *((["debug_hang.py", "--bug", "early-stop", *flags], "debug_hang.py's cases train in fp32, eagerly, one batch per "
       "step, without snapshots") for flags in (["--accum-steps", "2"], ["--precision", "bf16"], ["--compile"],
                                                ["--snapshot", "snap.pt"])),
]


@pytest.fixture(scope="module")
def cannot_work_runs(request):
    cases = [(argv[0], argv[1:], {}) for argv, _ in CANNOT_WORK]
    return run_forked_cases(request, "test_flags_that_cannot_work_are_one_line", cases)


@pytest.mark.parametrize("case", range(len(CANNOT_WORK)),
                         ids=["batch-over-K", "batch-over-world-x-K", "fp16-in-fsdp", "fp8", "K0", "momentum-1",
                              "ch8-accum", "ch8-bf16", "ch8-compile", "ch8-snapshot"])
def test_flags_that_cannot_work_are_one_line(case, cannot_work_runs):
    needle, proc = CANNOT_WORK[case][1], cannot_work_runs[case]
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr, proc.stderr


# bf16 autocast on the CPU through every launcher, at a learning rate where 2 epochs of the slice learn something.
BF16 = ["--lr", "0.05"]
# The weights cannot tell a bf16 run from an fp32 one: each DDP rank rounds its own half-batch gradient sums to
# bf16, which moves them as far from chapter 1's bf16 weights (measured 1.0e-3 to 1.35e-3) as bf16 moves chapter 1
# from fp32 (7.2e-4). The losses can. The first step's loss is the same weights on the same 48 images, and every
# launcher printed chapter 1's bf16 loss to the last digit (0), 2.1e-5 away from its fp32 loss; over the whole
# curve the runs stayed 3-5x nearer chapter 1's bf16 losses than its fp32 ones (mean |difference| 9e-5 vs 4.6e-4).
FIRST_LOSS = 2e-6  # allowed between the first bf16 losses: two units of the 6th digit for other summation orders
NEARER = 2  # the bf16 curve at least this many times nearer chapter 1's bf16 curve than its fp32 one


@pytest.fixture(scope="module")
def precision_reference(real_data, tmp_path_factory):
    """Chapter 1 on the slice at fp32, bf16 and fp16, made once for both workers (the SLURM group's srun test needs
    them too): {precision: (log, losses of metrics.jsonl, the folder it saved to)}."""
    runs = {}
    for precision in ("fp32", "bf16", "fp16"):
        out, log = chapter_1(tmp_path_factory, real_data, *BF16, "--precision", precision)
        runs[precision] = log, _losses(read_metrics(out)), out
    return runs


def train_16_bits(kind, world, precision, precision_reference, real_data, out, procs):
    """train() at --precision: (stdout, the folder it saved to). Chapter 1's run is the reference's own, the same
    command on the same data."""
    if kind == "single":
        log, _, folder = precision_reference[precision]
        return log, folder
    return train(kind, world, real_data, out, procs, *BF16, "--precision", precision), out


def _accuracies(log):
    return [float(x) for x in re.findall(r"Accuracy: ([\d.]+)%", log)]


def _losses(metrics):
    return [r["loss"] for r in metrics if r["kind"] == "train"]


LAUNCHERS = [("single", 1), ("dataparallel", 1), ("torchrun", 2), ("mp", 3), ("tcp", 2), ("fsdp", 2)]


@pytest.mark.parametrize("kind,world", LAUNCHERS, ids=[f"{kind}-{world}" for kind, world in LAUNCHERS])
def test_bf16_through_every_launcher(kind, world, precision_reference, real_data, tmp_path, procs):
    """bf16 ran: chapter 1's bf16 losses, not its fp32 ones; and the model learned as much as in fp32."""
    log, out = train_16_bits(kind, world, "bf16", precision_reference, real_data, tmp_path / "run", procs)
    _assert_bf16_ran(log, read_metrics(out), precision_reference)
    # The test loss is summed from float32 logits. From bf16 ones each rank's sum (250 images, 450 to 550) would be
    # rounded to bf16, whose steps there are 2 or 4: the total a multiple of 2. float32 sums land on one by chance
    # with odds of about 1 in 60,000 an epoch.
    for record in read_metrics(out):
        if record["kind"] == "epoch":
            total = record["test_loss"] * 500
            assert abs(total / 2 - round(total / 2)) > 1e-9, (record, "the test loss was summed in bf16")


# fp16 cannot be told from fp32 by the losses or weights (float16 keeps 3 more bits than bfloat16: chapter 1's first
# loss differs from fp32's by 2e-6, DDP's curve is no nearer chapter 1's fp16 curve than its fp32 one); its
# GradScaler can: each epoch ends with the scale it reached, the same as chapter 1's when every launcher skips the
# same steps. (tests/test_model_engine.py makes a step overflow and checks the skip and the halving.)
@pytest.mark.parametrize("kind,world", LAUNCHERS[:-1], ids=[f"{kind}-{world}" for kind, world in LAUNCHERS[:-1]])
def test_fp16_with_its_scaler_through_every_launcher(kind, world, precision_reference, real_data, tmp_path, procs):
    log, out = train_16_bits(kind, world, "fp16", precision_reference, real_data, tmp_path / "run", procs)
    _assert_fp16_ran(log, read_metrics(out), precision_reference)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bits_under_srun(slurm, precision_reference, real_data, tmp_path, precision):
    """The sixth launcher: srun, from scripts/job.sh on the local SLURM cluster."""
    from support.slurm_jobs import CPU_JOB, submit

    args = [*slice_args(real_data, tmp_path / "run"), *BF16, "--precision", precision]
    job_id, rc, log_path = submit(slurm, "job.sh", CPU_JOB, args, tmp_path)
    log = log_path.read_text()
    assert rc == 0 and slurm.job_state(job_id)["state"] == "COMPLETED", log
    check = _assert_bf16_ran if precision == "bf16" else _assert_fp16_ran
    check(log, read_metrics(tmp_path / "run"), precision_reference)


def _scales(log):
    return re.findall(r"^fp16 loss scale: (\S+)$", log, re.M)


def _assert_fp16_ran(log, metrics, reference):
    (fp32_log, *_), (fp16_log, fp16_losses, _) = reference["fp32"], reference["fp16"]
    losses = _losses(metrics)
    assert "precision=fp16" in log and len(losses) == len(fp16_losses)
    assert len(_scales(fp16_log)) == 2 and _scales(log) == _scales(fp16_log), log  # a scaler ran, as in chapter 1
    assert abs(losses[0] - fp16_losses[0]) <= FIRST_LOSS, (losses[0], fp16_losses[0])
    assert _accuracies(fp32_log)[-1] > 40  # the comparison means something: the model has learned
    assert abs(_accuracies(log)[-1] - _accuracies(fp32_log)[-1]) <= 1.0


def _assert_bf16_ran(log, metrics, bf16_reference):
    (fp32_log, fp32_losses, _), (_, bf16_losses, _) = bf16_reference["fp32"], bf16_reference["bf16"]
    losses = _losses(metrics)
    assert "precision=bf16" in log and len(losses) == len(bf16_losses)
    first = losses[0]
    assert abs(first - bf16_losses[0]) <= FIRST_LOSS, (first, bf16_losses[0])
    assert abs(first - fp32_losses[0]) >= 5 * FIRST_LOSS, (first, fp32_losses[0])  # fp32 would be (measured 2.1e-5)

    def mean_gap(reference):
        return sum(abs(a - b) for a, b in zip(losses, reference)) / len(losses)

    assert NEARER * mean_gap(bf16_losses) <= mean_gap(fp32_losses), (mean_gap(bf16_losses), mean_gap(fp32_losses))
    assert _accuracies(fp32_log)[-1] > 40  # the comparison means something: the model has learned
    assert abs(_accuracies(log)[-1] - _accuracies(fp32_log)[-1]) <= 1.0


def test_resuming_with_another_precision_is_refused(real_data, tmp_path, procs):
    snap = tmp_path / "snap.pt"
    args = [*slice_args(real_data, tmp_path / "run"), "--epochs", "1", "--snapshot", str(snap)]
    assert run_script("single_gpu.py", *args, "--precision", "bf16").returncode == 0
    proc = run_script("single_gpu.py", *args, "--epochs", "2")
    assert proc.returncode == 1
    one_error_line(proc.stderr, f"snapshot {snap} was made with --precision bf16, this run has --precision fp32")
    proc = run_script("single_gpu.py", *args, "--epochs", "2", "--precision", "bf16", "--accum-steps", "2")
    assert proc.returncode == 0 and "Resuming from" in proc.stdout, proc.stderr  # the same precision; K may change


# --compile against the eager run: Inductor's fused kernels sum in their own order. Measured max |w| difference on
# the slice: 3.7e-9 (chapter 1, and DDP at 2 ranks with --accum-steps 2), the same as between eager runs. That it
# compiled at all is in torch's own logs (TORCH_LOGS=dynamo, a public switch): Inductor compiled the training step,
# and under DDP, DDPOptimizer cut it in 2 where DDP's first gradient bucket (1 MiB, DDP's default) ends.
@pytest.mark.parametrize("kind,world,flags,parts", [("single", 1, (), None), ("torchrun", 2, ("--accum-steps", "2"), 2)],
                         ids=["chapter1", "torchrun-2-K2"])
def test_compile_trains_the_same_model(kind, world, flags, parts, real_data, reference, tmp_path, procs, monkeypatch):
    monkeypatch.setitem(BASE_ENV, "TORCH_LOGS", "dynamo")
    if kind == "single":
        code, log, err = procs.wait(procs.start([sys.executable, "single_gpu.py",
                                                 *slice_args(real_data, tmp_path / "run"), "--compile"]))
        codes = [code]
    else:
        codes, log, err = launch(kind, world, real_data, tmp_path / "run", procs, extra=("--compile", *flags))
    assert codes == [0] * len(codes), err
    assert "Step 2: done compiler function" in err, err[-3000:]  # DDP's: DDPOptimizer's compile_fn, then Inductor
    if parts:
        cut = re.findall(rf"^\[rank(\d)\]:.*DDPOptimizer used bucket cap \d+ and created {parts} buckets", err, re.M)
        assert set(cut) == {str(r) for r in range(world)}, err[-3000:]
    ref_state, ref_log, _ = reference
    state = load_state(tmp_path / "run" / "model.pth")
    assert next(iter(state)) == "linear_relu_stack.0.weight"  # compiled in place: no `_orig_mod.` in the keys
    assert max_abs_diff(ref_state, state) <= SAME_MODEL
    assert accuracy_lines(log) == accuracy_lines(ref_log)


def test_compile_without_a_compiler_says_so(real_data, tmp_path):
    env = dict(BASE_ENV, CXX="/nonexistent/g++", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    proc = subprocess.run([sys.executable, "single_gpu.py", *slice_args(real_data, tmp_path / "run"), "--epochs", "1",
                           "--compile"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    one_error_line(proc.stderr, "--compile needs a working C++ compiler", "apt-get install g++")
