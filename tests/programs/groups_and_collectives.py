"""Started by tests under torchrun in place of a chapter: the chapter runs unchanged (measure/harness.run_chapter),
with every all-reduce it calls written down (the group it ran in, its dtype and size) and, at its teardown, every
process group it made (the group's ranks and the timeout torch holds for it). Each rank writes OUT/rank_N.json.

    torchrun --standalone --nproc-per-node 2 tests/programs/groups_and_collectives.py OUT diloco.py FLAGS...
"""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch.distributed as dist  # noqa: E402

import common.ranks  # noqa: E402
from measure import harness  # noqa: E402

out, chapter, flags = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
calls, groups = [], []


def group_name(group):
    """The name torch gave the group (the default group's is "0")."""
    return (group or dist.group.WORLD).group_name


all_reduce = dist.all_reduce


def recorded_all_reduce(tensor, *args, **kwargs):
    group = kwargs.get("group", args[1] if len(args) > 1 else None)
    calls.append(dict(group=group_name(group), dtype=str(tensor.dtype).split(".")[1], numel=tensor.numel()))
    return all_reduce(tensor, *args, **kwargs)


dist.all_reduce = recorded_all_reduce
destroy = common.ranks.destroy_process_group


def recorded_destroy(*args, **kwargs):
    """Every group alive now, as torch holds it, then the chapter's own teardown."""
    for pg in dist.distributed_c10d._world.pg_map:
        for device in pg._device_types:
            groups.append(dict(name=pg.group_name, ranks=dist.get_process_group_ranks(pg), device=str(device),
                               timeout=pg._get_backend(device).options._timeout.total_seconds()))
    return destroy(*args, **kwargs)


common.ranks.destroy_process_group = recorded_destroy


def write(code):
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank_{harness.rank()}.json").write_text(json.dumps(dict(all_reduces=calls, groups=groups)))
    return code


harness.run_chapter(chapter, flags, write)
