"""scripts/timeline.py: each rank's trace holds the collectives its strategy makes in a step, with their bytes, when."""
import json
import subprocess
import sys

import pytest

from conftest import BASE_ENV, REPO

sys.path.insert(0, str(REPO / "scripts"))
from timeline import collective_bytes  # noqa: E402

# One step's gradient all-reduces, in bytes: DDP's two buckets (the last layers' 267,786 floats, then the first
# layer's 401,920), or by hand one per tensor (3 weights, 3 biases). Either way every gradient once: 2,678,824 bytes.
# PowerSGD (rank 1, compressing from step 3 on: the recorded steps are 4 and 5) the biases as they are, then P and Q,
# the second and third started from a callback on gloo's own thread: seen only when every thread is recorded.
ALL_REDUCES = {"ddp_launch.py": [267_786 * 4, 401_920 * 4],
               "ddp_by_hand.py": [784 * 512 * 4, 512 * 4, 512 * 512 * 4, 512 * 4, 512 * 10 * 4, 10 * 4],
               "ddp_launch.py --comm-hook powersgd": [1034 * 4, 1034 * 4, 1808 * 4]}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """{chapter: merged trace} of scripts/timeline.py on loopback, 2 ranks, its defaults."""
    found = {}
    for case in ALL_REDUCES:
        chapter, *flags = case.split()
        out = tmp_path_factory.mktemp(chapter[:-3])
        proc = subprocess.run([sys.executable, "scripts/timeline.py", chapter, "--out", str(out), "--", *flags], cwd=REPO,
                              env=BASE_ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert (out / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", proc.stdout
        found[case] = json.loads((out / "trace.json").read_text())["traceEvents"]
    return found


def first_step(events, rank):
    """The rank's complete events in its first recorded step (from the barrier's mark to the first step's end)."""
    mine = [e for e in events if e.get("pid") == rank and e.get("ph") == "X"]
    marks = sorted(e["ts"] for e in mine if e["name"] in ("timeline:start", "timeline:step"))
    return [e for e in mine if marks[0] <= e["ts"] < marks[1]]


@pytest.mark.parametrize("case", ALL_REDUCES)
def test_each_ranks_trace_holds_its_strategys_collectives(case, traces):
    """Both ranks in one trace, each the step's all-reduces with their bytes; DDP's first bucket leaves while the
    backward still has gradients to compute, by hand's and PowerSGD's (one bucket) only once the backward's last
    gradient is ready (what the picture shows)."""
    events = traces[case]
    assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1}
    for rank in (0, 1):
        step = first_step(events, rank)
        sent = [e for e in step if e["name"] == "gloo:all_reduce"]
        assert sorted(collective_bytes(e) for e in sent) == sorted(ALL_REDUCES[case]), sent
        # when each all-reduce was started (c10d's op, on the thread that called it; gloo may run it later)
        last_backward = max(e["ts"] for e in step if e["name"].startswith("autograd::engine::"))  # its last op's start
        first_started = min(e["ts"] for e in step if e["name"] == "c10d::allreduce_")
        assert (first_started < last_backward) == (case == "ddp_launch.py"), (first_started, last_backward)
