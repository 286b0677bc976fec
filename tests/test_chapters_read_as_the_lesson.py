"""The chapters read as the lesson: each DDP chapter's steps marked by the same comments and torch's calls in reading
order, the steps chapters 1 and 2 share marked alike, the diffs the README tells a reader to run within their budgets,
and each chapter's own way to hold gradients back passed to the one loop."""
import re
import subprocess

import pytest

from support import REPO

DDP_CHAPTERS = ["ddp_launch.py", "ddp_mp.py", "ddp_tcp_manual.py", "ddp_slurm.py", "ddp_comm_hooks.py"]
# The steps of a DDP chapter, each marked by the same comment in every chapter (`grep -n "# Step" ddp_*.py`), and
# the calls that make each step, in the order a reader meets them going down the file.
STEPS = [("who am I", []), ("device", ["set_device("]), ("init", ["init_process_group("]),
         ("teardown", ["\n        destroy_process_group()"]),  # in main()'s finally, around train()'s call
         ("data", ["with local_rank_0_first(ctx):", "load_fashion_mnist(", "DistributedSampler(", "DataLoader(train_set"]),
         ("wrap", []), ("epochs", ["set_epoch(", "train_one_epoch("]), ("save", ["if ctx.is_main:"])]
WRAPS = {"ddp_by_hand.py": "dist.broadcast(tensor, src=0)", "diloco.py": "dist.broadcast(tensor, src=0)", "fsdp.py": "fully_shard(model", "tensor_parallel.py": "parallelize_module(model", "pipeline.py": "PipelineStage(model"}
EPOCH_CALLS = {"pipeline.py": "train_stage_epoch("}  # a pipeline stage's epoch: schedule.step() per batch


def step_markers(source):
    """(step number, its words) of every `# Step N, words:` comment, in file order."""
    return [(int(n), words) for n, words in re.findall(r"# Step (\d), ([\w ]+):", source)]


@pytest.mark.parametrize("script", [*DDP_CHAPTERS, "ddp_by_hand.py", "diloco.py", "fsdp.py", "tensor_parallel.py",
                                    "pipeline.py"])
def test_each_ddp_chapter_reads_as_the_lesson_top_to_bottom(script):
    """The lesson is in the chapter, in reading order: who am I, device, init (with the teardown in the finally around
    the rest), data (fetched once per machine, a DistributedSampler in a plain DataLoader), wrap, epochs with
    set_epoch, rank-0 save; each step marked by the same comment, and torch's own calls in that order."""
    source = (REPO / script).read_text()
    markers = step_markers(source)
    numbers = {"who am I": 1, "device": 2, "init": 3, "data": 4, "wrap": 5, "epochs": 6, "save": 7, "teardown": 8}
    assert [words for _, words in markers] == [words for words, _ in STEPS], markers
    assert all(numbers[words] == n for n, words in markers), markers
    calls = [EPOCH_CALLS.get(script, call) if call == "train_one_epoch(" else call for words, step_calls in STEPS for call in
             [f"# Step {numbers[words]}, {words}:", *step_calls,
              *([WRAPS.get(script, "model = DDP(model")] if words == "wrap" else [])]]
    where = [source.find(call) for call in calls]
    assert -1 not in where and where == sorted(where), list(zip(calls, where))
    # Where rank, local rank and world size come from, in step 1.
    source_of_ranks = {"ddp_launch.py": 'os.environ["RANK"]', "ddp_comm_hooks.py": 'os.environ["RANK"]',
                       "ddp_by_hand.py": 'os.environ["RANK"]', "diloco.py": 'os.environ["RANK"]',
                       "ddp_mp.py": "def worker(rank,",
                       "ddp_tcp_manual.py": "cfg.rank", "ddp_slurm.py": 'os.environ["SLURM_PROCID"]',
                       "fsdp.py": 'os.environ["RANK"]', "tensor_parallel.py": 'os.environ["RANK"]',
                       "pipeline.py": 'os.environ["RANK"]'}
    assert source.find(source_of_ranks[script]) < source.find("# Step 2, device:")
    # The teardown is the finally of the try around everything after init, so it runs after an error too.
    assert re.search(r"^    try:\n        train\(cfg, ctx\).*\n    finally:  # Step 8, teardown:.*\n"
                     r"        destroy_process_group\(\)  # dist\.destroy_process_group\(\); .*$", source, re.M), script


def test_chapter_12_reads_as_the_lesson_top_to_bottom():
    """ddp_ft.py marks the same eight steps with its own calls in reading order: torchft's Manager where the others
    start a process group (its shutdown the teardown), the sampler dealing to the replica groups, torchft's Optimizer
    as the wrap, and in the step loop set_epoch, the quorum (zero_grad), the gradients averaged over it, the commit."""
    source = (REPO / "ddp_ft.py").read_text()
    assert step_markers(source) == [(1, "who am I"), (2, "device"), (3, "init"), (8, "teardown"), (4, "data"),
                                    (5, "wrap"), (6, "epochs"), (7, "save")]
    calls = ["# Step 1, who am I:", 'os.environ["RANK"]', "# Step 2, device:", "set_device(", "# Step 3, init:",
             "torchft.Manager(", "finally:  # Step 8, teardown:", "manager.shutdown(", "# Step 4, data:",
             "locate_fashion_mnist(", "DistributedSampler(", "# Step 5, wrap:", "torchft.Optimizer(",
             "# Step 6, epochs:", "set_epoch(", "optimizer.zero_grad()", "loss.backward()",
             "average_gradients(model, manager)", "optimizer.step()", "# Step 7, save:", "if ctx.is_main:"]
    where = [source.find(call) for call in calls]
    assert -1 not in where and where == sorted(where), list(zip(calls, where))


@pytest.mark.parametrize("script", ["single_gpu.py", "dataparallel.py"])
def test_chapters_1_and_2_mark_the_steps_they_share(script):
    source = (REPO / script).read_text()
    expected = [(2, "device"), (4, "data"), *([(5, "wrap")] if script == "dataparallel.py" else []), (6, "epochs"),
                (7, "save")]
    assert step_markers(source) == expected


# What a reader reads with the README's diff commands: changed lines (`diff A B`'s < and > lines), each budget a
# bound on the lesson of that pair. Between DDP chapters the diff may hold the launcher's lines only: where rank,
# local rank and world size come from, how the processes start, the rendezvous. Chapters 2, 9 and 10 hold code only
# they use: DataParallel's replica dtype (about 25 lines); tensor parallel's flag checks, the 2-D notices it hides
# and its mesh's groups, made with --timeout (about 35); a pipeline stage's own epoch and evaluation, its loss, padding, timetable, weights gather and flag
# checks (about 160, the stage's step: one schedule.step() with the images on the first stage, the labels on the last).
# Chapter 11b (ddp_comm_hooks.py) is chapter 3 with --comm-hook: its flag, import, one bucket for PowerSGD, the
# hook registered and its state passed to the snapshot, all of it the lesson (about 28 lines). Chapters 3 to 6 leave
# it out: a slow link's remedy is not the lesson of how DDP starts.
# Chapter 4 holds the ranks' store in its parent, bound before the workers start, as torchrun's agent does, on
# loopback alone (a socket bound there and handed to the store): 10 lines.
# Chapter 5 declares its four flags itself (--init-method, --rank, --world-size, --local-rank: how each process it
# starts by hand learns who it is), and chapter 6 finds its rank 0 itself (the job's first node from `scontrol show
# hostnames`, the port from the job id, and one line outside an srun step): each chapter's lesson, in the chapter.
# Chapter 3b (ddp_by_hand.py) is chapter 3 with DDP's two jobs done by hand: rank 0's weights broadcast, the
# gradients all-reduced and averaged before each step (an optimizer step pre-hook), fp16 refused and so no loss
# scaler (about 48 lines). Chapter 11 (diloco.py) is chapter 3b with the ranks left apart: its flags and their checks
# (about 30 lines), the inner optimizer's step post-hook in place of the pre-hook, the shared weights evaluated and
# saved, the last sync, and the outer loop (class DiLoCo: pseudo-gradient, async all-reduce, outer SGD, its snapshot
# state, about 120 lines), all of it the lesson.
# Chapter 4 holds how a spawned worker ends (`spawned`, 11 lines) and chapter 5 what its --init-method accepts
# (`rendezvous_url`, `check_file_rendezvous`, 22 lines): code only they use, in them (not in every DDP
# chapter's reach). Chapter 3's torchrun check also names the rank in errors and checks the global batch; chapters 4 to
# 6 make those two calls themselves, after they learn their rank (two lines each). Chapter 7's sharded snapshot stops
# at the time limit by its own StopAtTimeLimit, where chapter 3's save_snapshot says when to stop.
DIFF_BUDGETS = {("single_gpu.py", "dataparallel.py"): 44, ("single_gpu.py", "ddp_launch.py"): 55,
                ("ddp_launch.py", "ddp_by_hand.py"): 47, ("ddp_by_hand.py", "diloco.py"): 218, ("ddp_launch.py", "ddp_mp.py"): 71, ("ddp_launch.py", "ddp_tcp_manual.py"): 82,
                ("ddp_launch.py", "ddp_slurm.py"): 57, ("ddp_launch.py", "fsdp.py"): 90,
                ("fsdp.py", "tensor_parallel.py"): 167, ("ddp_launch.py", "pipeline.py"): 261,
                ("ddp_launch.py", "ddp_comm_hooks.py"): 28}
LESSON_CALLS = ("DistributedSampler(", "DataLoader(", "DDP(", "set_epoch(", "train_one_epoch(", "save_weights(",
                "local_rank_0_first(", "load_fashion_mnist(", "save_snapshot(", "Subset(")


def changed_lines(a, b):
    diff = subprocess.run(["diff", a, b], cwd=REPO, capture_output=True, text=True).stdout
    return [line[2:] for line in diff.splitlines() if line[:2] in ("< ", "> ")]


# How each strategy holds a micro-batch's gradients back (--accum-steps): its own line, in its chapter, passed to the
# one loop (tests/programs/collective_counter.py counts on the wire that the loop then sends them once per optimizer
# step).
HOLD_BACK = {**{script: "no_sync=model.no_sync)" for script in DDP_CHAPTERS},
             "fsdp.py": "gradient_sync=model.set_requires_gradient_sync)",
             "tensor_parallel.py": "gradient_sync=model.set_requires_gradient_sync if cfg.dp > 1 else None)"}


@pytest.mark.parametrize("script", HOLD_BACK)
def test_each_chapter_passes_its_own_way_to_hold_gradients_back(script):
    train = (REPO / script).read_text().split("def train(cfg, ctx):")[1]
    call = train[train.index("train_one_epoch("):].split("\n\n")[0]
    assert HOLD_BACK[script] in " ".join(call.split()), call


@pytest.mark.parametrize("pair,budget", DIFF_BUDGETS.items(), ids=[f"{a}-{b}" for a, b in DIFF_BUDGETS])
def test_chapter_diffs_stay_within_their_budget(pair, budget):
    changed = changed_lines(*pair)
    assert len(changed) <= budget, (pair, len(changed), changed)
    if pair[0] == "ddp_launch.py" and pair[1] not in ("ddp_by_hand.py", "fsdp.py", "pipeline.py", "ddp_comm_hooks.py"):  # launcher's only
        assert not [line for line in changed if any(call in line for call in LESSON_CALLS)], changed
    if pair[1] == "fsdp.py":  # the four calls of torch.distributed.checkpoint are fsdp.py's own lines
        source = (REPO / "fsdp.py").read_text()
        assert all(call in source for call in ("get_state_dict(", "dcp.save(", "dcp.load(", "set_state_dict(")), pair
