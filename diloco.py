"""Chapter 11: DiLoCo, chapter 3b's ranks left apart: each trains its own copy on its own shard with chapter 1's SGD
(the inner optimizer) for --sync-every H steps; then one all-reduce averages how far the ranks moved (the pseudo-
gradient), and an outer SGD with Nesterov momentum steps the shared weights with it. The lesson: diff ddp_by_hand.py
diloco.py

    torchrun --standalone --nproc-per-node 2 diloco.py --sync-every 10             # one machine, 2 processes
    torchrun --standalone --nproc-per-node 2 diloco.py --sync-every 30 --fragments 3 --overlap 5   # streaming
    torchrun --nnodes 2 --nproc-per-node 2 ... diloco.py --ranks-per-replica 2   # a machine's 2 ranks train one copy

The weights cross the network once every H steps instead of the gradients every step (DiLoCo, Douillard et al. 2023,
arXiv 2311.08105). Streaming DiLoCo (arXiv 2501.18512): --fragments F slices of the weights synced at staggered
steps, each all-reduce waited --overlap K steps after it starts (the wire runs under the compute), in bf16. Unlike the
paper: inner SGD, not AdamW; equal flat slices, not strided layers; bf16 summed in bf16, not 4-bit summed in fp32;
the inner steps made while a fragment was in flight dropped at its outer step (alpha = 0, torchft's default).
With --ranks-per-replica N, the N ranks of a machine train one copy together, averaging their gradients every step
over the fast link inside it (as DDP does); only the outer sync crosses the slow one, each rank carrying 1/N of it.
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, DistributedSampler, Subset, default_convert

from common.checkpoint import load_snapshot, prepare_output, save_snapshot, save_weights
from common.cli import MOMENTUM, NON_NEGATIVE, POSITIVE, RATE, FatalError, flag, parse_config, run_main
from common.data import load_fashion_mnist
from common.engine import MetricsLog, evaluate, train_one_epoch
from common.model import NeuralNetwork
from common.ranks import (DistContext, check_flags_and_set_threads, check_torchrun_worker, destroy_process_group,
                          local_rank_0_first, print0, rank_device)

WIRE = {"bf16": torch.bfloat16, "fp32": torch.float32}


def check_diloco(cfg):
    """What the outer loop cannot train with, in one line before any rendezvous (or None)."""
    if cfg.precision == "fp16":  # GradScaler skips a step on this rank's own overflow: the ranks' steps would drift
        return ("diloco.py trains in --precision fp32 or bf16: fp16's GradScaler would skip the steps this rank's own "
                "gradients overflowed in, and the ranks would sync after different inner steps; use --precision bf16")
    if cfg.fragments > cfg.sync_every:
        return (f"--fragments {cfg.fragments} is more than --sync-every {cfg.sync_every}: the fragments are synced "
                f"H/F steps apart, at least one step; use at most {cfg.sync_every} fragments")
    if (world_size := int(os.environ.get("WORLD_SIZE", 1))) % cfg.ranks_per_replica:  # torchrun's; 1 without it
        return (f"--ranks-per-replica {cfg.ranks_per_replica} does not divide the {world_size} ranks: "
                f"give each copy the same number of ranks (a machine's --nproc-per-node)")
    if cfg.overlap > cfg.sync_every:
        return (f"--overlap {cfg.overlap} is more than --sync-every {cfg.sync_every}: a fragment's all-reduce must "
                f"end before its next one starts; use an --overlap of at most {cfg.sync_every}")


DILOCO_FLAGS = dict(
    sync_every=flag(20, POSITIVE, "H: inner steps between a fragment's syncs", check=check_diloco),
    outer_lr=flag(0.7, RATE,
                  "the outer SGD's learning rate (DiLoCo's 0.7; 1, with momentum 0, steps to the ranks' mean)"),
    outer_momentum=flag(0.9, MOMENTUM,
                        "the outer SGD's Nesterov momentum (DiLoCo's 0.9; 0: plain SGD, torch's Nesterov needs some)"),
    fragments=flag(1, POSITIVE, "F: equal flat slices of the weights, each synced every H steps, H/F steps apart"),
    overlap=flag(0, NON_NEGATIVE, "K: inner steps from a fragment's all-reduce start to its wait (0: at once)"),
    wire_dtype=flag("bf16", tuple(WIRE), "the pseudo-gradients' dtype on the wire (bf16: half of fp32's bytes)"),
    ranks_per_replica=flag(1, POSITIVE, "N: ranks r..r+N-1 train one copy, averaging gradients every step (a "
                                        "machine's ranks: its --nproc-per-node); the outer sync runs across copies"))


@record  # Under torchrun, this worker's error and traceback go into torchrun's failure summary.
def main():
    cfg = parse_config(description=__doc__, **DILOCO_FLAGS)
    check_torchrun_worker(cfg)  # One line if torchrun did not start this process or the global batch does not split.
    # Step 1, who am I: torchrun sets RANK (global: rank 0 prints and saves), LOCAL_RANK (it picks the GPU), WORLD_SIZE.
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    # Step 2, device: this process's GPU, or the CPU (--device cpu, or no GPU visible).
    device = rank_device(cfg.device, local_rank, int(os.environ["LOCAL_WORLD_SIZE"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Pin this process's GPU before anything else touches one.
    ctx = DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    # Step 3, init: env:// reads torchrun's MASTER_ADDR and MASTER_PORT. A peer missing for --timeout is an error.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=cfg.timeout),
                            device_id=device if device.type == "cuda" else None)  # NCCL then connects here.
    try:
        train(cfg, ctx)  # steps 4 to 7, below
    finally:  # Step 8, teardown: it runs after an error too. The other ranks stop (gloo at once, NCCL at --timeout).
        destroy_process_group()  # dist.destroy_process_group(); after an error, common/ranks.py prints it first.


def train(cfg, ctx):
    print0(ctx, cfg.describe())
    print0(ctx, f"Using {ctx.device} device, {ctx.world_size} processes, backend {dist.get_backend()}")
    check_flags_and_set_threads(cfg, ctx)  # Each rank's line and share of the cores; differing flags stop all.
    output = prepare_output(cfg.output)

    # Step 3, init (continued): two groups of ours, each waiting --timeout as the default one does (a new group waits
    # torch's default: 10 minutes on NCCL, 30 on gloo). A copy's N ranks (one machine's) average gradients in
    # `replica`; the outer all-reduce runs in `across`, not in the group of the loss lines, which on NCCL (a stream
    # per group) would otherwise wait behind a sync in flight.
    wait, n, copies = timedelta(seconds=cfg.timeout), cfg.ranks_per_replica, ctx.world_size // cfg.ranks_per_replica
    ranks = range(ctx.world_size)
    replica, _ = dist.new_subgroups_by_enumeration([list(ranks[r:r + n]) for r in ranks[::n]], timeout=wait)
    across, _ = dist.new_subgroups_by_enumeration([list(ranks[i::n]) for i in range(n)], timeout=wait)

    # Step 4, data: chapter 1's shuffle dealt to the ranks in turn; each rank tests its own part of the test set.
    # Copy c's N ranks take what rank c of `copies` ranks would (so a copy trains alike at any N), dealt among them.
    dealt = ctx.rank // n + ctx.rank % n * copies  # ctx.rank at one rank per copy
    with local_rank_0_first(ctx):  # One process per machine finds the data (downloading it if it must), then the rest.
        train_set, test_set, folder = load_fashion_mnist(cfg, ctx.device)
    print0(ctx, f"Data: {folder} ({len(train_set)} train / {len(test_set)} test images)")
    train_sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=dealt, seed=cfg.seed)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size // (ctx.world_size * cfg.accum_steps),
                              sampler=train_sampler, collate_fn=default_convert)
    test_set = Subset(test_set, range(ctx.rank, len(test_set), ctx.world_size))
    test_loader = DataLoader(test_set, batch_size=1000, collate_fn=default_convert)  # The dataset gives whole batches.

    torch.manual_seed(cfg.seed)  # the same initial weights in every chapter
    model = NeuralNetwork().to(ctx.device)
    # Step 5, wrap: by hand, every rank starts from rank 0's weights (what DDP's constructor does) ...
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    if cfg.compile:  # in place (state_dict() keeps its keys): docs/benchmark.md says what it compiles
        model.compile()
    print0(ctx, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)  # the inner optimizer
    # ... then trains alone; every H steps after the inner step, the ranks average how far they moved since the last
    # sync (one all-reduce), and the outer optimizer steps the shared weights with it: every rank continues from them
    if n > 1:  # a copy's ranks average their gradients before each inner step, as DDP does
        optimizer.register_step_pre_hook(lambda *_: average_gradients(model, n, replica))
    diloco = DiLoCo(model, optimizer, cfg, ctx, replica, across, copies)
    optimizer.register_step_post_hook(diloco.after_inner_step)
    scaler = None  # no loss scaling: fp16, which needs it, is refused (check_diloco)

    first_epoch = load_snapshot(model, optimizer, scaler, cfg, ctx, diloco)  # 0, or the epochs it holds
    metrics = MetricsLog(output, ctx, first_epoch)
    # Step 6, epochs: each draws its own shuffle from seed + epoch.
    for epoch in range(first_epoch, cfg.epochs):
        print0(ctx, f"Epoch {epoch + 1}\n-------------------------------")
        train_sampler.set_epoch(epoch)  # without it, every epoch would repeat epoch 0's order
        # backward() leaves each rank its own gradients, step() takes them; every H steps the outer step follows
        train_one_epoch(model, train_loader, optimizer, scaler, epoch, cfg, ctx, metrics)
        evaluate(diloco.shared_model(), test_loader, epoch, ctx, metrics)  # the last outer step's: the same everywhere
        if save_snapshot(model, optimizer, scaler, epoch + 1, cfg, ctx, diloco):  # Every --save-every epochs.
            return  # SLURM warned of its time limit (docs/slurm.md): the snapshot holds the run.
    if diloco.last_sync():  # the steps since each fragment's last sync, averaged in too (after the last snapshot)
        print0(ctx, "After the last sync, the weights model.pth holds:")
        evaluate(diloco.shared_model(), test_loader, cfg.epochs - 1, ctx, MetricsLog(None, ctx))  # printed, not logged
    print0(ctx, "Done!")

    # Step 7, save: the shared weights, once (every rank holds the same).
    if ctx.is_main:
        save_weights(diloco.shared_model(), output / "model.pth")
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")


class DiLoCo:
    """The outer loop, after each inner step: every H steps a fragment's pseudo-gradient (its weights at the last sync
    minus this copy's now) is all-reduced across the copies, started then and waited K steps later (each of a copy's
    N ranks carries 1/N of it, gathered in the copy at the wait), and the outer SGD steps with it."""

    def __init__(self, model, optimizer, cfg, ctx, replica=None, across=None, copies=None):
        self.cfg, self.ctx, self.inner, self.step = cfg, ctx, optimizer, 0  # step: inner steps taken, all epochs
        self.replica, self.across, self.copies = replica, across, copies or ctx.world_size
        self.n = ctx.world_size // self.copies  # ranks per copy
        self.params = params = list(model.parameters())
        self.sizes = [p.numel() for p in params]
        self.local = torch.cat([p.detach().reshape(-1) for p in params])  # this rank's weights as one flat vector ...
        for p, flat in zip(params, self.local.split(self.sizes)):
            p.data = flat.view_as(p)  # ... that the model's weights are views of: a fragment is a slice of it
        self.shared = self.local.clone()  # the weights every rank agrees on, as of the last outer step
        # F equal flat slices (not layers: the first holds 60% of the weights); views, stepped in place
        self.fragments, self.mine = self.shared.tensor_split(cfg.fragments), self.local.tensor_split(cfg.fragments)
        self.outer = torch.optim.SGD(self.fragments, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                                     nesterov=cfg.outer_momentum > 0)  # torch's Nesterov needs momentum
        self.offsets = [(i + 1) * cfg.sync_every // cfg.fragments % cfg.sync_every for i in range(cfg.fragments)]
        self.started = [0] * cfg.fragments  # the step of each fragment's last all-reduce
        self.in_flight = {}  # fragment -> [the step it is waited at, the all-reduce's Work (None once waited), sum]
        self.evaluated = NeuralNetwork().to(ctx.device)

    @torch.no_grad()
    def after_inner_step(self, *_):
        """The inner optimizer's step post-hook: the fragments due finished, then those due started (F=1: every H)."""
        self.step += 1
        for i in [i for i, (due, *_) in self.in_flight.items() if due == self.step]:
            self.finish(i)
        for i, offset in enumerate(self.offsets):  # fragment i at steps (i + 1) H / F + n H: staggered
            if self.step % self.cfg.sync_every == offset:
                self.start(i)
                if self.cfg.overlap == 0:
                    self.finish(i)

    def start(self, i):
        """Fragment i's pseudo-gradient, averaged over the ranks by an all-reduce that runs while the steps go on."""
        pseudo_gradient = (self.fragments[i] - self.mine[i]) / self.copies  # divided first, as DDP's bf16 hook
        n = self.n  # the copy's ranks hold the same pseudo-gradient: each sends its 1/N (zeros pad it to N equal parts)
        wire = torch.nn.functional.pad(pseudo_gradient.to(WIRE[self.cfg.wire_dtype]), (0, -len(pseudo_gradient) % n))
        work = dist.all_reduce(wire.chunk(n)[self.ctx.rank % n], group=self.across, async_op=True)  # returns at once
        self.in_flight[i], self.started[i] = [self.step + self.cfg.overlap, work, wire], self.step

    def gather(self, flight):
        """A fragment's all-reduce waited for; its N parts gathered inside the copy: wire holds the whole sum."""
        if flight[1] is not None:
            flight[1].wait()  # on a GPU: the stream waits (NCCL); gloo's thread has ended the sum
            if self.n > 1:
                n, wire = self.n, flight[2]
                dist.all_gather(list(wire.chunk(n)), wire.chunk(n)[self.ctx.rank % n].clone(), group=self.replica)
            flight[1] = None

    def finish(self, i):
        """Fragment i's all-reduce waited for, the outer step taken with it; this rank continues from the result."""
        flight = self.in_flight.pop(i)
        self.gather(flight)
        self.fragments[i].grad = flight[2][:len(self.fragments[i])].float()
        self.outer.step()  # the outer SGD skips the fragments without a gradient: fragment i alone
        self.fragments[i].grad = None
        self.mine[i].copy_(self.fragments[i])  # every rank continues from the shared weights

    @torch.no_grad()
    def last_sync(self):
        """After the last epoch: fragments in flight finished, the others synced if they trained since: True if any."""
        idle = [i for i in range(self.cfg.fragments) if i not in self.in_flight and self.started[i] < self.step]
        changed = bool(idle or self.in_flight)
        for i in [*self.in_flight]:  # (the steps since it started are dropped, as at every sync)
            self.finish(i)
        for i in idle:
            self.start(i)
            self.finish(i)
        return changed

    @torch.no_grad()
    def shared_model(self):
        """A model holding the shared weights (the same on every rank): what is evaluated and saved."""
        for p, flat in zip(self.evaluated.parameters(), self.shared.split(self.sizes)):
            p.copy_(flat.view_as(p))
        return self.evaluated

    def all_gather(self, ctx):
        """For rank 0's snapshot: the outer state, any fragment in flight (waited: its sum), every rank's weights."""
        for flight in self.in_flight.values():  # waited now, applied when due: the sum is the same whenever it is read
            self.gather(flight)
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, dict(local=self.local.cpu(), momentum=[
            self.inner.state[p]["momentum_buffer"].cpu() for p in self.params if self.inner.state[p]]))
        return dict(flags={k: getattr(self.cfg, k) for k in DILOCO_FLAGS}, step=self.step, started=self.started,
                    shared=self.shared, outer=self.outer.state_dict(), everyone=everyone,
                    in_flight={i: (due, wire) for i, (due, _, wire) in self.in_flight.items()})

    def load(self, saved, ctx, where):
        """This rank's part of a snapshot; one line if it was made with other DiLoCo flags or another world size."""
        if saved is None or saved["flags"] != {k: getattr(self.cfg, k) for k in DILOCO_FLAGS}:
            raise FatalError(f"snapshot {where} was made with other DiLoCo flags ({saved and saved['flags']}): resume "
                             f"with them, or delete it to start afresh")
        if len(saved["everyone"]) != ctx.world_size:
            raise FatalError(f"snapshot {where} holds the weights of {len(saved['everyone'])} ranks, this run has "
                             f"{ctx.world_size}: resume with {len(saved['everyone'])} ranks (each trains its own), or "
                             f"delete it")
        mine = saved["everyone"][ctx.rank]
        self.step, self.started = saved["step"], saved["started"]
        self.shared.copy_(saved["shared"])
        self.outer.load_state_dict(saved["outer"])
        self.in_flight = {i: [due, None, wire.to(ctx.device)] for i, (due, wire) in saved["in_flight"].items()}
        self.local.copy_(mine["local"])
        for p, momentum in zip([p for p in self.params if self.inner.state[p]], mine["momentum"]):
            self.inner.state[p]["momentum_buffer"].copy_(momentum)  # this rank's own (rank 0's was loaded)


def average_gradients(model, world_size, group):
    """DDP's job by hand: each gradient summed over the ranks, one all-reduce per tensor in turn, then averaged."""
    for param in model.parameters():
        dist.all_reduce(param.grad, group=group)  # the sum of the copy's gradients, in place on each of its ranks
        param.grad /= world_size


if __name__ == "__main__":
    run_main(main)
