"""The DDP chapters through their launchers, and what each launcher gives a rank: torchrun's and srun's variables,
scontrol's stand-in, a file:// rendezvous left over from an earlier run."""
import os
import sys
import time

from support.ports import free_port
from support.run import BASE_ENV, TORCHRUN
from support.same_model import slice_args

# As torchrun / srun would set them for rank 0 of 2 (nothing is started: the flags are refused first).
TORCHRUN_ENV = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT="1")
SLURM_ENV = dict(SLURM_JOB_ID="7", SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0",
                 SLURM_JOB_NODELIST="localhost", SLURM_STEP_NODELIST="localhost")


def launch(kind, world, real_data, out, procs, timeout=60, extra=(), env=BASE_ENV):
    """Train with chapter `kind` on `world` ranks; returns (returncodes, stdout of all, stderr of all)."""
    args = [*slice_args(real_data, out), "--timeout", str(timeout), *extra]
    port = free_port()
    if kind == "mp":
        ps = [procs.start([sys.executable, "ddp_mp.py", "--nprocs", str(world), *args], env=env)]
    elif kind in ("torchrun", "by-hand", "hooks"):  # chapter 3b (DDP's job by hand) and 11b (--comm-hook): as 3
        script = {"torchrun": "ddp_launch.py", "by-hand": "ddp_by_hand.py", "hooks": "ddp_comm_hooks.py"}[kind]
        ps = [procs.start([*TORCHRUN, "--standalone", "--nproc-per-node", str(world), script, *args], env=env)]
    elif kind == "srun-env":  # chapter 6's tasks as one srun step starts them on one node: only its variables differ
        step = dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_NTASKS=str(world), SLURM_STEP_NODELIST="localhost",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # no scontrol to ask for the first node here
        ps = [procs.start([sys.executable, "ddp_slurm.py", *args],
                          env=dict(env, **step, SLURM_PROCID=str(r), SLURM_LOCALID=str(r))) for r in range(world)]
    else:
        init = f"tcp://127.0.0.1:{port}" if kind == "tcp" else f"file://{out}.rdzv"
        ps = [procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", init, "--rank", str(r),
                           "--world-size", str(world), *args], env=env) for r in range(world)]
    results = [procs.wait(p) for p in ps]
    return [r[0] for r in results], "".join(r[1] for r in results), "".join(r[2] for r in results)


def stale_rendezvous_file(folder):
    """A file:// rendezvous file left by a run an hour ago."""
    stale = folder / "rdzv"
    stale.write_text("old")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    return stale


# scontrol's stand-in where no SLURM is configured (tests/test_slurm.py runs the real one): `scontrol show hostnames
# LIST` as SLURM answers for a plain comma list and for "localhost,gpu[02-03]", SLURM's own error for anything else.
FAKE_SCONTROL = """#!/bin/sh
[ "$1 $2" = "show hostnames" ] || exit 2
case "$3" in
  "localhost,gpu[02-03]") printf 'localhost\\ngpu02\\ngpu03\\n' ;;
  *[[]*|"") echo "scontrol: error: Unable to create hostlist from $3" >&2; exit 1 ;;
  *) echo "$3" | tr ',' '\\n' ;;
esac
"""


def fake_scontrol(folder):
    """A PATH with scontrol's stand-in first (written into folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "scontrol").write_text(FAKE_SCONTROL)
    (folder / "scontrol").chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"
