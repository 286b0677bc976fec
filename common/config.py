"""The flags every chapter shares: one dataclass of defaults, built by argparse, printed once at start."""
import argparse
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

import torch

from common.errors import UsageError


@dataclass
class Config:
    """Everything a run depends on; the same flags work in every chapter."""

    epochs: int = 5  # the quickstart's 5 epochs reach ~64% test accuracy
    batch_size: int = 64  # GLOBAL batch: the DDP chapters split it evenly over the ranks
    lr: float = 1e-3  # plain SGD at the quickstart's rate, so the curves match it
    momentum: float = 0.0  # SGD momentum: 0 is the quickstart's plain SGD; above 0 the optimizer has state to save
    seed: int = 0  # same seed + same global batch = same model in every chapter
    data_dir: Optional[str] = None  # torchvision layout; unset: ./data, the system copy, then download
    device: Optional[str] = None  # unset: cuda if a GPU is visible, else cpu
    output: Optional[str] = None  # folder for model.pth; unset: runs/<script name>
    train_samples: Optional[int] = None  # train on the first N images only (quick runs, tests)
    test_samples: Optional[int] = None  # evaluate on the first N test images only
    log_every: int = 100  # batches between "loss:" lines, as in the quickstart
    timeout: float = 120.0  # seconds a rendezvous or collective may wait: a missing peer fails, never hangs
    snapshot: Optional[str] = None  # file to resume from (if it exists) and to save to every save_every epochs
    save_every: int = 1  # epochs between snapshots (with --snapshot)
    accum_steps: int = 1  # micro-batches summed per optimizer step; the global batch stays --batch-size
    precision: str = "fp32"  # fp32, bf16 (autocast) or fp16 (autocast + GradScaler); CPU or GPU
    compile: bool = False  # torch.compile the model (after the DDP wrap in the DDP chapters)
    # Chapter flags: only the chapters that need them accept them (see CHAPTER_FLAGS).
    nprocs: Optional[int] = None  # ddp_mp.py: processes to spawn on this machine
    init_method: Optional[str] = None  # ddp_tcp_manual.py: tcp://HOST:PORT or file:///path
    rank: Optional[int] = None  # ddp_tcp_manual.py: this process's global rank
    world_size: Optional[int] = None  # ddp_tcp_manual.py: total number of processes
    local_rank: Optional[int] = None  # ddp_tcp_manual.py: this process's index on its machine (picks the GPU)
    schedule: Optional[str] = None  # pipeline.py: the order of the micro-batches' forwards and backwards
    microbatches: Optional[int] = None  # pipeline.py: micro-batches per global batch, in flight through the stages
    dp: Optional[int] = None  # tensor_parallel.py: data-parallel groups; the world size / dp ranks of each split the layers

    def describe(self):
        """One line with every setting the chapter uses, for the top of the log."""
        items = asdict(self).items()
        shown = {k: v for k, v in items if k not in CHAPTER_FLAGS or v is not None}
        if self.snapshot is None:  # no snapshots: their settings change nothing
            del shown["snapshot"], shown["save_every"]
        for name in ("momentum", "accum_steps", "precision", "compile"):  # shown when used: the quickstart's line otherwise
            if shown[name] == getattr(Config, name):
                del shown[name]
        return "Config: " + " ".join(f"{k}={v}" for k, v in shown.items())


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage block) and exits 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _int_at_least(minimum, words):
    """argparse type: an integer >= minimum, reported as one clear line otherwise."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _fraction(text):
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < 1:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {text}")
    return value


CHAPTER_FLAGS = {
    "nprocs": dict(type=_positive_int, help="processes to start (default: one per visible GPU, or 2 on a CPU)"),
    "init_method": dict(help="rendezvous: tcp://HOST:PORT (HOST = rank 0's address) or file:///shared/path"),
    "rank": dict(type=_non_negative_int, help="this process's global rank, 0 .. world size - 1"),
    "world_size": dict(type=_positive_int, help="total number of processes over all machines"),
    "local_rank": dict(type=_non_negative_int, help="this process's index on its machine; picks cuda:N (default 0)"),
    "schedule": dict(choices=("gpipe", "1f1b"), default="gpipe", help="pipeline schedule: gpipe (all forwards, then "
                     "all backwards) or 1f1b (one forward, one backward) (default %(default)s)"),
    "microbatches": dict(type=_positive_int, default=4, help="micro-batches each global batch is cut into "
                         "(default %(default)s)"),
    "dp": dict(type=_positive_int, default=1, help="data-parallel groups (default 1); each group's world size / dp "
               "ranks split every layer (tensor parallel), the groups split the batch (FSDP2)"),
}


def build_parser(description=None, chapter_flags=()):
    """An argparse parser for the shared flags plus the named chapter flags; bad values are usage errors."""
    d = Config()
    p = _Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=_positive_int, default=d.epochs, help="passes over the training set (default %(default)s)")
    p.add_argument("--batch-size", type=_positive_int, default=d.batch_size, help="GLOBAL batch size, summed over all ranks (default %(default)s)")
    p.add_argument("--lr", type=_positive_float, default=d.lr, help="SGD learning rate (default %(default)s)")
    p.add_argument("--momentum", type=_fraction, default=d.momentum, help="SGD momentum, 0 <= m < 1 (default %(default)s: plain SGD)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for the weights and the shuffling (default %(default)s)")
    p.add_argument("--data-dir", default=d.data_dir, help="FashionMNIST folder (torchvision layout); default ./data, then the system copy, then download")
    p.add_argument("--device", default=d.device, help="cpu or cuda; cuda:N in chapters 1-2 (default: cuda if visible, else cpu)")
    p.add_argument("--output", default=d.output, help="folder for model.pth (default runs/<script name>)")
    p.add_argument("--train-samples", type=_positive_int, default=d.train_samples, help="use only the first N training images")
    p.add_argument("--test-samples", type=_positive_int, default=d.test_samples, help="use only the first N test images")
    p.add_argument("--log-every", type=_positive_int, default=d.log_every, help="batches between loss lines (default %(default)s)")
    p.add_argument("--timeout", type=_positive_float, default=d.timeout, help="seconds to wait for peers at a rendezvous or collective (default %(default)s)")
    p.add_argument("--snapshot", default=d.snapshot, help="snapshot file: resume from it if it exists, save to it every --save-every epochs")
    p.add_argument("--save-every", type=_positive_int, default=None, help=f"epochs between snapshots (default {d.save_every}; needs --snapshot)")
    p.add_argument("--accum-steps", type=_positive_int, default=d.accum_steps, help="sum the gradients of K micro-batches of batch-size / (world size x K) per optimizer step (default %(default)s)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=d.precision, help="fp32; bf16 autocast; fp16 autocast with a GradScaler; on the CPU and on GPUs (default %(default)s)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (on the CPU it needs a C++ compiler)")
    for name in chapter_flags:
        p.add_argument("--" + name.replace("_", "-"), required=name in ("init_method", "rank", "world_size"), **CHAPTER_FLAGS[name])
    return p


def check_device(parser, device):
    """Reject a --device this machine cannot use, as a usage error."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except RuntimeError:
        parser.error(f"--device {device!r} is not a device; use cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device {device} but no GPU is visible here (check CUDA_VISIBLE_DEVICES, nvidia-smi); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            parser.error(f"--device {device} but only {torch.cuda.device_count()} GPU(s) are visible")
    elif dev.type != "cpu":
        parser.error(f"--device {device}: this tutorial runs on cpu or cuda")


def flag_text(name, value):
    """A setting as the flag that gives it: "--batch-size 48", or "no --train-samples" for one that is unset."""
    flag = f"--{name.replace('_', '-')}"
    return f"no {flag}" if value is None else f"{flag} {value}"


def _valid_init_method(url):
    """tcp://HOST:PORT with a port in 1..65535, or file:// with an absolute path."""
    parts = urlparse(url)
    if parts.scheme == "file":
        return parts.path.startswith("/") and not parts.netloc
    try:
        return parts.scheme == "tcp" and bool(parts.hostname) and parts.port is not None and 0 < parts.port < 65536
    except ValueError:  # a port that is not a number
        return False


def parse_config(argv=None, description=None, chapter_flags=()):
    """Parse the command line (sys.argv by default) into a Config."""
    parser = build_parser(description, chapter_flags)
    cfg = Config(**vars(parser.parse_args(argv)))
    check_device(parser, cfg.device)
    if cfg.rank is not None and cfg.world_size is not None and cfg.rank >= cfg.world_size:
        parser.error(f"--rank {cfg.rank} must be below --world-size {cfg.world_size} (ranks count from 0)")
    if cfg.init_method is not None and not _valid_init_method(cfg.init_method):
        parser.error(f"--init-method {cfg.init_method!r}: use tcp://HOST:PORT (rank 0's address) or file:///shared/path")
    if cfg.batch_size % cfg.accum_steps:
        parser.error(f"--batch-size {cfg.batch_size} must split into --accum-steps {cfg.accum_steps} equal micro-batches; "
                     f"use a multiple of {cfg.accum_steps}")
    if cfg.save_every is not None and cfg.snapshot is None:
        parser.error("--save-every needs --snapshot FILE (the file to save to and resume from)")
    cfg.save_every = cfg.save_every or Config.save_every
    if cfg.output is None:
        cfg.output = str(Path("runs") / Path(sys.argv[0]).stem)
    return cfg


def check_fsdp_flags(cfg, script="fsdp.py", sharded_over=None):
    """fsdp.py's refusals, each one line and exit 2: fp16, fewer test images than ranks, a torch too old for FSDP2 on
    the CPU. First of all, so `python fsdp.py --precision fp16` says what is wrong with the flag. sharded_over: the
    ranks FSDP2 shards over, when not all of them (tensor_parallel.py's --dp)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    ranks = sharded_over or world_size
    if cfg.precision == "fp16":  # a GradScaler would see only this rank's slices of the gradients
        raise UsageError(f"{script} trains in --precision fp32 or bf16; fp16 needs a scaler that checks every rank's "
                         "gradient slices for overflow, which this chapter does not have: use --precision bf16")
    if cfg.test_samples is not None and cfg.test_samples < ranks:  # a rank with no test image would skip forward()
        raise UsageError(f"--test-samples {cfg.test_samples} is fewer than the {ranks} ranks: under FSDP every "
                         f"rank must run every test batch (forward() gathers the weights); use at least {ranks}")
    on_cpu = cfg.device == "cpu" or not torch.cuda.is_available()
    fsdp2 = sharded_over is None or sharded_over > 1  # fsdp.py shards even over one rank; tensor_parallel.py at --dp 2+
    if on_cpu and fsdp2 and not hasattr(torch.cpu.Stream, "record_event"):  # FSDP2 times its gathers with it
        raise UsageError(f"{script} on the CPU needs a torch whose FSDP2 runs on CPU streams (torch.cpu.Stream."
                         f"record_event; 2.14.1 has it, 2.6.0 does not); this is torch {torch.__version__}: upgrade "
                         f"torch, or run {script} on GPUs")


HIDDEN = 512  # the model's hidden width: tensor parallelism cuts it into equal slices


def check_tensor_parallel_flags(cfg):
    """tensor_parallel.py's refusals, each one line and exit 2: a world size that is not dp x tp with tp dividing the
    512 hidden units, then chapter 7's (fp16, test images, FSDP2 on the CPU) for the dp dimension."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size % cfg.dp:
        raise UsageError(f"--dp {cfg.dp} does not divide the {world_size} ranks into equal tensor-parallel groups; "
                         f"use a --dp that divides {world_size}")
    tp = world_size // cfg.dp
    if HIDDEN % tp:
        raise UsageError(f"{tp} ranks per tensor-parallel group (world size {world_size} / --dp {cfg.dp}) do not "
                         f"split the {HIDDEN} hidden units evenly; use 1, 2, 4, 8 ... ranks per group")
    check_fsdp_flags(cfg, "tensor_parallel.py", sharded_over=cfg.dp)


def check_pipeline_flags(cfg, stages_at_most):
    """pipeline.py's refusals, each one line and exit 2: more stages than the cuts it knows, micro-batches that do
    not split the global batch, flags the pipeline does not take (fp16, --accum-steps, --compile), a torch whose
    pipelining lacks what the chapter uses. First of all, before any rendezvous."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > stages_at_most:
        raise UsageError(f"{world_size} ranks but pipeline.py cuts the model into at most {stages_at_most} stages "
                         f"(one per Linear layer): start --nproc-per-node {stages_at_most} or fewer")
    if cfg.batch_size % cfg.microbatches:
        raise UsageError(f"--batch-size {cfg.batch_size} must split into --microbatches {cfg.microbatches} equal "
                         f"micro-batches; use a multiple of {cfg.microbatches}")
    if cfg.schedule == "1f1b" and cfg.microbatches < world_size:  # torch's Schedule1F1B refuses it after the rendezvous
        raise UsageError(f"--schedule 1f1b with {world_size} stages needs at least {world_size} --microbatches (each "
                         f"stage takes one forward before the first backward reaches it); pass --microbatches "
                         f"{world_size} or more, or --schedule gpipe")
    if cfg.precision == "fp16":  # each stage's scaler would see only its own layers' gradients
        raise UsageError("pipeline.py trains in --precision fp32 or bf16; fp16 needs a scaler that checks every "
                         "stage's gradients for overflow, which this chapter does not have: use --precision bf16")
    if cfg.accum_steps != 1:
        raise UsageError("pipeline.py takes no --accum-steps: its micro-batches already add their gradients up "
                         "before each optimizer step; use --microbatches")
    if cfg.compile:
        raise UsageError("pipeline.py takes no --compile: the schedule calls each stage's layers once per micro-batch "
                         "and torch.compile is not part of this chapter; leave --compile out")
    missing = pipelining_missing()
    if missing:
        raise UsageError(missing)


def pipelining_missing():
    """Why this torch cannot run pipeline.py (one line), or None: its schedules must take scale_grads= and have eval()."""
    import inspect

    from torch.distributed.pipelining import ScheduleGPipe

    if "scale_grads" in inspect.signature(ScheduleGPipe).parameters and hasattr(ScheduleGPipe, "eval"):
        return None
    return (f"pipeline.py needs a torch whose pipeline schedules take scale_grads= and have eval() (2.14.1 has both); "
            f"this is torch {torch.__version__}: upgrade torch")
