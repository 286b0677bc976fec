"""Errors never lie: what is recognised is one line with the fix; anything else keeps its words and traceback."""
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from common import ranks
from common.cli import EXPLAINED, FatalError, explain
from support import REPO
from support.run import BASE_ENV, TORCHRUN

EXPLAINED.extend(x for x in ranks.DISTRIBUTED_ERRORS if x not in EXPLAINED)  # as a rank's name_rank_in_errors does

# (what torch 2.14.1 raised, as seen in this project's runs) -> words the one line must have
RECOGNISED = [
    (dist.DistNetworkError("The client socket has timed out after 10000ms while trying to connect to (10.0.0.1, "
                           "29500)."),
     "no rendezvous at 10.0.0.1:29500 (torch's tries timed out after 10s each): rank 0 is not running there"),
    (dist.DistStoreError("Timed out after 6 seconds waiting for clients. 1/2 clients joined."),
     "only 1 of 2 processes reached the rendezvous within 6s: start every rank"),
    (RuntimeError("[enforce fail at gloo/transport/tcp/device.cc:84] ifa != nullptr. Unable to find address for: "
                  "eth9"), "GLOO_SOCKET_IFNAME=eth9 is not a network interface of this machine"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                  "[127.0.0.1]:38036. This is typically caused by a remote worker crashing."),
     "lost contact with the other ranks (Connection closed by peer): another rank died"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:13234: Connection "
                  "reset by peer"), "lost contact with the other ranks"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv "
                  "operation to complete"), "no answer from another rank within --timeout (5s)"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:1107] Application timeout caused pair closure"),
     "no answer from another rank within --timeout: one of them is stopped or stuck"),
    (RuntimeError("Wait timeout"), "not every rank reached the rendezvous within --timeout"),
    (dist.DistStoreError("wait timeout after 120000ms, keys: /default_pg/0//cpu//0"),
     "not every rank reached the rendezvous within --timeout (120s): start every rank"),
    # --compile on a GPU, Triton's launcher build (triton 3.8's runtime/build.py), as Inductor passes it on
    (RuntimeError("backend='inductor' raised:\nRuntimeError: Failed to find C compiler. Please specify via CC "
                  "environment variable or set triton.knobs.build.impl."), "Triton could not build its kernel launcher (no C compiler)"),
    (RuntimeError("backend='inductor' raised:\nCalledProcessError: Command '['/usr/bin/gcc', '/tmp/tmpq1/cuda_utils.c',"
                  " '-O3', '-shared', '-fPIC', '-Wno-psabi', '-o', '/tmp/tmpq1/cuda_utils.so']' returned non-zero exit "
                  "status 1."), "Triton could not build its kernel launcher (/usr/bin/gcc failed"),
]


@pytest.mark.parametrize("error,words", RECOGNISED, ids=[w.split(":")[0][:40] for _, w in RECOGNISED])
def test_recognised_errors_are_explained(error, words):
    assert words in explain(error)


# Any other NCCL error, in the form torch 2.14 builds it (C10D_NCCL_CHECK: "NCCL error in: FILE:LINE, <NCCL's
# error string>, NCCL version V", then getNcclErrorDetailStr's interpretation and "Last error:" with NCCL's own
# account of the failed call): not recognised, so its whole text stays, the last error with it.
NCCL_SYSTEM_ERROR = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled system error (run "
    "with NCCL_DEBUG=INFO for details), NCCL version 2.27.5\nncclSystemError: System call (e.g. socket, malloc) or "
    "external library call failed or device error. \nLast error:\nsocketStartConnect: Connect to 10.0.0.2<50311> "
    "failed : Software caused connection abort")


@pytest.mark.parametrize("error", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (64x784 and 10x10)"),
    RuntimeError("Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: SO_ERROR: Connection refused"),
    ValueError("Error initializing torch.distributed using env:// rendezvous: environment variable MASTER_ADDR "
               "expected, but not set"),
    dist.DistBackendError(NCCL_SYSTEM_ERROR),
    dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage, NCCL version 2.21.5\n"
                          "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\n"
                          "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000"),  # NCCL says it all
], ids=["shapes", "gloo-connect", "env-missing", "nccl-system-error", "nccl-duplicate-gpu"])
def test_anything_else_is_not_explained(error):
    """Not one of the messages above: no guessed cause (no "lost contact"): run_main shows it whole (below)."""
    assert explain(error) is None


def test_a_fatal_error_is_its_message():
    assert explain(FatalError("--data-dir x is not a readable folder;\n fix the path")) == \
        "--data-dir x is not a readable folder; fix the path"


def run_raising(error):
    """A script whose main() raises error under run_main: (exit status, stdout, stderr)."""
    script = f"from common.cli import FatalError, run_main\ndef main(): raise {error}\nrun_main(main)"
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=BASE_ENV, capture_output=True, text=True)
    return proc.returncode, proc.stdout, proc.stderr


def test_an_unknown_error_keeps_every_line_and_its_traceback():
    """What a learner's broken edit raises: its whole message and Python's traceback, as `python` shows it, then one
    line that says what it was; exit 1."""
    code, out, err = run_raising("RuntimeError('something torch said\\nand its second line')")
    assert code == 1 and out == ""
    assert err.startswith("Traceback (most recent call last):") and 'line 2, in main' in err
    assert "RuntimeError: something torch said\nand its second line\n" in err
    assert err.endswith("error: RuntimeError: something torch said (the traceback above)\n")


def test_a_recognised_error_is_one_line():
    code, _, err = run_raising("FatalError('--data-dir x is not a readable folder; fix the path')")
    assert code == 1 and err == "error: --data-dir x is not a readable folder; fix the path\n"
    code, _, err = run_raising("RuntimeError(\"InductorError: RuntimeError: No working C++ compiler found in cpp_builder\")")
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err and "--compile needs a working C++ compiler" in err


def test_a_step_of_chapter_12_not_committed_names_a_silent_quorum_store_in_its_own_words():
    """ddp_ft.py's reason for a step that did not commit because the quorum's store did not answer (torchrun's store
    once answered a connection 5.7 s late on a busy machine): the step is retried, so chapter 3's "start rank 0, check
    the address" would be wrong; a lost peer keeps the explanation every chapter gives."""
    from ddp_ft import not_committed_reason

    silent = dist.DistNetworkError("The client socket has timed out after 3000ms while trying to connect to "
                                   "(localhost, 41899).")
    assert not_committed_reason(silent) == ("the quorum's store at localhost:41899 did not answer within 3s: the group "
                                            "hosting it died or is cut off, or its machine is too busy for --timeout")
    lost = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:13234: "
                        "Connection reset by peer")
    assert not_committed_reason(lost) == explain(lost) and "another rank died" in explain(lost)


IN_FLIGHT = "tests/programs/fails_with_a_collective_in_flight.py"


def test_a_rank_that_fails_with_a_collective_in_flight_says_its_line_and_leaves_at_once(procs):
    """Rank 1 fails with an all-reduce queued that rank 0 never joins. Its teardown would wait for it (gloo: until
    --timeout, here 60 s; NCCL since torch 2.6: until the watchdog ends the process with SIGABRT, and no line): it
    says its line first and leaves without that wait, and torchrun then stops rank 0."""
    began = time.monotonic()
    code, _, err = procs.wait(procs.start([*TORCHRUN, "--standalone", "--nproc-per-node", "2", IN_FLIGHT, "cpu", "60"]),
                              timeout=150)
    took = time.monotonic() - began
    assert code == 1 and err.count("error: [rank 1] RuntimeError: a failure with an all-reduce in flight (the "
                                   "traceback above)\n") == 1, err
    assert took < 30, f"{took:.1f}s: rank 1 waited in its teardown"
