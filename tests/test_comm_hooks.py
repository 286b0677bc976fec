"""--comm-hook: torch's DDP communication hooks in chapter 11b (ddp_comm_hooks.py), their state in --snapshot, and
the refusals.

What each hook sends, step by step, and the gradient it leaves: test_each_comm_hook_value_sends_what_it_names;
the bytes per step on the shaped link: tests/test_scaling.py.
"""
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.model import NeuralNetwork
from common.ranks import cpu_threads
from measure.harness import descendants
from support import REPO
from support.launchers import TORCHRUN_ENV, launch
from support.ports import free_port
from support.long_runs import Watched, args_for, environ_of
from support.run import BASE_ENV, Runs, run_code, run_forked_cases, run_script
from support.same_model import accuracy_lines, load_state, max_abs_diff, slice_args

RESUMED = 0.0  # a resumed run against the uninterrupted one: the same steps, in the same memory layout


def train(kind, world, real_data, out, procs, *flags):
    codes, log, err = launch(kind, world, real_data, out, procs, extra=flags)
    assert set(codes) == {0}, err
    return log


@pytest.fixture(scope="module")
def first_epochs(real_data, tmp_path_factory, procs_module):
    """Epoch 1 of a 2-rank run with --snapshot, by (kind, flags), each made when a test first asks for it (two tests
    resume chapter 11b's PowerSGD one): the folder holding its run/ and snap.pt. A test copies it and resumes the copy."""
    def make(case):
        kind, flags = case
        folder = tmp_path_factory.mktemp("epoch-1")
        train(kind, 2, real_data, folder / "run", procs_module, *flags, "--snapshot", str(folder / "snap.pt"),
              "--epochs", "1")
        return folder

    return Runs(make)


def resume_from(first_epochs, kind, flags, tmp_path, run):
    """A copy of (kind, flags)'s epoch 1 in tmp_path: run/ as tmp_path/run, its snapshot as tmp_path/snap.pt."""
    folder = first_epochs[kind, tuple(flags)]
    shutil.copytree(folder / "run", tmp_path / run)
    shutil.copy2(folder / "snap.pt", tmp_path / "snap.pt")


@pytest.mark.parametrize("hook,flags", [("powersgd", ()), ("powersgd:2:5", ()), ("localsgd:4:3", ("--momentum", "0.9"))],
                         ids=["powersgd", "powersgd:2:5", "localsgd:4:3-momentum"])
def test_a_hook_with_state_resumes_as_the_uninterrupted_run(hook, flags, first_epochs, real_data, tmp_path, procs):
    """PowerSGD's residuals (each rank's own), factors and step count go into --snapshot: epoch 2 of a resumed run is
    epoch 2 of the uninterrupted one. A new DDP's first step holds its bucket in the model's order, later steps in
    the reverse: the residuals kept in the one are put in the order of the other. Post-local SGD's step counts go in
    too, and each epoch ends with the ranks' weights and momentum averaged: rank 0's snapshot is every rank's."""
    straight = train("hooks", 2, real_data, tmp_path / "straight", procs, "--comm-hook", hook, *flags)
    resume_from(first_epochs, "hooks", ["--comm-hook", hook, *flags], tmp_path, "resumed")
    log = train("hooks", 2, real_data, tmp_path / "resumed", procs, "--comm-hook", hook, *flags, "--snapshot",
                str(tmp_path / "snap.pt"))
    assert "Resuming from" in log and "1 of 2 epochs done" in log, log
    assert max_abs_diff(load_state(tmp_path / "straight" / "model.pth"),
                        load_state(tmp_path / "resumed" / "model.pth")) <= RESUMED
    assert accuracy_lines(log)[-1] == accuracy_lines(straight)[-1]



# The environment a user's shell has: no OMP_NUM_THREADS, nothing on PYTHONPATH (so no tests/programs/cuda_defaults
# either).
USER_ENV = {k: v for k, v in BASE_ENV.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}


@pytest.mark.parametrize("kind,hook", [("hooks", "powersgd:2"), ("mp", "none"), ("tcp", "none")])
def test_the_same_command_trains_the_same_model_as_users_run_it(kind, hook, real_data, tmp_path, procs):
    """The same seed twice, and a resumed run against the uninterrupted one, in the user's environment. torch's
    set_num_threads() sets its caller's count, and another thread's only at that thread's first parallel loop; gloo's
    threads run PowerSGD's callbacks, whose first matrix products on each then used all the cores (rank 2's differ
    from one thread's in the last bits), at whichever steps those threads happened to get them: 1e-8 here between two
    runs. torchrun's workers and chapter 4's start with OMP_NUM_THREADS; ranks started by hand: docs/snapshots.md."""
    flags = [*(["--comm-hook", hook] if hook != "none" else []), "--train-samples", "480"]
    runs = {name: launch(kind, 2, real_data, tmp_path / name, procs, extra=flags, env=USER_ENV) for name in ("a", "b")}
    snap = [*flags, "--snapshot", str(tmp_path / "snap.pt")]
    for name, epochs in (("stopped", ["--epochs", "1"]), ("resumed", [])):
        runs[name] = launch(kind, 2, real_data, tmp_path / "resumed", procs, extra=[*snap, *epochs], env=USER_ENV)
    for codes, _, err in runs.values():
        assert set(codes) == {0}, err
    assert "Resuming from" in runs["resumed"][1]
    weights = {name: load_state(tmp_path / name / "model.pth") for name in ("a", "b", "resumed")}
    assert [max_abs_diff(weights["a"], weights[name]) for name in ("b", "resumed")] == [RESUMED, RESUMED]


def test_chapter_4s_workers_start_with_their_share_of_the_cores_as_a_user_runs_it(real_data, tmp_path, procs):
    """What the test above rests on, on every CPU: whether one thread count or another moves PowerSGD's last bits
    depends on the CPU's matrix kernels (on some, two runs with gloo's threads at all the cores end equal anyway).
    mp.spawn's workers start with OMP_NUM_THREADS at their share of the cores, as torchrun's do, so every thread in
    them starts with it, gloo's included; torch.set_num_threads() in a worker would set only its caller's."""
    run = Watched(procs, [sys.executable, "ddp_mp.py", *args_for(real_data, tmp_path / "run")], env=USER_ENV)
    run.wait_for("Epoch 1")
    workers = [pid for pid in descendants(run.proc.pid)
               if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
    environs = [environ_of(pid) for pid in workers]
    procs.kill(run.proc)
    assert len(workers) == 2, workers
    assert [env.get("OMP_NUM_THREADS") for env in environs] == [str(cpu_threads(2))] * 2


def each_rank_line_says(err, world, needle):
    """Every rank reads the snapshot itself, so each may print the line, tagged [rank N]; torchrun stops the others
    as soon as one has failed, so at least one does. Each says needle, and no rank prints a traceback: before
    torchrun's failure summary (which repeats each worker's recorded traceback) the one traceback is torchrun's own."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    ranks = [line[:15] for line in lines]
    assert lines and len(set(ranks)) == len(ranks), err
    assert set(ranks) <= {f"error: [rank {r}]" for r in range(world)}, err
    assert all(needle in line for line in lines), err
    before_summary = err.split("errors.ChildFailedError:")[0]
    assert before_summary != err and before_summary.count("Traceback (most recent call last)") == 1, err


def test_powersgd_snapshot_at_another_world_size_is_one_line_per_rank(first_epochs, real_data, tmp_path, procs):
    resume_from(first_epochs, "hooks", ["--comm-hook", "powersgd"], tmp_path, "run")  # at SLICE's --batch-size 48
    codes, _, err = launch("hooks", 3, real_data, tmp_path / "run", procs,
                           extra=["--comm-hook", "powersgd", "--snapshot", str(tmp_path / "snap.pt")])
    assert codes == [1], err
    each_rank_line_says(err, 3, f"snapshot {tmp_path / 'snap.pt'} holds PowerSGD's residuals of 2 ranks, this run has 3")


def test_resuming_with_another_hook_is_one_line_per_rank(real_data, tmp_path, procs):
    snap = ["--snapshot", str(tmp_path / "snap.pt")]
    train("hooks", 2, real_data, tmp_path / "run", procs, *snap, "--epochs", "1")
    codes, _, err = launch("hooks", 2, real_data, tmp_path / "run", procs, extra=[*snap, "--comm-hook", "bf16"])
    assert codes == [1], err
    each_rank_line_says(err, 2, "was made with --comm-hook none, this run has --comm-hook bf16")


REFUSED = {
    "not-ddp": (["single_gpu.py", "--comm-hook", "bf16"], "unrecognized arguments: --comm-hook bf16"),
    "fsdp": (["fsdp.py", "--comm-hook", "powersgd"], "unrecognized arguments: --comm-hook powersgd"),
    "chapter-3": (["ddp_launch.py", "--comm-hook", "bf16"], "unrecognized arguments: --comm-hook bf16"),
    "chapter-4": (["ddp_mp.py", "--comm-hook", "powersgd"], "unrecognized arguments: --comm-hook powersgd"),
    "rank-0": (["ddp_comm_hooks.py", "--comm-hook", "powersgd:0"],
               "argument --comm-hook: must be none, bf16, fp16, powersgd[:RANK[:START]] or localsgd:H[:START]"),
    "start-1": (["ddp_comm_hooks.py", "--comm-hook", "powersgd:1:1"], "(RANK >= 1, START >= 2, H >= 2; e.g. powersgd:4, "
                "localsgd:16), got powersgd:1:1"),
    "period-1": (["ddp_comm_hooks.py", "--comm-hook", "localsgd:1"], "H >= 2; e.g. powersgd:4, localsgd:16), got "
                 "localsgd:1"),
    "localsgd-fp16": (["ddp_comm_hooks.py", "--comm-hook", "localsgd:8", "--precision", "fp16"],
                      "--comm-hook localsgd cannot train with --precision fp16: each rank's GradScaler"),
    "powersgd-fp16": (["ddp_comm_hooks.py", "--comm-hook", "powersgd:2:5", "--precision", "fp16"],
                      "--comm-hook powersgd cannot train with --precision fp16: one overflowed step leaves NaN"),
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


# A PowerSGD state made by DDP's real hook at world size 1 (3 steps: 2 plain, then a compressed one), written into a
# snapshot file by all_gather_hook_state, read back by read_snapshot, and loaded into a new hook with every tensor
# behaving as the tensors a load onto a GPU gives (map_location=cuda:N): their values cannot become a numpy array.
DEVICE_LOAD = """
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from common.checkpoint import SNAPSHOT_FORMAT, atomic_save, read_snapshot
from common.comm_hooks import register_comm_hook
from common.cli import Config
from common.model import NeuralNetwork
from common.ranks import DistContext, destroy_process_group

class OnTheGpu(torch.Tensor):
    # What a CUDA tensor refuses: .numpy() (TypeError); .cpu() gives a plain host tensor, as on a GPU.
    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                        "host memory first.")
    def cpu(self, *args, **kwargs):
        return torch.Tensor.cpu(self.as_subclass(torch.Tensor), *args, **kwargs)

def on_the_gpu(x):
    if isinstance(x, torch.Tensor):
        return x.as_subclass(OnTheGpu)
    if isinstance(x, dict):
        return {k: on_the_gpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(on_the_gpu(v) for v in x)
    return x

def trained_hook():
    torch.manual_seed(0)
    model = DDP(NeuralNetwork(), bucket_cap_mb=25)
    cfg = Config()
    cfg.comm_hook = "powersgd"
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    hook = register_comm_hook(model, cfg, optimizer, range(3))
    for _ in range(3):
        model(torch.rand(8, 1, 28, 28)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, hook

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}.rdzv", rank=0, world_size=1)
ctx = DistContext()
_, saved = trained_hook()
atomic_save(dict(format=SNAPSHOT_FORMAT, comm_hook=saved.all_gather(ctx)), sys.argv[1])
snapshot = read_snapshot(sys.argv[1], SNAPSHOT_FORMAT)
_, loaded = trained_hook()
loaded.load(on_the_gpu(snapshot["comm_hook"]), ctx, sys.argv[1])
same = [loaded.state.iter == saved.state.iter] + [torch.equal(mine[0], theirs[0]) for mine, theirs in (
        (list(loaded.state.error_dict.values()), list(saved.state.error_dict.values())),
        (list(loaded.state.q_memory_dict.values()), list(saved.state.q_memory_dict.values())))]
print("resumed:", all(same), same, flush=True)
destroy_process_group()
"""


def test_a_powersgd_snapshot_loads_onto_a_gpu(tmp_path):
    """On a GPU a snapshot loads straight onto the rank's device: the hook's state must come back whole from tensors
    that cannot become numpy arrays (numpy's random-state keys once did: every rank stopped with a TypeError; they
    are no longer saved, as warm_start draws Q once per bucket and keeps it)."""
    proc = run_code(DEVICE_LOAD, tmp_path / "snap.pt")
    assert "resumed: True" in proc.stdout, proc.stdout


# One overflow in fp16 (an inf in the loss at step 4, after PowerSGD's START of 2) on a DDP of one rank (gloo), with
# each hook through the chapters' register_comm_hook and a GradScaler as the chapters make it: per step, whether the
# weights moved (the scaler steps, or skips the step when a gradient is not finite), and whether the chapters refuse
# the hook with --precision fp16.
OVERFLOW = """
import json, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from common.cli import Config
from common.comm_hooks import ONE_BUCKET_MB, check_comm_hook, register_comm_hook
from common.model import NeuralNetwork
from common.ranks import destroy_process_group

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
torch.manual_seed(0)
batch = torch.rand(64, 1, 28, 28), torch.randint(0, 10, (64,))
report = {}
for value in sys.argv[2:]:
    cfg = Config(precision="fp16")
    cfg.comm_hook = value
    model = DDP(NeuralNetwork(), bucket_cap_mb=ONE_BUCKET_MB if value.startswith("powersgd") else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    register_comm_hook(model, cfg, optimizer, range(100))
    moved = []
    for step in range(1, 9):
        before = model.module.linear_relu_stack[0].weight.clone()
        optimizer.zero_grad()
        with torch.autocast("cpu", torch.float16):
            loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
        scaler.scale(loss * (float("inf") if step == 4 else 1.0)).backward()
        scaler.step(optimizer)
        scaler.update()
        moved.append(not torch.equal(before, model.module.linear_relu_stack[0].weight))
    report[value] = dict(moved=moved, refused=check_comm_hook(cfg) is not None)
print(json.dumps(report), flush=True)
destroy_process_group()
"""


def test_powersgd_never_recovers_from_one_fp16_overflow_so_it_is_refused(tmp_path):
    """Without a hook, or with fp16's, the scaler skips the step that overflowed and trains on. torch's PowerSGD adds
    each bucket's residual to the next gradient: the inf leaves NaN there for good, every later gradient is NaN and
    every later step is skipped while the loss scale falls. The chapters refuse exactly the hook that stalls (if
    torch's hook learns to recover, this test fails: lift the refusal)."""
    report = json.loads(run_code(OVERFLOW, tmp_path / "rdzv", "none", "fp16", "powersgd").stdout)
    trains_on, stalls = [True] * 3 + [False] + [True] * 4, [True] * 3 + [False] * 5
    assert {value: r["moved"] for value, r in report.items()} == dict(none=trains_on, fp16=trains_on, powersgd=stalls)
    assert {value: r["refused"] for value, r in report.items()} == dict(none=False, fp16=False, powersgd=True)


def one_rank():
    """torchrun's variables for a world of one rank, as `torchrun --nproc-per-node 1` sets them."""
    return dict(TORCHRUN_ENV, WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_PORT=str(free_port()))


def test_localsgd_saves_the_weights_alone(real_data, tmp_path):
    """torch's average_parameters would leave each weight a view into one flat buffer that at an epoch's end holds
    SGD's momentum too, and torch.save writes a view's whole buffer: model.pth doubled (5,359,977 bytes). After the
    epoch's average, model.pth is as large as chapter 1's, and each tensor of the snapshot holds its own bytes."""
    proc = run_script("ddp_comm_hooks.py", "--comm-hook", "localsgd:4", "--momentum", "0.9", "--snapshot",
                      tmp_path / "snap.pt", *slice_args(real_data, tmp_path), "--epochs", "1", env=one_rank())
    assert proc.returncode == 0, proc.stderr
    weights = io.BytesIO()
    torch.save(NeuralNetwork().state_dict(), weights)  # as atomic_save writes it: 2,681,749 bytes
    assert (tmp_path / "model.pth").stat().st_size == len(weights.getbuffer())
    snapshot = load_state(tmp_path / "snap.pt")
    tensors = [*snapshot["model"].values(), *(s["momentum_buffer"] for s in snapshot["optimizer"]["state"].values())]
    assert len(tensors) == 12 and all(t.untyped_storage().nbytes() == t.nbytes for t in tensors)


# A machine with a GPU, as far as torch.cuda.is_available() and device_count() tell: the check a chapter makes.
A_GPU_IS_VISIBLE = "import torch\ntorch.cuda.is_available = lambda: True\ntorch.cuda.device_count = lambda: 1\n"
# ... and torch.accelerator's, with what would open a CUDA context in a CPU rank failing instead
NO_CUDA_CONTEXT = ("torch.accelerator.is_available = lambda: True\ndef opens_a_cuda_context(*args):\n"
                   "    raise RuntimeError('a CPU rank opened a CUDA context')\n"
                   "torch.accelerator.synchronize = torch.cuda.synchronize = opens_a_cuda_context\n")


def gpu_visible(tmp_path, code=A_GPU_IS_VISIBLE):
    """The suite's environment in a process that sees a GPU (a sitecustomize on PYTHONPATH that says so)."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(code)
    return dict(BASE_ENV, PYTHONPATH=str(shim))


def test_localsgd_on_the_cpu_where_a_gpu_is_visible_opens_no_cuda_context(real_data, tmp_path):
    """torch's average_parameters calls torch.accelerator.synchronize() whenever an accelerator is available, whatever
    the weights' device: each CPU rank of a GPU machine would open a CUDA context (and hold its memory) to average.
    The chapters' average waits only for the device its tensors are on."""
    proc = subprocess.run([sys.executable, "ddp_comm_hooks.py", "--device", "cpu", "--comm-hook", "localsgd:4",
                           *slice_args(real_data, tmp_path / "run"), "--epochs", "1"], cwd=REPO, capture_output=True,
                          env=gpu_visible(tmp_path, A_GPU_IS_VISIBLE + NO_CUDA_CONTEXT) | one_rank(), text=True,
                          timeout=300)
    assert proc.returncode == 0 and "a CPU rank opened a CUDA context" not in proc.stderr, proc.stderr
    assert "Saved PyTorch Model State" in proc.stdout, proc.stdout


def test_powersgd_on_the_cpu_where_a_gpu_is_visible_is_one_line(real_data, tmp_path):
    """torch's PowerSGD hook calls torch.cuda.synchronize(device) whenever CUDA is available, with the gradients'
    device: for --device cpu on a GPU machine that is the CPU, and every rank dies at the first compressed step
    (ValueError: Expected a cuda device, but got: cpu). The chapters refuse it before any rendezvous."""
    proc = subprocess.run([sys.executable, "ddp_comm_hooks.py", "--device", "cpu", "--comm-hook", "powersgd",
                           *slice_args(real_data, tmp_path / "run")], cwd=REPO, env=gpu_visible(tmp_path) | TORCHRUN_ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--comm-hook powersgd cannot train with --device cpu where a GPU is visible" in proc.stderr
    assert "CUDA_VISIBLE_DEVICES=" in proc.stderr


# Each --comm-hook value through the chapters' register_comm_hook, on a DDP of one rank (gloo): every all-reduce a
# hook starts (torch's hooks start them from Python; DDP's own, without a hook, from C++) with its dtype and size,
# step by step, and the gradient the step is left with, against the same batch's gradient without DDP.
WIRE = """
import json, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from common.cli import Config
from common.comm_hooks import ONE_BUCKET_MB, register_comm_hook
from common.model import NeuralNetwork
from common.ranks import destroy_process_group

sent, started = [], dist.all_reduce
def counted(tensor, *args, **kwargs):
    sent[-1].append([str(tensor.dtype).split(".")[1], tensor.numel()])
    return started(tensor, *args, **kwargs)
dist.all_reduce = counted

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
torch.manual_seed(0)
batch = torch.rand(64, 1, 28, 28), torch.randint(0, 10, (64,))
plain = NeuralNetwork()
torch.nn.functional.cross_entropy(plain(batch[0]), batch[1]).backward()
report = {}
for value in sys.argv[2:]:
    cfg = Config()
    cfg.comm_hook = value
    model = DDP(NeuralNetwork(), bucket_cap_mb=ONE_BUCKET_MB if value.startswith("powersgd") else None)
    model.module.load_state_dict(plain.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # steps that leave the weights as they are
    register_comm_hook(model, cfg, optimizer, range(5))  # epochs of 5 steps
    steps = []
    for _ in range(7):
        sent.append([])
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()
        steps.append(sent[-1])
    # the last step's gradient of the first weight, against plain fp32, bf16 and fp16 rounding of the same gradient
    got, want = model.module.linear_relu_stack[0].weight.grad, plain.linear_relu_stack[0].weight.grad
    report[value] = dict(steps=steps, grad={name: torch.equal(got, want.to(dtype).float()) for name, dtype in
                                            [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]})
print(json.dumps(report), flush=True)
destroy_process_group()
"""
FULL = 669_706  # every gradient: DDP's first step sends it in one bucket, later ones in two (DDP rebuilds them)
WEIGHTS = ["float32", FULL]  # post-local SGD's average: every weight, flattened
POWERSGD = lambda rank: [["float32", 1034], ["float32", 1034 * rank], ["float32", 1808 * rank]]  # noqa: E731
# biases as they are (512 + 512 + 10), then P (n x rank per weight: 512 + 512 + 10 rows), then Q (784 + 512 + 512)
WIRE_CASES = {
    "none": dict(steps=[[]] * 7, grad="fp32"),  # DDP's own all-reduce, from C++: the gradient exactly
    "bf16": dict(steps=[[["bfloat16", FULL]]] + [[["bfloat16", 267_786], ["bfloat16", 401_920]]] * 6, grad="bf16"),
    "fp16": dict(steps=[[["float16", FULL]]] + [[["float16", 267_786], ["float16", 401_920]]] * 6, grad="fp16"),
    "powersgd": dict(steps=[[["float32", FULL]]] * 2 + [POWERSGD(1)] * 5, grad=None),  # start 2, rank 1
    "powersgd:2:5": dict(steps=[[["float32", FULL]]] * 5 + [POWERSGD(2)] * 2, grad=None),
    "powersgd:4:3": dict(steps=[[["float32", FULL]]] * 3 + [POWERSGD(4)] * 4, grad=None),
    # post-local SGD: torch's all-reduce for START steps, then none, and every H steps of an epoch (of 5 here) and at
    # its end the weights in one flat all-reduce (torch's average_parameters), the step's gradient left exactly
    "localsgd:4": dict(steps=[[["float32", FULL]], [["float32", 267_786], ["float32", 401_920]], [], [WEIGHTS],
                              [WEIGHTS], [], []], grad="fp32"),
    "localsgd:2:3": dict(steps=[[["float32", FULL]]] + [[["float32", 267_786], ["float32", 401_920]]] * 2 +
                         [[WEIGHTS], [WEIGHTS], [], [WEIGHTS]], grad="fp32"),
}


@pytest.fixture(scope="module")
def wire(tmp_path_factory):
    """Every WIRE_CASES value in one process: {value: {"steps": [[dtype, numel] per all-reduce] per step, "grad": ...}}."""
    rdzv = tmp_path_factory.mktemp("wire") / "rdzv"
    proc = run_code(WIRE, rdzv, *WIRE_CASES)
    return json.loads(proc.stdout)


@pytest.mark.parametrize("value", WIRE_CASES)
def test_each_comm_hook_value_sends_what_it_names(wire, value):
    """What reaches the wire, step by step: bf16 and fp16 the whole gradient in their own dtype (the same bytes, so
    the dtype tells them apart), PowerSGD the whole gradient for START steps, then the biases and its two factors
    at RANK columns; and the gradient each step is left with: none the exact one, bf16 and fp16 the gradient
    rounded to their dtype (and not to the other's)."""
    assert wire[value]["steps"] == WIRE_CASES[value]["steps"]
    want = WIRE_CASES[value]["grad"]
    if want:
        assert [name for name, equal in wire[value]["grad"].items() if equal] == [want], wire[value]["grad"]
