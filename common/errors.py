"""One way to stop: a clear line on stderr and a non-zero exit, never a traceback for a problem the user can fix."""
import os
import re
import sys


class FatalError(Exception):
    """A problem the user can fix (missing data, bad path, unreachable master); its message names the cause and fix."""

    exit_code = 1


class UsageError(FatalError):
    """A flag that cannot work (found after argparse, e.g. a batch that does not split over the ranks): exit 2."""

    exit_code = 2


def _say(line):
    """One line on stderr in one write, so the lines of processes sharing a terminal or log do not interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _report(error, rank=None):
    """Print a FatalError as exactly one line, tagged with the rank in multi-process runs."""
    text = " ".join(str(error).split())
    if rank and not text.startswith("[rank"):
        text = f"[rank {rank}] {text}"
    _say(f"error: {text}")


def _stop(error, rank=None):
    """Exit with one line for a FatalError or a lost peer; anything else is a bug, re-raised with its traceback."""
    fatal = error if isinstance(error, FatalError) else lost_peers(error)
    if fatal is None:
        raise error
    _report(fatal, rank)
    sys.exit(fatal.exit_code)


# The global rank of this process once it has joined a process group (set by init_distributed), else None.
_group_rank = None

# Words in the errors gloo and NCCL raise when a peer is gone or silent (the process was killed, the network dropped).
_PEER_LOST = re.compile(r"gloo|nccl|connection|timed out|socket|peer", re.IGNORECASE)


def joined_group(rank):
    """Called once this process is in a process group: from now on a failed collective is explained, not traced."""
    global _group_rank
    _group_rank = rank


def lost_peers(error):
    """A collective that failed because another rank died or stalled, as one FatalError line; else None."""
    if _group_rank is None or not _PEER_LOST.search(str(error)):
        return None
    reason = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())  # drop gloo's "[.../pair.cc:545]" prefix
    reason = reason.split(". This is typically")[0][:200]
    return FatalError(f"[rank {_group_rank}] lost contact with the other ranks ({reason}): another rank died or was "
                      f"stopped (see its log), or the network between them failed")


def run_main(main):
    """Run an entry script's main(): FatalError becomes one line and its exit code, Ctrl-C exit 130."""
    from torch.multiprocessing import ProcessExitedException

    try:
        main()
    except (FatalError, RuntimeError) as e:
        _stop(e)
    except ProcessExitedException as e:  # an mp.spawn worker failed; spawn has already stopped the others
        if e.signal_name:
            _say(f"error: rank {e.error_index} was killed by {e.signal_name}")
        sys.exit(e.exit_code if e.exit_code and e.exit_code > 0 else 1)  # the worker printed its own line
    except KeyboardInterrupt:
        _say("interrupted")
        sys.exit(130)
    except BrokenPipeError:  # `python single_gpu.py | head`: the reader left; stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's final flush cannot fail
        sys.exit(141)


def run_worker(rank, fn, *args):
    """Entry point of an mp.spawn worker: fn(rank, *args), with FatalError as one line and an exit code."""
    try:
        fn(rank, *args)
    except (FatalError, RuntimeError) as e:
        _stop(e, rank)
