"""The CUDA twin of every flag and mode the CPU suite proves: one chapter run at world size 1 on the first GPU, with the
outcome the CPU test checks. tests/test_gpu.py runs them on a GPU; tests/test_gpu_suite_coverage.py fails, on any
machine, for a flag or value of any chapter that no twin runs."""
import sys
from dataclasses import dataclass

from support.launchers import SLURM_ENV
from support.ports import free_port
from support.run import TORCHRUN
from support.same_model import SLICE

TORCHRUN_CHAPTERS = ("ddp_launch.py", "ddp_by_hand.py", "ddp_comm_hooks.py", "diloco.py", "fsdp.py", "tensor_parallel.py", "pipeline.py",
                     "debug_hang.py", "ddp_ft.py")


def chapter_command(script, out, data, *extra):
    """(argv, extra env) that run `script` at world size 1 on the first GPU, as a user starts each chapter."""
    args = [*SLICE, "--data-dir", data, "--output", out, *extra]
    port = str(free_port())
    if script in TORCHRUN_CHAPTERS:
        return [*TORCHRUN, "--standalone", "--nproc-per-node", "1", script, *args], {}
    if script == "ddp_mp.py":
        return [sys.executable, script, "--nprocs", "1", *args], {}
    if script == "ddp_tcp_manual.py":
        return [sys.executable, script, "--init-method", f"tcp://127.0.0.1:{port}", "--rank", "0", "--world-size", "1",
                *args], {}
    if script == "ddp_slurm.py":  # the variables srun gives a one-task job
        return [sys.executable, script, *args], dict(SLURM_ENV, SLURM_NTASKS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    return [sys.executable, script, *args], {}



@dataclass(frozen=True)
class Twin:
    """One chapter run at world size 1 on the first GPU (chapter_command), SLICE plus flags ({tmp}: the test's folder),
    and the outcome the CPU suite checks for it:
      same     chapter 1's CUDA weights, trained with the same model flags (ref: others), within test_gpu.SAME_MODEL;
      trains   it trains (16-bit gradients, a pipeline's micro-batches in bf16): an accuracy near chapter 1's;
      resume   stopped after epoch 1 by --snapshot and resumed, it ends equal to the uninterrupted run;
      refused  exit 2 and one error line that says `says`;
      one-process  a silent case of chapter 8 fixed: its model.pth within the bound it prints of its one_process.pth."""

    chapter: str
    flags: tuple = ()
    check: str = "same"
    says: str = ""
    ref: tuple = None

    def model_flags(self):
        """Chapter 1's flags to compare with: ref, or those of the row's flags that change the trained weights."""
        if self.ref is not None:
            return self.ref
        return tuple(x for name, value in zip(self.flags, self.flags[1:]) if name in MODEL_FLAGS for x in (name, value))


MODEL_FLAGS = ("--seed", "--lr", "--momentum", "--precision", "--train-samples")
CHAPTER_NAMES = ["single_gpu.py", "dataparallel.py", "ddp_launch.py", "ddp_by_hand.py", "ddp_mp.py",
                 "ddp_tcp_manual.py", "ddp_slurm.py", "fsdp.py", "debug_hang.py", "tensor_parallel.py", "pipeline.py",
                 "diloco.py", "ddp_comm_hooks.py", "ddp_ft.py"]
MOMENTUM = ("--momentum", "0.9")  # an optimizer with state: a resumed run must load it onto the GPU too
LEARNS = ("--lr", "0.05")  # SLICE's 2 epochs at the quickstart's 1e-3 stay near chance (10.6%): nothing to compare
TWINS = [
    # Every chapter at world size 1 on the GPU: chapter 1's model (chapter 8 with each bug fixed).
    Twin("dataparallel.py"), Twin("ddp_launch.py"), Twin("ddp_mp.py"), Twin("ddp_tcp_manual.py", ("--timeout", "60")),
    Twin("ddp_tcp_manual.py", ("--init-method", "file://{tmp}/rendezvous")), Twin("ddp_slurm.py"), Twin("fsdp.py"),
    Twin("tensor_parallel.py", ("--dp", "1")), Twin("pipeline.py"), Twin("pipeline.py", ("--schedule", "1f1b")),
    Twin("pipeline.py", ("--microbatches", "2")),
    Twin("debug_hang.py", ("--bug", "eval-on-rank0", "--fix")),
    Twin("debug_hang.py", ("--bug", "early-stop", "--fix", "--epochs", "3"), ref=()),  # stops after epoch 2 of 3
    Twin("debug_hang.py", ("--bug", "uneven-batches", "--fix", "--train-samples", "961")),
    Twin("debug_hang.py", ("--bug", "shape-mismatch", "--fix")),
    Twin("debug_hang.py", ("--bug", "unused-parameters", "--fix")),
    Twin("debug_hang.py", ("--bug", "save-wrapped", "--fix")),
    Twin("debug_hang.py", ("--bug", "slow-save", "--fix", "--timeout", "5")),  # writes --timeout + 8 s, off the path
    # The silent cases fixed: the model one process trains, which the run trains too and saves beside its own.
    Twin("debug_hang.py", ("--bug", "same-augmentation", "--fix"), "one-process"),
    Twin("debug_hang.py", ("--bug", "batchnorm", "--fix"), "one-process"),
    Twin("debug_hang.py", ("--bug", "shard-grad-norm", "--fix", "--max-norm", "0.5"), "one-process"),
    Twin("ddp_mp.py", ("--seed", "7", "--lr", "0.01")),
    # --precision: chapter 1's model at the same precision; FSDP2 computes in bf16 weights and the pipeline per
    # micro-batch, so theirs are not bit for bit chapter 1's and must train as well.
    Twin("single_gpu.py", ("--precision", "bf16")), Twin("dataparallel.py", ("--precision", "bf16")),
    Twin("ddp_launch.py", ("--precision", "bf16")), Twin("ddp_slurm.py", ("--precision", "bf16")),
    Twin("tensor_parallel.py", ("--precision", "bf16")), Twin("fsdp.py", (*LEARNS, "--precision", "bf16"), "trains"),
    Twin("pipeline.py", (*LEARNS, "--precision", "bf16"), "trains"),
    Twin("single_gpu.py", ("--precision", "fp16")), Twin("ddp_mp.py", ("--precision", "fp16")),
    Twin("ddp_tcp_manual.py", ("--precision", "fp16")),
    Twin("fsdp.py", ("--precision", "fp16"), "refused", "fsdp.py trains in --precision fp32 or bf16"),
    Twin("tensor_parallel.py", ("--precision", "fp16"), "refused", "tensor_parallel.py trains in --precision fp32 or bf16"),
    Twin("pipeline.py", ("--precision", "fp16"), "refused", "pipeline.py trains in --precision fp32 or bf16"),
    # --accum-steps and --compile: chapter 1's model.
    Twin("single_gpu.py", ("--accum-steps", "2")), Twin("ddp_launch.py", ("--accum-steps", "2")),
    Twin("fsdp.py", ("--accum-steps", "2")), Twin("tensor_parallel.py", ("--accum-steps", "2")),
    Twin("pipeline.py", ("--accum-steps", "2"), "refused", "pipeline.py takes no --accum-steps"),
    Twin("single_gpu.py", ("--compile",)), Twin("ddp_launch.py", ("--compile", "--accum-steps", "2")),
    Twin("tensor_parallel.py", ("--compile",)),
    Twin("pipeline.py", ("--compile",), "refused", "pipeline.py takes no --compile"),
    Twin("debug_hang.py", ("--bug", "early-stop", "--precision", "bf16"), "refused", "debug_hang.py's cases train in fp32"),
    # --comm-hook (chapter 11b): torch's hooks train; at world size 1 they still round (16 bits) or approximate
    # (PowerSGD) the gradient. PowerSGD on the CPU of this GPU machine is refused (torch's hook synchronizes CUDA on
    # the CPU).
    Twin("ddp_comm_hooks.py", (*LEARNS, "--comm-hook", "bf16"), "trains"),
    Twin("ddp_comm_hooks.py", (*LEARNS, "--comm-hook", "fp16"), "trains"),
    Twin("ddp_comm_hooks.py", (*LEARNS, "--comm-hook", "powersgd"), "trains"),
    Twin("ddp_comm_hooks.py", (*LEARNS, "--comm-hook", "powersgd:2:5"), "trains"),
    Twin("ddp_comm_hooks.py", ("--comm-hook", "powersgd", "--device", "cpu"), "refused",
         "--comm-hook powersgd cannot train with --device cpu where a GPU is visible"),
    Twin("ddp_comm_hooks.py", ("--comm-hook", "powersgd", "--precision", "fp16"), "refused",
         "--comm-hook powersgd cannot train with --precision fp16"),
    # DDP by hand (chapter 3b): its broadcast and per-tensor all-reduces on NCCL, with accumulation, bf16, a compiled
    # model and a resumed run; fp16 refused.
    Twin("ddp_by_hand.py"), Twin("ddp_by_hand.py", ("--accum-steps", "2", "--precision", "bf16")),
    Twin("ddp_by_hand.py", ("--compile",)), Twin("ddp_by_hand.py", MOMENTUM, "resume"),
    Twin("ddp_by_hand.py", ("--precision", "fp16"), "refused", "ddp_by_hand.py trains in --precision fp32 or bf16"),
    # post-local SGD at world size 1: its averages are of one rank, so it is chapter 1's model (and model.pth holds the
    # weights alone); on the CPU of this GPU machine it trains; fp16 is refused.
    Twin("ddp_comm_hooks.py", ("--comm-hook", "localsgd:4")), Twin("ddp_comm_hooks.py", ("--comm-hook", "localsgd:2:5")),
    Twin("ddp_comm_hooks.py", ("--comm-hook", "localsgd:4", "--device", "cpu"), "trains"),
    Twin("ddp_comm_hooks.py", ("--comm-hook", "localsgd:4", "--precision", "fp16"), "refused",
         "--comm-hook localsgd cannot train with --precision fp16"),
    # DiLoCo (chapter 11) at world size 1: with outer lr 1, no outer momentum and fp32 on the wire, each outer step
    # steps to the one rank's weights: chapter 1's model. Its own outer step with fragments overlapped (NCCL's async
    # all-reduce) in bf16 trains; a resumed run holds a fragment in flight; fp16 refused.
    Twin("diloco.py", ("--sync-every", "5", "--outer-lr", "1", "--outer-momentum", "0", "--wire-dtype", "fp32",
                       "--ranks-per-replica", "1")),
    Twin("diloco.py", (*LEARNS, "--sync-every", "6", "--fragments", "3", "--overlap", "2", "--wire-dtype", "bf16"),
         "trains"),
    Twin("diloco.py", (*MOMENTUM, "--sync-every", "6", "--fragments", "3", "--overlap", "2"), "resume"),
    Twin("diloco.py", ("--precision", "fp16"), "refused", "diloco.py trains in --precision fp32 or bf16"),
    # Chapter 12 (ddp_ft.py): a replica group on NCCL (torchft's ProcessGroupNCCL) under a lighthouse is
    # test_gpu.py's test_a_torchft_group_on_nccl_trains_chapter_1s_model; here, what it refuses before torchft starts.
    Twin("ddp_ft.py", ("--replica-group", "0", "--snapshot", "{tmp}/snap.pt", "--precision", "fp16"), "refused",
         "ddp_ft.py does not take --snapshot, --precision fp16"),
    # --snapshot: a run stopped after epoch 1 and resumed is the uninterrupted one, in every chapter that takes it.
    Twin("single_gpu.py", (*MOMENTUM, "--save-every", "1"), "resume"), Twin("dataparallel.py", MOMENTUM, "resume"),
    Twin("ddp_launch.py", MOMENTUM, "resume"), Twin("ddp_mp.py", MOMENTUM, "resume"),
    Twin("ddp_comm_hooks.py", (*MOMENTUM, "--comm-hook", "bf16"), "resume"),
    Twin("ddp_comm_hooks.py", (*MOMENTUM, "--comm-hook", "powersgd"), "resume"),  # PowerSGD's state onto the GPU
    Twin("ddp_comm_hooks.py", (*MOMENTUM, "--comm-hook", "localsgd:4"), "resume"),  # its step counts, momentum averaged
    Twin("ddp_tcp_manual.py", MOMENTUM, "resume"), Twin("ddp_slurm.py", ("--precision", "fp16"), "resume"),
    Twin("fsdp.py", MOMENTUM, "resume"), Twin("tensor_parallel.py", MOMENTUM, "resume"),
    Twin("pipeline.py", MOMENTUM, "resume"),
    Twin("debug_hang.py", ("--bug", "early-stop", "--snapshot", "{tmp}/snap.pt"), "refused",
         "debug_hang.py's cases train in fp32, eagerly, one batch per step, without snapshots"),
]
# The tests that train chapter 1's model on the GPU for a chapter that needs more than chapter_command starts.
SAME_MODEL_TESTS = {"ddp_ft.py": "test_a_torchft_group_on_nccl_trains_chapter_1s_model"}
# Flags every twin passes (SLICE and chapter_command's), and flags whose twins are the tests named here.
PASSED_BY_EVERY_RUN = ("--train-samples", "--test-samples", "--batch-size", "--epochs", "--log-every", "--data-dir",
                       "--output", "--nprocs", "--init-method", "--rank", "--world-size")
COVERED_BY = {"--device": ["test_a_snapshot_moves_between_cuda_and_the_cpu", "test_cuda_and_cpu_train_the_same_model"],
              "--local-rank": ["test_a_rank_shown_only_its_own_gpu_trains_on_it"],
              **{flag: ["test_a_torchft_group_on_nccl_trains_chapter_1s_model"] for flag in (
                  "--replica-group", "--replica-groups", "--min-replicas", "--lighthouse", "--torchft-log")}}
