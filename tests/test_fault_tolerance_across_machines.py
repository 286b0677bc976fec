"""Chapter 12 on two machines (two network namespaces, measure/netns.py: the partition tests' harness): the lighthouse
and replica group 0 on nodea, group 1 on nodeb, each started as README starts them. nodeb's trainer killed, or its
cable pulled for 30 s: group 0 goes on alone and never restarts; group 1 heals from it across the link once it is
back (started again, or still waiting within its --timeout), or ends in one line when its --timeout is shorter than
the cut."""
import json
import re
import subprocess
import sys
import time

import pytest

from measure.netns import NODES, tc_bits
from support import REPO
from support.fault_tolerance import LONG_FT, SLOWER, STEP_21, finished, lighthouse_command, needs_torchft, start_group
from support.run import BASE_ENV
from support.same_model import load_state, max_abs_diff
from support.two_machines import NODE_ENV

A, B = NODES
PORT = 29510  # the lighthouse's, on nodea (README's)
CUT = 30  # seconds nodeb's cable stays out
STATE_BYTES = 2 * 669_706 * 4  # what a healing group receives: the model's weights and their momentum, float32
HEALED = r"step (\d+): healed from a live group at its step (\d+) \(\d+ steps skipped here\): state received in"


def start(net, procs, data, out, timeouts):
    """The lighthouse and group 0 on nodea, group 1 on nodeb (each group's --timeout from timeouts); a function that
    starts group g again on its machine."""
    procs.start(net.command(A, lighthouse_command(f"[::]:{PORT}")), env={**BASE_ENV, "RUST_LOG": "warn"})

    def group(g):
        args = [*LONG_FT, "--data-dir", str(data), "--output", str(out / f"g{g}"), "--timeout", str(timeouts[g])]
        return start_group(procs, f"http://{A}:{PORT}", g, args, {**NODE_ENV, **SLOWER},
                           on=lambda cmd: net.command((A, B)[g], cmd))
    return group


def same_weights(out):
    return max_abs_diff(*[load_state(out / f"g{g}" / "model.pth") for g in (0, 1)])


@needs_torchft
@pytest.mark.parametrize("rate", ["10mbit", "100mbit"])
def test_a_killed_machine_heals_from_the_other_over_the_link(rate, two_machines, procs, real_data, tmp_path):
    """kill -9 of nodeb's torchrun and worker at step 21, then its command again with the link at `rate`: it heals from
    nodea over the link (torchft reaches a peer by its host name), receiving the weights and the momentum (5.36 MB) in
    no less than their wire time at that rate, and both end with the same weights. The link is unshaped again once
    it healed, so that the run ends soon. Measured: 4.55 s at 10 Mbit/s (wire 4.29 s), 0.47 s at 100 Mbit/s (0.43)."""
    group = start(two_machines, procs, real_data, tmp_path, timeouts=(60, 60))
    a, b = group(0), group(1)
    b.wait_for(STEP_21, after=b.wait_for("Epoch 1"), timeout=180)
    procs.kill(b.proc)
    b.finish()
    # started again once group 0 goes on alone: a group back within the lighthouse's heartbeat timeout (5 s) would
    # rejoin before group 0 took a step without it, and heal at the very step it died at (seen on an idle machine)
    a.wait_for("quorum of 1 replica group (was 2)", timeout=120)
    two_machines.shape(rate)
    b = group(1)
    b.wait_for("healed from a live group", timeout=120)
    two_machines.shape(None)
    out_a, out_b = finished(a), finished(b)
    both = f"{out_a}\n--- group 1, started again on nodeb:\n{out_b}"
    assert out_a.count("Config:") == 1, both  # group 0 never restarted
    assert re.search(r"step \d+: quorum of 1 replica group \(was 2\)", out_a), both
    assert re.search(r"step \d+: quorum of 2 replica groups \(was 1\)", out_a), both
    assert int(re.search(r"(\d+) retried", out_a)[1]) <= 1, both
    healed = re.search(HEALED + r" ([\d.]+)s", out_b)
    assert healed and 21 < int(healed[2]) < 1200 and int(healed[1]) == int(healed[2]) + 1, both
    wire = STATE_BYTES * 8 / tc_bits(rate)
    line = next(line for line in out_b.splitlines() if healed[0] in line)
    print(f"\n{rate}: {line} (the wire time of the weights and momentum: {wire:.2f}s)")
    assert wire <= float(healed[3]) <= 2 * wire + 1, (healed[0], wire)  # less would be less than they are
    assert "Done! 1200 steps committed" in out_a and "Done! 1200 steps committed" in out_b, both
    assert same_weights(tmp_path) == 0.0


@needs_torchft
def test_a_cut_shorter_than_the_timeout_the_lighthouse_side_goes_on_the_other_heals(two_machines, procs, real_data,
                                                                                     tmp_path):
    """nodeb's cable out for 30 s at step 21. Group 0 (--timeout 10, beside the lighthouse) gives up on group 1 and
    trains alone while the cable is out; group 1 (--timeout 60, longer than the cut) waits, and once the cable is
    back its step fails, it asks for a quorum, heals from group 0 and trains on with it: one process each, the same
    weights at the end. When group 0 goes alone depends on where the cut catches it: in a step's all-reduce, that step
    fails after its --timeout (10 s) and is retried; asking the lighthouse for the next quorum, it gets a quorum of
    one once group 1's heartbeats have been missing for the lighthouse's heartbeat timeout (5 s, torchft's default;
    group 1 heartbeats every 0.1 s), and no step is retried."""
    group = start(two_machines, procs, real_data, tmp_path, timeouts=(10, 60))
    a, b = group(0), group(1)
    b.wait_for(STEP_21, after=b.wait_for("Epoch 1"), timeout=180)
    two_machines.link(B, up=False)
    cut = time.monotonic()
    a.wait_for("quorum of 1 replica group (was 2)", timeout=CUT - 5)  # alone while the cable is out
    alone_after = time.monotonic() - cut
    time.sleep(max(0.0, CUT - alone_after))
    two_machines.link(B, up=True)
    out_a, out_b = finished(a), finished(b)
    both = f"{out_a}\n--- group 1 (nodeb):\n{out_b}\n--- group 0 alone {alone_after:.1f}s after the cut"
    retried_a = int(re.search(r"(\d+) retried", out_a)[1])
    assert alone_after >= (9 if retried_a else 4.5), both  # never before the --timeout or heartbeat timeout ran out
    assert re.search(r"step \d+: quorum of 2 replica groups \(was 1\)", out_a), both
    assert retried_a <= 1 and int(re.search(r"(\d+) retried", out_b)[1]) <= 1, both
    healed = re.search(HEALED, out_b)
    assert healed and int(healed[2]) > 21, both
    assert "Done! 1200 steps committed" in out_a and "Done! 1200 steps committed" in out_b, both
    assert same_weights(tmp_path) == 0.0


@needs_torchft
def test_a_cut_longer_than_the_timeout_ends_the_cut_off_group_in_one_line(two_machines, procs, real_data, tmp_path):
    """nodeb's cable out for 30 s, every --timeout 8 s: group 0 goes on alone and finishes; group 1 cannot reach the
    lighthouse for a quorum and ends with one line naming it, within two --timeouts (the step in flight, then the
    quorum), before the cable is back."""
    group = start(two_machines, procs, real_data, tmp_path, timeouts=(8, 8))
    a, b = group(0), group(1)
    b.wait_for(STEP_21, after=b.wait_for("Epoch 1"), timeout=180)
    two_machines.link(B, up=False)
    cut = time.monotonic()
    code, out_b, err_b = b.finish(timeout=CUT)
    ended_after = time.monotonic() - cut
    two_machines.link(B, up=True)
    out_a = finished(a)
    errors = [line for line in err_b.splitlines() if line.startswith("error:")]
    assert code != 0 and errors == [f"error: no quorum from the lighthouse at http://{A}:{PORT} within --timeout 8s: "
                                    f"this machine cannot reach it (the network, or the lighthouse died), or fewer "
                                    f"groups are alive than its --min_replicas; once a quorum can form, start this "
                                    f"group again and it heals from a live one"], err_b
    assert ended_after <= 2 * 8 + 8, ended_after
    assert re.search(r"step \d+: quorum of 1 replica group \(was 2\)", out_a), out_a
    assert "Done! 1200 steps committed" in out_a and "Done!" not in out_b, out_a


def test_the_docs_table_of_a_restart_against_a_heal_is_what_its_runs_measured():
    """docs/multinode.md's table, nodeb's trainer killed mid-run under chapter 3's elastic restart and under chapter
    12's healing (3 of each), is measure/restart_or_heal.py's table of docs/restart_or_heal.json; and those runs kept
    each way's promise: the restarted job did epoch 2's steps before the kill again and ended as if left alone (the
    same test accuracy); the healed one did at most the step in flight again and trained some steps with one
    machine."""
    runs = json.loads((REPO / "docs" / "restart_or_heal.json").read_text())["runs"]
    three, twelve = ([r for r in runs if r["way"].startswith(f"chapter {n}:")] for n in (3, 12))
    assert len(three) == len(twelve) == 3, runs
    assert all(r["killed"]["accuracy"] == r["alone"]["accuracy"] and r["killed"]["steps_again"] >= 400 for r in three)
    assert all(r["killed"]["steps_again"] <= 1 and r["killed"]["one_group_steps"] > 0 for r in twelve), twelve
    table = subprocess.run([sys.executable, "measure/restart_or_heal.py", "--from-json", "docs/restart_or_heal.json"],
                           cwd=REPO, env=BASE_ENV, capture_output=True, text=True)
    assert table.returncode == 0 and table.stdout.strip() in (REPO / "docs" / "multinode.md").read_text(), table
