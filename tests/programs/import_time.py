"""The environment variables a process reads as it starts or imports torch, which a forked child cannot take.

tests/programs/zygote.py and tests/programs/forkrun.py fork children from a process that has already started Python
and imported torch. A child keeps what that process read then: the thread counts (OMP_*, MKL_*, ...), PYTHON*
(PYTHONPATH's sitecustomize runs at the start), LD_*, CUDA_*, torch's compiler and logging switches, and the suite's
own. So a request whose environment differs from the parent's in one of them starts a new interpreter instead.
Standard library only: the zygote's executable side starts in milliseconds.
"""
import re

# PYTHON_EXEC names the zygote's executable itself; PYTHONUNBUFFERED is torchrun's -u, which the children take.
IMPORT_TIME = re.compile(r"(OMP_|MKL_|KMP_|GOMP_|OPENBLAS_|PYTHON(?!_EXEC$|UNBUFFERED$)|LD_|CUDA_|TORCHDYNAMO|"
                         r"TORCHINDUCTOR|TORCH_LOGS|TORCH_CPP|TORCH_COMPILE|TORCH_SHOW|TESTS_STEP|TUTORIAL_)")


def differs(env, started_with):
    """The import-time variables whose value (or presence) differs between env and started_with: [] if none."""
    keys = {k for k in (*env, *started_with) if IMPORT_TIME.match(k)}
    return sorted(k for k in keys if env.get(k) != started_with.get(k))
