"""The DDP chapters through their real launchers: same model as chapter 1 at world sizes 1-3, exact eval, errors."""
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.plot_curves import read_metrics
from ports import free_port
from conftest import (BASE_ENV, CUDA_DEFAULTS, REPO, TORCHRUN, assert_same_curves, load_state, max_abs_diff, one_error_line, run_script,
                      slice_args, torchrun_script)

DDP_CHAPTERS = ["ddp_launch.py", "ddp_mp.py", "ddp_tcp_manual.py", "ddp_slurm.py"]
# Chapter 1 and the DDP chapters at 1 thread per process differ only in how the gradients are summed (one
# 48-image batch, or 2-3 shards averaged by all_reduce): measured at most 3.7e-9 after SLICE's 40 steps (one float32
# step of a weight near 0.03). Allowed: 1e-6, room for other CPUs' summation orders, and 30x below what a step with
# its micro-batches weighted wrongly moves (3.4e-5, tests/mutations.py accum-one-over-k).
SAME_MODEL = 1e-6


def launch(kind, world, real_data, out, procs, timeout=60, extra=(), env=BASE_ENV):
    """Train with chapter `kind` on `world` ranks; returns (returncodes, stdout of all, stderr of all)."""
    args = [*slice_args(real_data, out), "--timeout", str(timeout), *extra]
    port = free_port()
    if kind == "mp":
        ps = [procs.start([sys.executable, "ddp_mp.py", "--nprocs", str(world), *args], env=env)]
    elif kind in ("torchrun", "by-hand"):  # by-hand: chapter 3b, DDP's job by hand, under torchrun as chapter 3
        script = "ddp_launch.py" if kind == "torchrun" else "ddp_by_hand.py"
        ps = [procs.start([*TORCHRUN, "--standalone", "--nproc-per-node", str(world), script, *args], env=env)]
    elif kind == "srun-env":  # chapter 6's tasks as one srun step starts them on one node: only its variables differ
        step = dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_NTASKS=str(world), SLURM_JOB_NODELIST="localhost",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # no scontrol to ask for the first node here
        ps = [procs.start([sys.executable, "ddp_slurm.py", *args],
                          env=dict(env, **step, SLURM_PROCID=str(r), SLURM_LOCALID=str(r))) for r in range(world)]
    else:
        init = f"tcp://127.0.0.1:{port}" if kind == "tcp" else f"file://{out}.rdzv"
        ps = [procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", init, "--rank", str(r),
                           "--world-size", str(world), *args], env=env) for r in range(world)]
    results = [procs.wait(p) for p in ps]
    return [r[0] for r in results], "".join(r[1] for r in results), "".join(r[2] for r in results)


def _accuracy_lines(log):
    return re.findall(r"Accuracy: [\d.]+%", log)


def _test_losses(log):
    return [float(x) for x in re.findall(r"Avg loss: ([\d.]+)", log)]


# srun-env: ddp_slurm.py's two tasks started with the variables srun gives them, where no SLURM is installed (`make
# test`); tests/test_slurm.py submits the real job to a real cluster.
CASES = [("mp", 1), ("mp", 2), ("mp", 3), ("torchrun", 1), ("torchrun", 2), ("torchrun", 3),
         ("tcp", 2), ("tcp", 3), ("file", 2), ("file", 3), ("srun-env", 2), ("by-hand", 2), ("by-hand", 3)]


@pytest.mark.parametrize("kind,world", CASES, ids=[f"{k}-{w}" for k, w in CASES])
def test_ddp_trains_the_same_model(kind, world, real_data, reference, tmp_path, procs):
    codes, out, err = launch(kind, world, real_data, tmp_path / "run", procs)
    assert codes == [0] * len(codes), err
    ref_state, ref_log, ref_metrics = reference
    assert max_abs_diff(ref_state, load_state(tmp_path / "run" / "model.pth")) <= SAME_MODEL
    assert_same_curves(read_metrics(tmp_path / "run"), ref_metrics)  # rank 0's metrics.jsonl: the same curve
    # Exact evaluation: the same accuracy over all 500 test images, whatever the world size.
    assert _accuracy_lines(out) == _accuracy_lines(ref_log)
    assert _test_losses(out) == pytest.approx(_test_losses(ref_log), abs=2e-6)
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
    assert _accuracy_lines(out) == _accuracy_lines(log) and f"seed={SEED}" in out


def test_two_torchrun_nodes_on_one_machine(real_data, reference, tmp_path, procs):
    """Two launchers as two nodes (node ranks 0 and 1) on 127.0.0.1 train together."""
    port = free_port()
    nodes = [procs.start([*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(n),
                          "--master-addr", "127.0.0.1", "--master-port", str(port), "ddp_launch.py",
                          *slice_args(real_data, tmp_path / "run"), "--timeout", "60"]) for n in range(2)]
    results = [procs.wait(p) for p in nodes]
    assert [r[0] for r in results] == [0, 0], results[0][2] + results[1][2]
    assert max_abs_diff(reference[0], load_state(tmp_path / "run" / "model.pth")) <= SAME_MODEL
    assert _accuracy_lines(results[0][1]) == _accuracy_lines(reference[1])


@pytest.mark.parametrize("rank,needles", [
    (1, ["no rendezvous at 127.0.0.1:{port} (torch's tries timed out after 10s each)",  # nobody at the master
         "GLOO_SOCKET_IFNAME", "firewall"]),
    (0, ["only 1 of 2 processes reached the rendezvous", "start every rank"]),  # the master's peer never comes
], ids=["unreachable-master", "missing-peer"])
def test_lone_rank_fails_within_the_timeout(rank, needles, procs):
    """The rendezvous gives up after torch's TCPStore has tried twice for --timeout (with a pause about as long as the
    timeout between the tries, torch 2.6 to 2.14), never later.

    The start-up (importing torch) is measured here, at this moment's load: the chapter's own `--help` exits right
    after its imports. A loaded machine stretches both alike.
    """
    start = time.monotonic()
    code, _, err = procs.wait(procs.start([sys.executable, "ddp_tcp_manual.py", "--help"]), timeout=120)
    assert code == 0, err
    startup = time.monotonic() - start
    port = free_port()
    start = time.monotonic()
    p = procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", f"tcp://127.0.0.1:{port}",
                     "--rank", str(rank), "--world-size", "2", "--timeout", "10"])
    code, _, err = procs.wait(p, timeout=120)
    seconds = time.monotonic() - start
    assert code == 1 and seconds < startup + 3 * 10 + 5, (seconds, startup, err)
    one_error_line(err, f"[rank {rank}]", *(n.format(port=port) for n in needles))


def test_busy_port_is_named(procs):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", f"tcp://127.0.0.1:{port}",
                         "--rank", "0", "--world-size", "2", "--timeout", "5"])
        code, _, err = procs.wait(p, timeout=60)
    # torch's own words name the port and the cause (torch 2.6 and 2.14 alike), so they stay as torch wrote them
    assert code == 1 and "Traceback" in err, err
    assert err.strip().splitlines()[-1].startswith("error: [rank 0] ") and f"port: {port}," in err, err
    assert "EADDRINUSE, message: address already in use" in err.strip().splitlines()[-1], err


# Imported by every process this test starts: in mp.spawn's workers (spawn_main's command line), take the rendezvous
# port before the workers go on, as another program on the machine may between a port's choice and its bind.
PORT_THIEF = """
import os, socket, sys
if "--multiprocessing-fork" in sys.argv and "MASTER_PORT" in os.environ:
    thief = socket.socket()
    try:
        thief.bind((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
        thief.listen()
        print(f"took port {os.environ['MASTER_PORT']}", file=sys.stderr, flush=True)
    except OSError:
        thief.close()  # held already: by the chapter's store, or by the other worker's thief
import runpy
runpy.run_path(SUITE_SITECUSTOMIZE, run_name="sitecustomize")  # the suite's own sitecustomize, as in every test
"""


def test_mp_port_cannot_be_taken_while_the_workers_start(real_data, tmp_path, procs):
    """ddp_mp.py binds its rendezvous port before it spawns: a program that takes the port meanwhile gets none.
    (A port picked free by the parent and bound by rank 0 seconds later failed once in CI with EADDRINUSE.)"""
    (tmp_path / "sitecustomize.py").write_text(PORT_THIEF.replace("SUITE_SITECUSTOMIZE", repr(str(CUDA_DEFAULTS / "sitecustomize.py"))))
    env = dict(BASE_ENV, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    p = procs.start([sys.executable, "ddp_mp.py", "--nprocs", "2", *slice_args(real_data, tmp_path / "out"),
                     "--epochs", "1", "--timeout", "30"], env=env)
    code, out, err = procs.wait(p, timeout=120)
    assert code == 0 and "took port" not in err and "Done!" in out, err


def listening_addresses(port):
    """The local addresses of this machine's sockets that listen on TCP `port`, IPv4 and IPv6 (/proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN; the address in the kernel's byte order
                raw = bytes.fromhex(address)
                found.add(socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6,
                                           b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))
    return found


def spawn_ddp_mp(monkeypatch):
    import ddp_mp
    monkeypatch.setattr(sys, "argv", ["ddp_mp.py", "--nprocs", "2", "--device", "cpu"])
    ddp_mp.main()


def spawn_preflight(monkeypatch):
    from scripts import preflight
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["preflight.py", "--nprocs", "2", "--device", "cpu"])
    preflight.main()


def spawn_benchmark_floor(monkeypatch):
    from argparse import Namespace
    from measure import benchmark
    benchmark.case_ddp_floor(Namespace(nprocs=2))


# Each parent that holds a store for the ranks mp.spawn starts on this machine, and where it tells them the port.
STORE_HOLDERS = {"ddp_mp": (spawn_ddp_mp, lambda args: args[2]),  # worker(i, cfg, world_size, port)
                 "preflight": (spawn_preflight, lambda args: int(os.environ["MASTER_PORT"])),
                 "benchmark-floor": (spawn_benchmark_floor, lambda args: args[1])}  # _floor_worker(i, args, port)


@pytest.mark.parametrize("holder", STORE_HOLDERS)
def test_spawned_ranks_store_listens_on_loopback_only(holder, monkeypatch):
    """mp.spawn's ranks all run on this machine, so the store their parent holds listens on 127.0.0.1 alone (a store
    that binds its own port listens on every interface: anyone on the network could join or feed the rendezvous)."""
    start, port_of = STORE_HOLDERS[holder]
    seen = []

    def spawn(fn, args, nprocs):  # instead of starting the ranks: what listens on the store's port as they would start
        seen.extend(listening_addresses(port_of(args)))

    monkeypatch.setattr("torch.multiprocessing.spawn", spawn)
    start(monkeypatch)
    assert seen == ["127.0.0.1"], seen


def test_wrong_interface_is_named(procs):
    env = dict(BASE_ENV, GLOO_SOCKET_IFNAME="nosuch0")
    p = procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", f"tcp://127.0.0.1:{free_port()}",
                     "--rank", "0", "--world-size", "1", "--timeout", "5"], env=env)
    code, _, err = procs.wait(p, timeout=60)
    assert code == 1
    one_error_line(err, "GLOO_SOCKET_IFNAME=nosuch0 is not a network interface of this machine")


def stale_rendezvous_file(folder):
    """A file:// rendezvous file left by a run an hour ago."""
    stale = folder / "rdzv"
    stale.write_text("old")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    return stale


# A chapter's teardown right after a collective, as rank 1 meets it (it has nothing to save): the collective's tensor
# is freed as the call returns, and its last owner may be gloo's worker thread, which needs Python's GIL to free it.
LEAVE_AFTER_A_COLLECTIVE = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
from common.ranks import destroy_process_group
rank, port, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
for i in range(rounds):
    dist.init_process_group("gloo", store=dist.PrefixStore(str(i), store), rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    dist.all_reduce(torch.ones(1))
    destroy_process_group()
print("left", rounds, "groups", flush=True)
"""


def test_leaving_the_group_after_a_collective_never_hangs(procs):
    """The chapters' teardown, 100 times in a row straight after an all-reduce. On torch 2.6 (the floor, make
    test-floor), dist.destroy_process_group() alone deadlocked within 10 rounds in 5 runs of 5 (ddp_slurm.py's rank 1
    hung so in CI); on torch 2.14 it would pass either way: torch frees the group without the GIL there."""
    port = free_port()
    ps = [procs.start([sys.executable, "-c", LEAVE_AFTER_A_COLLECTIVE, str(rank), str(port), "100"]) for rank in (0, 1)]
    for p in ps:
        code, out, err = procs.wait(p, timeout=120)
        assert code == 0 and out == "left 100 groups\n", err


def test_leftover_rendezvous_file_is_refused(tmp_path, procs):
    stale = stale_rendezvous_file(tmp_path)
    p = procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", f"file://{stale}",
                     "--rank", "0", "--world-size", "2", "--timeout", "5"])
    code, _, err = procs.wait(p, timeout=60)
    assert code == 1
    one_error_line(err, "left over", str(stale))


# The steps of a DDP chapter, each marked by the same comment in every chapter (`grep -n "# Step" ddp_*.py`), and
# the calls that make each step, in the order a reader meets them going down the file.
STEPS = [("who am I", []), ("device", ["set_device("]), ("init", ["init_process_group("]),
         ("teardown", ["\n        destroy_process_group()"]),  # in main()'s finally, around train()'s call
         ("data", ["locate_fashion_mnist(", "dist.barrier()", "DistributedSampler(", "DataLoader(train_set"]),
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
    source_of_ranks = {"ddp_launch.py": 'os.environ["RANK"]', "ddp_by_hand.py": 'os.environ["RANK"]', "diloco.py": 'os.environ["RANK"]',
                       "ddp_mp.py": "def worker(rank,",
                       "ddp_tcp_manual.py": "cfg.rank", "ddp_slurm.py": 'os.environ["SLURM_PROCID"]',
                       "fsdp.py": 'os.environ["RANK"]', "tensor_parallel.py": 'os.environ["RANK"]',
                       "pipeline.py": 'os.environ["RANK"]'}
    assert source.find(source_of_ranks[script]) < source.find("# Step 2, device:")
    # The teardown is the finally of the try around everything after init, so it runs after an error too.
    assert re.search(r"^    try:\n        train\(cfg, ctx\).*\n    finally:  # Step 8, teardown:.*\n"
                     r"        destroy_process_group\(\)  # dist\.destroy_process_group\(\), .*$", source, re.M), script


@pytest.mark.parametrize("script", ["single_gpu.py", "dataparallel.py"])
def test_chapters_1_and_2_mark_the_steps_they_share(script):
    source = (REPO / script).read_text()
    expected = [(2, "device"), (4, "data"), *([(5, "wrap")] if script == "dataparallel.py" else []), (6, "epochs"),
                (7, "save")]
    assert step_markers(source) == expected


def test_no_hand_built_store_on_the_default_path():
    """The chapters meet through torch's own rendezvous for their init_method: no rank builds a TCPStore itself.
    ddp_mp.py is its own launcher: its parent holds the store, as torchrun's agent does
    (test_mp_port_cannot_be_taken_while_the_workers_start)."""
    for path in [*REPO.glob("*.py"), *REPO.glob("common/*.py")]:
        source = path.read_text()
        if path.name == "ddp_mp.py":
            main_body = source[source.index("def main("):source.index("mp.spawn(")]
            assert "is_master=True" in main_body and source.count("is_master=True") == 1, "one store, before spawn"
        else:
            assert "TCPStore(" not in source, path


# What a reader reads with the README's diff commands: changed lines (`diff A B`'s < and > lines), each budget a
# bound on the lesson of that pair. Between DDP chapters the diff may hold the launcher's lines only: where rank,
# local rank and world size come from, how the processes start, the rendezvous. Chapters 2, 9 and 10 hold code only
# they use: DataParallel's replica dtype (about 25 lines); tensor parallel's flag checks, the 2-D notices it hides
# and its mesh's groups, made with --timeout (about 35); a pipeline stage's own epoch and evaluation, its loss, padding, timetable, weights gather and flag
# checks (about 160, the stage's step: one schedule.step() with the images on the first stage, the labels on the last).
# The DDP chapters' --comm-hook (its flag, import, one bucket for PowerSGD, registration and state passed to the
# snapshot) is DDP's lesson and not FSDP2's: 9 more lines against chapter 1, 4 against fsdp.py, none between them.
# Chapter 4 holds the ranks' store in its parent, bound before the workers start, as torchrun's agent does, on
# loopback alone (a socket bound there and handed to the store): 10 lines.
# Chapter 5 declares its four flags itself (--init-method, --rank, --world-size, --local-rank: how each process it
# starts by hand learns who it is), and chapter 6 finds its rank 0 itself (the job's first node from `scontrol show
# hostnames`, the port from the job id, and one line outside an srun step): each chapter's lesson, in the chapter.
# Chapter 3b (ddp_by_hand.py) is chapter 3 with DDP's two jobs done by hand: rank 0's weights broadcast, the
# gradients all-reduced and averaged before each step (an optimizer step pre-hook), fp16 refused and so no loss
# scaler (about 53 lines). Chapter 11 (diloco.py) is chapter 3b with the ranks left apart: its flags and their checks
# (about 30 lines), the inner optimizer's step post-hook in place of the pre-hook, the shared weights evaluated and
# saved, the last sync, and the outer loop (class DiLoCo: pseudo-gradient, async all-reduce, outer SGD, its snapshot
# state, about 120 lines), all of it the lesson.
# Chapter 4 holds how a spawned worker ends (`spawned`, 11 lines) and chapter 5 what its --init-method accepts
# (`rendezvous_url`, `check_file_rendezvous`, 22 lines): code only they use, in them (issue 40: not in every DDP
# chapter's reach). A DDP chapter's test loader takes two lines where chapter 1's takes one (collate_fn).
DIFF_BUDGETS = {("single_gpu.py", "dataparallel.py"): 50, ("single_gpu.py", "ddp_launch.py"): 81,
                ("ddp_launch.py", "ddp_by_hand.py"): 53, ("ddp_by_hand.py", "diloco.py"): 185, ("ddp_launch.py", "ddp_mp.py"): 71, ("ddp_launch.py", "ddp_tcp_manual.py"): 79,
                ("ddp_launch.py", "ddp_slurm.py"): 55, ("ddp_launch.py", "fsdp.py"): 93,
                ("fsdp.py", "tensor_parallel.py"): 165, ("ddp_launch.py", "pipeline.py"): 262}
LESSON_CALLS = ("DistributedSampler(", "DataLoader(", "DDP(", "set_epoch(", "train_one_epoch(", "save_weights(",
                "locate_fashion_mnist(", "barrier(", "StopAtTimeLimit", "time_limit")


def changed_lines(a, b):
    diff = subprocess.run(["diff", a, b], cwd=REPO, capture_output=True, text=True).stdout
    return [line[2:] for line in diff.splitlines() if line[:2] in ("< ", "> ")]


# How each strategy holds a micro-batch's gradients back (--accum-steps): its own line, in its chapter, passed to the
# one loop (tests/collective_counter.py counts on the wire that the loop then sends them once per optimizer step).
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
    if pair[0] == "ddp_launch.py" and pair[1] not in ("ddp_by_hand.py", "fsdp.py", "pipeline.py"):  # launcher's only
        assert not [line for line in changed if any(call in line for call in LESSON_CALLS)], changed
    if pair[1] == "fsdp.py":  # the four calls of torch.distributed.checkpoint are fsdp.py's own lines
        source = (REPO / "fsdp.py").read_text()
        assert all(call in source for call in ("get_state_dict(", "dcp.save(", "dcp.load(", "set_state_dict(")), pair


def test_ranks_started_with_different_flags_stop_with_one_line(procs):
    """Different --train-samples give the ranks different step counts; gloo would abort on the first mismatch."""
    init = f"tcp://127.0.0.1:{free_port()}"
    ranks = [procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", init, "--rank", str(r), "--world-size",
                          "2", "--train-samples", str(samples), "--timeout", "30"]) for r, samples in ((0, 960), (1, 480))]
    for rank, p in enumerate(ranks):
        code, out, err = procs.wait(p, timeout=90)
        assert code == 1 and "Epoch" not in out, err
        one_error_line(err, f"[rank {rank}] rank {1 - rank} was started with --train-samples",
                       "start every rank with the same flags")
