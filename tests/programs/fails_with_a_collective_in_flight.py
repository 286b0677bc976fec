"""Started by tests under torchrun, 2 ranks: rank 1 queues an all-reduce that rank 0 never joins, then fails, as a
rank does whose error comes while DDP's all-reduce is in flight. Its teardown would wait for that all-reduce (NCCL,
since torch 2.6: until the watchdog ends the process; gloo: until the group's timeout), so it must say its line
before the teardown and leave without that wait. Rank 0 sleeps meanwhile; torchrun stops it once rank 1 has failed.

    torchrun --standalone --nproc-per-node 2 tests/programs/fails_with_a_collective_in_flight.py cpu|cuda TIMEOUT
"""
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common.cli import run_main  # noqa: E402
from common.ranks import destroy_process_group, name_rank_in_errors  # noqa: E402


def main():
    device_type, timeout = sys.argv[1], float(sys.argv[2])
    rank = int(os.environ["RANK"])
    name_rank_in_errors(rank, 2)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    try:
        dist.barrier()
        if rank == 1:
            dist.all_reduce(torch.ones(1000, device=device), async_op=True)  # queued; rank 0 never joins it
            raise RuntimeError("a failure with an all-reduce in flight")
        time.sleep(3 * timeout)
    finally:
        destroy_process_group()


run_main(main)
