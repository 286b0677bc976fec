"""DDP's communication hooks (--comm-hook, the DDP chapters): torch's own, and PowerSGD's state kept in --snapshot."""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from common.errors import FatalError

# PowerSGD's start_powerSGD_iter: it all-reduces the whole gradient for its first steps, then compresses. torch
# needs at least 2 (DDP rebuilds its buckets after step 1, and the residuals it keeps are per bucket); a later start
# spares the first steps the compression, and on a slow link costs the whole gradient's bytes in each of them. For
# this model 2 trains as well as torch's default, 1,000: 64.8% and 64.9% after 5 epochs at rank 1, chapter 1 64.9%
# (scripts/scaling.py --accuracy, docs/scaling.md).
POWERSGD_START = 2
# With PowerSGD the chapters ask DDP for one bucket of up to 25 MiB (the whole 2.6 MB gradient) from the first step:
# PowerSGD keeps its residuals and factors per bucket index, and DDP's default buckets change after the first step
# (one becomes two here), so a run resumed from a --snapshot would meet, in its first step, residuals kept for other
# buckets. One bucket also keeps gloo from aborting: PowerSGD starts a bucket's second and third all-reduce from a
# callback, which gloo runs on its own thread, so with two buckets the ranks could start them in different orders.
ONE_BUCKET_MB = 25


@dataclass
class PowerSGD:
    """PowerSGD's state, and for each bucket the order of the parameters its residuals and factors are kept in."""

    state: object
    layouts: dict = field(default_factory=dict)


def register_comm_hook(model, cfg):
    """--comm-hook on a DDP model: torch's hook for what each bucket's all-reduce sends. bf16/fp16: the gradients
    cast to 16 bits, half the bytes. powersgd[:R[:START]]: each weight's gradient as two rank-R factors (784x512 at
    R=1: 1,296 numbers for 401,408), what they leave out added to the next step's (error feedback). Returns PowerSGD's
    state (for --snapshot), else None."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    name, *numbers = cfg.comm_hook.split(":")
    if name in ("bf16", "fp16"):
        model.register_comm_hook(None, getattr(default_hooks, f"{name}_compress_hook"))
    elif name == "powersgd":
        rank, start = [int(n) for n in numbers] + [1, POWERSGD_START][len(numbers):]  # powersgd[:RANK[:START]]
        hook = PowerSGD(powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=start))
        model.register_comm_hook(hook.state, in_the_buckets_order(powerSGD_hook.powerSGD_hook, model, hook.layouts))
        return hook
    return None


def in_the_buckets_order(hook, model, layouts):
    """PowerSGD's hook, its residuals and factors first put in the order of this step's bucket. A new DDP's first step
    holds the parameters in the model's order, later steps in the order their gradients came (the reverse), so the
    first step of a resumed run finds them kept in the other order."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    index = {id(p): i for i, p in enumerate(model.parameters())}

    def reorder(flat, old, new):  # old, new: [(parameter index, its length in flat)]
        pieces = dict(zip((i for i, _ in old), flat.split([n for _, n in old])))
        return torch.cat([pieces[i] for i, _ in new])

    def in_order(state, bucket):
        errors, factors = [], {}  # factors: Q's, grouped by shape as torch's hook lays them out
        for p, grad in zip(bucket.parameters(), bucket.gradients()):
            errors.append((index[id(p)], grad.numel()))
            n, m = grad.view(grad.shape[0], -1).shape
            r = min(n, m, state.matrix_approximation_rank)
            if _should_compress(n, m, r, state.min_compression_rate)[0]:
                factors.setdefault((n, m), []).append((index[id(p)], m * r))
        layout, b = (errors, [x for group in factors.values() for x in group]), bucket.index()
        if b in layouts and layouts[b] != layout:
            if b in state.error_dict:
                state.error_dict[b] = reorder(state.error_dict[b], layouts[b][0], layout[0])
            if b in state.q_memory_dict:  # P is computed from Q before it is read
                state.q_memory_dict[b] = reorder(state.q_memory_dict[b], layouts[b][1], layout[1])
        layouts[b] = layout
        return hook(state, bucket)

    return in_order


def all_gather_hook_state(hook, ctx):
    """An all_gather_object (every rank calls it) of each rank's PowerSGD state, for rank 0's snapshot: its step
    count, the factors every rank shares and the residuals each rank keeps of its own; None without PowerSGD."""
    if hook is None:
        return None
    state = hook.state
    kind, keys, pos, has_gauss, gauss = state.rng.get_state()  # numpy's (draws Q's first values), kept as a tensor
    cpu = lambda tensors: {bucket: t.cpu() for bucket, t in tensors.items()}  # noqa: E731
    mine = dict(iter=state.iter, error=cpu(state.error_dict), p=cpu(state.p_memory_dict), q=cpu(state.q_memory_dict),
                rng=[torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss], layouts=hook.layouts)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def load_hook_state(hook, saved, ctx, where):
    """This rank's part of a snapshot's PowerSGD state (all_gather_hook_state's) into hook; one line if the snapshot
    holds another number of ranks' residuals (they are per rank: no other world size can take them)."""
    if hook is None:
        return
    if saved is None or len(saved) != ctx.world_size:
        raise FatalError(f"snapshot {where} holds PowerSGD's residuals of {len(saved or [])} ranks, this run has "
                         f"{ctx.world_size}: each rank keeps its own, so resume with {len(saved or [])} ranks, or "
                         f"delete it to start afresh")
    mine, state = saved[ctx.rank], hook.state
    device = lambda tensors: {bucket: t.to(ctx.device) for bucket, t in tensors.items()}  # noqa: E731
    state.iter = mine["iter"]
    state.error_dict, state.p_memory_dict, state.q_memory_dict = (device(mine[k]) for k in ("error", "p", "q"))
    keys, pos, has_gauss, gauss = mine["rng"]  # the keys: a tensor where the load put it (a GPU's has no .numpy())
    state.rng.set_state(("MT19937", keys.cpu().numpy().astype("uint32"), pos, has_gauss, gauss))
    hook.layouts.update({b: ([tuple(x) for x in errors], [tuple(x) for x in factors])
                         for b, (errors, factors) in mine["layouts"].items()})
