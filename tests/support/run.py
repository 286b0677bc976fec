"""Processes the tests start: the suite's environment, a script as a user runs it, many short cases forked from one
process, torchrun, and Procs, which kills everything a test started."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from measure.harness import descendants
from support import REPO, zygote

# Every process a test starts: no download attempts, the CPU even where a GPU is visible (tests/test_gpu.py asks
# for it), and one thread per process. The thread count alone moves the weights (1 vs 2 threads: 3e-6 after
# 3 epochs of 200 steps on an AMD EPYC, 1.8e-4 with momentum 0.9), so runs that are compared must use the same; with
# it, a resumed run is
# bit for bit the uninterrupted one. CUDA_DEFAULTS on the path makes every process take CUDA's defaults where the
# CPU's differ (the optimizers' foreach, autocast's dtype: tests/programs/cuda_defaults/sitecustomize.py), and so
# does the pytest process (conftest.py).
CUDA_DEFAULTS = REPO / "tests" / "programs" / "cuda_defaults"
BASE_ENV = dict(os.environ, PYTHONUNBUFFERED="1", FASHION_MNIST_OFFLINE="1", OMP_NUM_THREADS="1",
                CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(CUDA_DEFAULTS))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
FORKRUN = REPO / "tests" / "programs" / "forkrun.py"


# What a process prints when a C++ thread is ended while the interpreter shuts down (see common/cli.py's
# end_process); no process of this project may ever print it, whatever the test expects otherwise.
ABORT_AT_EXIT = "terminate called without an active exception"


def no_abort_at_exit(err):
    """Fail the test if a process's stderr shows the abort at exit."""
    if ABORT_AT_EXIT in (err or ""):
        pytest.fail(f"a process aborted at exit ({ABORT_AT_EXIT}):\n{err}")


def run_script(script, *args, cwd=None, env=None, timeout=600):
    """Run an entry script as a user would (its own process), returning the CompletedProcess."""
    proc = subprocess.run(
        [sys.executable, str(REPO / script), *map(str, args)],
        cwd=cwd or REPO, env={**BASE_ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout,
    )
    no_abort_at_exit(proc.stderr)
    return proc


def run_code(code, *args):
    """Python code in a process of its own, with the project on its path; it must exit 0."""
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=REPO, env=dict(
        BASE_ENV, PYTHONPATH=f"{REPO}:{BASE_ENV['PYTHONPATH']}"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def run_forked(cases, timeout=120):
    """[(script, args, extra env[, folder to run in])] -> [CompletedProcess], as run_script gives them, each case in a
    process of its own forked from one that imported torch once (tests/programs/forkrun.py): for the many short runs
    that end at a flag."""
    payload = [dict(script=str(REPO / script), args=list(map(str, args)), env={**BASE_ENV, **env}, timeout=timeout,
                    cwd=str(cwd[0]) if cwd else None) for script, args, env, *cwd in cases]
    proc = subprocess.run([sys.executable, str(FORKRUN)], input=json.dumps(payload), cwd=REPO,
                          env=BASE_ENV, capture_output=True, text=True, timeout=timeout * len(cases) + 60)
    assert proc.returncode == 0, proc.stderr
    results = [subprocess.CompletedProcess(case["args"], code, out, err)
               for case, (code, out, err) in zip(payload, json.loads(proc.stdout))]
    for result in results:
        no_abort_at_exit(result.stderr)
    return results


def run_forked_cases(request, test, cases):
    """For a module-scoped fixture: run_forked for the cases (of a list or a dict) that this session runs test with
    (parametrized by "case"), all in one go: {case: result}. A planted bug that lets a flag through then trains
    only in the cases picked, not in every case of the list."""
    wanted = [item.callspec.params["case"] for item in request.session.items if item.path == request.node.path
              and getattr(item, "originalname", None) == test and hasattr(item, "callspec")]
    return dict(zip(wanted, run_forked([cases[case] for case in wanted])))


class Procs:
    """Processes started in their own sessions, so a test can kill every one of them and their children."""

    def __init__(self):
        self.procs, self.ended = [], {}  # ended: what wait() read from each process that ended

    def start(self, cmd, **kw):
        """cmd in a session of its own; torchrun's workers start warm where the test may (support/zygote.py)."""
        env = zygote.warm(cmd, kw.pop("env", BASE_ENV))
        p = subprocess.Popen(cmd, cwd=kw.pop("cwd", REPO), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def wait(self, p, timeout=300):
        """(returncode, stdout, stderr) of p, killing it if it overruns."""
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in [p.pid, *descendants(p.pid)]:  # each prints its threads' Python stacks (cuda_defaults/)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR2)
            time.sleep(2)
            self.kill(p)
            out, err = p.communicate()
            others = "".join(f"\n--- {q.args} ended with {rc}:\n{o}\n{e}" for q, (rc, o, e) in self.ended.items())
            pytest.fail(f"{p.args} still running after {timeout}s (its stacks, then the other processes of this test):"
                        f"\n{out}\n{err}{others}")
        self.ended[p] = (p.returncode, out, err)
        no_abort_at_exit(err)
        return p.returncode, out, err

    def kill(self, p):
        """p's process group, and every process started under it: torchrun starts each worker in a session of its
        own, so killing torchrun's group alone would leave its workers running."""
        for pid in descendants(p.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                self.kill(p)
            p.communicate()


class Runs(dict):
    """{key: run}, each run made by make(key) when a test first asks for it: a test that needs one world size does
    not wait for the others (`make test` runs one of each chapter's)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        self[key] = run = self.make(key)
        return run


def torchrun_script(script, world, args, procs, timeout=240):
    """script under torchrun --standalone on `world` ranks on this machine: (returncode, stdout, stderr)."""
    p = procs.start([*TORCHRUN, "--standalone", "--nproc-per-node", str(world), script, *map(str, args)])
    return procs.wait(p, timeout=timeout)


def one_error_line(err, *needles):
    """err holds exactly one `error:` line, no traceback, and the line holds every needle."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
