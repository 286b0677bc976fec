"""The docs cannot drift: every command in README.md and RUN.md is run here, or listed below with the reason it can't be.

Commands are README's ```bash lines and RUN.md's `$ ` lines. Each document's commands run in order, in one
scratch folder that links to the scripts (later commands use what earlier ones wrote: runs/..., snapshots),
with the training scripts on a small slice of the real data, and port 29500 swapped for a free one. A command
must end with the exit status RUN.md shows for it (`[exit status N]`), or 0.
"""
import os
import sys
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from common.distributed import free_port
from conftest import REPO
from test_ddp import BASE_ENV

# (pattern, reason): commands that are not run here, and why. A doc command must match one, or run.
NOT_RUN_HERE = [
    (r"^make test$", "the test suite itself: .ci/run runs it"),
    (r"^make run$", "set-up plus `python single_gpu.py`, which RUN.md's chapter 1 command runs here"),
    (r"10\.0\.0\.1|/shared/", "needs two machines"),
    (r"(^|\s)(sbatch|sinfo|squeue|scontrol)(\s|$)|^cat fmnist-", "needs a SLURM cluster: tests/test_slurm.py submits "
                                                           "job.sh and job_torchrun.sh with the CPU overrides"),
    (r"^echo \$\?$", "prints the previous command's status, which is checked directly"),
]
# Exit statuses a command may have here although RUN.md shows another: the kill can come after the slice is done.
ALSO_OK = {r"^timeout -s KILL \d+ python single_gpu\.py": {0, 137}}
SLICE = "--train-samples 960 --test-samples 500"
CHAPTER = re.compile(r"\b((?:single_gpu|dataparallel|ddp_launch|ddp_mp|ddp_tcp_manual|ddp_slurm)\.py)\b")


def doc_commands(name):
    """[(command, expected exit status or None)] in document order."""
    text = (REPO / name).read_text()
    found = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        lines = body.splitlines()
        for i, line in enumerate(lines):
            if name == "README.md" and lang == "bash":
                command = line.split("  #")[0].strip()
                if command and not command.startswith("#"):
                    found.append((command, None))
            elif lang == "console" and line.startswith("$ "):
                output = []
                for later in lines[i + 1:]:
                    if later.startswith("$ "):
                        break
                    output.append(later)
                status = re.findall(r"^\[exit status (\d+)\]$", "\n".join(output), re.M)
                if not status and i + 2 < len(lines) and lines[i + 2] == "$ echo $?":  # `$ cmd`, its line, `$ echo $?`
                    status = [lines[i + 3]] if i + 3 < len(lines) and lines[i + 3].isdigit() else []
                found.append((line[2:], int(status[-1]) if status else None))
    return found


def reason_not_run(command):
    return next((reason for pattern, reason in NOT_RUN_HERE if re.search(pattern, command)), None)


def runnable(command, data_dir, port):
    """The command as the test runs it: the chapters on a slice of the data, the benchmark on two rows."""
    command = CHAPTER.sub(lambda m: f"{m.group(1)} --data-dir {data_dir} {SLICE}", command)
    command = re.sub(r"(scripts/benchmark\.py[^;&|]*)", r"\1 --epochs 1 --cases single_gpu,floor ", command)
    # The elastic demo kills rank 1 after 20 s; on the slice that is after the end, so kill it early instead.
    # (tests/test_faults.py kills it mid-epoch, timed on the log, and checks the weights.)
    command = re.sub(r"^\( sleep \d+;", "( sleep 4;", command)
    return command.replace("29500", str(port))


@pytest.fixture
def workspace(tmp_path):
    """A scratch folder where `python single_gpu.py`, `scripts/...` and `common` resolve to this repository."""
    for entry in [*REPO.glob("*.py"), REPO / "common", REPO / "scripts"]:
        (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


def test_every_doc_command_is_known():
    """Each command either runs (below) or has a reason; the lists above hold no stale patterns."""
    commands = [c for name in ("README.md", "RUN.md") for c, _ in doc_commands(name)]
    assert len(commands) > 30
    for pattern, reason in NOT_RUN_HERE:
        assert any(re.search(pattern, c) for c in commands), f"no doc command matches {pattern!r} ({reason}) any more"
    for pattern in ALSO_OK:
        assert any(re.search(pattern, c) for c in commands), f"no doc command matches {pattern!r} any more"


@pytest.mark.parametrize("doc", ["README.md", "RUN.md"])
def test_doc_commands_run(doc, real_data, workspace):
    bin_dir = Path(sys.executable).parent  # python, torchrun: the ones the suite runs with
    env = dict(BASE_ENV, PATH=f"{bin_dir}{os.pathsep}{BASE_ENV.get('PATH', '')}")
    env.pop("SLURM_JOB_ID", None)
    port = free_port()
    ran = 0
    for command, status in doc_commands(doc):
        if reason_not_run(command):
            continue
        cmd = runnable(command, real_data, port)
        slurm_run = workspace / "runs" / "ddp_slurm"
        if "runs/ddp_slurm" in command and not slurm_run.exists():
            # The SLURM chapter's run comes from a cluster (not started here); chapter 4's run, the same model by
            # construction, stands in for it. tests/test_slurm.py checks the real job's metrics against chapter 1.
            shutil.copytree(workspace / "runs" / "ddp_mp", slurm_run)
        proc = subprocess.run(["bash", "-c", cmd], cwd=workspace, env=env, capture_output=True, text=True, timeout=300)
        allowed = next((codes for pattern, codes in ALSO_OK.items() if re.search(pattern, command)), {status or 0})
        assert proc.returncode in allowed, f"{doc}: `{command}` exited {proc.returncode}, expected {allowed}\n" \
                                           f"ran: {cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr, f"{doc}: `{command}`\n{proc.stderr[-3000:]}"
        ran += 1
    assert ran >= 8
