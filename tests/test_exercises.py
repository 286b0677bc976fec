"""The exercises a learner is given ("Try it": docs/exercises.md, README's chapter 3 and chapter 8, docs/strategies.md):
each one's stated outcome is what happens. Most outcomes are checked by a run the suite already makes (EXERCISES
names the test for each); the two that no other test makes are run here."""
import re
import subprocess
import sys

import pytest

from support import REPO
from support.run import BASE_ENV, TORCHRUN, run_script
from support.same_model import SAME_MODEL, SLICE, load_state, max_abs_diff, slice_args
from support.shared_runs import chapter_1

# Each exercise, by the words it starts with, and the tests that check what it says you will see.
EXERCISES = {
    # docs/exercises.md
    "Run `python single_gpu.py` twice": ["tests/test_exercises.py::test_chapter_1_twice_is_the_same_model"],
    "Add `--accum-steps 4`": ["tests/test_training_flags.py::test_accumulation_trains_the_same_model[single-1-K4]"],
    "Run `python dataparallel.py` on a machine without a GPU": [
        "tests/test_chapters_1_and_2.py::test_dataparallel_prints_its_fallback",
        "tests/test_chapters_1_and_2.py::test_dataparallel_trains_the_same_model"],
    "With two GPUs, run `CUDA_VISIBLE_DEVICES=0,1 python dataparallel.py`": [
        "tests/test_gpu.py::test_dataparallel_splits_over_every_visible_gpu"],
    "Run `torchrun --standalone --nproc-per-node 1 ddp_launch.py`": [
        "tests/test_ddp.py::test_ddp_trains_the_same_model[torchrun-1]"],
    "Read `diff ddp_launch.py ddp_by_hand.py`": ["tests/test_ddp.py::test_ddp_trains_the_same_model[by-hand-2]",
                                                 "tests/test_ddp.py::test_ddp_trains_the_same_model[by-hand-3]"],
    "Add `--precision fp16`. Chapter 3b refuses it": [
        "tests/test_bad_flags.py::test_bad_flag_exits_2_with_one_line[ddp_by_hand.py:--precision fp16]"],
    "Run `python ddp_mp.py --nprocs 3`": [
        "tests/test_bad_flags.py::test_bad_flag_exits_2_with_one_line[ddp_mp.py:--nprocs 3]",
        "tests/test_ddp.py::test_ddp_trains_the_same_model[mp-3]"],
    "While it trains, kill one worker": [
        "tests/test_killed_and_stopped_ranks.py::test_a_killed_rank_ends_the_others_instead_of_hanging[mp]"],
    "Start only rank 0": ["tests/test_rendezvous.py::test_lone_rank_fails_within_the_timeout[missing-peer]"],
    "Start both ranks, one with `--train-samples 960`": [
        "tests/test_rendezvous.py::test_ranks_started_with_different_flags_stop_with_one_line"],
    "Run `python ddp_slurm.py` outside a SLURM job": ["tests/test_slurm_env.py::test_outside_slurm_says_how_to_submit"],
    "Submit `sbatch scripts/job.sh --snapshot": [
        "tests/test_slurm_requeue.py::test_a_warned_job_requeues_itself_and_ends_as_if_left_alone"],
    "Run `torchrun --standalone --nproc-per-node 2 fsdp.py` and read": [
        "tests/test_fsdp.py::test_each_rank_holds_its_share_of_the_bytes"],
    "Train one epoch on 2 ranks with `--snapshot runs/fsdp/snap`": [
        "tests/test_fsdp.py::test_snapshot_saved_on_2_ranks_resumes_on_another_count[2-to-3]"],
    "Run `python debug_hang.py --bug early-stop`": [
        "tests/test_debug_hang.py::test_broken_case_fails_soon_naming_the_mismatch[early-stop]",
        "tests/test_debug_hang.py::test_early_stop_alone_stops_after_epoch_2_on_the_full_data",
        "tests/test_debug_hang.py::test_fix_trains_chapter_1s_model[early-stop]"],
    "Run `python debug_hang.py --bug shape-mismatch`": [
        "tests/test_debug_hang.py::test_broken_case_fails_soon_naming_the_mismatch[shape-mismatch]"],
    "Run `torchrun --standalone --nproc-per-node 2 debug_hang.py --bug batchnorm`": [
        "tests/test_debug_hang.py::test_silent_case_trains_a_model_unlike_one_process[batchnorm]",
        "tests/test_debug_hang.py::test_silent_fix_trains_one_process_model[batchnorm]"],
    "Run `python scripts/template.py` without torchrun": [
        "tests/test_template.py::test_the_template_prints_chapter_1s_lines[python]",
        "tests/test_template.py::test_the_template_trains_chapter_1s_model[python]"],
    "Run `torchrun --standalone --nproc-per-node 2 scripts/template.py --batch-size 47`": [
        "tests/test_template.py::test_a_batch_that_does_not_split_is_refused_in_one_line"],
    "Run `torchrun --standalone --nproc-per-node 3 tensor_parallel.py`": [
        "tests/test_tensor_parallel.py::test_three_ranks_cannot_split_the_hidden_layer"],
    "Run `torchrun --standalone --nproc-per-node 4 tensor_parallel.py --dp 2`": [
        "tests/test_tensor_parallel.py::test_tensor_parallel_trains_the_same_model[4ranks-dp2]"],
    "Run `torchrun --standalone --nproc-per-node 2 pipeline.py` with `--schedule gpipe`": [
        "tests/test_pipeline.py::test_the_timetable_shows_the_schedule[2stages-gpipe]",
        "tests/test_pipeline.py::test_the_timetable_shows_the_schedule[2stages-1f1b]"],
    "Train one epoch on 2 stages": ["tests/test_pipeline.py::test_a_snapshot_of_2_stages_resumes_on_3"],
    "Run `diloco.py` with `--outer-lr 1 --outer-momentum 0": [
        "tests/test_diloco.py::test_diloco_trains_post_local_sgds_model[2]"],
    "Run 4 ranks with `--ranks-per-replica 2`": [
        "tests/test_diloco.py::test_a_machines_ranks_train_one_copy_and_resume_exactly"],
    "Add `--comm-hook powersgd`.": ["tests/test_comm_hooks.py::test_each_comm_hook_value_sends_what_it_names[powersgd]"],
    "Add `--comm-hook powersgd --precision fp16`": [
        "tests/test_comm_hooks.py::test_powersgd_never_recovers_from_one_fp16_overflow_so_it_is_refused"],
    "Start the lighthouse and two replica groups": [
        "tests/test_fault_tolerance.py::test_two_groups_train_chapter_1s_model"],
    "Kill one group with `kill -9` mid-run": [
        "tests/test_fault_tolerance.py::test_a_killed_group_heals_from_the_live_one_which_never_restarts"],
    # README.md, chapter 3 and chapter 8
    "Delete `train_sampler.set_epoch(epoch)` from `ddp_launch.py`": [
        "tests/test_exercises.py::test_without_set_epoch_epoch_2_repeats_epoch_1s_order"],
    "Run `torchrun --standalone --nproc-per-node 3 ddp_launch.py` at the default batch of 64": [
        "tests/test_bad_flags.py::test_bad_flag_exits_2_with_one_line[ddp_launch.py:--batch-size 64]"],
    "Try it: run `python debug_hang.py --bug early-stop`": [
        "tests/test_debug_hang.py::test_broken_case_fails_soon_naming_the_mismatch[early-stop]",
        "tests/test_debug_hang.py::test_fix_trains_chapter_1s_model[early-stop]"],
    # docs/strategies.md
    "Try it: run `torchrun --standalone --nproc-per-node 2 fsdp.py`": [
        "tests/test_fsdp.py::test_each_rank_holds_its_share_of_the_bytes"],
}


def exercises_in_the_docs():
    """Every exercise a reader is given: docs/exercises.md's bullets, the bullets under README's "Try it:", and each
    line of README and docs/strategies.md with a "Try it:" inside it, each bullet joined onto one line."""
    bullets = re.compile(r"^- (.*\n(?:  .*\n?)*)", re.M)
    found = bullets.findall((REPO / "docs/exercises.md").read_text())
    for name in ("README.md", "docs/strategies.md"):
        text = (REPO / name).read_text()
        for block in re.findall(r"^Try it:\n\n((?:- .*\n(?:  .*\n)*)+)", text, re.M):
            found += bullets.findall(block)
        found += re.findall(r"(Try it: \S.*)", text)
    return [" ".join(b.split()) for b in found]


def test_every_exercise_names_the_tests_that_check_it():
    """Each exercise in the docs starts with the words of one EXERCISES entry, every entry is an exercise there, and
    every test named is one the suite collects."""
    given = exercises_in_the_docs()
    matched = {text: [start for start in EXERCISES if text.startswith(start)] for text in given}
    assert all(len(starts) == 1 for starts in matched.values()), {t: s for t, s in matched.items() if len(s) != 1}
    assert sorted(s for starts in matched.values() for s in starts) == sorted(EXERCISES)
    nodes = sorted({node for tests in EXERCISES.values() for node in tests})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *nodes],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    collected = proc.stdout.splitlines()  # a test named without its [id] stands for every case of it
    missing = [node for node in nodes if not any(c == node or c.startswith(node + "[") for c in collected)]
    assert missing == [], proc.stdout[-3000:] + proc.stderr[-3000:]


def loss_lines(log):
    return re.findall(r"^loss: .*$", log, re.M)


def test_chapter_1_twice_is_the_same_model(real_data, tmp_path_factory, tmp_path):
    """Run chapter 1 twice: the same loss lines, and compare_models.py finds every tensor bit-for-bit equal."""
    first, first_log = chapter_1(tmp_path_factory, real_data)
    second = run_script("single_gpu.py", *slice_args(real_data, tmp_path / "b"))
    assert second.returncode == 0, second.stderr
    assert loss_lines(second.stdout) == loss_lines(first_log) != []
    compare = subprocess.run([sys.executable, "scripts/compare_models.py", str(first / "model.pth"),
                              str(tmp_path / "b" / "model.pth")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert compare.returncode == 0 and "every tensor is bit-for-bit equal" in compare.stdout, compare.stdout


def without_set_epoch(script, folder):
    """A copy of a chapter without its `train_sampler.set_epoch(epoch)` line, as the exercise asks."""
    source = (REPO / script).read_text()
    line = next(x for x in source.splitlines(keepends=True) if x.strip().startswith("train_sampler.set_epoch(epoch)"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / script).write_text(source.replace(line, "", 1))
    return str(folder / script)


# The exercise's --lr: at the quickstart's 1e-3, SLICE's 40 steps move the weights too little (2.7e-6 here) for
# compare_models.py's --atol 1e-5 to tell the two orders apart.
LEARNS = ("--lr", "0.05")


def test_without_set_epoch_epoch_2_repeats_epoch_1s_order(real_data, tmp_path_factory, tmp_path, procs):
    """Chapter 3 without set_epoch on 2 ranks: no longer chapter 1's model (compare_models.py says they differ), but
    exactly the model chapter 1 trains without set_epoch, whose epoch 2 sees epoch 1's order again."""
    env = dict(BASE_ENV, PYTHONPATH=str(REPO))  # the copies live outside the repository; `common` is in it
    p = procs.start([*TORCHRUN, "--standalone", "--nproc-per-node", "2", without_set_epoch("ddp_launch.py", tmp_path / "c3"),
                     *slice_args(real_data, tmp_path / "ddp"), *LEARNS, "--timeout", "60"], env=env)
    code, _, err = procs.wait(p)
    assert code == 0, err
    single = subprocess.run([sys.executable, without_set_epoch("single_gpu.py", tmp_path / "c1"),
                             *slice_args(real_data, tmp_path / "single"), *LEARNS], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    ddp = load_state(tmp_path / "ddp" / "model.pth")
    assert max_abs_diff(ddp, load_state(tmp_path / "single" / "model.pth")) <= SAME_MODEL
    chapter_1_model = chapter_1(tmp_path_factory, real_data, *LEARNS)[0] / "model.pth"
    assert max_abs_diff(ddp, load_state(chapter_1_model)) > 100 * SAME_MODEL
    compare = subprocess.run([sys.executable, "scripts/compare_models.py", str(chapter_1_model),
                              str(tmp_path / "ddp" / "model.pth")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert compare.returncode == 1 and "different models" in compare.stdout, compare.stdout
    assert SLICE[SLICE.index("--epochs") + 1] == "2"  # the exercise's 2 epochs
    assert "`--epochs 2 --lr 0.05`" in (REPO / "README.md").read_text()  # the flags the exercise gives
