"""The torch range requirements.txt names (torch >= 2.6): on any torch in it, each chapter trains (the other tests),
or refuses in one line, before any rendezvous, naming the torch it needs. `make test-all` also runs `make test`'s quick
set on the floor (torch 2.6.0, `make test-floor`): there the chapters below refuse on the CPU, and the tests that
train them skip, naming this file. On a newer torch the same refusals are checked with the piece taken away."""
import pytest
import torch

from support.run import BASE_ENV, TORCHRUN
from support.torch_features import FSDP2_ON_CPU, GLOO_FLIGHT_RECORDER, PIPELINE_SCHEDULES

WITHOUT = {"stream events": "import torch\ndel torch.cpu.Stream.record_event\n",
           "gloo's recorder": "import torch\ndel torch._C._distributed_c10d._dump_fr_trace\n",
           "schedules' eval()": "from torch.distributed.pipelining import ScheduleGPipe\nfor c in ScheduleGPipe.__mro__:\n"
                                "    if 'eval' in vars(c):\n        delattr(c, 'eval')\n"}
# (the chapter and its flags, whether this torch has what it needs, what a floor torch lacks, the line it prints)
NEEDS = {
    "fsdp": (["fsdp.py"], FSDP2_ON_CPU, "stream events", "fsdp.py on the CPU needs torch 2.7 or later"),
    "2d": (["tensor_parallel.py", "--dp", "2"], FSDP2_ON_CPU, "stream events",
           "tensor_parallel.py on the CPU needs torch 2.7 or later"),
    "debug_hang": (["debug_hang.py", "--bug", "early-stop"], GLOO_FLIGHT_RECORDER, "gloo's recorder",
                   "debug_hang.py on the CPU needs torch 2.8 or later"),
    "pipeline": (["pipeline.py"], PIPELINE_SCHEDULES, "schedules' eval()", "pipeline.py needs torch 2.9 or later"),
}


@pytest.mark.parametrize("case", NEEDS)
def test_a_chapter_this_torch_cannot_run_says_which_it_needs(case, tmp_path, procs):
    argv, present, lacks, words = NEEDS[case]
    env = dict(BASE_ENV)
    if present:  # a newer torch than the floor: take away what the floor lacks
        (tmp_path / "sitecustomize.py").write_text(WITHOUT[lacks])
        env["PYTHONPATH"] = str(tmp_path)
    p = procs.start([*TORCHRUN, "--standalone", "--nproc-per-node", "2", *argv, "--output", str(tmp_path / "out")],
                    env=env)
    code, out, err = procs.wait(p, timeout=180)
    lines = [line for line in err.splitlines() if line.startswith("error:")]  # from each rank that said it before
    assert code != 0 and 1 <= len(lines) <= 2, err                            # torchrun stopped the others
    assert all(words in line and f"this is torch {torch.__version__}" in line for line in lines), err
    assert "Epoch 1" not in out and "host=" not in out  # before the rendezvous
