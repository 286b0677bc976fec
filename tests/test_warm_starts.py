"""The zygote (tests/programs/zygote.py) changes nothing but the cost of a worker's start: a chapter under torchrun
trains the same weights bit for bit and prints the same lines with its workers forked warm as with them cold; a
warm worker exits as a cold one does (its code, a signal's death, its atexit handlers, its unclosed files written);
a signal to the executable reaches the worker, and a SIGKILLed executable takes its worker with it."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from support import zygote
from support.run import BASE_ENV, torchrun_script
from support.same_model import load_state, slice_args


def torchrun_chapter(script, real_data, out, procs, warm):
    """script on 2 ranks over the slice, its workers forked by the zygote (warm) or new interpreters: (out, forks)."""
    zygote.allowed, since = warm, time.time()
    try:
        code, stdout, err = torchrun_script(script, 2, [*slice_args(real_data, out), "--seed", "7"], procs)
    finally:
        zygote.allowed = True
    assert code == 0, err
    printed = [re.sub(r"\d+\.\d+s \(\d+ samples/s\)", "TIME", line.replace(str(out), "OUT"))  # clocks differ
               for line in stdout.splitlines() if not line.startswith("[rank")]
    return printed, [f for f in zygote.forks(since) if f[1] == "fork"]  # (the [rank r] host= lines name pids)


@pytest.mark.parametrize("script", ["ddp_launch.py", "fsdp.py"])
def test_a_warm_run_trains_the_cold_runs_model_bit_for_bit(script, real_data, tmp_path, procs):
    cold, cold_forks = torchrun_chapter(script, real_data, tmp_path / "cold", procs, warm=False)
    warm, warm_forks = torchrun_chapter(script, real_data, tmp_path / "warm", procs, warm=True)
    assert len(cold_forks) == 0 and len(warm_forks) == 2, (cold_forks, warm_forks)  # each run as it was meant
    a, b = load_state(tmp_path / "cold" / "model.pth"), load_state(tmp_path / "warm" / "model.pth")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert cold == warm and "Done!" in warm


EXITS = """\
import atexit, os, signal, sys
atexit.register(lambda: print("atexit ran", flush=True))
sys.kept = open(sys.argv[2], "w")  # never closed: the interpreter's exit writes what it holds
sys.kept.write("written at exit")
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("ASKED"))
how = sys.argv[1]
if how == "raise":
    raise ValueError("a worker's own error")
if how == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
if how == "wait":
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(5)))
    print("waiting", flush=True)
    signal.pause()
sys.exit(int(how))
"""


@pytest.fixture
def executable(tmp_path):
    """The zygote's executable and a worker program that ends as its argument says."""
    program = tmp_path / "exits.py"
    program.write_text(EXITS)
    return zygote.start(BASE_ENV) / "python", program


@pytest.mark.parametrize("how,code", [("3", 3), ("0", 0), ("raise", 1), ("signal", -signal.SIGTERM)])
def test_a_warm_worker_exits_as_a_cold_one(how, code, executable, tmp_path):
    exe, program = executable
    runs = {}
    for kind, python in (("cold", sys.executable), ("warm", str(exe))):
        written = tmp_path / f"{kind}.txt"
        proc = subprocess.run([python, "-u", str(program), how, str(written)], cwd=tmp_path,
                              env=dict(BASE_ENV, ASKED=kind), capture_output=True, text=True, timeout=60)
        runs[kind] = proc
        assert proc.returncode == code, proc.stderr
        assert written.read_text() == ("" if how == "signal" else "written at exit")  # a signal's death writes none
        assert f"argv ['{how}', '{written}'] cwd {tmp_path} env {kind}" in proc.stdout
        assert ("atexit ran" in proc.stdout) == (how != "signal")
    assert ("ValueError: a worker's own error" in runs["warm"].stderr) == (how == "raise")
    assert runs["warm"].stderr == runs["cold"].stderr


def test_signals_reach_the_worker_and_its_executables_death_ends_it(executable, tmp_path):
    exe, program = executable
    for sig, expected in ((signal.SIGTERM, 5), (signal.SIGKILL, -signal.SIGKILL)):
        since = time.time()
        p = subprocess.Popen([str(exe), "-u", str(program), "wait", str(tmp_path / "w.txt")], cwd=tmp_path,
                             env=BASE_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout.readline().startswith("argv") and p.stdout.readline() == "waiting\n"
        child = next(pid for _, event, pid, _, _ in zygote.forks(since) if event == "fork")
        p.send_signal(sig)
        assert p.wait(timeout=30) == expected
        if sig == signal.SIGTERM:
            assert "got SIGTERM" in p.stdout.read()  # forwarded: the worker's own handler ran
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:  # ended, then reaped by the zygote
            time.sleep(0.05)
        if os.path.exists(f"/proc/{child}"):
            os.kill(child, signal.SIGKILL)  # not left waiting for good after the test
            pytest.fail("the worker outlived its executable")


def test_a_request_whose_start_differs_runs_cold(executable, tmp_path):
    """A variable read while torch is imported (here OMP_NUM_THREADS) differs from the zygote's: the executable becomes
    the real interpreter, and the worker sees its own value."""
    exe, _ = executable
    threads = tmp_path / "threads.py"
    threads.write_text("import torch\nprint(torch.get_num_threads())\n")
    since = time.time()
    proc = subprocess.run([str(exe), "-u", str(threads)], env=dict(BASE_ENV, OMP_NUM_THREADS="2"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "2", proc.stderr
    assert not [f for f in zygote.forks(since) if f[1] == "fork"]
