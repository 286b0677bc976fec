"""Check the project on a GPU machine, with one command: what it needs, where the data is, then tests/test_gpu.py.

    python scripts/gpu_check.py                               # on every GPU torch sees here
    CUDA_VISIBLE_DEVICES=2,3 python scripts/gpu_check.py      # on these two (UUIDs and MIG names work too)
    python scripts/gpu_check.py --data-dir ~/fashion-mnist    # the four FashionMNIST .gz files are there
    python scripts/gpu_check.py --workers 4 -- -x             # 4 tests at a time (pytest-xdist); pytest's flags after --

It needs torch with CUDA, pytest, and FashionMNIST on disk (no download is tried: GPU machines are often offline):
./data as torchvision reads it, filled from the four .gz files in --data-dir, else from Debian's dataset-fashion-mnist. For the --compile tests also a C compiler (gcc, or $CC)
and Python's headers, with which Triton builds its kernel launcher; without them those tests are skipped, saying why.
The tests see the GPUs this command was given and no others: CUDA_VISIBLE_DEVICES is passed on as it is.
"""
import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from common.cli import FatalError, UsageError, run_main  # noqa: E402


def c_compiler():
    """(compiler, Python.h) as Triton looks for them: $CC, else gcc, else clang; None for what is missing."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return (shutil.which(cc) if cc else None), (header if header.is_file() else None)


def find_data(data_dir):
    """./data as torchvision reads it (the folder the tests use), filled if need be from the four .gz files in
    data_dir, else from Debian's copy; one line if neither has them."""
    from common.data import unpack_debian_copy

    os.environ["FASHION_MNIST_OFFLINE"] = "1"  # the tests' processes try no download
    try:
        return unpack_debian_copy(REPO / "data", *[str(Path(data_dir).resolve())] * bool(data_dir)).parent.parent
    except FatalError as e:
        raise UsageError(f"{e} (or pass --data-dir, a folder holding the four FashionMNIST .gz files)") from None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", help="a folder with FashionMNIST's four .gz files (default: Debian's package)")
    p.add_argument("--workers", type=int, default=1, help="tests run at once, with pytest-xdist (default 1)")
    p.add_argument("pytest_args", nargs="*", help="more pytest flags, after --")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise UsageError(f"torch {torch.__version__} sees no GPU here (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}; torch built for CUDA "
                         f"{torch.version.cuda}): check nvidia-smi and the torch build, or run `make test` on the CPU")
    if importlib.util.find_spec("pytest") is None:
        raise UsageError("pytest is not installed: `pip install pytest` (the tests are pytest's)")
    if args.workers > 1 and importlib.util.find_spec("xdist") is None:
        raise UsageError("--workers needs pytest-xdist: `pip install pytest-xdist`, or leave --workers out")
    folder = find_data(args.data_dir)
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    cc, header = c_compiler()
    print(f"GPUs: {len(gpus)} ({', '.join(dict.fromkeys(gpus))}), CUDA_VISIBLE_DEVICES="
          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"Python {sys.version.split()[0]}")
    print(f"data: {folder}")
    print(f"--compile: C compiler {cc or 'none'}, Python.h {header or 'none'}"
          f"{'' if cc and header else ' (the --compile runs are skipped)'}")
    command = [sys.executable, "-m", "pytest", "-q", "tests/test_gpu.py"]  # -s / -rP: the measured spreads too
    command += ["-n", str(args.workers), "-rsP"] if args.workers > 1 else ["-rs", "-s"]
    command += args.pytest_args
    print("$ python", " ".join(command[1:]), flush=True)
    sys.exit(subprocess.run(command, cwd=REPO, env=os.environ).returncode)


if __name__ == "__main__":
    run_main(main)
