"""scripts/preflight.py as a SLURM job step: srun starts 2 tasks, as it starts ddp_slurm.py (conftest's slurm fixture)."""
import os
import re
import sys
from pathlib import Path

from support import REPO

SCRIPT = """#!/bin/bash
#SBATCH --nodes=1 --ntasks=2 --cpus-per-task=1
srun --kill-on-bad-exit=1 python scripts/preflight.py --timeout 30
"""


def test_preflight_under_srun(slurm, tmp_path):
    env = dict(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", PYTHONUNBUFFERED="1")
    job_id, rc = slurm.sbatch(SCRIPT, f"--output={tmp_path}/%j.out", cwd=REPO, env=env, timeout=120)
    assert job_id is not None, f"sbatch refused the job: {rc}"
    log = (tmp_path / f"{job_id}.out").read_text()
    assert rc == 0 and slurm.job_state(job_id)["state"] == "COMPLETED", log
    assert sorted(re.findall(r"^\[rank (\d)\] host=\S+ local_rank=\1 device=cpu backend=gloo world_size=2 ", log,
                             re.M)) == ["0", "1"], log
    assert re.search(r"^preflight: OK: 2 ranks on 1 host \(\S+: 0,1\); 16 MiB all_reduce \d+\.\d+ GB/s", log, re.M), log
