"""scripts/scaling.py and the shaped link under it: the link is no faster than its rate, the script's numbers come
from the run, and DDP over a slow link still trains chapter 1's model. Nothing here asserts how fast this machine is:
only what the link's rate forbids (less time than its floor) and what the strategies must send."""
import json
import os
import subprocess
import sys

import pytest

from conftest import BASE_ENV, REPO, load_state, max_abs_diff, slice_args
from scripts.netns import IFNAME, NODES, TwoMachines, tc_bits, why_not
from test_ddp import SAME_MODEL
from test_multinode import NODE_ENV, accuracy_lines, run_on_both, torchrun_nodes

MODEL_BYTES = 669_706 * 4  # the quickstart MLP's fp32 weights, and so its gradients


def shaped(net, rate):
    """net with its link shaped to rate; a test that needs shaping says in one line why it cannot have it."""
    try:
        net.shape(rate)
    except RuntimeError as e:
        reason = f"the kernel cannot shape a veth link here: {e}"
        pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
    return net


@pytest.fixture
def two_machines():
    reason = why_not()
    if reason:
        pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
    with TwoMachines() as net:
        yield net


ALL_REDUCE = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://{master}:29500", rank=int(sys.argv[1]), world_size=2)
buffer = torch.ones({numel})
dist.all_reduce(torch.ones(1))  # both ranks are connected and ready
start = time.perf_counter()
dist.all_reduce(buffer)
print(time.perf_counter() - start, buffer[0].item(), flush=True)
dist.destroy_process_group()
os._exit(0)  # as common.errors.end_process: no interpreter shutdown under gloo's threads
"""


def all_reduce_seconds(net, procs, numel):
    """Each rank's time for one all-reduce of numel floats across the link."""
    code = ALL_REDUCE.format(master=NODES["nodea"], numel=numel)
    results = run_on_both(net, procs, {node: [sys.executable, "-c", code, str(i)] for i, node in enumerate(NODES)},
                          timeout=120)
    assert [rc for rc, _, _ in results] == [0, 0], results
    assert [out.split()[1] for _, out, _ in results] == ["2.0", "2.0"]  # the sum of both ranks' ones
    return [float(out.split()[0]) for _, out, _ in results]


def test_a_shaped_link_is_no_faster_than_its_rate(two_machines, procs):
    """A ring all-reduce of B bytes between 2 ranks moves B through each direction of the link: at 10 Mbit/s no rank
    can finish it in less than B * 8 / 10**7 seconds. Unshaped, the same all-reduce takes a fraction of that."""
    numel = 250_000  # 1 MB: a floor of 0.8 s at 10 Mbit/s
    floor = 2 * (2 - 1) / 2 * numel * 4 * 8 / tc_bits("10mbit")
    unshaped = all_reduce_seconds(two_machines, procs, numel)
    assert max(unshaped) < floor / 4, unshaped
    seconds = all_reduce_seconds(shaped(two_machines, "10mbit"), procs, numel)
    # tbf lets one burst of 32 KiB (3% of the buffer) leave at once: the floor less that burst
    assert min(seconds) >= floor * (1 - 32 * 1024 / (numel * 4)), (seconds, floor)


def test_ddp_over_a_slow_link_trains_chapter_1s_model(two_machines, procs, real_data, reference, tmp_path):
    """Chapter 3, one rank on each machine, over a 100 Mbit/s link: the same weights and accuracy as chapter 1."""
    net = shaped(two_machines, "100mbit")
    results = run_on_both(net, procs, torchrun_nodes("static", slice_args(real_data, tmp_path / "run")))
    assert [code for code, _, _ in results] == [0, 0], results
    assert max_abs_diff(reference[0], load_state(tmp_path / "run" / "model.pth")) <= SAME_MODEL
    assert accuracy_lines(results[0][1]) == accuracy_lines(reference[1])


@pytest.fixture(scope="module")
def scaling(real_data, tmp_path_factory):
    """scripts/scaling.py's DDP and FSDP2 rows at 100 Mbit/s: its JSON and its report."""
    if why_not():
        pytest.fail(why_not()) if os.environ.get("CI") else pytest.skip(why_not())
    out = tmp_path_factory.mktemp("scaling") / "scaling.json"
    proc = subprocess.run([sys.executable, "scripts/scaling.py", "--rows", "single,ddp,fsdp", "--rates", "100mbit",
                           "--data-dir", str(real_data), "--json", str(out)], cwd=REPO, env=BASE_ENV,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode and "cannot shape the link" in proc.stderr:
        pytest.fail(proc.stderr) if os.environ.get("CI") else pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr
    from scripts.scaling import derive
    measured = json.loads(out.read_text())
    return {r["row"]: r for r in derive(measured)}, proc.stdout


def test_scaling_counts_the_bytes_each_strategy_sends(scaling):
    """Read from gloo's collectives in the run: DDP all-reduces every gradient once (a ring sends 2(n-1)/n of it);
    FSDP2 all-gathers the other half of the weights twice (forward, backward) and, on gloo, reduces the gradients
    with an all-reduce of the whole tensor."""
    rows, _ = scaling
    assert rows["ddp"]["ring_bytes"] == MODEL_BYTES
    assert rows["fsdp"]["ring_bytes"] == MODEL_BYTES / 2 * 2 + MODEL_BYTES


def test_scaling_times_the_communication_on_the_link(scaling):
    """The communication is what the run measured on the slow link: never under the floor of its bytes, inside the
    step, and, with a floor of 214 ms against a step's tens of milliseconds of compute, mostly exposed."""
    rows, report = scaling
    for name in ("ddp", "fsdp"):
        r = rows[name]
        assert r["floor"] == r["ring_bytes"] * 8 / 10**8
        assert r["floor"] * 0.97 <= r["communication"] <= r["step"], r
        assert r["hidden"] + r["exposed"] == pytest.approx(r["communication"])
        assert r["exposed"] >= 0.5 * r["communication"], r
        assert r["vs_single"] < 1, r  # the question the script answers: here, slower than one process
    assert "DDP's communication at 100 Mbit/s is" in report
