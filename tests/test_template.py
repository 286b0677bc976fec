"""scripts/template.py, the one file a reader copies into a project: plain torch + torchvision in at most 120 lines,
the 8 steps marked as chapter 3 marks them, and it trains chapter 1's model with chapter 1's lines, as `python
scripts/template.py` (a world of one) and under torchrun at 1 and 2 ranks."""
import ast
import re

import pytest

from support import REPO
from support.run import Runs, run_script, torchrun_script
from support.same_model import SAME_MODEL, accuracy_lines, load_state, max_abs_diff, printed_test_losses, slice_args

TEMPLATE = "scripts/template.py"
CASES = ["python", "torchrun-1", "torchrun-2"]  # python: no torchrun, a world of one
LOSS_LINE = re.compile(r"^loss: +([\d.]+)  (\[ *\d+/ *\d+\])$", re.M)


@pytest.fixture(scope="module")
def runs(real_data, tmp_path_factory, procs_module):
    """{case: (returncode, stdout, stderr, the state_dict it saved or None)}, each case run once for its tests."""
    def make(case):
        out = tmp_path_factory.mktemp(case)
        args = [*slice_args(real_data, out), "--timeout", "60"]
        if case == "python":
            proc = run_script(TEMPLATE, *args)
            code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        else:
            code, stdout, stderr = torchrun_script(TEMPLATE, int(case[-1]), args, procs_module)
        return code, stdout, stderr, load_state(out / "model.pth") if (out / "model.pth").exists() else None

    return Runs(make)


@pytest.mark.parametrize("case", CASES)
def test_the_template_trains_chapter_1s_model(case, runs, reference):
    """Chapter 1's seed, shuffle, global batch and optimizer: its weights, whatever the world size. Measured on SLICE
    (2 cores, 1 thread a process): 0.0 as plain python and under torchrun at 1 rank, 3.7e-9 at 2 ranks (the
    all-reduce's order of summing); allowed: SAME_MODEL (1e-6), as for every chapter."""
    code, _, err, state = runs[case]
    assert code == 0, err
    assert max_abs_diff(reference[0], state) <= SAME_MODEL


@pytest.mark.parametrize("case", CASES)
def test_the_template_prints_chapter_1s_lines(case, runs, reference):
    """The quickstart's lines, with chapter 1's figures: the global batch's loss at the same steps, the whole test
    set's accuracy and loss after each epoch (every rank's shard, all-reduced), Done! and where the weights went."""
    code, out, err, _ = runs[case]
    assert code == 0, err
    ref_log = reference[1]
    assert accuracy_lines(out) == accuracy_lines(ref_log) and len(accuracy_lines(out)) == 2
    assert printed_test_losses(out) == pytest.approx(printed_test_losses(ref_log), abs=2e-6)
    mine, ref = LOSS_LINE.findall(out), LOSS_LINE.findall(ref_log)
    assert [where for _, where in mine] == [where for _, where in ref] and "[  336/  960]" in out
    assert [float(loss) for loss, _ in mine] == pytest.approx([float(loss) for loss, _ in ref], abs=2e-6)
    assert out.count("Done!") == 1 and out.count("Saved PyTorch Model State to ") == 1


@pytest.mark.parametrize("case", CASES)
def test_only_rank_0_prints(case, runs):
    """Every line once, from global rank 0, whatever the world size; and no traceback."""
    code, out, err, _ = runs[case]
    assert code == 0, err
    assert out.count("Epoch 1\n") == 1 and out.count("Epoch 2\n") == 1 and out.count("Test Error:") == 2
    world = 1 if case == "python" else int(case[-1])
    assert out.count("Using cpu device, ") == 1 and f"{world} processes, backend gloo" in out
    assert "Traceback" not in err


def test_the_template_is_one_plain_file_marked_like_chapter_3():
    """One file of at most 120 lines, importing torch, torchvision and the standard library only (never common/),
    the 8 steps marked as chapter 3 marks them, their calls in the same order, and the two places to put yours."""
    source = (REPO / TEMPLATE).read_text()
    assert len(source.splitlines()) <= 120
    imported = {a.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    assert {name.split(".")[0] for name in imported} <= {"argparse", "os", "datetime", "torch", "torchvision"}, imported

    def steps(text):
        return re.findall(r"# Step (\d, [\w ]+):", text)

    assert steps(source) == steps((REPO / "ddp_launch.py").read_text()) and len(steps(source)) == 8
    calls = ["# Step 1, who am I:", 'os.environ.get("RANK"', "# Step 2, device:", "torch.cuda.set_device(device)",
             "# Step 3, init:", "dist.init_process_group(", "finally:  # Step 8, teardown:",
             "dist.destroy_process_group()",
             "# Step 4, data:", "DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed)",
             "batch_size=args.batch_size // world_size", "torch.manual_seed(args.seed)", "# Step 5, wrap:",
             "model = DDP(model", "# Step 6, epochs:", "train_sampler.set_epoch(epoch)", "# Step 7, save:",
             "if rank == 0:", "model.module.state_dict()"]
    where = [source.find(call) for call in calls]
    assert -1 not in where and where == sorted(where), list(zip(calls, where))
    assert re.search(r"^def build_model\(\):  # YOUR MODEL HERE", source, re.M)
    assert re.search(r"^def build_datasets\(.*\):  # YOUR DATA HERE", source, re.M)


def test_a_batch_that_does_not_split_is_refused_in_one_line(real_data, tmp_path, procs):
    """--batch-size 47 over 2 ranks: each rank's one line, before any process group, and torchrun's failure."""
    args = [*slice_args(real_data, tmp_path), "--batch-size", "47", "--epochs", "1"]  # were it let through: seconds
    code, out, err = torchrun_script(TEMPLATE, 2, args, procs)
    assert code != 0 and out == ""
    assert err.count("error: --batch-size 47 must split evenly over 2 processes\n") == 2, err


def test_help_names_every_flag():
    proc = run_script(TEMPLATE, "--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ["--epochs", "--batch-size", "--lr", "--seed", "--data-dir", "--output", "--train-samples",
                 "--test-samples", "--log-every", "--timeout", "--device"]:
        assert flag in proc.stdout, flag
