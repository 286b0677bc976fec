"""The command line every chapter shares: its flags in (one dataclass, built by argparse), and how a run ends."""
import argparse
import contextlib
import ctypes
import os
import re
import sys
import traceback
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

import torch


class FatalError(Exception):
    """A problem the user can fix (missing data, a bad path, an unreachable rank 0): its message names the fix."""

    exit_code = 1


class UsageError(FatalError):
    """A flag or launch that cannot work (a batch that does not split over the ranks, say): exit 2."""

    exit_code = 2


def _number(kind, ok, words):
    """An argparse type: text as kind (int or float; else argparse's own line) for which ok(value) holds."""
    def parse(text):
        if not ok(kind(text)):  # Written `not ok` so that it also refuses nan.
            raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
        return kind(text)
    parse.__name__ = kind.__name__  # For text that is no number, argparse's line names it: "invalid int value: 'two'".
    return parse


POSITIVE = _number(int, lambda v: v >= 1, "a positive integer")
NON_NEGATIVE = _number(int, lambda v: v >= 0, "an integer >= 0")
RATE = _number(float, lambda v: v > 0, "a positive number")  # The type of a learning rate.
MOMENTUM = _number(float, lambda v: 0 <= v < 1, "at least 0 and below 1")
REQUIRED = object()  # A chapter flag with this default must be given.


def device_type(text):
    """--device's type: cpu, or a GPU this machine has (cuda, cuda:N)."""
    gpus = torch.cuda.device_count()  # It is 0 where no GPU is visible.
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text) or text != "cpu" and (torch.device(text).index or 0) >= gpus:
        raise argparse.ArgumentTypeError(f"{text!r}: use cpu, or cuda or cuda:N of the {gpus} GPU(s) visible here "
                                         f"(check CUDA_VISIBLE_DEVICES, nvidia-smi)")
    return text


def flag(default, kind, text, check=None):
    """A flag: its default, type (choices, or bool: a switch), --help text; check(cfg): why flags clash, or None."""
    return field(default=default, metadata=dict(kind=kind, text=text, check=check))


@dataclass
class Config:
    """Everything a run depends on; every chapter takes these flags (and its own, which parse_config adds)."""

    epochs: int = flag(5, POSITIVE, "passes over the training set (the quickstart's 5 reach ~64%% test accuracy)")
    batch_size: int = flag(64, POSITIVE, "GLOBAL batch, split evenly over the ranks: the same model at any world size")
    lr: float = flag(1e-3, RATE, "SGD learning rate (the quickstart's)")
    momentum: float = flag(0.0, MOMENTUM,
                           "SGD momentum (0: the quickstart's plain SGD; above 0 the optimizer has state to save)")
    seed: int = flag(0, int, "seed for the weights and the shuffling: the same seed and batch, the same model")
    data_dir: Optional[str] = flag(None, str, "the folder torchvision reads FashionMNIST from (default ./data)")
    device: Optional[str] = flag(None, device_type, "cpu or cuda; cuda:N in chapters 1-2 (default cuda if visible)")
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

    def describe(self):
        """One line with every setting (the chapter's own flags last), for the top of the log."""
        return "Config: " + " ".join(f"{k}={v}" for k, v in vars(self).items())


FIELDS = [f.name for f in fields(Config)]


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage block) and exits 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_config(argv=None, description=None, **chapter_flags):
    """The command line (sys.argv by default) as a Config, with the chapter's own flags (flag(...)) as attributes."""
    parser = _Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, f in [*((f.name, f) for f in fields(Config)), *chapter_flags.items()]:
        kind, default = f.metadata["kind"], f.default
        how = dict(action="store_true") if kind is bool else dict(choices=kind) if isinstance(kind, tuple) else dict(
            type=kind)
        shown = "" if default is None or default is REQUIRED or kind is bool else f" (default {default})"
        parser.add_argument("--" + name.replace("_", "-"), **how, help=f.metadata["text"] + shown,
                            required=default is REQUIRED, default=None if default is REQUIRED else default)
    given = vars(parser.parse_args(argv))
    cfg = Config(**{name: given.pop(name) for name in FIELDS})
    vars(cfg).update(given)  # What is left are the chapter's own flags.
    if cfg.batch_size % cfg.accum_steps:
        parser.error(f"--batch-size {cfg.batch_size} must split into --accum-steps {cfg.accum_steps} equal "
                     f"micro-batches; use a multiple of {cfg.accum_steps}")
    if cfg.save_every != 1 and cfg.snapshot is None:
        parser.error("--save-every needs --snapshot FILE (the file to save to and resume from)")
    for why in (f.metadata["check"](cfg) for f in chapter_flags.values() if f.metadata["check"]):
        if why:
            parser.error(why)
    cfg.output = cfg.output or str(Path("runs") / Path(sys.argv[0]).stem)
    return cfg


def check_fsdp2(cfg, script, sharded_over, uses_fsdp2=True):
    """What sharded weights refuse, in one line before any rendezvous: fp16, too few test images, too old a torch."""
    if cfg.precision == "fp16":  # A GradScaler would see only this rank's slices of the gradients.
        raise UsageError(f"{script} trains in --precision fp32 or bf16; fp16 needs a scaler that checks every rank's "
                         f"gradient slices for overflow, which this chapter does not have: use --precision bf16")
    if cfg.test_samples is not None and cfg.test_samples < sharded_over:  # a rank with no test image: no forward()
        raise UsageError(f"--test-samples {cfg.test_samples} is fewer than the {sharded_over} ranks: under FSDP every "
                         f"rank must run every test batch (forward() gathers the weights); use at least {sharded_over}")
    on_cpu = cfg.device == "cpu" or not torch.cuda.is_available()
    if uses_fsdp2 and on_cpu and not hasattr(torch.cpu.Stream, "record_event"):  # FSDP2 times its gathers with it.
        raise UsageError(f"{script} on the CPU needs torch 2.7 or later, whose CPU streams FSDP2 can time its "
                         f"gathers with (torch.cpu.Stream.record_event); this is torch {torch.__version__}: upgrade "
                         f"torch, or run {script} on GPUs")


def flag_text(name, value):
    """A setting as the flag that gives it: "--batch-size 48", or "no --train-samples" for one that is unset."""
    return f"no --{name.replace('_', '-')}" if value is None else f"--{name.replace('_', '-')} {value}"


# ---- How a run ends: one line for what is recognised, Python's traceback for anything else ----

# torch's messages recognised by their words, each explained in one line that names the fix torch's own text does
# not (seen on torch 2.14.1; Triton's on 2.11). The distributed chapters add theirs (ranks.name_rank_in_errors).
EXPLAINED = [
    # With --compile on the CPU, Inductor builds its kernels with the C++ compiler in $CXX (default g++).
    (r"No working C\+\+ compiler found", lambda m: "--compile needs a working C++ compiler to build its CPU kernels "
     "(g++, or the one $CXX names) and found none: install one (`apt-get install g++`, as `make tools` does), or run "
     "without --compile"),
    # --compile on a GPU: Triton builds its launcher with $CC (else gcc, clang); a failed build names the command.
    (r"Failed to find C\+?\+? compiler|Command '\['([^']+)', '[^']+\.c', '-O3', '-shared'.*returned non-zero", lambda m: (
        f"--compile on a GPU: Triton could not build its kernel launcher ({m[1] or 'no C compiler'}"
        f"{' failed: its error is above' if m[1] else ''}): install gcc and Python's headers (`apt-get install gcc "
        "python3-dev`), or run without --compile")),
]
RANK = [None]  # Holds this process's global rank where there are several, for the [rank N] prefix.


def explain(error):
    """The one line for an error this tutorial recognises (its own, or torch's with the fix), else None."""
    if isinstance(error, FatalError):
        return " ".join(str(error).split())
    return next((say(m) for pattern, say in EXPLAINED for m in [re.search(pattern, str(error))] if m), None)


def say(error, rank=None):
    """An error's line, once: a recognised one alone, anything else after Python's traceback (ranks say it early)."""
    if getattr(error, "said", False):
        return
    rank, line, shown = RANK[0] if rank is None else rank, explain(error), ""
    if line is None:  # Not recognised, so show its whole message and where it came from, as `python` prints them.
        shown = "".join(traceback.format_exception(error))
        line = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]} (the traceback above)"
    prefix = f"[rank {rank}] " if rank is not None and not line.startswith("[rank") else ""
    sys.stderr.write(f"{shown}error: {prefix}{line}\n")  # One write, so other ranks' lines cannot land inside it.
    sys.stderr.flush()
    with contextlib.suppress(AttributeError):  # An exception type with __slots__ takes no new attribute.
        error.said = True


def stop(error, rank=None):
    """End the process for an error: its line (say), then its exit code."""
    say(error, rank)
    end_process(getattr(error, "exit_code", 1))


def end_process(code):
    """Flush, then os._exit: an interpreter shutdown can abort on a gloo thread that wants the GIL (pytorch#179291)."""
    with contextlib.suppress(OSError, ValueError):  # a reader that left, a closed stream: nothing more to show
        sys.stdout.flush()
        sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)  # Flush C's stdio too, which holds NCCL's and gloo's own lines.
    os._exit(code)


def run_main(main):
    """Run a chapter's main(): an error ends it through stop(), Ctrl-C with 130, every way out in end_process."""
    try:
        main()
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        end_process(130)
    except BrokenPipeError:  # As in `python single_gpu.py | head`, the reader left. Stop quietly, as other tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Then the last flush cannot fail.
        end_process(141)
    except Exception as e:
        stop(e)
    end_process(0)
