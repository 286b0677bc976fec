"""Two machines for real: two network namespaces (nodea 10.77.0.1, nodeb 10.77.0.2) with their own host names.

Each node runs its launcher as the README tells users to, with GLOO_SOCKET_IFNAME set to the interface on the
shared network (tests/support/two_machines.py); the output folder and snapshot stand for a filesystem both machines
mount.
"""
import os
import re
import signal
import sys

import pytest

from measure.netns import NODES, TwoMachines
from support.long_runs import Watched, args_for, worker_with_rank
from support.ports import free_port
from support.run import BASE_ENV, TORCHRUN
from support.same_model import SAME_MODEL, accuracy_lines, load_state, max_abs_diff, slice_args
from support.shared_runs import streaming_at_2_ranks
from support.two_machines import A, B, NODE_ENV, PORT, need_namespaces, run_on_both, tcp_nodes, torchrun_nodes


@pytest.mark.parametrize("how", ["torchrun-static", "torchrun-c10d", "tcp"])
def test_two_machines_train_the_same_model(how, two_machines, procs, real_data, reference, tmp_path):
    args = [*slice_args(real_data, tmp_path / "run"), "--timeout", "60"]
    commands = tcp_nodes(args) if how == "tcp" else torchrun_nodes(how.split("-")[1], args)
    results = run_on_both(two_machines, procs, commands)
    assert [code for code, _, _ in results] == [0, 0], results
    out = "".join(stdout for _, stdout, _ in results)
    # One rank on each machine, each on its own host and address.
    assert sorted(re.findall(r"^\[rank (\d)\] host=(node[ab]) ", out, re.M)) == [("0", A), ("1", B)]
    assert max_abs_diff(reference[0], load_state(tmp_path / "run" / "model.pth")) <= SAME_MODEL
    assert accuracy_lines(results[0][1]) == accuracy_lines(reference[1]) and out.count("Done!") == 1


def test_diloco_on_two_machines_of_two_ranks_syncs_only_the_outer_step_across(two_machines, procs, real_data,
                                                                               tmp_path, tmp_path_factory):
    """Chapter 11 at 2 machines x 2 ranks (`--ranks-per-replica 2`): a machine's ranks average their gradients every
    step over its own loopback, and only the outer all-reduce crosses the link (here about 45 MB, each sync's 2.7 MB
    sent both ways, in halves), under half of what the gradients of every step would take (DDP: 214 MB); the 2
    copies train the model of 2 ranks on one machine."""
    flags = ["--sync-every", "6", "--fragments", "3", "--overlap", "2", "--momentum", "0.9", "--wire-dtype", "fp32"]
    ref, _ = streaming_at_2_ranks(tmp_path_factory, real_data, procs)  # test_diloco.py's too: these flags
    args = [*slice_args(real_data, tmp_path / "run"), "--timeout", "60", *flags, "--ranks-per-replica", "2"]
    before = two_machines.sent_bytes()
    results = run_on_both(two_machines, procs, torchrun_nodes("c10d", args, script="diloco.py", nproc=2))
    sent = two_machines.sent_bytes() - before
    assert [code for code, _, _ in results] == [0, 0], results
    out = "".join(stdout for _, stdout, _ in results)
    assert sorted(re.findall(r"^\[rank (\d)\] host=(node[ab]) ", out, re.M)) == [("0", A), ("1", A), ("2", B), ("3", B)]
    steps = 2 * 960 // 48  # SLICE: 2 epochs of 20 steps
    every_step = steps * 2 * 669_706 * 4  # an all-reduce of the gradients a step: each machine sends them once
    print(f"link: {sent:,} bytes; every step's gradients: {every_step:,}")
    assert sent < every_step / 2
    assert max_abs_diff(load_state(ref / "model.pth"), load_state(tmp_path / "run" / "model.pth")) <= SAME_MODEL


def test_elastic_restart_across_two_machines(two_machines, procs, real_data, tmp_path):
    """nodeb's worker SIGKILLed in epoch 2: both torchruns restart, resume from the snapshot, end as if left alone."""
    env = dict(NODE_ENV, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    straight = run_on_both(two_machines, procs, torchrun_nodes("c10d", args_for(real_data, tmp_path / "straight")),
                           env=env)
    assert [code for code, _, _ in straight] == [0, 0], straight

    snap = tmp_path / "snap.pt"
    args = args_for(real_data, tmp_path / "run", "--snapshot", snap, "--timeout", "30")
    commands = torchrun_nodes("c10d", args, "--max-restarts", "1")
    node_a = Watched(procs, two_machines.command(A, commands[A]), env=env)
    node_b = Watched(procs, two_machines.command(B, commands[B]), env=env)
    node_a.wait_mid_epoch_2()
    os.kill(worker_with_rank(node_b.proc.pid, 1), signal.SIGKILL)
    (code_a, out_a, err_a), (code_b, out_b, err_b) = node_a.finish(), node_b.finish()
    assert (code_a, code_b) == (0, 0), err_a + err_b
    assert f"Resuming from {snap}: 1 of 3 epochs done, continuing with epoch 2" in out_a
    assert out_a.count("Done!") == 1 and "Done!" not in out_b  # rank 0 (on nodea) prints, after the restart
    assert len(re.findall(r"^\[rank 1\] host=nodeb ", out_b, re.M)) == 2  # nodeb's worker ran twice
    # One rank per machine adds the two gradients in one order: bit for bit the job that was left alone.
    assert max_abs_diff(load_state(tmp_path / "straight" / "model.pth"), load_state(tmp_path / "run" / "model.pth")) == 0


def test_c10d_endpoint_on_a_second_address_needs_is_host(procs, real_data, tmp_path):
    """nodea's host name resolves to 10.77.0.1, the endpoint is its second address 10.77.0.11 (another card).

    torchrun decides who hosts the c10d store by comparing the endpoint with the machine's host name and its
    addresses: nodea does not recognise 10.77.0.11, nobody hosts, and both nodes time out. `--rdzv-conf is_host=1`
    on nodea says it.
    """
    need_namespaces()
    args = [*slice_args(real_data, tmp_path / "run"), "--epochs", "1"]
    with TwoMachines(extra_addresses={A: ["10.77.0.11"]}) as net:
        def nodes(conf_a, conf_b):
            return {node: [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", f"10.77.0.11:{PORT}", "--rdzv-id", "job1", "--rdzv-conf",
                           conf_a if node == A else conf_b, "ddp_launch.py", *args] for node in NODES}

        # A short read_timeout to see the trap quickly (the default is 60 s, plus torch's retries).
        trapped = run_on_both(net, procs, nodes("read_timeout=5", "read_timeout=5"))
        assert [code for code, _, _ in trapped] == [1, 1], trapped
        for _, _, err in trapped:
            assert "RendezvousConnectionError: The connection to the C10d store has failed" in err
            assert "timed out after 5000ms while trying to connect to (10.77.0.11, 29500)" in err
        # The default read_timeout again: nodeb may start before nodea's store is up.
        fixed = run_on_both(net, procs, nodes("is_host=1", "read_timeout=60"))
        assert [code for code, _, _ in fixed] == [0, 0], fixed
        assert "Done!" in fixed[0][1]


def test_cpu_ranks_split_the_cores_of_their_own_machine(two_machines, procs, real_data, tmp_path):
    """Threads per rank count the ranks on its machine, not in the world: 1 rank per machine gets all its cores."""
    cores = len(os.sched_getaffinity(0))
    env, host_env = ({k: v for k, v in e.items() if k != "OMP_NUM_THREADS"} for e in (NODE_ENV, BASE_ENV))  # the chapters choose
    args = ["--train-samples", "96", "--test-samples", "96", "--epochs", "1", "--data-dir", real_data, "--timeout", "60"]
    apart = run_on_both(two_machines, procs, tcp_nodes([*args, "--output", tmp_path / "apart"]), env=env)
    init = f"tcp://127.0.0.1:{free_port()}"
    started = [procs.start([sys.executable, "ddp_tcp_manual.py", "--init-method", init, "--rank", str(r), "--world-size",
                            "2", *map(str, args), "--output", str(tmp_path / "together")], env=host_env) for r in range(2)]
    together = [procs.wait(p) for p in started]
    for runs, threads in ((apart, cores), (together, max(1, cores // 2))):
        assert [code for code, _, _ in runs] == [0, 0], runs
        assert re.findall(r"threads=(\d+)$", "".join(out for _, out, _ in runs), re.M) == [str(threads)] * 2
