"""Every entry script of chapters 1 to 6 (and 3b's fp16), every bad value: exit 2, one line on stderr, nothing on stdout, no
traceback. (The other chapters' refusals are in their own files: test_fsdp.py, test_tensor_parallel.py,
test_pipeline.py, test_diloco.py, test_comm_hooks.py, test_training_flags.py.)"""
import pytest

from support.launchers import SLURM_ENV, TORCHRUN_ENV
from support.run import run_forked_cases

COMMON_BAD = [["--epochs", "0"], ["--epochs", "-1"], ["--batch-size", "0"], ["--batch-size", "-64"],
              ["--lr", "0"], ["--lr", "-0.1"], ["--device", "tpu"], ["--save-every", "0"]]
SCRIPTS = ["single_gpu.py", "dataparallel.py", "ddp_launch.py", "ddp_mp.py", "ddp_tcp_manual.py", "ddp_slurm.py"]
TCP = ["--init-method", "tcp://127.0.0.1:1", "--world-size", "2", "--rank", "0"]
NEEDS = {"ddp_tcp_manual.py": (TCP, {}), "ddp_launch.py": ([], TORCHRUN_ENV), "ddp_slurm.py": ([], SLURM_ENV)}

BAD = [(s, flag, NEEDS.get(s, ([], {}))[1], None) for s in SCRIPTS for flag in COMMON_BAD] + [
    # a global batch that does not split over the ranks
    ("ddp_mp.py", ["--nprocs", "2", "--batch-size", "63"], {}, "split evenly over 2"),
    ("ddp_launch.py", ["--batch-size", "63"], TORCHRUN_ENV, "split evenly over 2"),
    ("ddp_tcp_manual.py", ["--batch-size", "63"], {}, "split evenly over 2"),
    ("ddp_slurm.py", ["--batch-size", "63"], SLURM_ENV, "split evenly over 2"),
    # docs/exercises.md and README's "Try it": 3 ranks at the default batch of 64; chapter 3b without a loss scaler
    ("ddp_launch.py", ["--batch-size", "64"], dict(TORCHRUN_ENV, WORLD_SIZE="3", LOCAL_WORLD_SIZE="3"),
     "--batch-size 64 is the global batch and must split evenly over 3 ranks"),
    ("ddp_mp.py", ["--nprocs", "3"], {}, "--batch-size 64 is the global batch and must split evenly over 3 ranks"),
    ("ddp_by_hand.py", ["--precision", "fp16"], TORCHRUN_ENV, "ddp_by_hand.py trains in --precision fp32 or bf16"),
    # ranks and world sizes
    ("ddp_tcp_manual.py", ["--rank", "2"], {}, "--rank 2 must be below --world-size 2"),
    ("ddp_tcp_manual.py", ["--world-size", "0"], {}, "--world-size"),
    ("ddp_slurm.py", [], dict(SLURM_ENV, SLURM_STEP_ID=""), "not a task of an srun step"),
    ("ddp_mp.py", ["--nprocs", "0"], {}, "--nprocs"),
    ("ddp_launch.py", [], {}, "start this script with torchrun"),
    ("single_gpu.py", ["--save-every", "2"], {}, "--save-every needs --snapshot"),
    # malformed rendezvous
    ("ddp_tcp_manual.py", ["--init-method", "udp://x"], {}, "--init-method"),
    ("ddp_tcp_manual.py", ["--init-method", "tcp://host:port"], {}, "--init-method"),
    ("ddp_tcp_manual.py", ["--init-method", "file://relative/path"], {}, "--init-method"),
    # a flag another chapter has
    ("single_gpu.py", ["--nprocs", "2"], {}, "unrecognized arguments"),
]


@pytest.fixture(scope="module")
def bad_flag_runs(request):
    """The BAD cases this session runs, as `python SCRIPT ARGS` would run them, each in its own (forked) process."""
    cases = [(script, [*NEEDS.get(script, ([], {}))[0], *flag], env) for script, flag, env, _ in BAD]
    return run_forked_cases(request, "test_bad_flag_exits_2_with_one_line", cases)


@pytest.mark.parametrize("case", range(len(BAD)), ids=[f"{s}:{' '.join(f) or 'env'}" for s, f, _, _ in BAD])
def test_bad_flag_exits_2_with_one_line(case, bad_flag_runs):
    needle, proc = BAD[case][3], bad_flag_runs[case]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "error:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert needle is None or needle in proc.stderr, proc.stderr
    assert proc.stdout == ""
