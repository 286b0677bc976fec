"""The suite's fixtures and pytest hooks: the data, chapter 1's reference run, processes a test starts, a SLURM cluster,
two machines; `make test`'s set (QUICK), and the workers' groups. What the tests share besides fixtures is in
tests/support/, the programs they start in tests/programs/."""
import importlib
import os
import time
from pathlib import Path

import pytest

from support.data import make_fake_fashion_mnist, real_data_dir  # support first: it puts the project on sys.path
from support.cpu_time import pytest_runtest_protocol  # noqa: F401  (a hook: TESTS_CPU_LOG=FILE, CPU seconds per test)
from support.run import Procs
from support.shared_runs import chapter_1_reference

# The pytest process takes CUDA's defaults where the CPU's differ, as every process it starts does (support/run.py's
# BASE_ENV puts tests/programs/cuda_defaults on their PYTHONPATH). TUTORIAL_CPU_DEFAULTS=1 leaves the CPU's.
if os.environ.get("TUTORIAL_CPU_DEFAULTS") != "1":
    from programs.cuda_defaults.sitecustomize import TARGET, play_cuda_defaults

    play_cuda_defaults(importlib.import_module(TARGET))


# `make test`: what a newcomer runs first, under 10 minutes on 2 cores, on any machine (no SLURM, no network
# namespaces, no root): every chapter once through its real launcher on a slice of the real data, training chapter
# 1's model, and the tests that take no more than a few seconds. `make test-all` runs every test (.ci/run does).
# An entry is the start of test ids: a module, a test (all its cases) or one case; docs/tests.md says what each proves.
QUICK = [
    # every chapter, through its launcher, trains chapter 1's model
    "tests/test_chapters_1_and_2.py::test_chapter_trains_and_saves[single_gpu.py]",
    "tests/test_chapters_1_and_2.py::test_dataparallel_trains_the_same_model",
    "tests/test_ddp.py::test_ddp_trains_the_same_model[torchrun-2]",
    "tests/test_ddp.py::test_ddp_trains_the_same_model[mp-2]",
    "tests/test_ddp.py::test_ddp_trains_the_same_model[tcp-2]",
    "tests/test_ddp.py::test_ddp_trains_the_same_model[srun-env-2]",
    "tests/test_ddp.py::test_ddp_trains_the_same_model[by-hand-2]",
    "tests/test_rendezvous.py::test_leaving_the_group_after_a_collective_never_hangs",
    "tests/test_fsdp.py::test_fsdp_trains_the_same_model[2]",
    "tests/test_debug_hang.py::test_broken_case_fails_soon_naming_the_mismatch[eval-on-rank0]",
    "tests/test_debug_hang.py::test_fix_trains_chapter_1s_model[eval-on-rank0]",
    "tests/test_tensor_parallel.py::test_tensor_parallel_trains_the_same_model[2ranks-dp1]",
    "tests/test_pipeline.py::test_the_pipeline_trains_the_same_model[2stages-1f1b]",
    "tests/test_diloco.py::test_diloco_trains_post_local_sgds_model[2]",
    "tests/test_fault_tolerance.py::test_two_groups_train_chapter_1s_model",
    "tests/test_fault_tolerance.py::test_the_refusals_are_one_line_each",
    # the template a reader copies: plain python and torchrun at 1 and 2 ranks, chapter 1's model
    "tests/test_template.py",
    # the chapters read as the lesson, and refuse what cannot work in one line
    "tests/test_chapters_read_as_the_lesson.py::test_each_ddp_chapter_reads_as_the_lesson_top_to_bottom",
    "tests/test_chapters_read_as_the_lesson.py::test_chapters_1_and_2_mark_the_steps_they_share",
    "tests/test_chapters_read_as_the_lesson.py::test_chapter_12_reads_as_the_lesson_top_to_bottom",
    "tests/test_chapters_read_as_the_lesson.py::test_chapter_diffs_stay_within_their_budget",
    "tests/test_rendezvous.py::test_spawned_ranks_store_listens_on_loopback_only",
    "tests/test_bad_flags.py::test_bad_flag_exits_2_with_one_line",
    "tests/test_training_flags.py::test_flags_that_cannot_work_are_one_line",
    # the units: data, model and loop, flags, errors, the GPU path played on the CPU
    "tests/test_cli.py", "tests/test_errors.py", "tests/test_model_engine.py",
    "tests/test_cuda_defaults_and_no_host_sync.py", "tests/test_gpu_path_with_fake_gpus.py",
    "tests/test_gpu_suite_coverage.py", "tests/test_data.py::test_a_damaged_file_is_one_line",
    "tests/test_data.py::test_load_from", "tests/test_data.py::test_batches_match_torchvision_totensor",
    "tests/test_data.py::test_union_of_rank_batches",
    "tests/test_data.py::test_shards_of_the_test_set_hold_each_image_once", "tests/test_data.py::test_loader_batches",
    "tests/test_preflight.py::test_bus_bandwidth_is_nccl_tests_busbw",
    "tests/test_docs.py::test_every_doc_command_is_known",
    # the torch range: what a chapter refuses on a torch too old for it (all of them on the floor, make test-floor)
    "tests/test_torch_range.py", "tests/test_gpu_suite_coverage.py::test_every_flag_has_a_cuda_twin",
]


# The tests whose processes start cold, as a user's do (every other torchrun run's workers are forked from a warm
# zygote: support/zygote.py). Their subject is the start itself, or what a cold start changes: a test id's start
# here, each with why; every QUICK test (each chapter's run through its launcher, and the floor's set); and every
# test whose name says it runs as a user runs it.
COLD = {
    "tests/test_docs.py": "the docs' commands, as a user types them",
    "tests/test_rendezvous.py": "the workers' start: ports, stores and rendezvous",
    "tests/test_killed_and_stopped_ranks.py": "a worker killed by a signal, as torchrun sees its own die",
    "tests/test_snapshots_and_resume.py": "a worker killed, or stopped by SIGUSR1, and its run resumed",
    "tests/test_pipeline.py::test_a_stage_whose_peer_stops_answering": "a worker frozen by SIGSTOP",
    "tests/test_tensor_parallel.py::test_a_2d_rank_whose_peer_stops_answering": "a worker frozen by SIGSTOP",
    "tests/test_multinode.py::test_elastic_restart_across_two_machines": "a worker killed, torchrun's restart",
    "tests/test_fault_tolerance.py": "a group killed, restarted and healed",
    "tests/test_debug_hang.py": "py-spy and the flight recorder find the workers among torchrun's children",
    "tests/test_errors.py": "a failing worker's exit and teardown",
    "tests/test_torch_range.py": "what a worker refuses at its start on a torch too old",
    "tests/test_slurm_env.py": "the thread count set before torch starts",
    "tests/test_cuda_defaults_and_no_host_sync.py": "what every process takes at its start",
}
AS_A_USER = ("as_a_user_runs_it", "as_users_run_it", "as_a_user_runs_them", "users_shell")


def must_start_cold(nodeid):
    """Whether the test's processes must start as a user's do: a new interpreter each (COLD's rule)."""
    return (nodeid.startswith(tuple(COLD)) or nodeid.startswith(tuple(QUICK))
            or any(words in nodeid for words in AS_A_USER))


@pytest.fixture(autouse=True)
def _cold_or_warm(request):
    """Let the test start torchrun's workers warm unless it must start cold; after a cold one, check that the zygote
    forked nothing while it ran (one zygote per pytest process, one test at a time in each)."""
    from support import zygote

    cold, started = must_start_cold(request.node.nodeid), time.time()
    zygote.allowed = not cold
    yield
    zygote.allowed = False
    if cold:
        warm = [f for f in zygote.forks(started) if f[1] == "fork"]
        assert not warm, f"{request.node.nodeid} must start cold, but {len(warm)} of its processes were forked warm"


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: in `make test` (QUICK in tests/conftest.py)")


# The tests of a SLURM cluster (those that use the slurm or two_nodes fixture), in two groups: each group runs on one
# worker, which starts its own cluster (its own ports, folders and job ids), so the two groups run side by side.
SLURM_TESTS = {
    "slurm": ("tests/test_slurm.py", "tests/test_preflight_slurm.py", "tests/test_slurm_cluster.py",
              "tests/test_training_flags.py::test_16_bits_under_srun"),
    "slurm-requeue": ("tests/test_slurm_requeue.py",),
}


def group_of(nodeid):
    """The worker group of a test: a SLURM group; a document's (or a section's) commands in tests/test_docs.py alone,
    as they share no fixture; else its module, so a module's module-wide runs are made once."""
    for group, entries in SLURM_TESTS.items():
        if nodeid.startswith(entries):
            return group
    return nodeid if nodeid.startswith("tests/test_docs.py::test_doc_commands_run[") else nodeid.split("::")[0]


# Each group's wall seconds in a recorded run (python tests/support/cpu_time.py LOG writes them from a TESTS_CPU_LOG):
# `make test-all`'s workers take the longest groups first, so that no long group starts last and runs alone.
COSTS = Path(__file__).parent / "recorded" / "group_seconds.tsv"


def by_cost(items):
    """items with the groups in order of their recorded cost, longest first (a group not recorded: its tests' count
    times the recorded mean per test); the tests of a group in their own order."""
    recorded = {}
    if COSTS.exists():
        recorded = {group: float(s) for s, group in (line.split("\t") for line in COSTS.read_text().splitlines())}
    groups = {}
    for item in items:
        groups.setdefault(group_of(item.nodeid), []).append(item)
    per_test = sum(recorded.values()) / max(1, sum(len(g) for name, g in groups.items() if name in recorded))
    cost = {name: recorded.get(name, per_test * len(tests)) for name, tests in groups.items()}
    return [item for name in sorted(groups, key=lambda name: -cost[name]) for item in groups[name]]


@pytest.hookimpl(optionalhook=True)  # a known hook only where pytest-xdist is installed
def pytest_xdist_make_scheduler(config, log):
    """`make test-all`'s two workers (pytest -n 2 --dist loadgroup) take whole groups (group_of). xdist's own loadgroup
    reads the groups from marks it writes into each test's id, which pytest 9.2 no longer takes (pytest-xdist#1386):
    every test was then scheduled alone, and a module's fixtures ran on both workers."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return group_of(nodeid)

    config.option.loadscopereorder = False  # the groups in the order collected: by_cost's
    return ByGroup(config, log)


def pytest_collection_modifyitems(config, items):
    """Mark the tests QUICK names (every entry must name a test that exists); check that SLURM_TESTS holds every test
    of a SLURM cluster."""
    unused = set(QUICK)
    for item in items:
        if {"slurm", "two_nodes"} & set(getattr(item, "fixturenames", ())) and group_of(item.nodeid) not in SLURM_TESTS:
            raise pytest.UsageError(f"{item.nodeid} starts a SLURM cluster: add it to conftest.SLURM_TESTS")
        for entry in QUICK:
            if item.nodeid.startswith(entry):
                item.add_marker(pytest.mark.quick)
                unused.discard(entry)
    if len(items) > 400 and unused:  # the whole suite was collected: a stale entry would drop a test silently
        raise pytest.UsageError(f"conftest.QUICK names tests that do not exist: {sorted(unused)}")
    if getattr(config.option, "loadgroup", False):  # on xdist's workers, whose collection the scheduler takes
        items[:] = by_cost(items)


@pytest.fixture(autouse=True)
def _restore_environ():
    """Tests may change os.environ; put it back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def procs():
    """Start processes with procs.start(cmd); every one still running at the end is killed with its children."""
    ps = Procs()
    yield ps
    ps.close()


@pytest.fixture(scope="module")
def procs_module():
    """procs for module-scoped fixtures: every process still running at the end of the module is killed."""
    ps = Procs()
    yield ps
    ps.close()


@pytest.fixture
def fake_data(tmp_path):
    """A data folder with a small fake FashionMNIST, as torchvision reads it."""
    folder = tmp_path / "fmnist"
    make_fake_fashion_mnist(folder)
    return folder


@pytest.fixture(scope="session")
def real_data():
    """The real FashionMNIST folder. Skips where it is absent, except in CI, which installs it and must use it."""
    folder = real_data_dir()
    if folder is None:
        msg = "real FashionMNIST not found (make test installs dataset-fashion-mnist)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return folder


@pytest.fixture(scope="session")
def reference(real_data, tmp_path_factory):
    """single_gpu.py on SLICE: (state_dict, stdout, metrics), the model every distributed run must reproduce (made
    once for both workers: support/shared_runs.py)."""
    return chapter_1_reference(tmp_path_factory, real_data)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A running one-node SLURM cluster. Skips where SLURM cannot be installed, except in CI, which must have it."""
    from support.slurm_cluster import LocalSlurm, ensure_slurm_installed

    reason = ensure_slurm_installed()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    with LocalSlurm(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture
def two_machines():
    """Two network namespaces as two machines (measure/netns.py's TwoMachines), where they can be made."""
    from measure.netns import TwoMachines
    from support.two_machines import need_namespaces

    need_namespaces()
    with TwoMachines() as net:
        yield net
