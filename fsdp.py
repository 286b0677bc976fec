"""Chapter 7: the same model sharded with FSDP2 (`fully_shard`): each rank holds a slice of every weight.

    torchrun --standalone --nproc-per-node 2 fsdp.py                 # one machine, 2 processes
    torchrun --standalone --nproc-per-node gpu fsdp.py               # one process per visible GPU
    # two machines, 4 GPUs each; run on both, with --node-rank 0 on the master (10.0.0.1):
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 fsdp.py
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 fsdp.py
    # a sharded snapshot (a folder, one file per rank); it resumes on any number of ranks:
    torchrun --standalone --nproc-per-node 2 fsdp.py --snapshot runs/snap-fsdp

Started like chapter 3 (`diff ddp_launch.py fsdp.py` is the lesson). Where DDP keeps a whole copy of the model
on every rank and all-reduces the gradients, FSDP2 keeps 1/world_size of every weight on each rank, all-gathers a
layer's weights just before it runs, frees them after, and reduce-scatters the gradients so each rank gets the
averaged gradient of its own slice only.
"""
import math
import os
import re
import shutil
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DistributedSampler

from common.checkpoint import TRAJECTORY_FLAGS, atomic_save, check_resumable, prepare_output
from common.config import parse_config
from common.data import ShardSampler, load_fashion_mnist, locate_fashion_mnist, make_loader
from common.engine import evaluate, train_one_epoch
from common.errors import FatalError, UsageError, run_main
from common.metrics import MetricsLog
from common.model import NeuralNetwork
from common.ranks import DistContext, all_reduce_sum, check_global_batch, meet_the_group, print0, rank_device

SHARDED_FORMAT = "fashion-mnist-ddp-tutorial sharded snapshot v1"


def train(cfg, ctx):
    print0(ctx, cfg.describe())
    print0(ctx, f"Using {ctx.device} device, {ctx.world_size} processes, backend {dist.get_backend()}")
    meet_the_group(cfg, ctx)  # each rank's line; one line if they disagree on flags or share a GPU
    output = prepare_output(cfg.output)

    if ctx.local_rank == 0:  # one process per machine finds the data, downloading it if it must, ...
        locate_fashion_mnist(cfg.data_dir)
    dist.barrier()  # ... while the machine's other ranks wait here; then every rank reads it
    train_set, test_set, folder = load_fashion_mnist(cfg, ctx.device)
    print0(ctx, f"Data: {folder} ({len(train_set)} train / {len(test_set)} test images)")
    # Each rank takes every world_size-th image of chapter 1's shuffle, batch_size / world_size at a time, so
    # the ranks' k-th batches together are chapter 1's k-th batch. Each rank tests a disjoint shard.
    train_sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, seed=cfg.seed)
    train_loader = make_loader(train_set, cfg.batch_size // (ctx.world_size * cfg.accum_steps), train_sampler)
    # Every forward() all-gathers weights, a collective: all ranks must run as many test batches. The shards
    # differ by one image at most, so batches sized from the largest shard come out the same number everywhere.
    largest = math.ceil(len(test_set) / ctx.world_size)  # rank 0's shard
    test_batch = math.ceil(largest / math.ceil(largest / 1000))  # at most 1000
    test_loader = make_loader(test_set, test_batch, ShardSampler(test_set, ctx.rank, ctx.world_size))

    torch.manual_seed(cfg.seed)  # the same initial weights in every chapter
    model = NeuralNetwork().to(ctx.device)
    # FSDP2: each Linear becomes a unit whose weights are cut along dim 0 into world_size slices (DTensors); its
    # forward() all-gathers the whole weight just before it runs and frees it after; its backward() reduce-scatters
    # the gradient, so each rank receives the average over the ranks of its own slice. The root unit comes last.
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))  # the ranks to shard over: all of them
    fsdp_kwargs = dict(mesh=mesh)  # fp32: gather, compute and reduce in the weights' own dtype
    if cfg.precision == "bf16":  # gather the weights as bf16 and compute in bf16; average the gradients in fp32;
        # return float32 outputs, so the test loss and counts are summed unrounded (a bf16 sum near 2,300 moves in
        # steps of 16). Evaluation computes in bf16 all the same: every forward gathers bf16 weights.
        fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                        output_dtype=torch.float32)
    for layer in model.linear_relu_stack:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    if cfg.compile:  # after fully_shard: Dynamo traces through FSDP2's hooks, the gathers stay where they are
        model.compile()
    print0(ctx, model)
    show_parameter_bytes(model, ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)  # after fully_shard: it steps this rank's slices

    first_epoch = load_sharded_snapshot(model, optimizer, cfg, ctx)  # 0, or the epochs a --snapshot folder holds
    metrics = MetricsLog(output, ctx, first_epoch)
    for epoch in range(first_epoch, cfg.epochs):
        print0(ctx, f"Epoch {epoch + 1}\n-------------------------------")
        train_sampler.set_epoch(epoch)  # this epoch's shuffle: seed + epoch (without it, every epoch is epoch 0's)
        train_one_epoch(model, train_loader, optimizer, None, epoch, cfg, ctx, metrics)  # None: no GradScaler
        evaluate(model, test_loader, epoch, ctx, metrics)
        save_sharded_snapshot(model, optimizer, epoch + 1, cfg, ctx)  # with --snapshot: every --save-every epochs
    print0(ctx, "Done!")

    # No rank has the whole model: every rank sends its slices and rank 0 gets a plain state_dict on the CPU (the
    # others get {}), the same file chapter 1 writes.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.is_main:
        atomic_save(full, output / "model.pth")
    print0(ctx, f"Saved PyTorch Model State to {output / 'model.pth'}")


def show_parameter_bytes(model, ctx):
    """One line from rank 0: the whole model's parameter bytes, and the bytes of the slices each rank holds."""
    mine = sum(p.to_local().numel() * p.element_size() for p in model.parameters())  # p is a DTensor
    full = sum(p.numel() * p.element_size() for p in model.parameters())  # a DTensor's numel() is the whole
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    per_rank = (", ".join(f"rank {r} {b:,}" for r, b in enumerate(everyone)) if ctx.world_size <= 8
                else f"{min(everyone):,} to {max(everyone):,} per rank")
    print0(ctx, f"Parameter bytes: {full:,} in the whole model; held: {per_rank}")


def _snapshot_failure(error):
    """The first line of the first rank's error inside torch.distributed.checkpoint's CheckpointException."""
    failures = getattr(error, "failures", None) or {}
    first = next(iter(failures.values()), (error, None))[0]
    sentence = re.split(r"(?<=\.)\s|;\s", str(first).strip())[0]  # torch's messages run on for several sentences
    return f"{type(first).__name__}: {sentence}" if sentence else type(first).__name__


def save_sharded_snapshot(model, optimizer, epochs_done, cfg, ctx):
    """With --snapshot DIR, every --save-every epochs and after the last: DIR/epoch-N, every rank writing its slices.

    The snapshot counts once rank 0 has written DIR/epoch-N/snapshot.pt (after all the slices); then the older
    epoch-* folders go. A run killed mid-save leaves the previous snapshot to resume from.
    """
    if not cfg.snapshot or (epochs_done % cfg.save_every and epochs_done != cfg.epochs):
        return
    folder = Path(cfg.snapshot) / f"epoch-{epochs_done}"
    # This rank's slices (DTensors) of the weights and of the optimizer's state, under the plain model's names.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:
        # Every rank writes its own file; rank 0 then writes .metadata, the map of which slice lies where.
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
    except CheckpointException as e:  # raised on every rank when any rank failed
        raise FatalError(f"cannot write the snapshot {folder} ({_snapshot_failure(e)}); free some space or pass "
                         f"another --snapshot") from None
    error = None
    if ctx.is_main:
        about = dict(format=SHARDED_FORMAT, epochs_done=epochs_done, world_size=ctx.world_size,
                     config={k: getattr(cfg, k) for k in TRAJECTORY_FLAGS})
        try:
            atomic_save(about, folder / "snapshot.pt")
            for old in Path(cfg.snapshot).glob("epoch-*"):
                if old != folder:
                    shutil.rmtree(old)
        except (FatalError, OSError) as e:
            error = e
    (written,) = all_reduce_sum([error is None], ctx)
    if error is not None:
        raise error if isinstance(error, FatalError) else FatalError(f"cannot remove an old snapshot: {error}")
    if written < ctx.world_size:
        raise FatalError(f"rank 0 could not finish the snapshot {folder} (see its error)")


def load_sharded_snapshot(model, optimizer, cfg, ctx):
    """With --snapshot DIR holding a finished epoch-N: load it into model and optimizer at any world size; else 0."""
    if not cfg.snapshot:
        return 0
    root = Path(cfg.snapshot)
    fix = "delete it to start afresh, or pass another --snapshot"
    if root.exists() and not root.is_dir():
        raise FatalError(f"--snapshot {root} is a file; fsdp.py's snapshots are folders (one file per rank, written "
                         f"by torch.distributed.checkpoint): pass a folder name, e.g. --snapshot runs/snap-fsdp")
    prepare_output(root, "--snapshot")  # fail now, not after the first epoch
    finished = sorted((p.parent for p in root.glob("epoch-*/snapshot.pt")), key=_epoch_number)
    if not finished:
        return 0
    folder = finished[-1]
    try:
        about = torch.load(folder / "snapshot.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # cut off, not a torch file, a pickle weights_only refuses
        raise FatalError(f"snapshot {folder} cannot be read ({type(e).__name__} in snapshot.pt): {fix}") from None
    if not isinstance(about, dict) or about.get("format") != SHARDED_FORMAT:
        raise FatalError(f"{folder} is not a sharded snapshot of this tutorial; {fix}")
    epochs_done = about["epochs_done"]
    check_resumable(about["config"], epochs_done, cfg, folder, fix)  # the same flags, not ahead of --epochs
    # Ask for this rank's slices at this world size; dcp.load reads from every saved file the pieces they need,
    # however many ranks wrote them. set_state_dict then puts them into the model and the optimizer.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, checkpoint_id=folder)
    except CheckpointException as e:
        raise FatalError(f"snapshot {folder} cannot be read ({_snapshot_failure(e)}): {fix}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    left = f"continuing with epoch {epochs_done + 1}" if epochs_done < cfg.epochs else "nothing left to train"
    print0(ctx, f"Resuming from {folder} (saved by {about['world_size']} ranks, loaded by {ctx.world_size}): "
                f"{epochs_done} of {cfg.epochs} epochs done, {left}")
    return epochs_done


def _epoch_number(folder):
    """N of an epoch-N folder (-1 for a name that has no number)."""
    number = folder.name.removeprefix("epoch-")
    return int(number) if number.isdigit() else -1


@record  # under torchrun: this worker's error and traceback go into torchrun's failure summary
def main():
    cfg = parse_config(description=__doc__)
    if cfg.precision == "fp16":  # a GradScaler would see only this rank's slices of the gradients
        raise UsageError("fsdp.py trains in --precision fp32 or bf16; fp16 needs a scaler that checks every rank's "
                         "gradient slices for overflow, which this chapter does not have: use --precision bf16")
    if not {"RANK", "LOCAL_RANK", "WORLD_SIZE"} <= os.environ.keys():
        raise UsageError("RANK/LOCAL_RANK/WORLD_SIZE are not set: start this script with torchrun, e.g. "
                         "`torchrun --standalone --nproc-per-node 2 fsdp.py`")
    # torchrun --max-restarts starts a new group after a failure. Sharing torchrun's own key-value store (its
    # default) the new workers would meet among the dead ones' keys and could dial their addresses (on torch 2.14
    # the store keeps every attempt's keys), and on several nodes they need not agree which attempt they are in.
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes rank 0 open a fresh store for every attempt instead.
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise UsageError("torchrun --max-restarts needs a fresh store per restart: run it as "
                         "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ...` with a c10d rendezvous (--standalone, "
                         "or --rdzv-backend c10d --rdzv-endpoint HOST:PORT), not --master-addr/--node-rank")
    rank = int(os.environ["RANK"])  # global: 0 .. world_size - 1 over all machines; rank 0 prints and saves
    local_rank = int(os.environ["LOCAL_RANK"])  # this process's index on its machine: it picks the GPU
    world_size = int(os.environ["WORLD_SIZE"])  # processes over all machines
    check_global_batch(cfg.batch_size, world_size, cfg.accum_steps)
    if cfg.test_samples is not None and cfg.test_samples < world_size:  # a rank with no test image would skip forward()
        raise UsageError(f"--test-samples {cfg.test_samples} is fewer than the {world_size} ranks: under FSDP every rank "
                         f"must run every test batch (forward() gathers the weights); use at least {world_size}")
    device = rank_device(cfg.device, local_rank, int(os.environ["LOCAL_WORLD_SIZE"]))  # cuda:<local_rank>, or the CPU
    if device.type == "cpu" and not hasattr(torch.cpu.Stream, "record_event"):  # FSDP2 times its gathers with it
        raise UsageError(f"fsdp.py on the CPU needs a torch whose FSDP2 runs on CPU streams (torch.cpu.Stream."
                         f"record_event; 2.14.1 has it, 2.6.0 does not); this is torch {torch.__version__}: upgrade "
                         f"torch, or run fsdp.py on GPUs")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init_process_group: NCCL binds this process to its own GPU
    ctx = DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    # env:// reads MASTER_ADDR and MASTER_PORT, which torchrun also set. A peer that does not come within --timeout
    # (here, and in every collective later) is an error, never a hang.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=cfg.timeout),
                            device_id=device if device.type == "cuda" else None)  # NCCL connects here, not later
    try:
        train(cfg, ctx)
    finally:
        dist.destroy_process_group()  # leave, after an error too: the others stop at once (gloo) or at --timeout (NCCL)


if __name__ == "__main__":
    run_main(main)
