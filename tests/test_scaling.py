"""measure/scaling.py and the shaped link under it: the link is no faster than its rate, the script's numbers come
from the run, and DDP over a slow link still trains chapter 1's model. Nothing here asserts how fast this machine is:
only what the link's rate forbids (less time than its floor) and what the strategies must send."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from measure.netns import IFNAME, NODES, burst_bytes, tc_bits
from support import REPO
from support.run import BASE_ENV
from support.same_model import SAME_MODEL, accuracy_lines, load_state, max_abs_diff, slice_args
from support.two_machines import cannot_shape, need_namespaces, run_on_both, torchrun_nodes

MODEL_BYTES = 669_706 * 4  # the quickstart MLP's fp32 weights, and so its gradients


def shaped(net, rate):
    """net with its link shaped to rate."""
    try:
        net.shape(rate)
    except RuntimeError as e:
        cannot_shape(f"the kernel cannot shape a veth link here: {e}")
    return net


CROSSINGS = """
import json, os, sys, time, torch, torch.distributed as dist
from common.ranks import destroy_process_group
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://{master}:29500", rank=rank, world_size=2)
buffer, seconds = torch.ones({numel}), {{}}
for name, op in [("all_reduce", lambda: dist.all_reduce(buffer)),
                 ("0 to 1", lambda: dist.broadcast(torch.ones({numel}), src=0)),
                 ("1 to 0", lambda: dist.broadcast(torch.ones({numel}), src=1))]:
    dist.all_reduce(torch.ones(1))  # both ranks are connected and ready, the last crossing done
    start = time.perf_counter()
    op()
    seconds[name] = time.perf_counter() - start
print(json.dumps(dict(seconds, sum=buffer[0].item())), flush=True)
destroy_process_group()
os._exit(0)  # as common.cli.end_process: no interpreter shutdown under gloo's threads
"""


def on_both(net, procs, script, numel):
    """script, for numel floats, as rank 0 on nodea (the rendezvous) and rank 1 on nodeb: the JSON each rank prints."""
    code = script.format(master=NODES["nodea"], numel=numel)
    results = run_on_both(net, procs, {node: [sys.executable, "-c", code, str(i)] for i, node in enumerate(NODES)},
                          timeout=120)
    assert [rc for rc, _, _ in results] == [0, 0], results
    return [json.loads(out) for _, out, _ in results]


def crossing_seconds(net, procs, numel):
    """Each rank's times for an all-reduce of numel floats, and for numel floats broadcast from each rank."""
    ranks = on_both(net, procs, CROSSINGS, numel)
    assert [r.pop("sum") for r in ranks] == [2.0, 2.0]  # the sum of both ranks' ones
    return ranks


def test_a_shaped_link_is_no_faster_than_its_rate(two_machines, procs):
    """A ring all-reduce of B bytes between 2 ranks moves B through each direction of the link: at 10 Mbit/s no rank
    can finish it in less than B * 8 / 10**7 seconds. B broadcast from one rank crosses one direction: the rank it
    reaches cannot have it sooner, whichever direction it is. Unshaped, each takes a fraction of that. tbf lets
    one burst leave at once (netns.burst_bytes: 1,600 bytes at 10 Mbit/s, 0.2% of the buffer)."""
    numel = 250_000  # 1 MB: a floor of 0.8 s at 10 Mbit/s
    floor = 2 * (2 - 1) / 2 * numel * 4 * 8 / tc_bits("10mbit")  # = numel * 4 * 8 / rate, a broadcast's too
    unshaped = crossing_seconds(two_machines, procs, numel)
    assert max(t for r in unshaped for t in r.values()) < floor / 4, unshaped
    ranks = crossing_seconds(shaped(two_machines, "10mbit"), procs, numel)
    at_least = floor * (1 - burst_bytes(tc_bits("10mbit")) / (numel * 4))
    assert min(r["all_reduce"] for r in ranks) >= at_least, (ranks, floor)
    assert ranks[1]["0 to 1"] >= at_least and ranks[0]["1 to 0"] >= at_least, (ranks, floor)


# What PowerSGD (rank 1) all-reduces each step, 15,504 bytes, after the link was idle long enough to fill tbf's bucket:
# a burst as large as the step (tbf's usual 32 KiB) would let the whole step leave at once, and the link would
# never limit PowerSGD (0.07x its wire time at 10 Mbit/s, measured with a 32 KiB burst).
AFTER_IDLE = """
import json, os, sys, time, torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://{master}:29500", rank=rank, world_size=2)
seconds = []
for _ in range(5):
    dist.all_reduce(torch.ones(1))
    time.sleep(0.3)  # idle: tbf's bucket fills to its burst
    dist.all_reduce(torch.ones(1))  # both ranks are here: the timed all-reduce starts together
    buffer = torch.ones({numel})
    start = time.perf_counter()
    dist.all_reduce(buffer)
    seconds.append(time.perf_counter() - start)
print(json.dumps(seconds), flush=True)
os._exit(0)
"""


def link_burst(net):
    """The bytes the shaper lets out at once after an idle gap, as tc reports it on each node (the larger)."""
    units = {"b": 1, "Kb": 1024, "Mb": 1024 ** 2}
    bursts = []
    for ns in net.ns.values():
        shown = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", IFNAME], capture_output=True,
                               text=True, check=True).stdout
        size, unit = re.search(r"burst ([\d.]+)(b|Kb|Mb)\b", shown).groups()
        bursts.append(float(size) * units[unit])
    return max(bursts)


@pytest.mark.parametrize("rate", ["10mbit", "100mbit"])
def test_a_small_all_reduce_after_an_idle_gap_takes_its_wire_time(two_machines, procs, rate):
    """PowerSGD's 15,504 bytes a step after an idle gap, 5 times on each rank. The idle gap fills the shaper's
    bucket, so one burst leaves at once: the link as tc shows it lets at most a third of the step through so, and no
    all-reduce takes less than the wire time of what the burst does not cover (measured here: at least 1.06x the wire
    time at 10 Mbit/s and, in the median, 1.16x at 100 Mbit/s; once 0.996x, which the burst allows)."""
    numel = 3876
    wire = numel * 4 * 8 / tc_bits(rate)
    net = shaped(two_machines, rate)
    burst = link_burst(net)
    assert burst <= numel * 4 / 3, f"tc's burst at {rate} is {burst:.0f} bytes: a step of {numel * 4} nearly free"
    for seconds in on_both(net, procs, AFTER_IDLE, numel):
        assert min(seconds) >= wire * (1 - burst / (numel * 4)), (seconds, wire, burst)


def test_ddp_over_a_slow_link_trains_chapter_1s_model(two_machines, procs, real_data, reference, tmp_path):
    """Chapter 3, one rank on each machine, over a 100 Mbit/s link: the same weights and accuracy as chapter 1."""
    net = shaped(two_machines, "100mbit")
    results = run_on_both(net, procs, torchrun_nodes("static", slice_args(real_data, tmp_path / "run")))
    assert [code for code, _, _ in results] == [0, 0], results
    assert max_abs_diff(reference[0], load_state(tmp_path / "run" / "model.pth")) <= SAME_MODEL
    assert accuracy_lines(results[0][1]) == accuracy_lines(reference[1])


# FSDP2 on the CPU needs torch.cpu.Stream.record_event (torch 2.14.1 has it, 2.6.0 does not: fsdp.py says so)
FSDP_ROW = pytest.param("fsdp", marks=pytest.mark.skipif(not hasattr(torch.cpu.Stream, "record_event"),
                                                         reason="fsdp.py on the CPU needs torch.cpu.Stream.record_event"))
ROWS = ["ddp", FSDP_ROW]
EVERY_THREAD = "profile_all_threads" in torch._C._profiler._ExperimentalConfig.__init__.__doc__  # torch 2.8 on
HOOKS = ["bf16", pytest.param("powersgd", marks=pytest.mark.skipif(  # DDP with --comm-hook: what they send
    not EVERY_THREAD, reason="PowerSGD's all-reduces run on gloo's thread, which torch's profiler sees from 2.8"))]
BYTES = {  # ring bytes per rank and step, by kind of collective, computed by hand
    "ddp": {"all_reduce": MODEL_BYTES},  # every gradient once; a ring sends 2(n-1)/n of it, at 2 ranks all of it
    "bf16": {"all_reduce": MODEL_BYTES / 2},  # --comm-hook bf16: the same gradients in 2 bytes each
    # --comm-hook powersgd (rank 1): the biases as they are (512 + 512 + 10 floats), and for each weight (n x m) its
    # two factors, P (n x 1) and Q (m x 1): 512 + 512 + 10 and 784 + 512 + 512 floats, each all-reduced in turn.
    "powersgd": {"all_reduce": (1034 + 1034 + 1808) * 4},
    "fsdp": {"all_gather": MODEL_BYTES / 2 * 2,  # the other rank's half of the weights, before forward and backward
             "all_reduce": MODEL_BYTES},  # gloo runs FSDP2's reduce-scatter as an all-reduce of every gradient
}
LINE = {"ddp": r"DDP \(chapter 3\) at 100 Mbit/s: communication [\d.]+x its floor \(.*\)$",
        "fsdp": r"FSDP2 \(chapter 7\) at 100 Mbit/s: .*; by kind: all_gather [\d.]+x \(rank 0 [\d.]+x, rank 1 "
                r"[\d.]+x\), all_reduce [\d.]+x \(rank 0 [\d.]+x, rank 1 [\d.]+x\)$"}


@pytest.fixture(scope="module")
def scaling(real_data, tmp_path_factory):
    """measure/scaling.py's DDP and FSDP2 rows at 100 Mbit/s (DDP alone where fsdp.py cannot run): JSON and report."""
    need_namespaces()
    out = tmp_path_factory.mktemp("scaling") / "scaling.json"
    rows = "single,ddp,bf16" + (",fsdp" if hasattr(torch.cpu.Stream, "record_event") else "") + (
        ",powersgd" if EVERY_THREAD else "")
    proc = subprocess.run([sys.executable, "measure/scaling.py", "--rows", rows, "--rates", "100mbit",
                           "--data-dir", str(real_data), "--json", str(out)], cwd=REPO, env=BASE_ENV,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode and "cannot shape the link" in proc.stderr:
        cannot_shape(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr
    from measure.scaling import derive
    measured = json.loads(out.read_text())
    return {r["row"]: r for r in derive(measured)}, proc.stdout


@pytest.mark.parametrize("row", [*ROWS, *HOOKS])
def test_scaling_counts_the_bytes_each_strategy_sends(scaling, row):
    """Read from gloo's collectives in the run, in all and by kind (what says which of FSDP2's collectives missed
    the floor): the bytes each strategy must send, as BYTES computes them."""
    r = scaling[0][row]
    assert r["ring_bytes"] == sum(BYTES[row].values())
    assert {kind: x["ring_bytes"] for kind, x in r["by_kind"].items()} == BYTES[row]


@pytest.mark.parametrize("row", ROWS)
def test_scaling_times_the_communication_on_the_link(scaling, row):
    """The communication is what the run measured on the slow link: never under the floor of its bytes, inside the
    step, and, with a floor of 214 ms against a step's tens of milliseconds of compute, mostly exposed."""
    rows, report = scaling
    r = rows[row]
    assert r["floor"] == r["ring_bytes"] * 8 / 10**8
    assert r["floor"] * 0.97 <= r["communication"] <= r["step"], r
    assert r["hidden"] + r["exposed"] == pytest.approx(r["communication"])
    assert r["exposed"] >= 0.5 * r["communication"], r
    assert r["vs_single"] < 1, r  # the question the script answers: here, slower than one process
    assert all(x["communication"] <= r["communication"] for x in r["by_kind"].values()), r  # parts of the whole
    assert re.search(rf"^(PASS|MISS): {LINE[row]}", report, re.M), report


@pytest.mark.parametrize("row", [*ROWS, *HOOKS])
def test_no_row_crosses_the_link_faster_than_its_rate(scaling, row):
    """Every row's communication takes at least the wire time of its bytes (PowerSGD's 15,504 bytes a step among
    them: a burst as large as a step let them through at 0.07x), and the report says so of none."""
    rows, report = scaling
    assert rows[row]["communication"] >= rows[row]["floor"], rows[row]
    assert "FAST LINK" not in report, report


def test_no_run_in_docs_crossed_the_link_faster_than_its_rate():
    """docs/scaling.json, which docs/scaling.md's steady-state tables and pictures come from, holds no run whose
    communication took less than its bytes' wire time (the sweep ran before the burst was cut: its PowerSGD runs at
    10 Mbit/s crossed faster than the rate and were taken out)."""
    from measure.scaling import derive
    results = derive(json.loads((REPO / "docs" / "scaling.json").read_text()))
    shaped = [r for r in results if r["floor"]]
    assert shaped and all(r["communication"] >= r["floor"] for r in shaped), \
        [(r["row"], r["rate"], r["over_floor"]) for r in shaped if r["communication"] < r["floor"]]


@pytest.mark.parametrize("name, count", [("scaling_diloco.json", 39),  # 13 rows x 3 repeats
                                         ("scaling_ft_diloco.json", 24)])  # 4 rows x 2 rates x 3 repeats
def test_no_whole_run_in_docs_sent_its_bytes_faster_than_its_link(name, count):
    """docs/scaling_diloco.json, chapter 11's whole runs, and docs/scaling_ft_diloco.json, torchft's DiLoCo beside
    them: what both machines sent, counted on the link's interfaces, needs at least half of it (the busier direction)
    over the rate, and every shaped run took longer than that."""
    runs = json.loads((REPO / "docs" / name).read_text())["runs"]
    shaped = [r for r in runs if r["rate"] in ("10mbit", "100mbit")]
    assert len(shaped) == count and all(r["link_bytes"] for r in shaped), len(shaped)
    for r in shaped:
        assert r["link_bytes"] / 2 * 8 / tc_bits(r["rate"]) < r["wall_seconds"], r


def test_torchfts_diloco_in_docs_trained_chapter_11s_model_where_they_sync_alike():
    """docs/scaling.md's claim for the whole runs: with one fragment and fp32 on the wire, torchft's DiLoCo
    (ddp_ft.py --sync-every 59) ended every run at the test accuracy of chapter 11's (diloco.py --sync-every 59
    --wire-dtype fp32) on the same link, and with the lighthouse's heartbeats and quorums it sent more bytes than
    the pseudo-gradients alone (5 syncs of 2.68 MB each way: 26.8 MB) but less than chapter 11, which also
    broadcasts the weights before the first step."""
    runs = json.loads((REPO / "docs" / "scaling_ft_diloco.json").read_text())["runs"]
    for rate in ("unlimited", "100mbit", "10mbit"):
        ft, ours = ([r for r in runs if r["row"] == row and r["rate"] == rate]
                    for row in ("ft_diloco_h59", "diloco_h59_fp32"))
        assert len(ft) == len(ours) == 3, rate
        assert {r["accuracy"] for r in ft} == {r["accuracy"] for r in ours} and len({r["accuracy"] for r in ft}) == 1
        assert all(26.8e6 < r["link_bytes"] < min(o["link_bytes"] for o in ours) for r in ft), (ft, ours)


def test_gloo_sends_nothing_until_the_peer_is_ready_to_receive(tmp_path):
    """docs/scaling.md's reason FSDP2 misses the floor on gloo: a rank sends only once its peer says it is ready to
    receive, and that message travels behind the data the peer has already sent. With the peer 50 ms late, a swap of
    785 KiB each way at 10 Mbit/s: posted receive first, both directions run at once; posted send first, the late
    rank's data crosses before its "ready" does, so the two directions take turns (2x the floor, less tbf's
    burst); gloo's all-gather posts each half send first, so the early rank starts a half late (1.5x)."""
    need_namespaces()
    out = tmp_path / "order.json"
    proc = subprocess.run([sys.executable, "measure/scaling.py", "--order", "10mbit", "--json", str(out)], cwd=REPO,
                          env=BASE_ENV, capture_output=True, text=True, timeout=300)
    if proc.returncode and "cannot shape the link" in proc.stderr:
        cannot_shape(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr
    late = json.loads(out.read_text())["late_rank"]
    burst = burst_bytes(tc_bits("10mbit")) / (200_960 * 4)
    assert late["send"] >= 2 * (1 - burst), late
    assert late["all_gather"] >= 1.5 * (1 - burst), late
    assert late["receive"] <= 0.75 * late["send"], late
    assert f"send first (isend, then irecv)       {late['send']:.2f}x" in proc.stdout


def test_a_congestion_control_the_kernel_lacks_is_one_line():
    proc = subprocess.run([sys.executable, "measure/scaling.py", "--order", "--congestion-control", "nosuch"],
                          cwd=REPO, env=BASE_ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == "", proc
    assert re.fullmatch(r"error: --congestion-control nosuch is not in this kernel; it has [a-z0-9 ]+\n", proc.stderr)


@pytest.fixture(scope="module")
def whole(real_data, tmp_path_factory):
    """measure/scaling.py --whole: chapter 1 and PowerSGD at 100 Mbit/s, each run twice: (JSON, report)."""
    need_namespaces()
    out = tmp_path_factory.mktemp("whole") / "whole.json"
    proc = subprocess.run([sys.executable, "measure/scaling.py", "--whole", "--rows", "single,powersgd", "--rates",
                           "100mbit", "--repeats", "2", "--data-dir", str(real_data), "--json", str(out)], cwd=REPO,
                          env=BASE_ENV, capture_output=True, text=True, timeout=900)
    if proc.returncode and "cannot shape the link" in proc.stderr:
        cannot_shape(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_whole_runs_are_timed_and_scored_as_a_user_runs_them(whole):
    """Whole 5-epoch runs at the timed configuration (batch 1,024, --lr 0.016): each repeat is a run of its own, its
    time from the first step to the last inside its wall time, and its accuracy that of the same run: PowerSGD's
    within 1 point of chapter 1's there. The report's figures are the runs': the mean of the repeats, then min-max,
    and the goal's line judges the mean."""
    measured, report = whole
    runs = {(r["row"], r["rate"]): [] for r in measured["runs"]}
    for r in measured["runs"]:
        runs[(r["row"], r["rate"])].append(r)
        assert 0 < r["train_seconds"] < r["wall_seconds"], r
        # counted on the link's interfaces: at least the weights DDP broadcasts from rank 0 before the first step
        assert r["link_bytes"] is None if r["row"] == "single" else r["link_bytes"] > 2_678_824, r
    assert {key: len(group) for key, group in runs.items()} == {("single", None): 2, ("powersgd", "100mbit"): 2}
    single, powersgd = runs[("single", None)], runs[("powersgd", "100mbit")]
    base = sum(r["train_seconds"] for r in single) / 2
    assert abs(sum(r["accuracy"] for r in powersgd) / 2 - sum(r["accuracy"] for r in single) / 2) <= 0.01, runs
    ratios = [base / r["train_seconds"] for r in powersgd]
    row = "| 100 Mbit/s | " + " | ".join([
        f"{sum(r['train_seconds'] for r in powersgd) / 2:,.1f} ({min(r['train_seconds'] for r in powersgd):,.1f}-"
        f"{max(r['train_seconds'] for r in powersgd):,.1f})",
        f"{sum(ratios) / 2:.2f} ({min(ratios):.2f}-{max(ratios):.2f})"]) + " | "
    assert row in report, (row, report)
    assert re.search(rf"^(PASS|MISS): .* at 100 Mbit/s: {sum(ratios) / 2:.2f}x chapter 1 over whole runs", report,
                     re.M), report


def test_diloco_rows_are_judged_by_chapter_11s_goals():
    """--whole's line for a DiLoCo row at 10 Mbit/s: its speed against chapter 1's mean, its accuracy within 0.5
    points, its time against its own on the unshaped link, and DDP's bytes on the link against its own (a planted
    miss of each turns the line to MISS, naming the figure)."""
    from measure.scaling import diloco_goals
    run = lambda seconds, accuracy=0.645, sent=25e6: dict(train_seconds=seconds, accuracy=accuracy, link_bytes=sent)
    unshaped = [run(6.0), run(6.2)]
    line = lambda group: diloco_goals("diloco_f4_k10", "10mbit", group, unshaped, 16.0, 0.648, [2e9, 2e9])
    assert line([run(6.8), run(7.0)]) == (
        "PASS: DiLoCo (chapter 11), --sync-every 59 --fragments 4 --overlap 10 at 10 Mbit/s: 2.32x chapter 1 (goal >= "
        "1.5x), 64.5% against chapter 1's 64.8% (goal: within 0.5 points), 1.13x its time on the unshaped link (goal <= "
        "1.15), 80x fewer bytes on the link than DDP (goal >= 50x)")
    assert line([run(11.0), run(11.0)]).startswith("MISS")  # 1.45x chapter 1
    assert line([run(6.8, accuracy=0.642)] * 2).startswith("MISS")  # 0.6 points below
    assert line([run(7.3), run(7.3)]).startswith("MISS")  # 1.20x its unshaped time
    assert line([run(6.8, sent=50e6)] * 2).startswith("MISS")  # 40x fewer bytes only
