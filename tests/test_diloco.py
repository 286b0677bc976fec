"""Chapter 11, diloco.py: torch's post-local SGD's model where DiLoCo reduces to it, resume exact as a user runs it,
the shared weights evaluated, what each sync sends (dtype, bytes, per fragment) and when it is waited, the refusals."""
import json

import pytest
import torch
from torch.utils.data import DataLoader, default_convert

from common.cli import Config
from common.data import load_fashion_mnist
from common.engine import MetricsLog, evaluate
from common.model import NeuralNetwork
from common.ranks import DistContext
from scripts.plot_curves import read_metrics
from support.run import BASE_ENV, TORCHRUN, run_code, run_forked
from support.same_model import SAME_MODEL, accuracy_lines, load_state, max_abs_diff, slice_args
from support.shared_runs import streaming_at_2_ranks

# SLICE's 20 steps an epoch: H = 5 divides them, so post-local SGD's average at an epoch's end is a DiLoCo sync too
AS_LOCALSGD = ["--sync-every", "5", "--outer-lr", "1", "--outer-momentum", "0", "--momentum", "0", "--fragments", "1",
               "--overlap", "0", "--wire-dtype", "fp32"]
# streaming, with fragment 0 in flight across the epoch's end (started at step 20, waited at 22) and inner momentum
STREAMING = ["--sync-every", "6", "--fragments", "3", "--overlap", "2", "--momentum", "0.9"]


def torchrun(script, world, real_data, out, procs, *flags, env=BASE_ENV):
    """script on `world` ranks under torchrun on SLICE: its stdout; it must exit 0."""
    p = procs.start([*TORCHRUN, "--standalone", "--nproc-per-node", str(world), script, *slice_args(real_data, out),
                     "--timeout", "60", *flags], env=env)
    code, out, err = procs.wait(p)
    assert code == 0, err
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_diloco_trains_post_local_sgds_model(world, real_data, tmp_path, procs):
    """Outer SGD at lr 1 without momentum steps the shared weights to the ranks' mean: torch's post-local SGD (local
    from the first step, the weights averaged every H steps and at each epoch's end), within float rounding."""
    log = torchrun("diloco.py", world, real_data, tmp_path / "diloco", procs, *AS_LOCALSGD)
    ref = torchrun("ddp_comm_hooks.py", world, real_data, tmp_path / "localsgd", procs, "--comm-hook", "localsgd:5:0")
    diff = max_abs_diff(load_state(tmp_path / "diloco" / "model.pth"), load_state(tmp_path / "localsgd" / "model.pth"))
    print(f"max |diff| against post-local SGD at {world} ranks: {diff:.3g}")
    assert diff <= SAME_MODEL
    assert accuracy_lines(log) == accuracy_lines(ref) and len(accuracy_lines(log)) == 2


def test_a_resumed_run_ends_as_the_uninterrupted_one_as_a_user_runs_it(real_data, tmp_path, procs):
    """The snapshot holds the shared weights, the outer momentum, the step count, the fragment in flight and each
    rank's own weights and inner momentum: resumed after epoch 1, the run ends bit for bit as the uninterrupted one,
    in the user's environment (no OMP_NUM_THREADS, nothing on PYTHONPATH)."""
    user = {k: v for k, v in BASE_ENV.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}
    straight = torchrun("diloco.py", 2, real_data, tmp_path / "straight", procs, *STREAMING, env=user)
    snap = [*STREAMING, "--snapshot", tmp_path / "snap.pt"]
    torchrun("diloco.py", 2, real_data, tmp_path / "resumed", procs, *snap, "--epochs", "1", env=user)
    log = torchrun("diloco.py", 2, real_data, tmp_path / "resumed", procs, *snap, env=user)
    assert "Resuming from" in log and "1 of 2 epochs done" in log, log
    assert max_abs_diff(load_state(tmp_path / "straight" / "model.pth"),
                        load_state(tmp_path / "resumed" / "model.pth")) == 0.0
    assert accuracy_lines(log)[-2:] == accuracy_lines(straight)[-2:]


def test_a_machines_ranks_train_one_copy_and_resume_exactly(real_data, tmp_path, tmp_path_factory, procs):
    """--ranks-per-replica 2 at 4 ranks (2 machines x 2 ranks, here on one): each pair averages its gradients every
    step and carries half of each outer all-reduce, gathered in the pair. A pair sees what one rank of a 2-rank run
    sees, so the pairs train its model; streaming with a fragment in flight across the epoch's end, resumed after
    epoch 1 (the snapshot holds the gathered sum), within float rounding of it."""
    flags = [*STREAMING, "--wire-dtype", "fp32"]
    two, ref = streaming_at_2_ranks(tmp_path_factory, real_data, procs)
    snap = [*flags, "--ranks-per-replica", "2", "--snapshot", tmp_path / "snap.pt"]
    torchrun("diloco.py", 4, real_data, tmp_path / "pairs", procs, *snap, "--epochs", "1")
    log = torchrun("diloco.py", 4, real_data, tmp_path / "pairs", procs, *snap)
    assert "Resuming from" in log and "1 of 2 epochs done" in log, log
    diff = max_abs_diff(load_state(two / "model.pth"), load_state(tmp_path / "pairs" / "model.pth"))
    print(f"max |diff| of 2 pairs, resumed, against 2 ranks: {diff:.3g}")
    assert diff <= SAME_MODEL
    assert accuracy_lines(log)[-2:] == accuracy_lines(ref)[-2:]


def test_the_epoch_is_evaluated_on_the_shared_weights(real_data, tmp_path, procs):
    """After an epoch of 20 steps with H = 7 each rank's own weights have moved on from the last outer step's (step
    14): the epoch's test lines are those of the shared weights, which the snapshot holds, evaluated here alone."""
    torchrun("diloco.py", 2, real_data, tmp_path, procs, "--sync-every", "7", "--epochs", "1", "--snapshot",
             tmp_path / "snap.pt")
    shared = load_state(tmp_path / "snap.pt")["comm_hook"]["shared"]
    model = NeuralNetwork()
    torch.nn.utils.vector_to_parameters(shared, model.parameters())
    ctx = DistContext()
    _, test_set, _ = load_fashion_mnist(Config(data_dir=str(real_data), test_samples=500), ctx.device)
    loader = DataLoader(test_set, batch_size=1000, collate_fn=default_convert)
    accuracy, loss = evaluate(model, loader, 0, ctx, MetricsLog(None, ctx))
    logged = [r for r in read_metrics(tmp_path) if r["kind"] == "epoch"][-1]
    assert logged["test_accuracy"] == accuracy and logged["test_loss"] == pytest.approx(loss, abs=2e-6)


GROUPS_AND_COLLECTIVES = "tests/programs/groups_and_collectives.py"


@pytest.mark.parametrize("world,n", [(2, 1), (4, 2)], ids=["one-rank-per-copy", "two-ranks-per-copy"])
def test_every_group_waits_timeout_and_the_outer_sync_has_its_own(world, n, real_data, tmp_path, procs):
    """Every process group the chapter makes waits --timeout at most, as the default group does (a stuck peer ends
    the run, not 10 or 30 minutes later); the outer all-reduces run in a group of their own, never in the one the
    loss and accuracy lines' sums use (on NCCL each group has its own stream: a line would wait behind a sync in
    flight). Streaming, so that syncs are in flight while lines are summed."""
    records = tmp_path / "records"
    flags = [*slice_args(real_data, tmp_path), "--epochs", "1", "--timeout", "37", *STREAMING,
             "--ranks-per-replica", str(n)]
    p = procs.start([*TORCHRUN, "--standalone", "--nproc-per-node", str(world), GROUPS_AND_COLLECTIVES, records,
                     "diloco.py", *flags])
    code, _, err = procs.wait(p)
    assert code == 0, err
    for rank in range(world):
        seen = json.loads((records / f"rank_{rank}.json").read_text())
        assert len({g["name"] for g in seen["groups"]}) == 3, seen["groups"]  # the default group, and its two
        assert {g["timeout"] for g in seen["groups"]} == {37.0}, seen["groups"]
        outer = {c["group"] for c in seen["all_reduces"] if c["numel"] > 1000}  # pseudo-gradients: a fragment each
        lines = {c["group"] for c in seen["all_reduces"] if c["dtype"] == "float64"}  # all_reduce_sum's
        assert outer and lines and not outer & lines, (outer, lines)


# The chapter's DiLoCo on one rank (gloo), after each of 13 inner steps of random gradients: every all-reduce it
# starts (dtype, numbers, async) with the step it starts at and the step its wait comes at; and the shared weights
# against the outer step written out (Nesterov SGD on the pseudo-gradient, its momentum kept across syncs).
WIRE = """
import json, sys, torch, torch.distributed as dist
import diloco
from common.cli import Config
from common.model import NeuralNetwork
from common.ranks import DistContext, destroy_process_group

sent, started = [], dist.all_reduce
class Waited:
    def __init__(self, work, entry):
        self.work, self.entry = work, entry
    def wait(self):
        self.entry["waited"] = hook.step
        return self.work.wait()
def counted(tensor, *args, async_op=False, **kwargs):
    sent.append(dict(dtype=str(tensor.dtype).split(".")[1], numel=tensor.numel(), bytes=tensor.nbytes,
                     started=hook.step, async_op=async_op))
    work = started(tensor, *args, async_op=async_op, **kwargs)
    return Waited(work, sent[-1]) if async_op else work
dist.all_reduce = counted

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
report = {}
for case in sys.argv[2:]:
    cfg = Config(lr=0.01, momentum=0.9)
    vars(cfg).update(json.loads(case))
    torch.manual_seed(0)
    model = NeuralNetwork()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    hook = diloco.DiLoCo(model, optimizer, cfg, DistContext())
    after_inner = []  # this rank's weights after each inner step, before DiLoCo's hook (registered first, runs first)
    optimizer.register_step_post_hook(lambda *_: after_inner.append(torch.cat([p.detach().reshape(-1) for p in
                                                                               model.parameters()])))
    optimizer.register_step_post_hook(hook.after_inner_step)
    sent.clear()
    shared, buf = torch.cat([p.detach().reshape(-1) for p in model.parameters()]), None
    for step in range(1, 14):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        if step % cfg.sync_every == 0:  # the outer step written out, as torch's SGD with Nesterov takes it
            g = shared - after_inner[-1]
            buf = g.clone() if buf is None else buf.mul_(cfg.outer_momentum).add_(g)
            shared = shared.add(g.add(buf, alpha=cfg.outer_momentum), alpha=-cfg.outer_lr)
    report[case] = dict(sent=sent[:], outer_as_written=torch.equal(shared, hook.shared))
print(json.dumps(report), flush=True)
destroy_process_group()
"""
FULL = 669_706  # every weight and bias, flat
SLICES = [223_236, 223_235, 223_235]  # --fragments 3: torch.tensor_split's equal slices
WIRE_CASES = {
    # blocking fp32 syncs at steps 4, 8, 12: the whole pseudo-gradient, 4 bytes a number, waited where it starts
    "fp32": (dict(wire_dtype="fp32"), [("float32", FULL, s, s) for s in (4, 8, 12)]),
    "bf16": (dict(), [("bfloat16", FULL, s, s) for s in (4, 8, 12)]),  # the default: 2 bytes a number
    # three fragments, each every 4 steps at staggered steps (1, 2, 4 ...: (i + 1) H / F), each waited 2 steps later
    "fragments-overlap": (dict(fragments=3, overlap=2), sorted(
        [("bfloat16", SLICES[i], s, s + 2 if s + 2 <= 13 else None) for i, first in enumerate((1, 2, 4))
         for s in range(first, 14, 4)], key=lambda sync: sync[2])),
    "overlap-h": (dict(overlap=4), [("bfloat16", FULL, s, s + 4) for s in (4, 8)] + [("bfloat16", FULL, 12, None)]),
}


@pytest.fixture(scope="module")
def wire(tmp_path_factory):
    """Every WIRE_CASES case in one process (H = 4, outer lr 0.7, momentum 0.9): {case: report}."""
    rdzv = tmp_path_factory.mktemp("wire") / "rdzv"
    cases = [json.dumps(dict(sync_every=4, outer_lr=0.7, outer_momentum=0.9, fragments=1, overlap=0,
                             wire_dtype="bf16") | flags) for flags, _ in WIRE_CASES.values()]
    report = json.loads(run_code(WIRE, rdzv, *cases).stdout)
    return dict(zip(WIRE_CASES, report.values()))


@pytest.mark.parametrize("case", WIRE_CASES)
def test_each_sync_sends_its_fragment_in_the_wire_dtype_and_waits_k_steps_later(wire, case):
    """What reaches the wire per sync: one all-reduce, started with async_op, of the pseudo-gradient (every weight,
    or one fragment's slice) in fp32 (4 bytes a number: 2,678,824 bytes) or bf16 (half), its wait --overlap inner
    steps after its start (the last one still in flight when the 13 steps end)."""
    sent = [(s["dtype"], s["numel"], s["started"], s.get("waited")) for s in wire[case]["sent"]]
    assert sent == WIRE_CASES[case][1]
    assert all(s["async_op"] and s["bytes"] == s["numel"] * (4 if s["dtype"] == "float32" else 2)
               for s in wire[case]["sent"])


@pytest.mark.parametrize("case", ["fp32"])
def test_the_outer_step_is_nesterov_sgd_on_the_pseudo_gradient(wire, case):
    """On one rank the pseudo-gradient is the shared weights minus this rank's: three syncs of torch's SGD with
    Nesterov momentum written out (its momentum kept from sync to sync) give the chapter's shared weights exactly."""
    assert wire[case]["outer_as_written"]


REFUSED = {
    "fp16": (["--precision", "fp16"], "diloco.py trains in --precision fp32 or bf16: fp16's GradScaler would skip"),
    "fragments": (["--sync-every", "4", "--fragments", "5"], "--fragments 5 is more than --sync-every 4"),
    "overlap": (["--sync-every", "4", "--overlap", "5"], "--overlap 5 is more than --sync-every 4"),
    "wire-fp16": (["--wire-dtype", "fp16"], "argument --wire-dtype: invalid choice: 'fp16'"),
    "no-momentum-nesterov": (["--outer-momentum", "1"], "argument --outer-momentum: must be at least 0 and below 1"),
    "uneven-copies": (["--ranks-per-replica", "3"], "--ranks-per-replica 3 does not divide the 4 ranks"),
}


def test_flags_that_cannot_work_are_one_line():
    runs = run_forked([("diloco.py", argv, {"WORLD_SIZE": "4"}) for argv, _ in REFUSED.values()])  # as torchrun's
    for (case, (_, says)), proc in zip(REFUSED.items(), runs):
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (case, proc.stderr)
        assert says in proc.stderr, (case, proc.stderr)
