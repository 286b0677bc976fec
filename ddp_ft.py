"""Chapter 12: DDP that trains on when a machine dies. Each machine runs a replica group (its own torchrun job); before
every step torchft's lighthouse forms a quorum of the groups alive, the step's gradients are averaged over them, and a
group that (re)joins is healed from a live one (weights, optimizer state, step) instead of everyone restarting.
Read it top to bottom: its own step loop, as torchft decides step by step which groups take part.

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 &       # once, on machine A: the quorum's referee
    TORCHFT_LIGHTHOUSE=http://A:29510 torchrun --standalone --nproc-per-node 1 ddp_ft.py --replica-group 0   # on A
    TORCHFT_LIGHTHOUSE=http://A:29510 torchrun --standalone --nproc-per-node 1 ddp_ft.py --replica-group 1   # on B

Kill B and A goes on alone after one quorum without it (each group keeps its batch: the global batch shrinks); start
B's command again and it heals from A and trains with it from the next step. torchft: github.com/meta-pytorch/torchft
(pip install torchft==0.2.0, torch 2.7 or later). docs/fault_tolerance.md compares it with chapter 3's restarts.
With --sync-every H the groups sync as chapter 11's DiLoCo does, with torchft's own (torchft.local_sgd.DiLoCo): each
trains alone, and a quorum forms only at each sync (a lighthouse with --min_replicas 2 makes the first wait for both).
"""
import hashlib
import logging
import math
import os
import re
import socket
import time
import traceback
from datetime import timedelta

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.torch_version import TorchVersion
from torch.utils.data import DataLoader, DistributedSampler, default_convert

from common.checkpoint import prepare_output, save_weights
from common.cli import (MOMENTUM, NON_NEGATIVE, POSITIVE, RATE, REQUIRED, FatalError, UsageError, explain, flag,
                        parse_config, run_main)
from common.data import load_fashion_mnist, locate_fashion_mnist
from common.engine import MetricsLog, autocast, evaluate, loss_fn, print_epoch_line, print_loss_line
from common.model import NeuralNetwork
from common.ranks import (CONNECT_TIMED_OUT, DistContext, check_torchrun_worker, cpu_threads, name_rank_in_errors,
                          print0, rank_device)

TORCHFT = "torchft==0.2.0"  # the release this chapter was written and tested with


def check_ft(cfg):
    """What this chapter cannot run with, in one line before it starts (or None)."""
    if cfg.replica_group >= cfg.replica_groups:
        return (f"--replica-group {cfg.replica_group} is not below --replica-groups {cfg.replica_groups}: number the "
                f"machines' groups 0 to {cfg.replica_groups - 1}")
    if cfg.batch_size % cfg.replica_groups:
        return (f"--batch-size {cfg.batch_size} is the global batch and must split evenly over --replica-groups "
                f"{cfg.replica_groups}; use a multiple of {cfg.replica_groups}")
    unsupported = [name for name, given in (("--snapshot", cfg.snapshot), ("--accum-steps", cfg.accum_steps > 1),
                                            ("--precision fp16", cfg.precision == "fp16"), ("--compile", cfg.compile))
                   if given]
    if unsupported:
        return (f"ddp_ft.py does not take {', '.join(unsupported)}: a restarted group heals from a live one instead "
                f"of a snapshot, and its step is torchft's (one batch, fp32 or bf16, eager)")
    h, f = cfg.sync_every, cfg.fragments
    if not h and (f != 1 or cfg.overlap):
        return "--fragments and --overlap are DiLoCo's: give --sync-every H too"
    if h and f > 3:
        return (f"--fragments {f} is more than 3: torchft's fragments are whole modules, and this model has 3 Linear "
                f"layers; use 1 to 3")
    if h % f:
        return (f"--sync-every {h} must be a multiple of --fragments {f} (torchft syncs a fragment every H/F steps): "
                f"use --sync-every {h + f - h % f}")
    if h and cfg.overlap >= h // f:
        return (f"--overlap {cfg.overlap} must be below --sync-every/--fragments = {h // f} (torchft's "
                f"fragment_sync_delay: a fragment's all-reduce ends before the next fragment's starts)")


FT_FLAGS = dict(
    replica_group=flag(REQUIRED, NON_NEGATIVE, "this machine's replica group, 0 to R-1: which shard of the data it "
                                               "trains on", check=check_ft),
    replica_groups=flag(2, POSITIVE, "R: the most replica groups (machines); the data is dealt in R shards"),
    min_replicas=flag(1, POSITIVE, "the fewest groups a step may commit with (1: any survivor trains on alone)"),
    lighthouse=flag(os.environ.get("TORCHFT_LIGHTHOUSE", "http://localhost:29510"), str,
                    "the lighthouse's address (env TORCHFT_LIGHTHOUSE)"),
    torchft_log=flag(False, bool, "show torchft's own log lines (off: one line when the quorum changes)"),
    # torchft's own DiLoCo (torchft.local_sgd.DiLoCo): chapter 11's outer loop across the groups, with its flags
    sync_every=flag(0, NON_NEGATIVE, "H: torchft's DiLoCo, the groups synced every H inner steps (chapter 11's "
                                     "outer loop; 0: every step's gradients averaged)"),
    fragments=flag(1, POSITIVE, "DiLoCo's F: the model's 3 Linear layers dealt in F fragments, synced H/F steps apart"),
    overlap=flag(0, NON_NEGATIVE, "DiLoCo's K (torchft's fragment_sync_delay): steps from a fragment's all-reduce "
                                  "to its wait"),
    outer_lr=flag(0.7, RATE, "DiLoCo's outer SGD learning rate (chapter 11's 0.7)"),
    outer_momentum=flag(0.9, MOMENTUM, "DiLoCo's outer SGD Nesterov momentum (chapter 11's 0.9; 0: plain SGD)"))


def import_torchft():
    """torchft, or one line naming what to install: it needs torch 2.7 or later."""
    if TorchVersion(torch.__version__) < (2, 7):
        raise UsageError(f"ddp_ft.py needs torch 2.7 or later for torchft; this is torch {torch.__version__}: "
                         f"`pip install 'torch>=2.7' {TORCHFT}`")
    try:
        import torchft
        import torchft.local_sgd  # DiLoCo (--sync-every)
    except ImportError as e:
        raise UsageError(f"ddp_ft.py needs torchft ({e}): `pip install {TORCHFT}` (`make setup` installs it)") from None
    return torchft


@record  # Under torchrun, this worker's error and traceback go into torchrun's failure summary.
def main():
    cfg = parse_config(description=__doc__, **FT_FLAGS)
    restarts, agent_store = (os.environ.get(k) for k in ("TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE"))
    if restarts not in (None, "0") or agent_store == "False":  # torchrun's environment for its worker
        raise UsageError("ddp_ft.py runs without torchrun's --max-restarts and TORCH_DISABLE_SHARE_RDZV_TCP_STORE: its "
                         "Manager meets in torchrun's own store, which nobody else would host; start a group that "
                         "died again, and it heals from a live one")
    os.environ.setdefault("RUST_LOG", "info" if cfg.torchft_log else "warn")  # torchft's Rust side: its lines
    torchft = import_torchft()
    check_torchrun_worker()  # started by torchrun: its store is where the group's Manager meets
    # Step 1, who am I: a replica group (one per machine) and, inside it, torchrun's ranks; here one rank per group.
    group_rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if int(os.environ["WORLD_SIZE"]) != 1:
        raise UsageError("ddp_ft.py runs one rank per replica group (torchrun --nproc-per-node 1 on each machine): "
                         "torchft averages across groups, not inside one; diloco.py --ranks-per-replica shows that")
    name_rank_in_errors(group_rank, 1)
    # Step 2, device: this process's GPU, or the CPU (--device cpu, or no GPU visible).
    device = rank_device(cfg.device, local_rank, int(os.environ["LOCAL_WORLD_SIZE"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = DistContext(rank=group_rank, local_rank=local_rank, world_size=1, device=device)  # this group's own
    # Step 3, init: no process group of all ranks. A Manager talks to the lighthouse; before each step the lighthouse
    # names the live groups (the quorum) and the Manager (re)builds a process group of them, gloo or NCCL.
    logging.basicConfig()  # torchft's Python side: its lines with --torchft-log, else none (a failed step is one line
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):  # of ours, with its error's)
        logging.getLogger(name).setLevel(logging.INFO if cfg.torchft_log else logging.CRITICAL)
    timeout = timedelta(seconds=cfg.timeout)
    pg = (torchft.ProcessGroupNCCL if device.type == "cuda" else torchft.ProcessGroupGloo)(timeout=timeout)
    transport = timed_transport(torchft, timeout)  # sends our state to a healing group (HTTP); times what it receives
    try:
        manager = torchft.Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=cfg.min_replicas,
                                  replica_id=f"group_{cfg.replica_group}", lighthouse_addr=cfg.lighthouse,
                                  timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                                  checkpoint_transport=transport, init_sync=False,  # seeded alike: no sync at step 0
                                  use_async_quorum=not cfg.sync_every)  # DiLoCo: each sync's quorum waited for
    except RuntimeError as e:  # the Manager's server connects to the lighthouse first, for up to --timeout
        if "failed to connect" not in str(e):
            raise
        raise FatalError(f"cannot reach the lighthouse at {cfg.lighthouse} within --timeout {cfg.timeout:g}s: start "
                         f"it first (`torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000`), and pass its "
                         f"address as --lighthouse or TORCHFT_LIGHTHOUSE") from None
    try:
        train(cfg, ctx, torchft, manager, transport)  # steps 4 to 7, below
    except TimeoutError as e:  # no quorum within --timeout: this machine lost the lighthouse (a cut link, or it died)
        if not any(frame.name == "_async_quorum" for frame in traceback.extract_tb(e.__traceback__)):
            raise
        raise FatalError(f"no quorum from the lighthouse at {cfg.lighthouse} within --timeout {cfg.timeout:g}s: this "
                         f"machine cannot reach it (the network, or the lighthouse died), or fewer groups are alive "
                         f"than its --min_replicas; once a quorum can form, start this group again and it heals from "
                         f"a live one") from None
    finally:  # Step 8, teardown: the Manager's server and threads, after an error too
        manager.shutdown(wait=False)


def train(cfg, ctx, torchft, manager, transport):
    print0(ctx, cfg.describe())
    print0(ctx, f"Using {ctx.device} device, replica group {cfg.replica_group} of at most {cfg.replica_groups}, "
                f"lighthouse {cfg.lighthouse}")
    output = prepare_output(cfg.output)

    # Step 4, data: chapter 1's shuffle dealt to the R groups in turn; the batch of step S depends on S alone, so a
    # group that healed to step S takes step S's batch, and a step that failed is retried with the same one.
    locate_fashion_mnist(cfg.data_dir)
    train_set, test_set, folder = load_fashion_mnist(cfg, ctx.device)
    print0(ctx, f"Data: {folder} ({len(train_set)} train / {len(test_set)} test images)")
    train_sampler = DistributedSampler(train_set, num_replicas=cfg.replica_groups, rank=cfg.replica_group,
                                       seed=cfg.seed)
    batch = cfg.batch_size // cfg.replica_groups
    steps = math.ceil(len(train_sampler) / batch)  # per epoch, as a DataLoader counts them
    test_loader = DataLoader(test_set, batch_size=1000, collate_fn=default_convert)  # every group tests on all of it

    torch.manual_seed(cfg.seed)  # the same initial weights in every chapter
    model = NeuralNetwork().to(ctx.device)
    # Step 5, wrap: no DDP wrapper. torchft's Optimizer starts each step's quorum in zero_grad(), and step() steps
    # only if every group of the quorum got through the step (should_commit), else no group takes it.
    inner = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    optimizer = inner if cfg.sync_every else torchft.Optimizer(manager, inner)
    # What a healing group receives from a live one: the weights and the optimizer's state (momentum); and the step.
    # (And which machine each group is on, for the healing group's share of its machine's cores.)
    cores = CoreShare(cfg, ctx)
    manager.register_state_dict_fn("train", lambda state: load_state(model, inner, state, cores),
                                   lambda: {"model": model.state_dict(), "optim": inner.state_dict(),
                                            "hosts": cores.hosts})
    # --sync-every H: torchft's DiLoCo (chapter 11's outer loop) instead. Each group steps its own weights with the
    # inner optimizer; every H/F steps its hook syncs a fragment: a quorum, how far the group moved since the last sync
    # all-reduced over it, the outer SGD's step (or, if a group failed, the fragment back to its last sync).
    diloco, shared = (diloco_over_groups(cfg, torchft, manager, model, inner) if cfg.sync_every else
                      (None, lambda: model))
    print0(ctx, model)

    metrics, watch = MetricsLog(output, ctx), QuorumWatch(manager, transport, cfg, ctx, diloco, cores)
    epoch = None
    # Step 6, epochs: torchft counts the committed steps (the Manager's step, the same in every group of a quorum;
    # with DiLoCo, its syncs); the epochs follow from it, each drawing its own shuffle from seed + epoch.
    while (step := watch.steps_done()) < cfg.epochs * steps:
        if step // steps != epoch:
            epoch = step // steps
            print0(ctx, f"Epoch {epoch + 1}\n-------------------------------")
            train_sampler.set_epoch(epoch)  # without it, every epoch would repeat epoch 0's order
            order = list(train_sampler)
            loss_sum, seen, start = torch.zeros((), device=ctx.device), 0, time.perf_counter()
        k = step % steps
        X, y = train_set.__getitems__(order[k * batch:(k + 1) * batch])  # this group's share of step `step`'s batch
        optimizer.zero_grad()  # torchft: starts this step's quorum in the background (DiLoCo: at a sync)
        watch.wait_for_every_group(step)  # step 1 waits (up to --timeout) for all --replica-groups to be there
        with autocast(cfg, ctx.device):
            loss = loss_fn(model(X), y)
        loss.backward()
        if diloco is None:
            average_gradients(model, manager)  # over the quorum's groups: together, the step's whole batch
        optimizer.step()  # steps only if the quorum committed; a healing group loads the live state first
        if not watch.committed(step):  # a group died mid-step, or this group healed: no loss of ours to count
            continue
        loss_sum.add_(loss.detach(), alpha=len(y))
        seen += len(y)
        if k % cfg.log_every == 0:  # this group's loss
            print_loss_line(loss.detach(), len(y), k, epoch, steps, len(train_set), cfg, ctx, metrics)
        if k == steps - 1:  # the epoch's end: its line, then the test set (each group tests the weights it holds;
            print_epoch_line(loss_sum, seen, start, epoch, steps, ctx, metrics)  # DiLoCo: the shared ones)
            evaluate(shared(), test_loader, epoch, ctx, metrics)
            model.train()
    print0(ctx, f"Done! {watch.summary()}")

    # Step 7, save: every group holds the same weights; each saves its own copy on its machine.
    if diloco is not None and diloco._local_step + cfg.fragments > 1:  # (torchft's count of steps since a sync)
        print0(ctx, "model.pth holds each fragment's weights as of its last sync, as every group does (torchft has "
                    "no call to sync the steps since; chapter 11 does)")
    if ctx.is_main:
        save_weights(shared(), output / "model.pth")
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")


def diloco_over_groups(cfg, torchft, manager, model, inner):
    """torchft's DiLoCo over the replica groups, with chapter 11's outer SGD (one per fragment: each steps its own
    momentum) and fp32 on the wire; and a function giving a model with the shared weights, as of each fragment's last
    sync (torchft keeps them on the CPU, and sends them to a healing group): the same in every group."""
    linears = lambda m: [layer for layer in m.modules() if isinstance(layer, torch.nn.Linear)]  # noqa: E731
    split = lambda m: [torch.nn.ModuleList(part) for part in  # noqa: E731  F consecutive runs of layers
                       (linears(m)[i * 3 // cfg.fragments:(i + 1) * 3 // cfg.fragments] for i in range(cfg.fragments))]
    fragments = split(model)
    outer = [torch.optim.SGD(fragment.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                             nesterov=cfg.outer_momentum > 0) for fragment in fragments]
    diloco = torchft.local_sgd.DiLoCo(manager, fragments, inner, outer, sync_every=cfg.sync_every,
                                      fragment_sync_delay=cfg.overlap)
    diloco.__enter__()  # its hooks on the inner optimizer (torchft's DiLoCo is a context manager): for the whole run
    evaluated = NeuralNetwork().to(next(model.parameters()).device)
    evaluated_parts = split(evaluated)

    @torch.no_grad()
    def shared():
        for part, synced in zip(evaluated_parts, diloco._fragments):
            for param, saved in zip(part.parameters(), synced.original_parameters.values()):
                param.copy_(saved)
        return evaluated

    return diloco, shared


def load_state(model, optimizer, state, cores):
    """A healing group takes a live group's weights and optimizer state (torchft sets the step itself); and its
    share of the cores, from where the live group knows the groups to be."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    cores.take(state["hosts"])


class CoreShare:
    """On the CPU without OMP_NUM_THREADS: this group's share of its machine's cores, as the torchrun chapters take
    theirs (each group is its own torchrun of one rank, which leaves a process every core). The groups of the first
    quorum tell each other their machine, in one all-reduce of a number per group; a group that heals later learns
    the machines from the live group's state. Each group's number is its host name's hash, exact in float64. With
    DiLoCo the groups first meet at the first sync: there one line says how to set the threads instead."""

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx, self.host = cfg, ctx, socket.gethostname()
        self.on = ctx.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ and cfg.replica_groups > 1
        if self.on and cfg.sync_every:
            self.on = False
            print0(ctx, f"{torch.get_num_threads()} CPU threads, every core of {self.host}: with --sync-every the "
                        f"groups first meet at the first sync, too late to share the cores; where several groups "
                        f"share a machine, start each with OMP_NUM_THREADS=<cores / groups>")
        self.mine = float(int.from_bytes(hashlib.sha256(self.host.encode()).digest()[:6], "big"))
        self.hosts = torch.zeros(cfg.replica_groups, dtype=torch.float64)  # 0: a group not seen

    def gather(self, manager):
        """Every group of this step's quorum puts its number in its own place; the sum holds them all."""
        if self.on:
            self.hosts.zero_()[self.cfg.replica_group] = self.mine
            manager.allreduce(self.hosts, reduce_op=torch.distributed.ReduceOp.SUM).wait()
            self.take(self.hosts)

    def take(self, hosts):
        """This group's threads: the cores over the groups on this machine (this one counted wherever it was)."""
        if self.on:
            self.hosts.copy_(hosts)[self.cfg.replica_group] = self.mine
            here = int((self.hosts == self.mine).sum())
            torch.set_num_threads(threads := cpu_threads(here))
            print0(self.ctx, f"{here} replica group{'s' * (here > 1)} on {self.host}: {threads} CPU thread"
                             f"{'s' * (threads > 1)} each")


def average_gradients(model, manager):
    """DDP's job through the Manager: the gradients averaged over the quorum's groups (a healing group sends zeros),
    all in one flat buffer, as DDP sends a bucket: one all-reduce a step, not one per tensor (6 here, each paying
    gloo's and the network's round trips). An all-reduce that fails (a group died mid-step) is noted by the Manager,
    and the step then commits nowhere."""
    grads = [param.grad for param in model.parameters()]
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    manager.allreduce(flat).wait()  # the sum over the quorum, divided by its size
    for grad, averaged in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(averaged.view_as(grad))


def timed_transport(torchft, timeout):
    """torchft's HTTP checkpoint transport, which also notes when this group received a live group's state."""

    class Timed(torchft.checkpointing.HTTPTransport):
        received_seconds, received_step = 0.0, None

        def recv_checkpoint(self, src_rank, metadata, step, timeout):
            begin = time.perf_counter()
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
            self.received_seconds, self.received_step = time.perf_counter() - begin, step
            return state

    return Timed(timeout=timeout, num_chunks=0)


def not_committed_reason(error):
    """Why a step did not commit, in one line: torch's words for a lost peer explained, as every chapter does; for the
    quorum's store (torchrun's, on the group that leads the quorum) not answering, this chapter's own words, since
    the step is retried with the next quorum and chapter 3's advice (start rank 0, check the address) is not this."""
    silent = re.search(CONNECT_TIMED_OUT, str(error))
    if silent:
        return (f"the quorum's store at {silent[2]}:{silent[3]} did not answer within {int(silent[1]) / 1000:g}s: the "
                f"group hosting it died or is cut off, or its machine is too busy for --timeout")
    return explain(error) or str(error).splitlines()[0]


class QuorumWatch:
    """After each step: one line when the quorum's size changes or this group healed (where the time went); None for
    a step that did not commit. With DiLoCo, torchft's step counts syncs, H/F inner steps each."""

    def __init__(self, manager, transport, cfg, ctx, diloco, cores):
        self.manager, self.transport, self.cfg, self.ctx, self.diloco = manager, transport, cfg, ctx, diloco
        self.cores = cores  # this group's share of its machine's cores, taken once every group is there
        self.gathered, self.waited, self.deadline = bool(diloco), False, time.monotonic() + cfg.timeout
        self.size, self.failed, self.began = None, 0, time.perf_counter()
        self.per_sync = cfg.sync_every // cfg.fragments if diloco else 1  # inner steps per step of torchft's

    def steps_done(self):
        """The steps this group has taken and kept: torchft's, times H/F with DiLoCo, plus those since its last sync."""
        return self.manager.current_step() * self.per_sync + (self.diloco._local_step if self.diloco else 0)

    def wait_for_every_group(self, step):
        """At step 0, until --timeout: a quorum without all --replica-groups commits nothing (the step is retried with
        the next quorum), so that every group trains from step 1 and a run without failures is chapter 1's. Not with
        DiLoCo: its first quorum is at the first sync, and a quorum of ours before it would meet a live group's sync
        (a group started again) with no all-reduce; there a lighthouse with --min_replicas R waits for all R."""
        if step or self.gathered:  # (with DiLoCo, gathered from the start)
            return
        self.manager.wait_quorum()
        healing = self.transport.received_step is not None  # joined groups that train already: no wait (and it
        # counts only them, not the healing group, as participants)
        here = self.manager.num_participants()
        if not healing and here < self.cfg.replica_groups and time.monotonic() < self.deadline:
            if not self.waited:
                print0(self.ctx, f"waiting up to --timeout {self.cfg.timeout:g}s for all {self.cfg.replica_groups} "
                                 f"replica groups ({here} in the quorum)")
            self.waited = True
            # Each try re-forms the quorum, and torchft builds a new process group for it: twice a second, not as
            # fast as the loop spins (60 a second opened as many connections to torchrun's store, which then stalled)
            time.sleep(0.5)
            self.manager.report_error(RuntimeError(f"waiting for {self.cfg.replica_groups} replica groups"))
            return
        self.gathered = True
        if healing:
            return
        if here < self.cfg.replica_groups:  # --timeout is over, and no group there had trained: nothing to heal from
            print0(self.ctx, f"only {here} of {self.cfg.replica_groups} replica groups after --timeout "
                             f"{self.cfg.timeout:g}s, none with steps to heal from (the others have not started, or "
                             f"have ended): training from step 1 with {here}, a run of its own, whose model.pth is "
                             f"not the other groups'")
        self.cores.gather(self.manager)  # the groups now in the quorum: which machine each is on

    def committed(self, step):
        """True if step `step` committed with this group's own gradients; the lines for what changed."""
        took, self.began = time.perf_counter() - self.began, time.perf_counter()
        healed_to, self.transport.received_step = self.transport.received_step, None
        now, per = self.steps_done(), self.per_sync
        # a healed group is at the live groups' step: torchft's count times H/F, plus the inner steps since a sync
        if now != (step + 1 if healed_to is None else healed_to * per + ((step + 1) % per or per)):
            if not self.gathered:  # still waiting for every group at step 0
                return False
            self.failed += 1
            error = self.manager.errored()
            reason = not_committed_reason(error.original_exception) if error else "another group failed it"
            print0(self.ctx, f"step {step + 1} not committed ({reason}): retried" if per == 1 else
                   f"the sync at step {step + 1} not committed ({reason}): steps {now + 1}-{step + 1} retried")
            return False
        if healed_to is not None:  # this step healed us: the live groups' weights after their `healed_to` steps
            print0(self.ctx, f"step {now}: healed from a live group at its "
                             + (f"step {healed_to} ({healed_to - step}" if per == 1 else
                                f"sync {healed_to} ({now - step - 1}") + " steps skipped here): state received in "
                             f"{self.transport.received_seconds:.2f}s, quorum and step {took:.2f}s in all")
            return False  # the step was the live groups' (their gradients); the quorum's size is said at the next
        size = self.manager.num_participants()
        if size != self.size and size:  # (0 with DiLoCo before its first sync: no quorum yet)
            print0(self.ctx, f"step {now}: quorum of {size} replica group{'s' * (size != 1)}"
                             + ("" if self.size is None else f" (was {self.size})"))
            self.size = size
        return True

    def summary(self):
        return (f"{self.manager.current_step()} {'syncs' if self.diloco else 'steps'} committed, {self.failed} "
                f"retried, {self.manager.batches_committed()} group batches")


if __name__ == "__main__":
    run_main(main)
