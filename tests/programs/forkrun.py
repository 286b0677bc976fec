"""Run many short `python SCRIPT ARGS` cases, each in its own process, for the price of one torch import.

tests/support/run.py's run_forked() starts this with the cases as JSON on stdin. It imports torch once, then forks one
child per case: the child takes the case's environment and argv and runs the script as `python SCRIPT` would (as
__main__, the project's modules imported afresh), its stdout and stderr going to files. A refusal that exits 2
before any training then costs a fork, not a new interpreter and its 1.5 s of imports. A case whose environment
sets a variable read at the start (import_time.py: a PYTHONPATH of its own, CUDA_*, the compiler's switches) starts
a new interpreter instead, as a fork would keep this process's. Prints one JSON line with each case's exit status,
stdout and stderr.
"""
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time

from import_time import differs

STARTED_WITH = dict(os.environ)  # before torch's imports

# The imports the children share: torch and the parts of it the chapters import (not the project's own modules,
# some of which read the environment when imported).
import torch  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.elastic.multiprocessing.errors  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401
import torch.multiprocessing  # noqa: F401
import torch.utils.data  # noqa: F401


def run_case(script, args, env, timeout, cwd=None):
    """(returncode, stdout, stderr) of one case, run in a child forked from here, in folder cwd (else this one's);
    a case whose environment differs from this process's where a fork would keep this one's (import_time.py) runs
    in a new interpreter instead."""
    if differs(env, STARTED_WITH):
        try:
            proc = subprocess.run([sys.executable, script, *args], env=env, cwd=cwd, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as e:  # as a forked case that hangs: killed, and its status says so
            text = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr)]
            return -signal.SIGKILL, *text
        return proc.returncode, proc.stdout, proc.stderr
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        pid = os.fork()
        if pid == 0:  # the child: become `python script args` under env
            try:
                if cwd:
                    os.chdir(cwd)
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                os.environ.clear()
                os.environ.update(env)
                sys.argv = [script, *args]
                sys.path[0] = os.path.dirname(os.path.abspath(script))
                for name in [m for m in sys.modules if m == "common" or m.startswith("common.")]:
                    del sys.modules[name]
                runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException as e:  # noqa: BLE001  (as the interpreter would: a traceback and exit 1)
                import traceback

                traceback.print_exception(e)
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:  # a case that hangs: killed, and its status says so (-9)
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.005)
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return code, out.read(), err.read()


def main():
    cases = json.load(sys.stdin)
    results = [run_case(c["script"], c["args"], c["env"], c["timeout"], c.get("cwd")) for c in cases]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
