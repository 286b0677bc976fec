"""See one step: what each rank computed and sent, and when, measured by torch's profiler on every rank.

    python scripts/timeline.py ddp_launch.py                          # DDP, 2 ranks on this machine (loopback)
    python scripts/timeline.py ddp_launch.py --link 100mbit           # one rank on each of two machines (as root)
    python scripts/timeline.py ddp_launch.py --comm-hook powersgd    # the chapter's own flags, as it takes them
    python scripts/timeline.py pipeline.py --nproc 3 -- --schedule gpipe

It runs the chapter unchanged under torchrun for a few optimizer steps (the chapter gains no profiling line: this
script's worker wraps it), records every rank with torch's profiler on every thread (gloo runs its collectives on
threads of its own), and writes into --out:
    rank<N>.json   each rank's own trace (Chrome's trace format)
    trace.json     every rank in one trace, a process row per rank, aligned at the barrier the ranks left together;
                   Perfetto (ui.perfetto.dev) and chrome://tracing open it
    step.png       one step drawn: a row per rank, forward, backward, optimizer and each collective in its colour,
                   the collective's bytes in its label (needs matplotlib)
"""
import argparse
import json
import math
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.cli import FatalError, UsageError, run_main  # noqa: E402
from scripts.scaling import PROFILER_DTYPES  # noqa: E402  (the profiler's dtype names as strategy_table's)
from scripts.strategy_table import DTYPE_BYTES  # noqa: E402

TORCHRUN_CHAPTERS = ("ddp_launch.py", "ddp_by_hand.py", "fsdp.py", "tensor_parallel.py", "pipeline.py")
COMPUTE = ("forward", "backward", "optimizer")
MARK = "timeline:"  # this script's own profiler ranges: timeline:start, timeline:step, timeline:forward
CHUNK = re.compile(re.escape(MARK) + r"([FB])(\d+)$")  # and a pipeline stage's micro-batches: timeline:F2, timeline:B2
COLOURS = {"forward": "#4C72B0", "backward": "#55A868", "optimizer": "#8172B2", "all_reduce": "#C44E52",
           "all_gather": "#DD8452", "reduce_scatter": "#CCB974", "send": "#64B5CD", "recv": "#8C8C8C",
           "broadcast": "#937860"}


# --- Inside each rank: the chapter, run unchanged, profiled from step WARMUP to WARMUP + steps ---

def worker(chapter, out, warmup, steps, args):
    """Run chapter with args in this process; write out/rank<RANK>.json, the profiler's trace of the chosen steps."""
    import torch
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, record_function

    import common.cli

    every_thread = {}
    try:  # torch 2.8 on: the collectives gloo runs on its own threads (before it, those go unseen)
        from torch._C._profiler import _ExperimentalConfig
        every_thread = dict(experimental_config=_ExperimentalConfig(profile_all_threads=True))
    except TypeError:
        pass
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(activities=activities, record_shapes=True, **every_thread)
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    done, depth, forward = [0], [0], [None]

    def enter(module, inputs):  # the outermost module's forward as one range: the model's forward
        if depth[0] == 0:
            forward[0] = record_function(MARK + "forward")
            forward[0].__enter__()
        depth[0] += 1

    def leave(module, inputs, output):
        depth[0] -= 1
        if depth[0] == 0 and forward[0] is not None:
            forward[0].__exit__(None, None, None)
            forward[0] = None

    register_module_forward_pre_hook(enter)
    register_module_forward_hook(leave)

    from torch.distributed.pipelining import PipelineStage

    def chunk(kind, method):  # chapter 10: each micro-batch's forward (F2) and backward (B2) on this stage, as a range
        def run(stage, index, *args, **kwargs):
            with record_function(f"{MARK}{kind}{index}"):
                return method(stage, index, *args, **kwargs)
        return run

    PipelineStage.forward_one_chunk = chunk("F", PipelineStage.forward_one_chunk)
    PipelineStage.backward_one_chunk = chunk("B", PipelineStage.backward_one_chunk)

    def after_step(optimizer, *_):
        done[0] += 1
        if done[0] == warmup:
            if dist.is_initialized():
                dist.barrier()  # the ranks leave it together: the merged trace aligns them here
            profiler.start()
            with record_function(MARK + "start"):
                pass
        elif warmup < done[0] <= warmup + steps:
            with record_function(MARK + "step"):  # each measured step's end, on the profiler's clock
                pass
            if done[0] == warmup + steps:
                profiler.stop()

    register_optimizer_step_post_hook(after_step)
    end = common.cli.end_process

    def write_then_end(code):
        if code == 0 and done[0] < warmup + steps:
            print(f"error: {chapter} made {done[0]} optimizer steps; the timeline needs {warmup + steps}: give it "
                  f"more --train-samples or a smaller --batch-size", file=sys.stderr)
            code = 1
        if code == 0:
            profiler.export_chrome_trace(str(Path(out) / f"rank{os.environ.get('RANK', '0')}.json"))
        end(code)

    common.cli.end_process = write_then_end
    sys.argv = [chapter, *args]
    runpy.run_path(str(REPO / chapter), run_name="__main__")


# --- The driver: start the ranks, merge their traces, draw a step ---

def merge(out, ranks):
    """Every rank's trace in one: pid = rank, its time shifted so that 0 is where the ranks left the barrier."""
    merged = []
    for rank in range(ranks):
        events = json.loads((out / f"rank{rank}.json").read_text())["traceEvents"]
        start = min(e["ts"] for e in events if e.get("name") == MARK + "start")
        for e in events:
            if "ts" in e:
                e = dict(e, ts=e["ts"] - start)
            merged.append(dict(e, pid=rank) if "pid" in e else e)
        merged.append(dict(ph="M", name="process_name", pid=rank, args=dict(name=f"rank {rank}")))
        merged.append(dict(ph="M", name="process_sort_index", pid=rank, args=dict(sort_index=rank)))
    (out / "trace.json").write_text(json.dumps(dict(traceEvents=merged)))
    return merged


def collective_bytes(event):
    """The bytes of a gloo collective's input, from the profiler's recorded shapes and dtypes."""
    args = event.get("args", {})
    dims, types = args.get("Input Dims") or [[]], args.get("Input type") or ["float"]
    return math.prod(dims[0] or [0]) * DTYPE_BYTES[PROFILER_DTYPES.get(types[0], "Float")]


def size_text(n):
    """Bytes as a label: 40 B, 2.0 KiB, 1,568 KiB."""
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 10 * 1024 else f"{n / 1024:,.0f} KiB"


def spans(merged, ranks):
    """Per rank, the first measured step's (kind, start, end, label) spans, in ms from the step's start."""
    rows = {}
    for rank in range(ranks):
        mine = [e for e in merged if e.get("pid") == rank and e.get("ph") == "X"]
        marks = sorted(e["ts"] for e in mine if e["name"] in (MARK + "start", MARK + "step"))
        a, b = marks[0], marks[1]  # the first measured step: from the start mark to the first step's end
        inside = [e for e in mine if a <= e["ts"] < b]
        chunked = any(CHUNK.match(e["name"]) for e in inside)  # a pipeline stage
        found = []
        for e in inside:
            name, t0, t1 = e["name"], (e["ts"] - a) / 1e3, (e["ts"] + e.get("dur", 0) - a) / 1e3
            chunk = CHUNK.match(name)
            if chunk:  # a pipeline stage's micro-batch: F2, B2
                found.append(("forward" if chunk[1] == "F" else "backward", t0, t1, chunk[1] + chunk[2]))
            elif chunked and not name.startswith(("gloo:", "nccl:", "Optimizer.step#")):
                continue  # the stage's work is its micro-batches'
            elif name == MARK + "forward" or name.endswith(".forward") and "DistributedDataParallel" in name:
                found.append(("forward", t0, t1, ""))
            elif name.startswith("autograd::engine::evaluate_function"):
                found.append(("backward", t0, t1, ""))
            elif name.startswith("Optimizer.step#"):
                found.append(("optimizer", t0, t1, ""))
            elif name.startswith("gloo:") or name.startswith("nccl:"):
                kind = name.split(":", 1)[1]
                found.append((kind, t0, t1, size_text(collective_bytes(e))))
        rows[rank] = found
    return rows


def draw(rows, path, title):
    """step.png: a row per rank, each span in its kind's colour, collectives labelled with their bytes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 1 + 1.1 * len(rows)))
    seen = set()
    for rank, found in rows.items():
        y = len(rows) - 1 - rank
        ends = []  # the wire's sub-lanes: a collective that starts while another runs goes below it
        for kind, t0, t1, label in sorted(found, key=lambda f: f[1]):
            if kind in COMPUTE:  # compute above, the wire below
                bottom, height = y + 0.5, 0.4
            else:
                lane = next((i for i, end in enumerate(ends) if end <= t0), len(ends))
                ends[lane:lane + 1] = [t1]
                bottom, height = y + 0.45 - 0.15 * (lane + 1), 0.13
            ax.broken_barh([(t0, max(t1 - t0, 0.02))], (bottom, height), color=COLOURS.get(kind, "#333333"),
                           label=None if kind in seen else kind)
            seen.add(kind)
            if label:
                ax.text(t0, bottom + height / 2, label, fontsize=7, va="center")
    ax.set_yticks([len(rows) - 1 - r + 0.5 for r in rows], [f"rank {r}" for r in rows])
    ax.set_xlabel("ms from the step's start")
    ax.set_title(title, pad=20)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=8, ncol=9, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    if "--worker" in sys.argv:
        p = argparse.ArgumentParser()
        p.add_argument("--worker")
        p.add_argument("--out")
        p.add_argument("--warmup", type=int)
        p.add_argument("--steps", type=int)
        known, rest = p.parse_known_args()
        return worker(known.worker, known.out, known.warmup, known.steps, rest[1:] if rest[:1] == ["--"] else rest)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s CHAPTER [options] [the chapter's flags]")
    p.add_argument("chapter", help=f"one of {', '.join(TORCHRUN_CHAPTERS)}")
    p.add_argument("--nproc", type=int, default=2, help="ranks on this machine (default 2)")
    p.add_argument("--link", metavar="RATE", help="instead: one rank on each of two machines joined by a link of RATE "
                                                  "(10mbit, 100mbit, 1gbit, unlimited; needs root)")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps before the recording (default 3)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps recorded (default 2)")
    p.add_argument("--out", default="runs/timeline", help="folder for the traces and step.png (default runs/timeline)")
    p.add_argument("--png", help="where to draw the step (default OUT/step.png)")
    argv = sys.argv[1:]  # the chapter's own flags: after --, or any this script does not know
    own, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args, unknown = p.parse_known_args(own)
    args.flags = unknown + flags
    if args.chapter not in TORCHRUN_CHAPTERS:
        raise UsageError(f"{args.chapter}: the timeline runs the chapters torchrun starts ({', '.join(TORCHRUN_CHAPTERS)})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    steps = args.warmup + args.steps
    flags = ["--epochs", "1", "--log-every", "100000", "--test-samples", "1000", "--train-samples",
             str(steps * 64), "--output", str(out / "run"), *args.flags]  # the chapter's defaults: batch 64
    worker_cmd = [str(Path(__file__).resolve()), "--worker", args.chapter, "--out", str(out.resolve()), "--warmup",
                  str(args.warmup), "--steps", str(args.steps), "--", *flags]
    ranks = 2 if args.link else args.nproc
    if args.link:
        from scripts import scaling
        with scaling.two_machines("reno") as net:
            scaling.shape(net, scaling.RATES[args.link] and args.link)
            procs = scaling.torchrun_on_two(net, worker_cmd)
            scaling.wait_for(procs, f"{args.chapter} at {args.link}")
    else:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(ranks), *worker_cmd], cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
        if proc.returncode != 0:
            raise FatalError(f"{args.chapter} under the profiler failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        (out / "chapter.log").write_text(proc.stdout)  # what the chapter printed (rank 0's lines)
    merged = merge(out, ranks)
    rows = spans(merged, ranks)
    for rank, found in rows.items():  # the step in words: its collectives in order, and its compute
        busy = {k: sum(t1 - t0 for kind, t0, t1, _ in found if kind == k) for k in COMPUTE}
        in_order = sorted(found, key=lambda f: f[1])
        chunks = " ".join(label for kind, t0, t1, label in in_order if kind in COMPUTE and label)  # a pipeline's
        wire = [f"{kind} {label}" for kind, t0, t1, label in in_order if kind not in COMPUTE]
        print(f"rank {rank}: {f'{chunks}; ' if chunks else ''}{', '.join(wire) or 'no collective'}; "
              + ", ".join(f"{k} {v:.1f} ms" for k, v in busy.items()))
    png = Path(args.png or out / "step.png")
    png.parent.mkdir(parents=True, exist_ok=True)
    try:
        draw(rows, png, f"{' '.join([args.chapter, *args.flags])}, {ranks} ranks"
             f"{f', {args.link}' if args.link else ', loopback'}: one step")
        print(f"Wrote {out / 'trace.json'} and {png}")
    except ImportError:
        print(f"Wrote {out / 'trace.json'} (no matplotlib: no step.png)")


if __name__ == "__main__":
    run_main(main)
