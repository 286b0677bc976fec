"""One way to stop: a clear line on stderr and a non-zero exit, never a traceback for a problem the user can fix."""
import os
import sys


class FatalError(Exception):
    """A problem the user can fix (missing data, bad path, unreachable master); its message names the cause and fix."""

    exit_code = 1


class UsageError(FatalError):
    """A flag that cannot work (found after argparse, e.g. a batch that does not split over the ranks): exit 2."""

    exit_code = 2


def _report(error, rank=None):
    """Print a FatalError as exactly one line, tagged with the rank in multi-process runs."""
    text = " ".join(str(error).split())
    if rank and not text.startswith("[rank"):
        text = f"[rank {rank}] {text}"
    print("error:", text, file=sys.stderr, flush=True)


def run_main(main):
    """Run an entry script's main(): FatalError becomes one line and its exit code, Ctrl-C exit 130."""
    from torch.multiprocessing import ProcessExitedException

    try:
        main()
    except FatalError as e:
        _report(e)
        sys.exit(e.exit_code)
    except ProcessExitedException as e:  # an mp.spawn worker failed; spawn has already stopped the others
        if e.signal_name:
            print(f"error: rank {e.error_index} was killed by {e.signal_name}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code if e.exit_code and e.exit_code > 0 else 1)  # the worker printed its own line
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    except BrokenPipeError:  # `python single_gpu.py | head`: the reader left; stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's final flush cannot fail
        sys.exit(141)


def run_worker(rank, fn, *args):
    """Entry point of an mp.spawn worker: fn(rank, *args), with FatalError as one line and an exit code."""
    try:
        fn(rank, *args)
    except FatalError as e:
        _report(e, rank)
        sys.exit(e.exit_code)
