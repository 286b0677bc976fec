"""Chapter 12, ddp_ft.py: replica groups under torchft's lighthouse, started as a user starts them (torchft_lighthouse,
then one torchrun per group) on this machine's loopback. Two groups train chapter 1's model; a group killed with -9
mid-epoch and started again heals from the live one, which never restarts; both end with the same weights."""
import re
import time

import pytest
import torch

from support.fault_tolerance import (HAS_TORCHFT, LONG_FT, SLOWER, STEP_21, TORCH_2_7, USERS_SHELL, finished,
                                     lighthouse_command, needs_torchft, share_line, start_group)
from support.ports import free_port
from support.run import BASE_ENV, run_code, run_forked, run_script, torchrun_script
from support.same_model import SAME_MODEL, accuracy_lines, load_state, max_abs_diff, slice_args


def start_lighthouse(procs, min_replicas=1):
    """A lighthouse on a free loopback port, as docs/fault_tolerance.md starts it; its address."""
    port = free_port()
    procs.start(lighthouse_command(f"127.0.0.1:{port}", min_replicas), env={**BASE_ENV, "RUST_LOG": "warn"})
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def lighthouse(procs):
    return start_lighthouse(procs)


@needs_torchft
def test_two_groups_train_chapter_1s_model(procs, lighthouse, real_data, reference, tmp_path):
    """Both groups in the quorum from step 1 (the first step waits for them): together each step's batch is chapter
    1's, averaged over the two, so both save chapter 1's weights and print its test accuracies. Started as a user
    starts them (no OMP_NUM_THREADS), the two groups on this machine each take half its cores, as torchrun's ranks
    would: each its own torchrun, they would otherwise each run a thread per core."""
    runs = [start_group(procs, lighthouse, g, slice_args(real_data, tmp_path / f"g{g}"), USERS_SHELL) for g in (0, 1)]
    outs = [finished(run) for run in runs]
    for g, out in enumerate(outs):
        assert out.count(share_line()) == 1, out
        assert "step 1: quorum of 2 replica groups" in out, out
        assert out.count("quorum of") == 1, out  # one line for the quorum, none per step
        assert "Done! 40 steps committed, 0 retried, 80 group batches" in out, out
        assert accuracy_lines(out) == accuracy_lines(reference[1])
        assert max_abs_diff(reference[0], load_state(tmp_path / f"g{g}" / "model.pth")) <= SAME_MODEL


@needs_torchft
def test_a_killed_group_heals_from_the_live_one_which_never_restarts(procs, lighthouse, real_data, tmp_path):
    """kill -9 of group 1 (its torchrun and worker: the machine gone) at step 21: group 0 drops at most the step in
    flight, goes on alone, then takes group 1 back once it is started again; group 1 heals (weights, momentum and
    step) and follows the step it healed to. Both end with the same weights, within 0.5 points of chapter 1's accuracy
    (what a run without the kill trains: test_two_groups_train_chapter_1s_model)."""
    args = lambda g: [*LONG_FT, "--data-dir", str(real_data), "--output", str(tmp_path / f"g{g}")]  # noqa: E731
    env = {**SLOWER, **USERS_SHELL}  # as a user starts them: a healed group takes its share of the cores too
    a, b = start_group(procs, lighthouse, 0, args(0), env), start_group(procs, lighthouse, 1, args(1), env)
    b.wait_for(STEP_21, after=b.wait_for("Epoch 1"), timeout=180)  # step 21 of 1200
    procs.kill(b.proc)  # torchrun and its worker
    b.finish()
    a.wait_for("quorum of 1 replica group (was 2)", timeout=120)  # then started again (as below, with DiLoCo)
    b = start_group(procs, lighthouse, 1, args(1), env)
    out_a, out_b = finished(a), finished(b)
    both = f"{out_a}\n--- group 1, started again:\n{out_b}"

    assert out_a.count("Config:") == 1, both  # group 0 never restarted
    assert re.search(r"step \d+: quorum of 1 replica group \(was 2\)", out_a), both
    assert re.search(r"step \d+: quorum of 2 replica groups \(was 1\)", out_a), both
    assert int(re.search(r"(\d+) retried", out_a)[1]) <= 1, both  # at most the step in flight when group 1 died
    healed = re.search(r"step (\d+): healed from a live group at its step (\d+) \(\2 steps skipped here\): state "
                       r"received in [\d.]+s", out_b)
    assert healed and 21 < int(healed[2]) < 1200 and int(healed[1]) == int(healed[2]) + 1, both
    assert out_a.count(share_line()) == 1 and out_b.count(share_line()) == 1, both  # group 1 learns it as it heals
    assert "Done! 1200 steps committed" in out_a and "Done! 1200 steps committed" in out_b, both
    assert max_abs_diff(*[load_state(tmp_path / f"g{g}" / "model.pth") for g in (0, 1)]) == 0.0

    chapter_1 = run_script("single_gpu.py", *LONG_FT, "--data-dir", real_data, "--output", tmp_path / "chapter_1")
    assert chapter_1.returncode == 0, chapter_1.stderr
    accuracy = [float(re.findall(r"Accuracy: ([\d.]+)%", out)[-1]) for out in (out_a, out_b, chapter_1.stdout)]
    assert accuracy[0] == accuracy[1] and abs(accuracy[0] - accuracy[2]) <= 0.5, accuracy


# torchft's DiLoCo where chapter 11 syncs alike: H = 5 (SLICE's 40 steps end at a sync), one fragment, no overlap,
# fp32 on the wire, chapter 11's outer Nesterov SGD (lr 0.7, momentum 0.9) and inner momentum
FT_DILOCO = ["--sync-every", "5", "--momentum", "0.9"]
CHAPTER_11 = [*FT_DILOCO, "--fragments", "1", "--overlap", "0", "--wire-dtype", "fp32"]
# streaming: the model's 3 layers each a fragment, one synced every 2 steps, its all-reduce waited 1 step later
FT_STREAMING = ["--sync-every", "6", "--fragments", "3", "--overlap", "1", "--momentum", "0.9"]


def both_groups(procs, lighthouse, real_data, tmp_path, flags):
    """Groups 0 and 1 on SLICE with flags, started together: their stdouts."""
    runs = [start_group(procs, lighthouse, g, [*slice_args(real_data, tmp_path / f"g{g}"), *flags]) for g in (0, 1)]
    return [finished(run) for run in runs]


def diloco_py(procs, real_data, out, flags):
    """Chapter 11 on two ranks on SLICE: its stdout."""
    code, stdout, err = torchrun_script("diloco.py", 2, [*slice_args(real_data, out), "--timeout", "60", *flags], procs)
    assert code == 0, err
    return stdout


@needs_torchft
def test_torchfts_diloco_trains_chapter_11s_model(procs, real_data, tmp_path):
    """--sync-every H: torchft's DiLoCo over the two groups. With chapter 11's settings (one fragment, fp32 on the
    wire) both groups save chapter 11's weights and print its test accuracies; the lighthouse's --min_replicas 2 puts
    both groups in the first sync. Each sync is a quorum: its line once, and the syncs counted."""
    lighthouse = start_lighthouse(procs, min_replicas=2)
    outs = both_groups(procs, lighthouse, real_data, tmp_path, FT_DILOCO)
    chapter_11 = diloco_py(procs, real_data, tmp_path / "chapter_11", CHAPTER_11)
    for g, out in enumerate(outs):
        assert out.count("quorum of") == 1 and "step 5: quorum of 2 replica groups" in out, out
        assert "Done! 8 syncs committed, 0 retried, 16 group batches" in out, out
        assert accuracy_lines(out) == accuracy_lines(chapter_11)
        difference = max_abs_diff(load_state(tmp_path / "chapter_11" / "model.pth"),
                                  load_state(tmp_path / f"g{g}" / "model.pth"))
        print(f"group {g} against chapter 11: max |diff| {difference:.3g}")
        assert difference <= SAME_MODEL


@needs_torchft
def test_torchfts_streaming_diloco_saves_the_same_weights_in_both_groups(procs, real_data, tmp_path):
    """Three fragments synced in turn, each all-reduce waited a step later: both groups save the weights of each
    fragment's last sync (torchft does not sync the steps since; the run says so), the same in both, and learn as
    chapter 11's streaming run does (its slices are not whole layers: within 10 points of its accuracy)."""
    lighthouse = start_lighthouse(procs, min_replicas=2)
    outs = both_groups(procs, lighthouse, real_data, tmp_path, FT_STREAMING)
    for out in outs:
        assert "Done! 20 syncs committed, 0 retried" in out, out
        assert "model.pth holds each fragment's weights as of its last sync, as every group does" in out, out
    assert max_abs_diff(*[load_state(tmp_path / f"g{g}" / "model.pth") for g in (0, 1)]) == 0.0
    assert accuracy_lines(outs[0]) == accuracy_lines(outs[1])
    chapter_11 = diloco_py(procs, real_data, tmp_path / "chapter_11", [*FT_STREAMING, "--wire-dtype", "fp32"])
    accuracy = [float(re.findall(r"Accuracy: ([\d.]+)%", out)[-1]) for out in (outs[0], chapter_11)]
    assert abs(accuracy[0] - accuracy[1]) <= 10, accuracy


@needs_torchft
def test_with_diloco_and_min_replicas_2_a_group_alone_ends_in_one_line(procs, fake_data, tmp_path):
    """The first sync waits for both groups under a lighthouse at --min_replicas 2, and for no longer than --timeout:
    a group alone ends there in one line that names the lighthouse's --min_replicas, not in a traceback."""
    run = start_group(procs, start_lighthouse(procs, min_replicas=2), 0,
                      ["--data-dir", str(fake_data), "--output", str(tmp_path), "--sync-every", "5", "--timeout", "5"])
    code, out, err = run.finish(timeout=120)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code != 0 and len(errors) == 1 and "within --timeout 5s" in errors[0], err[-3000:]
    assert "or fewer groups are alive than its --min_replicas" in errors[0], errors


@needs_torchft
def test_with_diloco_a_killed_group_heals_at_a_sync(procs, lighthouse, real_data, tmp_path):
    """--sync-every 10: group 1 killed at step 21 and started again trains alone until its first sync, heals there
    from group 0 (the shared weights, each group's weights and momentum, torchft's step) and syncs with it from then
    on; group 0 never restarts. Both end with the same weights and accuracy."""
    args = lambda g: [*LONG_FT, "--sync-every", "10", "--data-dir", str(real_data),  # noqa: E731
                      "--output", str(tmp_path / f"g{g}")]
    a, b = start_group(procs, lighthouse, 0, args(0), SLOWER), start_group(procs, lighthouse, 1, args(1), SLOWER)
    b.wait_for(STEP_21, after=b.wait_for("Epoch 1"), timeout=180)
    procs.kill(b.proc)
    b.finish()
    # Group 0 syncs alone once the lighthouse has missed group 1's heartbeats for 5 s (torchft's default); a group 1
    # started again sooner would keep it waiting for group 1's first sync instead: started after that here
    a.wait_for("quorum of 1 replica group (was 2)", timeout=120)
    b = start_group(procs, lighthouse, 1, args(1), SLOWER)
    out_a, out_b = finished(a), finished(b)
    both = f"{out_a}\n--- group 1, started again:\n{out_b}"
    assert out_a.count("Config:") == 1, both
    assert re.search(r"step \d+: quorum of 2 replica groups \(was 1\)", out_a), both
    healed = re.search(r"step (\d+): healed from a live group at its sync (\d+) \((\d+) steps skipped here\)", out_b)
    assert healed and int(healed[1]) == (int(healed[2]) + 1) * 10 and int(healed[3]) == int(healed[1]) - 10, both
    assert "Done! 120 syncs committed" in out_a and "Done! 120 syncs committed" in out_b, both
    assert max_abs_diff(*[load_state(tmp_path / f"g{g}" / "model.pth") for g in (0, 1)]) == 0.0
    assert accuracy_lines(out_a)[-1] == accuracy_lines(out_b)[-1], both


ALONE = """
import sys
import torch
from torch.utils.data import DistributedSampler
from common.cli import Config
from common.data import load_fashion_mnist
from common.engine import loss_fn
from common.model import NeuralNetwork

cfg = Config(data_dir=sys.argv[1], train_samples=960, test_samples=500)
train_set, _, _ = load_fashion_mnist(cfg, torch.device("cpu"))
sampler = DistributedSampler(train_set, num_replicas=2, rank=0, seed=0)
torch.manual_seed(0)
model = NeuralNetwork()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for epoch in range(2):
    sampler.set_epoch(epoch)
    order = list(sampler)
    for k in range(20):
        X, y = train_set.__getitems__(order[k * 24:(k + 1) * 24])
        loss_fn(model(X), y).backward()
        optimizer.step()
        optimizer.zero_grad()
torch.save(model.state_dict(), sys.argv[2])
"""


@needs_torchft
def test_a_group_alone_steps_with_its_own_batch(procs, lighthouse, real_data, tmp_path):
    """Group 0 of 2 started alone: after --timeout it trains without group 1, each step the mean gradient of its own
    24 images (the global batch shrinks to them; no absent group's share counted): SGD on its shard, step by step.
    While it waits it asks the lighthouse twice a second: torchft's log (--torchft-log) shows each quorum it formed, a
    process group and a connection to torchrun's store each (asked as fast as the loop ran: 43 to 96 in the 3 s)."""
    code, out, err = start_group(procs, lighthouse, 0, [*slice_args(real_data, tmp_path / "g0"), "--timeout", "3",
                                                        "--torchft-log"]).finish(timeout=300)
    assert code == 0, out + err[-3000:]
    assert "waiting up to --timeout 3s for all 2 replica groups (1 in the quorum)" in out, out
    assert ("only 1 of 2 replica groups after --timeout 3s, none with steps to heal from (the others have not started, "
            "or have ended): training from step 1 with 1, a run of its own, whose model.pth is not the other groups'"
            in out), out
    assert 2 <= err.count("reconfiguring for quorum_id") <= 2 * 3 + 4, err[-3000:]
    assert ("step 1: quorum of 1 replica group" in out
            and "Done! 40 steps committed, 0 retried, 40 group batches" in out), out
    run_code(ALONE, real_data, tmp_path / "by_hand.pth")
    assert max_abs_diff(load_state(tmp_path / "by_hand.pth"), load_state(tmp_path / "g0" / "model.pth")) <= SAME_MODEL


@needs_torchft
def test_an_unreachable_lighthouse_is_one_line_within_the_timeout(procs, fake_data, tmp_path):
    port = free_port()
    run = start_group(procs, f"http://127.0.0.1:{port}", 0,
                      ["--data-dir", str(fake_data), "--output", str(tmp_path), "--timeout", "3"])
    begin = time.monotonic()
    code, out, err = run.finish(timeout=120)
    assert code != 0 and time.monotonic() - begin < 60
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: cannot reach the lighthouse at http://127.0.0.1:{port} within --timeout 3s: start it "
                      f"first (`torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000`), and pass its address as "
                      f"--lighthouse or TORCHFT_LIGHTHOUSE"], err


def test_the_refusals_are_one_line_each(fake_data):
    """Before torchft or any network: flags the chapter cannot run with; a torch too old for torchft (the floor's
    2.6), or torchft missing, names what to install."""
    base = ["--data-dir", str(fake_data), "--epochs", "1"]
    cases = [(["--replica-group", "2"], "--replica-group 2 is not below --replica-groups 2"),
             (["--replica-group", "0", "--batch-size", "63", "--replica-groups", "2"],
              "--batch-size 63 is the global batch and must split evenly over --replica-groups 2"),
             (["--replica-group", "0", "--snapshot", "x.pt"], "ddp_ft.py does not take --snapshot"),
             (["--replica-group", "0", "--precision", "fp16", "--compile"],
              "ddp_ft.py does not take --precision fp16, --compile"),
             (["--replica-group", "0", "--fragments", "3"], "--fragments and --overlap are DiLoCo's: give --sync-every"),
             (["--replica-group", "0", "--sync-every", "12", "--fragments", "4"],
              "--fragments 4 is more than 3: torchft's fragments are whole modules"),
             (["--replica-group", "0", "--sync-every", "59", "--fragments", "3"],
              "--sync-every 59 must be a multiple of --fragments 3 (torchft syncs a fragment every H/F steps): use "
              "--sync-every 60"),
             (["--replica-group", "0", "--sync-every", "60", "--fragments", "3", "--overlap", "20"],
              "--overlap 20 must be below --sync-every/--fragments = 20")]
    restarts = "ddp_ft.py runs without torchrun's --max-restarts and TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    envs = [{}] * len(cases) + [{"TORCHELASTIC_MAX_RESTARTS": "3"}, {"TORCHELASTIC_USE_AGENT_STORE": "False"}]
    cases += [(["--replica-group", "0"], restarts)] * 2  # torchrun's environment for each (the Manager would wait)
    results = run_forked([("ddp_ft.py", [*base, *flags], env) for (flags, _), env in zip(cases, envs)])
    for (flags, words), result in zip(cases, results):
        assert result.returncode == 2 and words in result.stderr, (flags, result.stderr)
    if not TORCH_2_7:
        missing = f"ddp_ft.py needs torch 2.7 or later for torchft; this is torch {torch.__version__}"
    elif not HAS_TORCHFT:
        missing = "ddp_ft.py needs torchft (No module named 'torchft'): `pip install torchft==0.2.0`"
    else:
        return
    [result] = run_forked([("ddp_ft.py", [*base, "--replica-group", "0"], {})])
    assert result.returncode == 2 and missing in result.stderr, result.stderr


def test_a_steps_gradients_cross_in_one_all_reduce_and_come_back_averaged():
    """The Manager's all-reduce pays its round trips once a step: every gradient (669,706 numbers) goes in one flat
    buffer, as DDP sends a bucket, and each gradient gets its part of the average back. A stand-in Manager averages
    with a group whose gradients are zeros (a healing one)."""
    from common.model import NeuralNetwork
    from ddp_ft import average_gradients

    model, sent = NeuralNetwork(), []
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    before = [param.grad.clone() for param in model.parameters()]

    class Done:
        def wait(self):
            return True

    class Manager:
        def allreduce(self, tensor):
            sent.append(tensor.numel())
            tensor.div_(2)
            return Done()

    average_gradients(model, Manager())
    assert sent == [669_706]
    assert all(torch.equal(param.grad, grad / 2) for param, grad in zip(model.parameters(), before))
