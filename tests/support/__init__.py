"""What the tests share, by concern; the tests themselves are the test_*.py files beside this folder.

    run.py            processes: the suite's environment (BASE_ENV), running a script, torchrun or forked cases, Procs
    data.py           FashionMNIST in its real IDX format: a small fake one, and the real one in ./data
    same_model.py     the slice the distributed tests train on, and what "chapter 1's model" means (SAME_MODEL)
    launchers.py      a DDP chapter through its launcher, and the variables torchrun and srun give a rank
    long_runs.py      runs long enough to interrupt: a rank killed, stopped or frozen mid-epoch
    two_machines.py   the two network namespaces' commands (the fixture is conftest.py's two_machines)
    slurm_cluster.py  a real local SLURM cluster (the fixture is conftest.py's slurm); slurm_jobs.py submits to it
    ports.py          a port per use, from a block per xdist worker
    torch_features.py what this torch has, which some chapters need on the CPU
    cuda_twins.py     the CUDA twin of every flag: tests/test_gpu.py runs them, test_gpu_suite_coverage.py counts them
    traces.py         what a step's trace holds: each strategy's collectives, a rank's recorded steps
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the project's own modules (common, measure, scripts, the chapters)
