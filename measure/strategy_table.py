"""What each strategy holds and sends, measured: runs the chapters and writes the table of docs/strategies.md.

    python measure/strategy_table.py                      # every row (about 2.5 minutes on 2 CPU cores), printed
    python measure/strategy_table.py --write docs/strategies.md   # and put into that page between its table markers
    python measure/strategy_table.py --rows ddp,tp --ranks 2     # some rows

Each row runs its chapter unchanged under torchrun (chapter 1 alone) on the CPU with gloo, once: 8 optimizer steps of
the default 64-image batch, SGD with --momentum 0.9 so the optimizer holds a velocity per weight, the records read
after the 4th step and after the 8th. What came before the 4th step's end (start-up, the first loss line, the first
steps) cancels in their difference, and the test comes after the 8th; what is left, over 4 steps, is one optimizer
step's communication. The numbers come from torch's own records, read inside each rank:

- collectives: torch's flight recorder (TORCH_FR_BUFFER_SIZE), which logs every collective a process group runs,
  DDP's C++ all-reduces included, with its sizes, dtypes and group; read before the chapter's destroy_process_group
  (torch 2.14.1 records gloo's collectives; the table was made there). A collective is recorded as it starts, so
  each step's are in the record when its optimizer step ends.
  Bytes sent per rank are what a ring algorithm sends for each: 2(n-1)/n of the buffer for an all-reduce, (n-1)/n
  of the whole for an all-gather or a reduce-scatter (n: the ranks of its group). gloo's own algorithms may send more.
- point-to-point (the pipeline's activations and their gradients): gloo's flight recorder does not log sends, so
  every torch.distributed.P2POp made with isend is counted with its tensor's bytes.
- held bytes: an optimizer step hook (torch.optim.Optimizer.register_optimizer_step_post_hook) adds up what this
  rank holds after the 8th step: its parameters, their gradients, the optimizer's state (local slices of DTensors).

Each rank writes one JSON file; the table shows the largest rank's numbers (pipeline stages differ).
"""
import argparse
import json
import pickle
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for measure/ and common/

from common.cli import FatalError, run_main  # noqa: E402
from measure import harness  # noqa: E402
from measure.harness import kib, sent_by_ring  # noqa: E402

STEPS = (4, 8)  # the records are read after these optimizer steps; their difference is 4 steps
BATCH = 64
ROWS = {  # name: (chapter, extra flags, ranks it runs at, what it is, use it when)
    "single": ("single_gpu.py", [], (1,), "chapter 1, one process",
               "it fits on one device and one device is fast enough"),
    "ddp": ("ddp_launch.py", [], (2, 4), "DDP (chapters 3-6)",
            "the weights, gradients and optimizer state fit on every GPU: the most samples per second for the least "
            "code"),
    "fsdp": ("fsdp.py", [], (2, 4), "FSDP2 (chapter 7)",
             "they do not fit on one GPU: each rank holds 1/n of all three, for about 1.5x DDP's bytes (on NCCL) and "
             "a message per layer"),
    "tp": ("tensor_parallel.py", [], (2, 4), "tensor parallel (chapter 9)",
           "one layer's weights or products are too big for one GPU, and the GPUs share a fast link: the ranks talk "
           "inside every forward, and the bytes grow with the batch, not the weights"),
    "2d": ("tensor_parallel.py", ["--dp", "2"], (4,), "FSDP2 x tensor parallel (chapter 9, --dp 2)",
           "many nodes: tensor parallel between the GPUs of a node, FSDP2 between the nodes"),
    "pp": ("pipeline.py", [], (2, 3), "pipeline, GPipe, 4 micro-batches (chapter 10)",
           "the model is deep and the links are slow: only the activations at the cuts travel, but a stage waits "
           "while the pipeline fills and drains, less the more micro-batches"),
}
MARK = "<!-- strategy table: made by measure/strategy_table.py --write docs/strategies.md -->"


# --- Inside each rank: record, run the chapter, write what was recorded ---

def _local_bytes(t):
    """Bytes this rank holds of tensor t (a DTensor's local slice)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def worker(known, args):
    """Run the chapter with args in this process, recording its communication after each of STEPS and what it holds;
    write out/<rank>.json: {"records": one per step of STEPS}."""
    import torch
    import torch.distributed as dist

    records, sends = [], []

    def after_step(n, optimizer):
        if n not in STEPS:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        held = dict(params=sum(map(_local_bytes, params)),
                    grads=sum(_local_bytes(p.grad) for p in params if p.grad is not None),
                    optimizer=sum(_local_bytes(v) for state in optimizer.state.values() for v in state.values()
                                  if isinstance(v, torch.Tensor)))
        trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
        # Each group's size by its name (the record's pg_config is empty for gloo on torch 2.14.1)
        sizes = {name: pg.size() for pg, name in dist.distributed_c10d._world.pg_names.items()}
        collectives = [dict(kind=e["profiling_name"].split(":")[-1], ranks=sizes[e["process_group"][0]],
                            sizes=e["input_sizes"], out_sizes=e["output_sizes"], dtypes=e["input_dtypes"])
                       for e in trace.get("entries", [])]
        records.append(dict(held=held, collectives=collectives, sends=list(sends)))

    steps = harness.after_steps(after_step)

    class CountedP2POp(dist.P2POp):  # the pipeline builds one per send or receive
        def __init__(self, op, tensor, *rest, **kw):
            super().__init__(op, tensor, *rest, **kw)
            if op is dist.isend:
                sends.append(_local_bytes(tensor))

    dist.P2POp = CountedP2POp

    def write(code):
        Path(known.out, f"{harness.rank()}.json").write_text(json.dumps(dict(records=records)))
        return code or harness.too_few_steps(known.worker, steps[0], STEPS[-1])

    harness.run_chapter(known.worker, args, write)


# --- The driver: run each row, take the difference of its records, make the table ---

def run(chapter, extra, ranks, data_dir):
    """One run of chapter at ranks with the last of STEPS optimizer steps: every rank's records."""
    out = Path(tempfile.mkdtemp(prefix="strategy-"))
    args = ["--train-samples", str(STEPS[-1] * BATCH), "--test-samples", str(BATCH), "--batch-size", str(BATCH),
            "--epochs", "1", "--log-every", "1000", "--momentum", "0.9", "--device", "cpu", "--output", str(out / "run"),
            *(["--data-dir", data_dir] if data_dir else []), *extra]
    alone = ranks == 1 and chapter == "single_gpu.py"
    harness.run(harness.torchrun(None if alone else ranks, [*harness.worker_command(__file__, chapter, out), *args]),
                f"{chapter} at {ranks} rank(s)", harness.env(TORCH_FR_BUFFER_SIZE="100000", OMP_NUM_THREADS="1"))
    return [rank["records"] for rank in harness.records(out, ranks, f"{chapter} at {ranks} rank(s)")]


def per_step(ranks_records):
    """Per rank: (held bytes, {kind: collectives per step}, bytes sent per step) from its two records' difference."""
    steps = STEPS[1] - STEPS[0]
    rows = []
    for a, b in ranks_records:
        kinds = {}
        for c in b["collectives"]:
            kinds[c["kind"]] = kinds.get(c["kind"], 0) + 1
        for c in a["collectives"]:
            kinds[c["kind"]] = kinds.get(c["kind"], 0) - 1
        sent = (sum(map(sent_by_ring, b["collectives"])) + sum(b["sends"])
                - sum(map(sent_by_ring, a["collectives"])) - sum(a["sends"])) / steps
        sends = (len(b["sends"]) - len(a["sends"])) / steps
        kinds = {k: v / steps for k, v in kinds.items() if v}
        if sends:
            kinds["send (point-to-point)"] = sends
        rows.append((b["held"], kinds, sent))
    return rows


def measure(name, ranks, data_dir):
    """One row of the table: the largest rank's held bytes and bytes sent, the collectives per step."""
    chapter, extra, _, _, _ = ROWS[name]
    ranks_rows = per_step(run(chapter, extra, ranks, data_dir))
    held = max((r[0] for r in ranks_rows), key=lambda h: sum(h.values()))
    kinds = max((r[1] for r in ranks_rows), key=lambda k: sum(k.values()))
    sent = max(r[2] for r in ranks_rows)
    return dict(name=name, ranks=ranks, held=held, kinds=kinds, sent=sent)


def table(results):
    lines = ["| strategy | ranks | weights KiB | gradients KiB | optimizer KiB | collectives per step | sent per step KiB "
             "| use it when |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        _, _, _, what, when = ROWS[r["name"]]
        kinds = ", ".join(f"{v:g} {k}" for k, v in sorted(r["kinds"].items())) or "none"
        h = r["held"]
        lines.append(f"| {what} | {r['ranks']} | {kib(h['params'])} | {kib(h['grads'])} | {kib(h['optimizer'])} "
                     f"| {kinds} | {kib(r['sent'])} | {when} |")
    return "\n".join(lines)


def write_into(path, text):
    """Replace what lies between the two markers in path with text."""
    doc = Path(path).read_text()
    pattern = re.compile(re.escape(MARK) + r"\n(?:.*?\n)?" + re.escape(MARK), re.S)
    if not pattern.search(doc):
        raise FatalError(f"{path} has no pair of lines `{MARK}` to write the table between")
    Path(path).write_text(pattern.sub(lambda m: f"{MARK}\n{text}\n{MARK}", doc))


def main():
    if "--worker" in sys.argv:  # inside one rank of a run
        return worker(*harness.worker_args())
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help=f"rows to measure, of {','.join(ROWS)} (default all)")
    p.add_argument("--ranks", default=None, help="only these rank counts, e.g. 2 or 2,4 (default: each row's own)")
    p.add_argument("--data-dir", default=None, help="FashionMNIST folder (default: the chapters' own search)")
    p.add_argument("--write", metavar="FILE", help="also write the table into FILE between its markers")
    p.add_argument("--json", metavar="FILE", help="also write the measured numbers as JSON")
    args = p.parse_args()
    names = args.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        p.error(f"no row named {', '.join(unknown)}; the rows are {', '.join(ROWS)}")
    only = {int(n) for n in args.ranks.split(",")} if args.ranks else None
    results = []
    for name in names:
        for ranks in ROWS[name][2]:
            if only is None or ranks in only:
                results.append(measure(name, ranks, args.data_dir))
                print(f"measured {name} at {ranks} rank(s)", file=sys.stderr, flush=True)
    text = table(results)
    print(text)
    harness.write_json(args.json, results)
    if args.write:
        write_into(args.write, text)


if __name__ == "__main__":
    run_main(main)
