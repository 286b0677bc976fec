"""One way to stop: one line on stderr and a non-zero exit; the traceback is one variable away (FULL_TRACEBACK=1)."""
import ctypes
import functools
import os
import re
import sys
import traceback

TRACEBACK_VARIABLE = "FULL_TRACEBACK"


class FatalError(Exception):
    """A problem the user can fix (missing data, bad path, unreachable master); its message names the cause and fix."""

    exit_code = 1


class UsageError(FatalError):
    """A flag or launch that cannot work (e.g. a batch that does not split over the ranks): exit 2."""

    exit_code = 2


_rank = None  # this process's global rank in a multi-process run, for the [rank N] prefix (name_rank_in_errors)


def name_rank_in_errors(rank, world_size):
    """From now on this process's error lines start with [rank N], where there are several ranks."""
    global _rank
    _rank = rank if world_size > 1 else None


NO_RANK0 = ("rank 0 is not running there, a firewall blocks the port, or the address is wrong. Start rank 0, check "
            "the address and port, and set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface that reaches it")
MISSING_PEERS = ("start every rank, with the same address and world size; a firewall between the machines, or "
                 "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME naming the wrong interface, keeps them apart too")


PORT = r"port: (\d+)"
# torch's own messages (seen on torch 2.14.1; Triton's on 2.11 too), each recognised by its words and explained in one
# line that names the fix, which torch's own text does not; any other message keeps its own words (explain).
_EXPLAINED = [
    (r"EADDRINUSE|ddress already in use", lambda m, text: (
        f"port {(re.search(PORT, text) or ['', '?'])[1]} is busy (another job or a leftover process holds it); pick "
        f"a free port (MASTER_PORT, --init-method tcp://HOST:OTHER_PORT) or stop the old job")),
    (r"Unable to find address for: ?(\S+)", lambda m, text: (
        f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', m[1])} is not a network interface of this "
        f"machine; set it to the one on the network the ranks share (`ip -br addr` lists them), or unset it")),
    (r"timed out after (\d+)ms while trying to connect to \((.+), (\d+)\)", lambda m, text: (
        f"no rendezvous at {m[2]}:{m[3]} within {int(m[1]) / 1000:g}s: {NO_RANK0}")),
    (r"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined", lambda m, text: (
        f"only {m[2]} of {m[3]} processes reached the rendezvous within {m[1]}s: {MISSING_PEERS}")),
    # --compile on the CPU: Inductor builds its kernels with the C++ compiler in $CXX (default g++).
    (r"No working C\+\+ compiler found", lambda m, text: (
        "--compile needs a working C++ compiler to build its CPU kernels (g++, or the one $CXX names) and found "
        "none: install one (`apt-get install g++`, as `make tools` does), or run without --compile")),
    # --compile on a GPU: Triton builds a small C launcher with the C compiler in $CC (else gcc or clang) and Python's
    # headers; with no compiler it says so, and a failed build ends in the compiler's command (its error is above).
    (r"Failed to find C\+?\+? compiler", lambda m, text: (
        "--compile on a GPU needs a C compiler: Triton builds its kernel launcher with gcc (or $CC) and Python's "
        "headers, and found no compiler; install them (`apt-get install gcc python3-dev`), or run without --compile")),
    (r"Command '\['([^']+)', '[^']+\.c', '-O3', '-shared'.*returned non-zero exit status", lambda m, text: (
        f"--compile on a GPU: Triton could not build its kernel launcher with {m[1]} (the compiler's error is above; "
        "most often Python.h is missing): install Python's headers (`apt-get install python3-dev`), or run without "
        "--compile")),
    # NCCL: two ranks of one machine were given the same GPU.
    (r"Duplicate GPU detected ?: rank (\d+) and rank (\d+) both on CUDA device (\w+)", lambda m, text: (
        f"ranks {m[1]} and {m[2]} are on the same GPU, and NCCL needs one GPU per rank: start at most one process "
        f"per visible GPU on each machine and give each its own local rank")),
    # TORCH_DISTRIBUTED_DEBUG=DETAIL's check: the ranks were about to run different collectives.
    (r"Detected mismatch between collectives on ranks\. Rank (\d+) is running collective: CollectiveFingerPrint\("
     r"SequenceNumber=(\d+), OpType=(\w+), TensorShape=\[([^\]]*)\], TensorDtypes=(\w+).*?but Rank (\d+) is running "
     r"collective: CollectiveFingerPrint\(SequenceNumber=(\d+), OpType=(\w+), TensorShape=\[([^\]]*)\], "
     r"TensorDtypes=(\w+)", lambda m, text: (
        f"collective mismatch: rank {m[1]} runs collective #{m[2]} {m[3]} [{m[4]}] {m[5]}, rank {m[6]} runs #{m[7]} "
        f"{m[8]} [{m[9]}] {m[10]}: every rank must call the same collectives in the same order with the same shapes "
        f"(a collective under `if rank == 0`, a loop one rank leaves early, uneven data)")),
    # gloo, once the group is up: the peer's end of the connection was closed (its process died).
    (r"Connection (?:closed|reset) by peer|Broken pipe", lambda m, text: (
        f"lost contact with the other ranks ({_first_line(text)}): another rank died (see its log), or the "
        f"network between them failed")),
    # gloo, once the group is up: a peer stopped answering but kept its connection (stopped, hung, or elsewhere); the
    # operation that timed out says so, or one waiting on a connection gloo then closed ("pair closure").
    (r"Timed out waiting (\d+)ms for (?:recv|send) operation|Application timeout caused pair closure", lambda m, text: (
        f"no answer from another rank within --timeout{f' ({int(m[1]) / 1000:g}s)' if m[1] else ''}: one of them is "
        f"stopped or stuck (see its log), or the network between them stalled")),
]


def _first_line(text):
    """The first line of an exception's text, without gloo's "[.../pair.cc:545]" source prefix."""
    line = next((x for x in str(text).strip().splitlines() if x.strip()), "")
    return re.sub(r"^\[[^\]]*\]\s*", "", line).split(". This is typically")[0].strip()


def explain(error):
    """The one line for an exception: its explanation where recognised, else its own first line and the hint."""
    if isinstance(error, FatalError):
        return " ".join(str(error).split())
    text = str(error)
    for pattern, say in _EXPLAINED:
        match = re.search(pattern, text)
        if match:
            return say(match, text)
    if re.fullmatch(r"Wait timeout|Socket Timeout", text.strip()):  # a store's wait ran out: a peer never came
        return f"not every rank reached the rendezvous within --timeout: {MISSING_PEERS}"
    # Any other NCCL error that reaches Python: its own words, without the source file, and the line NCCL gives
    # after "Last error:" (the failed call and its reason: often the one line that says what went wrong).
    nccl = re.match(r"NCCL error in: [^,\n]*, ([^\n]*)", text.strip())
    if nccl:
        last = re.search(r"\nLast error:\s*([^\n]+)", text)
        return (f"{type(error).__name__}: NCCL error: {nccl[1]}{f'; last error: {last[1].strip()}' if last else ''} "
                f"({TRACEBACK_VARIABLE}=1 shows the traceback)")
    return (f"{type(error).__name__}: {_first_line(text) or '(no message)'} "
            f"({TRACEBACK_VARIABLE}=1 shows the traceback)")


def _say(line):
    """One line on stderr in one write, so the lines of processes sharing a terminal or log do not interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def stop(error, rank=None):
    """Print the error as one line (tagged [rank N] in multi-process runs) and end the process with its code."""
    if os.environ.get(TRACEBACK_VARIABLE):
        traceback.print_exception(error)
    rank = _rank if rank is None else rank
    line = explain(error)
    if rank is not None and not line.startswith("[rank"):
        line = f"[rank {rank}] {line}"
    _say(f"error: {line}")
    end_process(getattr(error, "exit_code", 1))


def end_process(code):
    """Flush what was printed, then end the process with code at once, without Python's interpreter shutdown.

    torch's process groups outlive destroy_process_group() (DDP's and DTensor's caches hold them), and a gloo thread
    that asks for the GIL during the shutdown is ended by pthread_exit: std::terminate, SIGABRT after the run's last
    line (4 of 30 two-rank runs on torch 2.14.1; pytorch/pytorch#179291, not fixed). os._exit skips that shutdown.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that left, a closed stream: nothing more can be shown
            pass
    ctypes.CDLL(None).fflush(None)  # C's stdio too (NCCL's and gloo's own lines)
    os._exit(code)


def one_line_errors(fn):
    """Decorator for an mp.spawn worker fn(rank, ...): an exception becomes one line and exit 1 (or 2)."""

    @functools.wraps(fn)
    def worker(rank, *args):
        try:
            fn(rank, *args)
        except Exception as e:
            stop(e, rank)
        end_process(0)  # not back into spawn, whose sys.exit would shut the interpreter down (see end_process)

    return worker


def run_main(main):
    """Run an entry script's main(): an exception is one line and a non-zero exit, Ctrl-C 130; all end in end_process."""
    from torch.multiprocessing import ProcessExitedException

    try:
        main()
    except ProcessExitedException as e:  # an mp.spawn worker failed; spawn has already stopped the others
        if e.signal_name:
            _say(f"error: rank {e.error_index} was killed by {e.signal_name}")
        end_process(e.exit_code if e.exit_code and e.exit_code > 0 else 1)  # else the worker printed its own line
    except KeyboardInterrupt:
        _say("interrupted")
        end_process(130)
    except BrokenPipeError:  # `python single_gpu.py | head`: the reader left; stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the last flush cannot fail
        end_process(141)
    except Exception as e:
        stop(e)
    end_process(0)
