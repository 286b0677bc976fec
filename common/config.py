"""The flags every chapter shares: one dataclass of defaults, built by argparse, printed once at start."""
import argparse
import re
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

import torch

from common.errors import UsageError


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage block) and exits 2; a chapter flag given to another
    chapter says which chapters take it."""

    def error(self, message):
        if message.startswith("unrecognized arguments"):
            for f in fields(Config):
                name = "--" + f.name.replace("_", "-")
                if f.metadata["taken_by"] and re.search(rf"{name}\b", message):
                    message += f"; {name} is a flag of {f.metadata['taken_by']} only"
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _number(kind, ok, words):
    """An argparse type: text as kind (int or float) for which ok(value) holds, else one line with words."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):  # `not ok` also refuses nan
            raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
        return value

    return parse


POSITIVE = _number(int, lambda v: v >= 1, "a positive integer")
NON_NEGATIVE = _number(int, lambda v: v >= 0, "an integer >= 0")
SHARED, REQUIRED = object(), object()  # a flag every chapter takes; a chapter flag without a default


def flag(default, kind, text, chapter_default=SHARED, taken_by=None):
    """A Config field that is also a flag: kind is its type (or its choices, or bool for a switch), text its --help.
    A chapter flag (chapter_default given) is taken only by the chapters that name it (taken_by), with that default."""
    return field(default=default, metadata=dict(kind=kind, text=text, chapter_default=chapter_default,
                                                taken_by=taken_by))


def _comm_hook(text):
    """--comm-hook's type: none, bf16, fp16, or powersgd[:RANK[:START]] (PowerSGD's rank and first compressed step)."""
    name, *numbers = text.split(":")
    if text in ("none", "bf16", "fp16") or (name == "powersgd" and len(numbers) <= 2
                                            and all(n.isdigit() and int(n) >= i + 1 for i, n in enumerate(numbers))):
        return text
    raise argparse.ArgumentTypeError(f"must be none, bf16, fp16 or powersgd[:RANK[:START]] (RANK >= 1, START >= 2; "
                                     f"e.g. powersgd:4), got {text}")


@dataclass
class Config:
    """Everything a run depends on; the same flags work in every chapter. Each: default, type, what it does."""

    epochs: int = flag(5, POSITIVE, "passes over the training set (the quickstart's 5 reach ~64%% test accuracy)")
    batch_size: int = flag(64, POSITIVE, "GLOBAL batch, split evenly over the ranks: the same model at any world size")
    lr: float = flag(1e-3, _number(float, lambda v: v > 0, "a positive number"), "SGD learning rate (the quickstart's)")
    momentum: float = flag(0.0, _number(float, lambda v: 0 <= v < 1, "at least 0 and below 1"),
                           "SGD momentum (0: the quickstart's plain SGD; above 0 the optimizer has state to save)")
    seed: int = flag(0, int, "seed for the weights and the shuffling: the same seed and batch, the same model")
    data_dir: Optional[str] = flag(None, str, "FashionMNIST folder (default ./data, Debian's copy, then a download)")
    device: Optional[str] = flag(None, str, "cpu or cuda; cuda:N in chapters 1-2 (default cuda if visible, else cpu)")
    output: Optional[str] = flag(None, str, "folder for model.pth and metrics.jsonl (default runs/<script name>)")
    train_samples: Optional[int] = flag(None, POSITIVE, "train on the first N images only (quick runs, tests)")
    test_samples: Optional[int] = flag(None, POSITIVE, "evaluate on the first N test images only")
    log_every: int = flag(100, POSITIVE, "steps between loss lines, as in the quickstart")
    timeout: float = flag(120.0, _number(float, lambda v: v > 0, "a positive number"),
                          "seconds a rendezvous or collective may wait: a missing peer fails, never hangs")
    snapshot: Optional[str] = flag(None, str, "snapshot file (a folder in chapters 7, 9, 10): resume from it, save to it")
    save_every: int = flag(1, POSITIVE, "epochs between snapshots (needs --snapshot)")
    accum_steps: int = flag(1, POSITIVE, "micro-batches summed per optimizer step; the global batch stays --batch-size")
    precision: str = flag("fp32", ("fp32", "bf16", "fp16"), "fp32; bf16 autocast; fp16 autocast with a GradScaler")
    compile: bool = flag(False, bool, "torch.compile the model (it needs a C compiler: g++ on CPUs, gcc for Triton)")
    # Chapter flags: only the chapters that name them take them.
    nprocs: Optional[int] = flag(None, POSITIVE, "processes to spawn (default one per visible GPU, or 2 on a CPU)",
                                 chapter_default=None, taken_by="ddp_mp.py")
    init_method: Optional[str] = flag(None, str, "rendezvous: tcp://HOST:PORT (rank 0's address) or file:///shared/path",
                                      chapter_default=REQUIRED, taken_by="ddp_tcp_manual.py")
    rank: Optional[int] = flag(None, NON_NEGATIVE, "this process's global rank, 0 .. world size - 1", REQUIRED,
                               "ddp_tcp_manual.py")
    world_size: Optional[int] = flag(None, POSITIVE, "total number of processes over all machines", REQUIRED,
                                     "ddp_tcp_manual.py")
    local_rank: Optional[int] = flag(None, NON_NEGATIVE, "this process's index on its machine; picks cuda:N (default 0)",
                                     chapter_default=None, taken_by="ddp_tcp_manual.py")
    schedule: Optional[str] = flag(None, ("gpipe", "1f1b"), "pipeline schedule: all forwards then all backwards, or "
                                   "one of each in turn", chapter_default="gpipe", taken_by="pipeline.py")
    microbatches: Optional[int] = flag(None, POSITIVE, "micro-batches each global batch is cut into", 4, "pipeline.py")
    dp: Optional[int] = flag(None, POSITIVE, "data-parallel groups; each group's ranks split every layer", 1,
                              "tensor_parallel.py")
    comm_hook: str = flag("none", _comm_hook, "DDP's communication hook: what each all-reduce sends: bf16/fp16 halve "
                          "the bytes; powersgd[:R[:START]] all-reduces whole gradients for START steps (default 2), "
                          "then a rank-R approximation (default 1) (docs/scaling.md)", "none",
                          "the DDP chapters (ddp_launch.py, ddp_mp.py, ddp_tcp_manual.py, ddp_slurm.py)")

    def describe(self):
        """One line with every setting the chapter uses, for the top of the log."""
        shown = {k: v for k, v in asdict(self).items() if k not in CHAPTER_FLAGS or v is not None}
        if self.snapshot is None:  # no snapshots: their settings change nothing
            del shown["snapshot"], shown["save_every"]
        # Shown when used (else the quickstart's).
        for name in ("momentum", "accum_steps", "precision", "compile", "comm_hook"):
            if shown[name] == getattr(Config, name):
                del shown[name]
        return "Config: " + " ".join(f"{k}={v}" for k, v in shown.items())


CHAPTER_FLAGS = [f.name for f in fields(Config) if f.metadata["chapter_default"] is not SHARED]


def build_parser(description=None, chapter_flags=()):
    """An argparse parser for the shared flags plus the named chapter flags; bad values are usage errors."""
    p = _Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(Config):
        if f.name in CHAPTER_FLAGS and f.name not in chapter_flags:
            continue
        kind, text = f.metadata["kind"], f.metadata["text"]
        default = f.metadata["chapter_default"] if f.name in CHAPTER_FLAGS else f.default
        name, shown = "--" + f.name.replace("_", "-"), "" if default in (None, REQUIRED) else f" (default {default})"
        if kind is bool:
            p.add_argument(name, action="store_true", help=text)
        elif isinstance(kind, tuple):
            p.add_argument(name, choices=kind, default=default, help=text + shown)
        else:  # --save-every is None when not given, to refuse it without --snapshot
            p.add_argument(name, type=kind, required=default is REQUIRED, help=text + shown,
                           default=None if f.name == "save_every" or default is REQUIRED else default)
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
            parser.error(f"--device {device} but no GPU is visible here (check CUDA_VISIBLE_DEVICES, nvidia-smi); use "
                         f"--device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            parser.error(f"--device {device} but only {torch.cuda.device_count()} GPU(s) are visible")
    elif dev.type != "cpu":
        parser.error(f"--device {device}: this tutorial runs on cpu or cuda")


def flag_text(name, value):
    """A setting as the flag that gives it: "--batch-size 48", or "no --train-samples" for one that is unset."""
    return f"no --{name.replace('_', '-')}" if value is None else f"--{name.replace('_', '-')} {value}"


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
    if cfg.comm_hook.startswith("powersgd") and cfg.device == "cpu" and torch.cuda.is_available():  # torch's bug:
        parser.error("--comm-hook powersgd cannot train with --device cpu where a GPU is visible: torch's PowerSGD "
                     "hook then calls torch.cuda.synchronize() on the CPU's gradients and fails at its first "
                     "compressed step; train on the GPUs, or hide them to train on the CPU (CUDA_VISIBLE_DEVICES=)")
    if cfg.rank is not None and cfg.world_size is not None and cfg.rank >= cfg.world_size:
        parser.error(f"--rank {cfg.rank} must be below --world-size {cfg.world_size} (ranks count from 0)")
    if cfg.init_method is not None and not _valid_init_method(cfg.init_method):
        parser.error(f"--init-method {cfg.init_method!r}: use tcp://HOST:PORT (rank 0's address) or "
                     f"file:///shared/path")
    if cfg.batch_size % cfg.accum_steps:
        parser.error(f"--batch-size {cfg.batch_size} must split into --accum-steps {cfg.accum_steps} equal "
                     f"micro-batches; use a multiple of {cfg.accum_steps}")
    if cfg.save_every is not None and cfg.snapshot is None:
        parser.error("--save-every needs --snapshot FILE (the file to save to and resume from)")
    cfg.save_every = cfg.save_every or Config.save_every
    if cfg.output is None:
        cfg.output = str(Path("runs") / Path(sys.argv[0]).stem)
    return cfg


def check_fsdp2(cfg, script, sharded_over, uses_fsdp2=True):
    """What sharded weights refuse (fsdp.py; tensor_parallel.py, FSDP2 at --dp 2+), in one line and exit 2, before
    any rendezvous: fp16, fewer test images than the ranks FSDP2 shards over, a torch whose FSDP2 cannot run here."""
    if cfg.precision == "fp16":  # a GradScaler would see only this rank's slices of the gradients
        raise UsageError(f"{script} trains in --precision fp32 or bf16; fp16 needs a scaler that checks every rank's "
                         f"gradient slices for overflow, which this chapter does not have: use --precision bf16")
    if cfg.test_samples is not None and cfg.test_samples < sharded_over:  # a rank with no test image: no forward()
        raise UsageError(f"--test-samples {cfg.test_samples} is fewer than the {sharded_over} ranks: under FSDP every "
                         f"rank must run every test batch (forward() gathers the weights); use at least {sharded_over}")
    on_cpu = cfg.device == "cpu" or not torch.cuda.is_available()
    if uses_fsdp2 and on_cpu and not hasattr(torch.cpu.Stream, "record_event"):  # FSDP2 times its gathers with it
        raise UsageError(f"{script} on the CPU needs torch 2.7 or later, whose CPU streams FSDP2 can time its "
                         f"gathers with (torch.cpu.Stream.record_event); this is torch {torch.__version__}: upgrade "
                         f"torch, or run {script} on GPUs")
