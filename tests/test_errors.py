"""Errors never lie: torch's messages that are recognised get their explanation, everything else its own words."""
import subprocess
import sys

import pytest
import torch.distributed as dist

from common.errors import FatalError, explain
from conftest import BASE_ENV, REPO

# (what torch 2.14.1 raised, as seen in this project's runs) -> words the one line must have
RECOGNISED = [
    (dist.DistNetworkError("The client socket has timed out after 10000ms while trying to connect to (10.0.0.1, "
                           "29500)."), "no rendezvous at 10.0.0.1:29500 within 10s: rank 0 is not running there"),
    (dist.DistStoreError("Timed out after 6 seconds waiting for clients. 1/2 clients joined."),
     "only 1 of 2 processes reached the rendezvous within 6s: start every rank"),
    (dist.DistNetworkError("The server socket has failed to listen on any local network address. port: 29500, "
                           "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"),
     "port 29500 is busy"),
    (RuntimeError("[enforce fail at gloo/transport/tcp/device.cc:84] ifa != nullptr. Unable to find address for: "
                  "eth9"), "GLOO_SOCKET_IFNAME=eth9 is not a network interface of this machine"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                  "[127.0.0.1]:38036. This is typically caused by a remote worker crashing."),
     "lost contact with the other ranks (Connection closed by peer [127.0.0.1]:38036): another rank died"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:13234: Connection "
                  "reset by peer"), "lost contact with the other ranks"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv "
                  "operation to complete"), "no answer from another rank within --timeout (5s)"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:1107] Application timeout caused pair closure"),
     "no answer from another rank within --timeout: one of them is stopped or stuck"),
    (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage, NCCL version 2.21.5\n"
                           "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\n"
                           "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000"),
     "ranks 1 and 0 are on the same GPU, and NCCL needs one GPU per rank"),
    (RuntimeError("Wait timeout"), "not every rank reached the rendezvous within --timeout"),
    # --compile on a GPU, Triton's launcher build (triton 3.8's runtime/build.py), as Inductor passes it on
    (RuntimeError("backend='inductor' raised:\nRuntimeError: Failed to find C compiler. Please specify via CC "
                  "environment variable or set triton.knobs.build.impl."), "--compile on a GPU needs a C compiler"),
    (RuntimeError("backend='inductor' raised:\nCalledProcessError: Command '['/usr/bin/gcc', '/tmp/tmpq1/cuda_utils.c',"
                  " '-O3', '-shared', '-fPIC', '-Wno-psabi', '-o', '/tmp/tmpq1/cuda_utils.so']' returned non-zero exit "
                  "status 1."), "Triton could not build its kernel launcher with /usr/bin/gcc"),
]


@pytest.mark.parametrize("error,words", RECOGNISED, ids=[w.split(":")[0][:40] for _, w in RECOGNISED])
def test_recognised_errors_are_explained(error, words):
    assert words in explain(error)


# Any other NCCL error, in the form torch 2.14 builds it (C10D_NCCL_CHECK: "NCCL error in: FILE:LINE, <NCCL's
# error string>, NCCL version V", then getNcclErrorDetailStr's interpretation and "Last error:" with NCCL's own
# account of the failed call): the line keeps NCCL's words and its last error, and guesses no cause.
NCCL_SYSTEM_ERROR = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled system error (run "
    "with NCCL_DEBUG=INFO for details), NCCL version 2.27.5\nncclSystemError: System call (e.g. socket, malloc) or "
    "external library call failed or device error. \nLast error:\nsocketStartConnect: Connect to 10.0.0.2<50311> "
    "failed : Software caused connection abort")


@pytest.mark.parametrize("text,line", [
    (NCCL_SYSTEM_ERROR, "DistBackendError: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details), "
                        "NCCL version 2.27.5; last error: socketStartConnect: Connect to 10.0.0.2<50311> failed : "
                        "Software caused connection abort (FULL_TRACEBACK=1 shows the traceback)"),
    ("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.21.5\nncclUnhandledCudaError: "
     "Call to CUDA function failed.\nLast error: Unknown NCCL Error\n",
     "DistBackendError: NCCL error: unhandled cuda error, NCCL version 2.21.5; last error: Unknown NCCL Error "
     "(FULL_TRACEBACK=1 shows the traceback)"),
], ids=["system-error", "cuda-error"])
def test_an_nccl_error_keeps_nccls_last_error(text, line):
    assert explain(dist.DistBackendError(text)) == line


@pytest.mark.parametrize("error", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (64x784 and 10x10)"),
    RuntimeError("Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: SO_ERROR: Connection refused"),
    ValueError("Error initializing torch.distributed using env:// rendezvous: environment variable MASTER_ADDR "
               "expected, but not set"),
], ids=["shapes", "gloo-connect", "env-missing"])
def test_anything_else_keeps_its_own_first_line(error):
    """Not one of the messages above: no guessed cause (no "lost contact"), its own words and the traceback hint."""
    line = explain(error)
    first = str(error).splitlines()[0]
    assert line == f"{type(error).__name__}: {first} (FULL_TRACEBACK=1 shows the traceback)"
    assert "lost contact" not in line


def test_a_fatal_error_is_its_message():
    assert explain(FatalError("--data-dir x is not a readable folder;\n fix the path")) == \
        "--data-dir x is not a readable folder; fix the path"


RAISES = "from common.errors import run_main\ndef main(): raise RuntimeError('something torch said\\nmore lines')\nrun_main(main)"


def test_run_main_prints_one_line_and_the_traceback_on_request():
    quiet = subprocess.run([sys.executable, "-c", RAISES], cwd=REPO, env=BASE_ENV, capture_output=True, text=True)
    assert quiet.returncode == 1 and quiet.stdout == ""
    assert quiet.stderr == "error: RuntimeError: something torch said (FULL_TRACEBACK=1 shows the traceback)\n"
    loud = subprocess.run([sys.executable, "-c", RAISES], cwd=REPO, env=dict(BASE_ENV, FULL_TRACEBACK="1"),
                          capture_output=True, text=True)
    assert loud.returncode == 1 and loud.stderr.startswith("Traceback (most recent call last):")
    assert "in main" in loud.stderr and loud.stderr.endswith(quiet.stderr)
