"""scripts/timeline.py: each rank's trace holds the collectives its strategy makes in a step, with their bytes, when;
a pipeline's trace holds each stage's micro-batches in the order the chapter prints."""
import json
import re
import subprocess
import sys

import pytest

from conftest import BASE_ENV, REPO

sys.path.insert(0, str(REPO / "scripts"))
from timeline import collective_bytes  # noqa: E402

# One step's collectives at 2 ranks, in bytes (each collective's input on one rank), as docs/scaling.md's pictures.
# DDP: its two buckets' all-reduces (the last layers' 267,786 floats, then the first layer's 401,920); by hand one
# per tensor (3 weights, 3 biases). Either way every gradient once: 2,678,824 bytes.
# PowerSGD (rank 1, compressing from step 3 on: the recorded steps are 4 and 5) the biases as they are, then P and Q,
# the second and third started from a callback on gloo's own thread: seen only when every thread is recorded.
# FSDP2: each Linear's half of its weights and bias gathered in the forward and again in the backward (200,960,
# 131,328 and 2,565 floats), and its whole gradient reduced: gloo has no reduce-scatter and runs FSDP2's as an
# all-reduce (README.md). Tensor parallel: one all-reduce of the row-wise layer's partial products, 64 x 512 floats,
# in the forward; the backward sends nothing (the column-wise layer's input is the images, which need no gradient).
LAYERS = [200_960 * 4, 131_328 * 4, 2_565 * 4]
COLLECTIVES = {
    "ddp_launch.py": dict(all_reduce=[267_786 * 4, 401_920 * 4]),
    "ddp_by_hand.py": dict(all_reduce=[784 * 512 * 4, 512 * 4, 512 * 512 * 4, 512 * 4, 512 * 10 * 4, 10 * 4]),
    "ddp_launch.py --comm-hook powersgd": dict(all_reduce=[1034 * 4, 1034 * 4, 1808 * 4]),
    "fsdp.py": dict(all_gather=LAYERS * 2, all_reduce=[401_920 * 4, 262_656 * 4, 5_130 * 4]),
    "tensor_parallel.py": dict(all_reduce=[64 * 512 * 4]),
}
# Which collectives leave while the step still computes: DDP's first bucket and FSDP2's first gradient before the
# backward's last op, by hand's and PowerSGD's (one bucket) only after it; FSDP2's gathers and tensor parallel's
# all-reduce inside the forward.
BEFORE_BACKWARD_ENDS = {"ddp_launch.py", "fsdp.py"}
IN_FORWARD = {"fsdp.py": "all_gather", "tensor_parallel.py": "all_reduce"}


def timeline(tmp_path, chapter, *flags, ranks=2):
    """scripts/timeline.py on loopback, its defaults: (the merged trace's events, what the chapter printed)."""
    proc = subprocess.run([sys.executable, "scripts/timeline.py", chapter, "--nproc", str(ranks), "--out",
                           str(tmp_path), "--", *flags], cwd=REPO, env=BASE_ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", proc.stdout
    return json.loads((tmp_path / "trace.json").read_text())["traceEvents"], (tmp_path / "chapter.log").read_text()


def first_step(events, rank):
    """The rank's complete events in its first recorded step (from the barrier's mark to the first step's end)."""
    mine = [e for e in events if e.get("pid") == rank and e.get("ph") == "X"]
    marks = sorted(e["ts"] for e in mine if e["name"] in ("timeline:start", "timeline:step"))
    return sorted((e for e in mine if marks[0] <= e["ts"] < marks[1]), key=lambda e: e["ts"])


@pytest.mark.parametrize("case", COLLECTIVES)
def test_each_ranks_trace_holds_its_strategys_collectives(case, tmp_path):
    """Both ranks in one trace, each the step's collectives with their bytes, each started where the strategy
    starts it (what the picture shows)."""
    chapter, *flags = case.split()
    events, _ = timeline(tmp_path, chapter, *flags)
    assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1}
    for rank in (0, 1):
        step = first_step(events, rank)
        for kind, sizes in COLLECTIVES[case].items():
            sent = [e for e in step if e["name"] == f"gloo:{kind}"]
            assert sorted(collective_bytes(e) for e in sent) == sorted(sizes), (kind, sent)
        assert {e["name"][5:] for e in step if e["name"].startswith("gloo:")} == set(COLLECTIVES[case])
        # when each all-reduce was started (c10d's op, on the thread that called it; gloo may run it later)
        last_backward = max(e["ts"] for e in step if e["name"].startswith("autograd::engine::"))  # its last op's start
        gradients = [e["ts"] for e in step if e["name"] in ("c10d::allreduce_", "c10d::_reduce_scatter_base_")]
        if case != "tensor_parallel.py":
            assert (min(gradients) < last_backward) == (case in BEFORE_BACKWARD_ENDS), (min(gradients), last_backward)
        forward = next(e for e in step if e["name"] == "timeline:forward")
        in_forward = [e for e in step if e["name"] == f"gloo:{IN_FORWARD.get(case)}"
                      and forward["ts"] <= e["ts"] < forward["ts"] + forward["dur"]]
        assert len(in_forward) == (3 if chapter == "fsdp.py" else 1 if chapter == "tensor_parallel.py" else 0), in_forward


PIPELINES = [(2, "gpipe"), (2, "1f1b"), (3, "gpipe"), (3, "1f1b")]


@pytest.mark.parametrize("ranks,schedule", PIPELINES, ids=[f"{r}-stages-{s}" for r, s in PIPELINES])
def test_pipeline_trace_follows_the_timetable_the_chapter_prints(ranks, schedule, tmp_path):
    """Each stage's micro-batch forwards (F2) and backwards (B2) come in the trace in the order chapter 10 prints for
    its first step: the schedule's, which 1F1B makes differ from stage to stage."""
    events, printed = timeline(tmp_path, "pipeline.py", "--schedule", schedule, ranks=ranks)
    table = dict(re.findall(r"^  stage (\d+): (.*)$", printed, re.M))
    assert len(table) == ranks, printed
    for rank in range(ranks):
        traced = [e["name"][len("timeline:"):] for e in first_step(events, rank)
                  if re.fullmatch(r"timeline:[FB]\d+", e["name"])]
        assert traced == table[str(rank)].split(), (rank, printed)


def test_timeline_across_two_machines_waits_for_the_link(tmp_path):
    """--link 100mbit: one rank on each of the two machines, the link between them shaped. Each rank's all-reduces
    must last at least the wire time of what it has to receive (at 2 ranks, half of each bucket: 1,339,412 bytes
    in all, 107 ms at 100 Mbit/s), from the first one's start to the last one's end."""
    from test_multinode import need_namespaces
    need_namespaces()
    proc = subprocess.run([sys.executable, "scripts/timeline.py", "ddp_launch.py", "--link", "100mbit", "--out",
                           str(tmp_path)], cwd=REPO, env=BASE_ENV, capture_output=True, text=True, timeout=300)
    if "cannot shape" in proc.stderr:
        from test_scaling import cannot_shape
        cannot_shape(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    for rank in (0, 1):
        sent = [e for e in first_step(events, rank) if e["name"] == "gloo:all_reduce"]
        assert sorted(collective_bytes(e) for e in sent) == sorted(COLLECTIVES["ddp_launch.py"]["all_reduce"])
        span_s = (max(e["ts"] + e["dur"] for e in sent) - min(e["ts"] for e in sent)) / 1e6
        assert span_s >= sum(COLLECTIVES["ddp_launch.py"]["all_reduce"]) / 2 * 8 / 100e6, span_s


def test_the_chapters_gain_no_profiling_line():
    """Profiling is the script's: no chapter and nothing in common/ starts a profiler or marks a range, so a chapter
    run without scripts/timeline.py runs exactly as before it existed."""
    for path in [*REPO.glob("*.py"), *REPO.glob("common/*.py")]:
        assert not re.search(r"profiler|record_function", path.read_text()), path
