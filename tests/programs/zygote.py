"""A warm start for the workers of runs whose launcher is not what the test is about: torch imported once, each
worker forked from here instead of a new interpreter importing it again (about 3 CPU-s each on 2 cores).

`python tests/programs/zygote.py FOLDER` imports what the chapters import, writes FOLDER/python (the executable
torchrun runs in place of Python when PYTHON_EXEC names it: tests/programs/zygote_exec.py) and serves
FOLDER/socket. torchrun, its agent, its rendezvous, its store, its restarts and its signals stay real: only the
worker's interpreter is not new. For each `python -u SCRIPT ARGS` (or `-u -m MODULE ARGS`) the executable sends its
argv, environment, folder and its stdin, stdout and stderr; this process forks a child that takes them all and runs
the script as __main__ (the project's modules imported afresh), then ends as that interpreter would, atexit handlers
included. The executable forwards every signal it gets to the child and exits as the child did (a signal's death by
the same signal); if the executable dies (SIGKILL), the child sees its socket close and kills itself.

A request whose environment differs from this process's in a variable read while torch is imported (the thread
counts, PYTHON*, CUDA_VISIBLE_DEVICES, the suite's own switches) is answered "cold": the executable then becomes the
real interpreter (exec), as if no zygote were there. FOLDER/forks.log gets a line per child: the time it was forked,
its pid, the CPU seconds it used (with its own children), and the test that asked (TESTS_WARM_TEST), which
tests/support/cpu_time.py adds to that test's CPU and tests/conftest.py reads to check that the tests which must
start cold never came here.
"""
import atexit
import contextlib
import gc
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time

from import_time import differs

STARTED_WITH = dict(os.environ)  # before torch's imports, which set some variables of their own

# The imports the workers share: torch, torchvision and the parts of torch the chapters and torchrun's workers import
# (not the project's own modules, some of which read the environment when imported).
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it on an optimizer's first param group)
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.elastic.multiprocessing.errors  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401
import torch.multiprocessing  # noqa: F401
import torch.utils.data  # noqa: F401
import torchvision  # noqa: F401

torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # the optimizers' lazy imports, done once here

ADDED_BY_IMPORTS = {k: v for k, v in os.environ.items() if k not in STARTED_WITH}  # as a cold worker's imports would

FRAME = 1 << 20  # the most bytes one request may take


def parse(argv):
    """(run, target, args) for `-u SCRIPT ARGS` or `-u -m MODULE ARGS`, as torchrun runs a worker; None otherwise."""
    if len(argv) >= 2 and argv[0] == "-u" and argv[1] != "-m" and not argv[1].startswith("-"):
        return "path", argv[1], argv[2:]
    if len(argv) >= 3 and argv[:2] == ["-u", "-m"]:
        return "module", argv[2], argv[3:]
    return None


def answer(conn, **message):
    conn.sendall(json.dumps(message).encode() + b"\n")


def become(conn, fds, request):
    """In the child: take the request's stdio, environment, folder and argv; watch the executable; run the script."""
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update({k: v for k, v in ADDED_BY_IMPORTS.items() if k not in request["env"]})
    os.chdir(request["cwd"])

    def watch():  # the executable never writes again: recv returns only when it is gone
        conn.recv(1)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="zygote-watch").start()
    run, target, args = parse(request["argv"])
    for name in [m for m in sys.modules if m == "common" or m.startswith("common.")]:
        del sys.modules[name]
    sys.argv = [target, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(target)) if run == "path" else os.getcwd()
    try:
        if run == "path":
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:  # as the interpreter reads sys.exit's argument
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt as e:  # the interpreter prints it, then dies of SIGINT
        sys.excepthook(type(e), e, e.with_traceback(own_frames(e.__traceback__)).__traceback__)
        code = -signal.SIGINT
    except BaseException as e:  # noqa: BLE001  (a traceback and exit 1)
        sys.excepthook(type(e), e, e.with_traceback(own_frames(e.__traceback__)).__traceback__)
        code = 1
    finish(code)


def own_frames(tb):
    """The traceback from the script's first frame on, as a cold interpreter prints it (not this file's, runpy's)."""
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>"):
        tb = tb.tb_next
    return tb


def finish(code):
    """End as the interpreter ends, without tearing down the heap shared with the zygote (which touches, and so
    copies, every page of it: 1 CPU-s): other threads joined, atexit handlers run, every file still open flushed."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for generation in range(3):  # the objects made since the fork (the zygote's are frozen)
        for obj in gc.get_objects(generation):
            if isinstance(obj, io.IOBase):
                with contextlib.suppress(Exception):
                    obj.closed or obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def serve(folder):
    """Accept requests until stdin closes (the suite's process ended); return a request in the child, None here."""
    path = os.path.join(folder, "socket")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the pipe
    children = {}  # pid -> (connection, test)
    log = open(os.path.join(folder, "forks.log"), "a", buffering=1)
    gc.freeze()  # what is here now is never collected in a child: its pages stay shared
    print("ready", flush=True)
    while True:
        try:
            ready, _, _ = select.select([server, wake_r, sys.stdin], [], [])
        except InterruptedError:
            continue
        if sys.stdin in ready and not sys.stdin.buffer.read1(1):
            return None
        if wake_r in ready:
            os.read(wake_r, 4096)
        while children:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            conn, test = children.pop(pid, (None, ""))
            if conn is None:
                continue
            cpu = usage.ru_utime + usage.ru_stime
            log.write(f"{time.time():.3f}\tend\t{pid}\t{cpu:.2f}\t{test}\n")
            try:
                answer(conn, status=status)
            except OSError:
                pass
            conn.close()
        if server in ready:
            conn, _ = server.accept()
            try:
                data, fds, _, _ = socket.recv_fds(conn, FRAME, 3)
                request = json.loads(data)
            except (OSError, ValueError):
                conn.close()
                continue
            why = differs(request["env"], STARTED_WITH) or ([] if parse(request["argv"]) else ["argv"])
            if why or len(fds) != 3:
                for fd in fds:
                    os.close(fd)
                log.write(f"{time.time():.3f}\tcold\t0\t0\t{request['env'].get('TESTS_WARM_TEST', '')}: "
                          f"{', '.join(why) or 'no stdio'}\n")
                answer(conn, cold=", ".join(why) or "no stdio", python=sys.executable)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                os.close(wake_r)
                os.close(wake_w)
                log.close()
                return conn, fds, request
            for fd in fds:
                os.close(fd)
            test = request["env"].get("TESTS_WARM_TEST", "")
            children[pid] = (conn, test)
            log.write(f"{time.time():.3f}\tfork\t{pid}\t0\t{test}\n")
            answer(conn, pid=pid)


def write_executable(folder):
    """FOLDER/python: tests/programs/zygote_exec.py under this interpreter, isolated (-I: no PYTHONPATH, no site)."""
    exe = os.path.join(folder, "python")
    source = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote_exec.py")).read()
    with open(exe, "w") as f:
        f.write(f"#!{sys.executable} -IS\n{source}")
    os.chmod(exe, 0o755)


def main():
    folder = sys.argv[1]
    write_executable(folder)
    child = serve(folder)
    if child is None:
        return
    conn, fds, request = child
    become(conn, fds, request)


if __name__ == "__main__":
    main()
