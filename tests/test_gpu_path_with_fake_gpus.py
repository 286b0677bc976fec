"""The GPU path, played on the CPU: the decisions the chapters take on CUDA + NCCL, checked where no GPU is.

Each test stands in for one piece of a GPU machine (how many GPUs a rank sees, NCCL's init, NCCL's error text) and
runs the project's own code, or the chapters themselves, against it. tests/test_gpu.py runs the same on real GPUs.
"""
import json
import subprocess
import sys

import pytest
import torch
from torch.torch_version import TorchVersion

from common.cli import UsageError
from common.ranks import rank_device
from support import REPO
from support.ports import free_port
from support.run import BASE_ENV


@pytest.mark.parametrize("gpus,local_rank,ranks_here,expected", [
    (4, 3, None, "cuda:3"),  # srun, 4 tasks on a node that shows each task all 4 GPUs
    (1, 3, None, "cuda:0"),  # srun --gpus-per-task 1 / --gpu-bind: each task sees its own GPU only
    (2, 3, None, "local rank 3 but 2 GPU(s) visible"),  # 4 tasks with 2 GPUs each: which 2 are this task's?
    (8, 1, 2, "cuda:1"),  # torchrun --nproc-per-node 2 on an 8-GPU machine: the first two
    (8, 7, 8, "cuda:7"),  # torchrun --nproc-per-node gpu
    (1, 1, 2, "2 ranks on this machine but 1 GPU(s) visible"),  # torchrun gives all its ranks the same GPUs
], ids=["srun-all-gpus", "srun-gpu-per-task", "srun-2-of-4", "torchrun-2-of-8", "torchrun-8-of-8", "torchrun-2-on-1"])
def test_each_rank_finds_its_gpu(gpus, local_rank, ranks_here, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if expected.startswith("cuda"):
        assert rank_device(None, local_rank, ranks_here) == torch.device(expected)
    else:
        with pytest.raises(UsageError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            rank_device(None, local_rank, ranks_here)


# Fake GPUs, and record(): each process writes what it saw to a file of its own and ends there (the lines of ranks
# that share one pipe can run together).
FAKE_GPUS = """\
import json, os, torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: {gpus}
torch.cuda.set_device = lambda device: None
def record(**seen):
    with open(os.path.join({records!r}, str(os.getpid()) + ".json"), "w") as out:
        json.dump(seen, out)
    os._exit(0)
"""


def _shim(tmp_path, code, gpus):
    """A sitecustomize.py of FAKE_GPUS + code in tmp_path/shim; -> (shim, reader of what the processes recorded)."""
    shim, records = tmp_path / "shim", tmp_path / "records"
    shim.mkdir()
    records.mkdir()
    (shim / "sitecustomize.py").write_text(FAKE_GPUS.format(gpus=gpus, records=str(records)) + code)
    return shim, lambda: [json.loads(record.read_text()) for record in records.iterdir()]


# An init_process_group that records what it was asked for.
RECORD_INIT = """\
def init_process_group(backend=None, **kwargs):
    record(backend=backend, rank=kwargs.get("rank"), device_id=str(kwargs.get("device_id")),
           env={k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL_", "TORCH_FR_"))})
torch.distributed.init_process_group = init_process_group
"""


def _launch_env(rank, local_rank, world, ranks_here):
    return dict(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(ranks_here),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def _slurm_env(rank, local_rank, world):
    return dict(SLURM_JOB_ID="4242", SLURM_PROCID=str(rank), SLURM_LOCALID=str(local_rank), SLURM_NTASKS=str(world),
                SLURM_STEP_NODELIST="localhost", SLURM_STEP_ID="0", MASTER_ADDR="127.0.0.1")  # no scontrol to ask


CHAPTERS = [  # (command, environment, GPUs this process sees, [(rank, the device it must bind NCCL to)])
    (["ddp_launch.py"], _launch_env(3, 1, 4, 2), 2, [(3, "cuda:1")]),
    (["ddp_by_hand.py"], _launch_env(3, 1, 4, 2), 2, [(3, "cuda:1")]),
    (["fsdp.py"], _launch_env(1, 1, 2, 2), 2, [(1, "cuda:1")]),
    (["debug_hang.py", "--bug", "early-stop"], _launch_env(1, 1, 2, 2), 2, [(1, "cuda:1")]),
    (["ddp_mp.py"], {}, 2, [(0, "cuda:0"), (1, "cuda:1")]),
    (["ddp_tcp_manual.py", "--init-method", "tcp://127.0.0.1:1", "--rank", "0", "--world-size", "2", "--local-rank",
      "1"], {}, 2, [(0, "cuda:1")]),
    (["ddp_slurm.py"], _slurm_env(0, 3, 8), 1, [(0, "cuda:0")]),  # srun --gpus-per-task 1: local rank 3, its own GPU
    (["scripts/preflight.py"], _launch_env(1, 1, 2, 2), 2, [(1, "cuda:1")]),
]


def _init_calls(argv, env, gpus, tmp_path):
    """Run a chapter with `gpus` fake GPUs up to init_process_group: what each rank asked it for."""
    shim, recorded = _shim(tmp_path, RECORD_INIT, gpus)
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(BASE_ENV, PYTHONPATH=str(shim), **env))
    assert proc.returncode == 0, proc.stderr
    return recorded(), proc.stdout


@pytest.mark.parametrize("argv,env,gpus,expected", CHAPTERS, ids=[c[0][0] for c in CHAPTERS])
def test_nccl_is_bound_to_the_ranks_gpu_at_init(argv, env, gpus, expected, tmp_path):
    """init_process_group gets device_id=<the rank's GPU> on CUDA: NCCL then connects inside it, so a broken NCCL
    set-up fails there, in one line, rather than in the first collective (torch's advice since 2.3)."""
    calls, out = _init_calls(argv, env, gpus, tmp_path)
    assert sorted((c["rank"], c["backend"], c["device_id"]) for c in calls) == \
        [(rank, "nccl", device) for rank, device in expected], out


# A process group that answers every call, so the chapter runs on to its DDP wrap: the data and the model stay on
# the CPU (no .to() moves anything), and DDP itself records what it was given.
RECORD_WRAP = """\
import torch.distributed as dist, torch.nn.parallel
import common.data
bound = []
dist.init_process_group = lambda backend=None, **kwargs: bound.append(str(kwargs.get("device_id")))
dist.get_backend = lambda group=None: "nccl"
dist.barrier = lambda *args, **kwargs: None
def all_gather_object(out, obj, group=None):
    out[:] = [obj] * len(out)
dist.all_gather_object = all_gather_object
load = common.data.load_fashion_mnist
common.data.load_fashion_mnist = lambda cfg, device: load(cfg, torch.device("cpu"))
torch.nn.Module.to = lambda self, *args, **kwargs: self
class DDP:
    def __init__(self, module, device_ids=None, **kwargs):
        ids = [str(torch.device("cuda", d) if isinstance(d, int) else torch.device(d)) for d in device_ids or []]
        record(bound=bound[0], device_ids=ids)
torch.nn.parallel.DistributedDataParallel = DDP
"""

WRAPS = [  # (command, environment, GPUs this process sees, the GPU each rank computes on)
    (["ddp_launch.py"], _launch_env(3, 1, 4, 2), 2, ["cuda:1"]),
    (["ddp_mp.py"], {}, 2, ["cuda:0", "cuda:1"]),
    (["ddp_tcp_manual.py", "--init-method", "tcp://127.0.0.1:1", "--rank", "0", "--world-size", "2", "--local-rank",
      "1"], {}, 1, ["cuda:0"]),  # started by hand with CUDA_VISIBLE_DEVICES=1: it sees its own GPU only
    (["ddp_slurm.py"], _slurm_env(0, 3, 8), 1, ["cuda:0"]),  # srun --gpus-per-task 1: local rank 3, its own GPU
    (["debug_hang.py", "--bug", "early-stop"], _launch_env(1, 1, 2, 2), 2, ["cuda:1"]),
]


@pytest.mark.parametrize("argv,env,gpus,expected", WRAPS, ids=[w[0][0] for w in WRAPS])
def test_ddp_wraps_the_model_on_the_gpu_the_rank_computes_on(argv, env, gpus, expected, fake_data, tmp_path):
    """DDP(device_ids=...) names the rank's own GPU, the one NCCL was bound to: DDP moves each batch there, so a
    local rank in its place (cuda:3 where the rank sees one GPU) fails on the first forward."""
    shim, recorded = _shim(tmp_path, RECORD_WRAP, gpus)
    proc = subprocess.run([sys.executable, *argv, "--data-dir", str(fake_data), "--output", str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(BASE_ENV, PYTHONPATH=f"{shim}:{REPO}", **env))
    assert proc.returncode == 0, proc.stderr
    made = recorded()
    wraps, bound = sorted(wrap["device_ids"] for wrap in made), sorted(wrap["bound"] for wrap in made)
    assert wraps == [[device] for device in expected] and bound == expected, proc.stdout


def test_chapter_8_lets_the_nccl_watchdog_write_the_flight_record(tmp_path):
    """On NCCL a rank that times out is ended by the watchdog (SIGABRT), where chapter 8's own record writing cannot
    run: before init it asks NCCL to dump the record itself, into the folder where the gloo records go, under the
    names this torch reads without a deprecation warning (renamed in torch 2.8: TORCH_NCCL_TRACE_BUFFER_SIZE and
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE are the old ones)."""
    out = tmp_path / "out"
    calls, log = _init_calls(["debug_hang.py", "--bug", "early-stop", "--output", str(out)],
                             _launch_env(0, 0, 2, 2), 2, tmp_path)
    renamed = TorchVersion(torch.__version__) >= (2, 8)
    buffer, dump = ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE") if renamed else (
        "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    assert calls[0]["env"] == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", buffer: "2000",
                               dump: f"{out}/flight_recorder/nccl_trace_rank_"}
    assert f"torchfrtrace {out}/flight_recorder --prefix nccl_trace_rank_" in log
