"""What one step's trace holds (measure/timeline.py): each strategy's collectives at 2 ranks, and a rank's recorded
steps; tests/test_timeline.py checks the CPU's traces against them, tests/test_gpu.py a GPU's."""
# One step's collectives at 2 ranks, in bytes (each collective's input on one rank), as docs/scaling.md's pictures.
# DDP: its two buckets' all-reduces (the last layers' 267,786 floats, then the first layer's 401,920); by hand one
# per tensor (3 weights, 3 biases). Either way every gradient once: 2,678,824 bytes.
# PowerSGD (rank 1, compressing from step 3 on: the recorded steps are 4 and 5) the biases as they are, then P and Q,
# the second and third started from a callback on gloo's own thread: seen only when every thread is recorded.
# FSDP2: each Linear's half of its weights and bias gathered in the forward and again in the backward (200,960,
# 131,328 and 2,565 floats), and its whole gradient reduced: gloo has no reduce-scatter and runs FSDP2's as an
# all-reduce (README.md). Tensor parallel: one all-reduce of the row-wise layer's partial products, 64 x 512 floats,
# in the forward; the backward sends nothing (the column-wise layer's input is the images, which need no gradient).
LAYERS = [200_960 * 4, 131_328 * 4, 2_565 * 4]
COLLECTIVES = {
    "ddp_launch.py": dict(all_reduce=[267_786 * 4, 401_920 * 4]),
    "ddp_by_hand.py": dict(all_reduce=[784 * 512 * 4, 512 * 4, 512 * 512 * 4, 512 * 4, 512 * 10 * 4, 10 * 4]),
    "ddp_comm_hooks.py --comm-hook powersgd": dict(all_reduce=[1034 * 4, 1034 * 4, 1808 * 4]),
    "ddp_comm_hooks.py --comm-hook bf16": dict(all_reduce=[267_786 * 2, 401_920 * 2]),  # the hooks' half-size dtypes
    "ddp_comm_hooks.py --comm-hook fp16": dict(all_reduce=[267_786 * 2, 401_920 * 2]),
    "fsdp.py": dict(all_gather=LAYERS * 2, all_reduce=[401_920 * 4, 262_656 * 4, 5_130 * 4]),
    "tensor_parallel.py": dict(all_reduce=[64 * 512 * 4]),
}


def recorded_steps(events, rank):
    """The rank's complete events in each recorded step (from one mark to the next), each list in time order."""
    mine = [e for e in events if e.get("pid") == rank and e.get("ph") == "X"]
    marks = sorted(e["ts"] for e in mine if e["name"] in ("timeline:start", "timeline:step"))
    return [sorted((e for e in mine if a <= e["ts"] < b), key=lambda e: e["ts"]) for a, b in zip(marks, marks[1:])]
