"""See a few steps: what each rank computed, sent and waited for, and when, measured by torch's profiler on every rank.

    python measure/timeline.py ddp_launch.py                          # DDP, 2 ranks on this machine (loopback)
    python measure/timeline.py ddp_launch.py --link 100mbit           # one rank on each of two machines (as root)
    python measure/timeline.py ddp_comm_hooks.py --comm-hook powersgd  # the chapter's own flags, as it takes them
    python measure/timeline.py pipeline.py --nproc 3 -- --schedule gpipe

It runs the chapter unchanged under torchrun for a few optimizer steps (the chapter gains no profiling line: this
script's worker wraps it), records every rank with torch's profiler on every thread (gloo runs its collectives on
threads of its own), and chapter 1 alone as the baseline (with the chapter's flags that every chapter takes: the same
global batch, data folder, precision), and writes into --out:
    rank<N>.json   each rank's own trace (Chrome's trace format), on its own clock
    trace.json     every rank in one trace on rank 0's clock, a process row per rank; Perfetto (ui.perfetto.dev) and
                   chrome://tracing open it
    step.png       the median recorded step drawn: a row per rank and one for chapter 1, compute above (waiting on the
                   wire hatched), each collective below with its bytes, each rank's compute, waiting and idle shares
One clock: each rank's clock offset from rank 0's is measured inside the recording (rank 0 bounces a tensor off each
rank 20 times; the fastest round gives the offset, and half its round trip bounds the error), so ranks on different
machines line up too. A collective's bar ends when the rank went on with its result (its thread stopped waiting), or,
if nothing waited for it, when the backend closed it: gloo's worker thread closes its range only after it has woken
the waiting thread, and on a CPU with more busy threads than cores that can come milliseconds later (drawn paler).
"""
import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for measure/ and common/

from common.cli import FIELDS, Config, UsageError, parse_config, run_main  # noqa: E402
from measure import harness  # noqa: E402
from measure.harness import DTYPE_BYTES, PROFILER_DTYPES  # noqa: E402

TORCHRUN_CHAPTERS = ("ddp_launch.py", "ddp_by_hand.py", "ddp_comm_hooks.py", "fsdp.py", "tensor_parallel.py", "pipeline.py", "diloco.py")
BASELINE = "single_gpu.py"
COMPUTE = ("forward", "backward", "optimizer")
MARK = "timeline:"  # this script's own profiler ranges: timeline:start, timeline:step, timeline:forward
CHUNK = re.compile(re.escape(MARK) + r"([FB])(\d+)$")  # and a pipeline stage's micro-batches: timeline:F2, timeline:B2
CLOCK = re.compile(re.escape(MARK) + r"clock (\d+) (\d+) (send|got|back)$")  # the bounced tensor's marks
ROUNDS = 20  # bounces per rank: the fastest one's round trip bounds the clock offset's error
WAIT_MS = 0.2  # a gap this long in a rank's main thread while a collective is in flight is waiting on it
# The legend's order, the same in every picture (a kind absent from one is left out of its legend)
COLOURS = {"forward": "#4C72B0", "backward": "#55A868", "optimizer": "#8172B2", "all_reduce": "#C44E52",
           "all_gather": "#DD8452", "reduce_scatter": "#CCB974", "broadcast": "#937860", "send": "#64B5CD",
           "recv": "#8C8C8C"}


# --- Inside each rank: the chapter, run unchanged, profiled from step WARMUP to WARMUP + steps ---

def clock_marks():
    """Rank 0 bounces a tensor off each other rank ROUNDS times and marks, on the profiler's clock, when it left and
    came back; the other rank marks when it arrived. merge() reads each rank's clock offset from them."""
    import torch
    import torch.distributed as dist
    from torch.profiler import record_function

    group, rank, t = CLOCK_GROUP[0], dist.get_rank(), torch.zeros(1)  # gloo: CPU tensors on any backend
    for peer in range(1, dist.get_world_size()):
        for i in range(ROUNDS):
            if rank == 0:
                with record_function(f"{MARK}clock {peer} {i} send"):
                    pass
                dist.send(t, peer, group=group)
                dist.recv(t, peer, group=group)
                with record_function(f"{MARK}clock {peer} {i} back"):
                    pass
            elif rank == peer:
                dist.recv(t, 0, group=group)
                with record_function(f"{MARK}clock {peer} {i} got"):
                    pass
                dist.send(t, 0, group=group)


CLOCK_GROUP = [None]
def worker(known, args):
    """Run the chapter with args in this process; write out/rank<RANK>.json, the profiler's trace of the chosen steps."""
    import torch
    import torch.distributed as dist
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.profiler import record_function

    chapter, warmup, steps = known.worker, known.warmup, known.steps
    profiler = harness.profiler(cuda=torch.cuda.is_available())
    depth, forward = [0], [None]

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

    # Chapter 10: each micro-batch's forward (F2) and backward (B2) on this stage, as a timed range, on the class
    # before the chapter makes its stage. pipeline.py's timetable wraps the same two methods on its stage, for the
    # order of its first step alone (no clock); tests/test_timeline.py checks that the two agree.
    def chunk(kind, method):
        def run(stage, index, *args, **kwargs):
            with record_function(f"{MARK}{kind}{index}"):
                return method(stage, index, *args, **kwargs)
        return run

    PipelineStage.forward_one_chunk = chunk("F", PipelineStage.forward_one_chunk)
    PipelineStage.backward_one_chunk = chunk("B", PipelineStage.backward_one_chunk)

    def after_step(n, optimizer):
        if n == warmup:
            if dist.is_initialized():
                CLOCK_GROUP[0] = dist.new_group(backend="gloo")  # made before the recording starts
            profiler.start()
            if dist.is_initialized():
                clock_marks()
                dist.barrier()
            with record_function(MARK + "start"):
                pass
        elif warmup < n <= warmup + steps:
            with record_function(MARK + "step"):  # each measured step's end, on the profiler's clock
                pass
            if n == warmup + steps:
                profiler.stop()

    done = harness.after_steps(after_step)

    def write(code):
        code = code or harness.too_few_steps(chapter, done[0], warmup + steps)
        if code == 0:
            profiler.export_chrome_trace(str(Path(known.out) / f"rank{harness.rank()}.json"))
        return code

    harness.run_chapter(chapter, args, write)


# --- The driver: start the ranks, put their traces on one clock, find the steps, draw the median one ---

def clock_offsets(traces):
    """Per rank, (its clock minus rank 0's, the error's bound) in µs, from the fastest of the bounced tensor's rounds:
    it arrived at the rank's `got` halfway through rank 0's round trip, to within half that round trip."""
    marks = [{m.groups(): e["ts"] for e in events if (m := CLOCK.match(e.get("name", "")))} for events in traces]
    offsets = [(0.0, 0.0)]
    for peer in range(1, len(traces)):
        rounds = []
        for i in map(str, range(ROUNDS)):
            sent, back = marks[0][str(peer), i, "send"], marks[0][str(peer), i, "back"]
            rounds.append((back - sent, marks[peer][str(peer), i, "got"] - (sent + back) / 2))
        trip, offset = min(rounds)
        offsets.append((offset, trip / 2))
    return offsets


def merge(out, ranks):
    """Every rank's trace in one, pid = rank, on rank 0's clock: 0 is where rank 0's recording starts."""
    traces = [json.loads((out / f"rank{rank}.json").read_text())["traceEvents"] for rank in range(ranks)]
    offsets = clock_offsets(traces)
    zero = min(e["ts"] for e in traces[0] if e.get("name") == MARK + "start")
    merged = []
    for rank, events in enumerate(traces):
        for e in events:
            if "ts" in e:
                e = dict(e, ts=e["ts"] - offsets[rank][0] - zero)
            merged.append(dict(e, pid=rank) if "pid" in e else e)
        merged.append(dict(ph="M", name="process_name", pid=rank, args=dict(name=f"rank {rank}")))
        merged.append(dict(ph="M", name="process_sort_index", pid=rank, args=dict(sort_index=rank)))
    (out / "trace.json").write_text(json.dumps(dict(traceEvents=merged)))
    return merged, offsets


def collective_bytes(event):
    """The bytes of a collective's input, from the profiler's recorded shapes and dtypes."""
    args = event.get("args", {})
    dims, types = args.get("Input Dims") or [[]], args.get("Input type") or ["float"]
    return math.prod(dims[0] or [0]) * DTYPE_BYTES[PROFILER_DTYPES.get(types[0], "Float")]


def size_text(n):
    """Bytes as a label: 40 B, 2.0 KiB, 1,568 KiB."""
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 10 * 1024 else f"{n / 1024:,.0f} KiB"


def windows(merged, rank):
    """The rank's recorded steps as (start, end) in µs: from the start mark to each step's end, which is the end of
    the optimizer's step that holds the step's mark (made in its post-hook), else the mark."""
    mine = [e for e in merged if e.get("pid") == rank and e.get("ph") == "X"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in mine if e["name"].startswith("Optimizer.step#")]
    marks = sorted(e["ts"] if e["name"] == MARK + "start" else max([t for s, t in steps if s <= e["ts"] <= t],
                                                                    default=e["ts"])
                   for e in mine if e["name"] in (MARK + "start", MARK + "step"))
    return list(zip(marks, marks[1:]))


def is_collective(e):
    """A collective's own range: gloo's or NCCL's CPU-side op, not the copy CUDA traces hold of it on the GPU's row."""
    return e["name"].startswith(("gloo:", "nccl:")) and e.get("cat") != "gpu_user_annotation"


LAUNCHES = ("cuda_runtime", "cuda_driver")  # cudaLaunchKernel, and cuLaunchKernel (cuBLASLt's GEMMs on an H100)


def gpu_kernels(mine, e):
    """The GPU kernels the CPU-side event e launched (a CUDA runtime or driver launch inside it, the kernel by its
    correlation)."""
    launched = {x["args"].get("correlation") for x in mine if x.get("cat") in LAUNCHES
                and e["ts"] <= x["ts"] <= e["ts"] + e.get("dur", 0)}
    return [x for x in mine if x.get("cat") == "kernel" and x["args"].get("correlation") in launched]


def leaf_gaps(main, a, b):
    """The gaps in [a, b] between the main thread's innermost ops, its explicit waits and a send's or receive's
    range (gloo's on the thread that waits for it) counting as gaps: (start, end)."""
    ops = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in main if not e["name"].startswith(MARK)
                 and "wait" not in e["name"].lower() and not is_collective(e))
    leaves = [(s, t) for i, (s, t) in enumerate(ops) if not any(s <= s2 and t2 <= t and (s2, t2) != (s, t)
                                                                for s2, t2 in ops[i + 1:i + 40])]
    gaps, reach = [], a
    for s, t in leaves:
        if s > reach:
            gaps.append((reach, min(s, b)))
        reach = max(reach, t)
        if reach >= b:
            break
    if reach < b:
        gaps.append((reach, b))
    return [(s, t) for s, t in gaps if t > s]


def step_events(merged, rank, window):
    """One rank's step on the common clock (µs): compute [kind, start, end, label], wire [kind, start, end, label,
    drawn end, bytes, on a thread of the backend's own, started in an optimizer step], and its main thread's gaps."""
    a, b = window
    mine = [e for e in merged if e.get("pid") == rank and e.get("ph") == "X"]
    inside = sorted((e for e in mine if a <= e["ts"] < b), key=lambda e: e["ts"])
    main_tid = next(e["tid"] for e in mine if e["name"] == MARK + "start")
    chunked = any(CHUNK.match(e["name"]) for e in inside)  # a pipeline stage
    kernels = [e for e in inside if e.get("cat") == "kernel"]
    found, wire = [], []
    for e in inside:
        name, t0, t1 = e["name"], e["ts"], e["ts"] + e.get("dur", 0)
        chunk = CHUNK.match(name)
        if chunk:  # a pipeline stage's micro-batch: F2, B2
            found.append(["forward" if chunk[1] == "F" else "backward", t0, t1, chunk[1] + chunk[2]])
        elif chunked and not (is_collective(e) or name.startswith("Optimizer.step#")):
            continue  # the stage's work is its micro-batches'
        elif name == MARK + "forward" or name.endswith(".forward") and "DistributedDataParallel" in name:
            found.append(["forward", t0, t1, ""])
        elif name.startswith("autograd::engine::evaluate_function"):
            found.append(["backward", t0, t1, ""])
        elif name.startswith("Optimizer.step#"):
            found.append(["optimizer", t0, t1, ""])
        elif is_collective(e):
            on_gpu = gpu_kernels(mine, e) if kernels else []
            if on_gpu:  # NCCL: the wire is the kernel's time on the GPU, not its launch on the CPU
                t0, t1 = min(k["ts"] for k in on_gpu), max(k["ts"] + k.get("dur", 0) for k in on_gpu)
            nbytes = collective_bytes(e)
            wire.append([name.split(":", 1)[1], t0, t1, size_text(nbytes), t1, nbytes, e["tid"] != main_tid])
    steps = [(t0, t1) for kind, t0, t1, label in found if kind == "optimizer"]
    launches = sorted(e["ts"] for e in inside if e["tid"] == main_tid and e["name"].startswith("c10d::"))
    for w in wire:  # launched by an optimizer step's hook (by hand's, DiLoCo's): it may be waited for steps later
        launch = max((t for t in launches if t <= w[1]), default=w[1])  # the backend's thread may start it later
        w.append(any(t0 <= launch <= t1 for t0, t1 in steps))
    if kernels:  # a GPU rank: its compute as the GPU ran it, each kernel in the phase that launched it
        phases = [(k, t0, t1) for k, t0, t1, label in found if not label]
        launch = {x["args"].get("correlation"): x["ts"] for x in mine if x.get("cat") in LAUNCHES}
        found = [f for f in found if f[3]]  # a pipeline's micro-batches stay as the CPU ran them
        for k in kernels:
            at = launch.get(k["args"].get("correlation"), k["ts"])
            kind = next((p for p, t0, t1 in phases if t0 <= at <= t1), None)
            if kind and not k["name"].startswith(("ncclDevKernel", "ncclKernel")):
                found.append([kind, k["ts"], k["ts"] + k.get("dur", 0), ""])
        return found, wire, []
    return found, wire, leaf_gaps([e for e in inside if e["tid"] == main_tid], a, b)


def waiting(wire, gaps, everyone_started):
    """The gaps in which the rank's main thread stood still while a collective was in flight: it waited on the wire.
    When one ends, the collective it waited for (the earliest started still open) was done, unless that is before
    every rank had started it (impossible): its drawn end moves there, where the backend's thread had not yet closed
    it. Not for one an optimizer step's hook started: it may be waited for steps later (DiLoCo), gaps between."""
    waits = []
    for s, t in gaps:
        flying = sorted((w for w in wire if w[1] < t and w[2] > s), key=lambda w: w[1])  # gloo may start it late
        if t - s < WAIT_MS * 1e3 or not flying:
            continue
        waits.append((s, t))
        late = next((w for w in flying if w[4] > t), None)  # collectives are waited for in the order they started
        if late and late[6] and not late[7] and t >= everyone_started[id(late)]:
            late[4] = t
    return waits


def stepped_with(found, wire, everyone_started):
    """backward() returns only when every gradient reduction it started is done (DDP's and FSDP2's last hook waits
    for them), so one started outside an optimizer step was done when the next one began: its drawn end goes no
    later. (One started inside a step, by its hooks, may run on: DiLoCo's outer all-reduce is waited steps later.)"""
    steps = sorted(t0 for kind, t0, t1, label in found if kind == "optimizer")
    for w in wire:
        step = next((t0 for t0 in steps if t0 > w[1]), None)
        if step and w[6] and not w[7] and step < w[4] and step >= everyone_started[id(w)]:
            w[4] = step


def step_spans(events, origin):
    """Spans (kind, start, end, label, drawn end) in ms from origin, for the picture and the numbers."""
    ms = lambda t: (t - origin) / 1e3
    found, wire = events
    return ([(k, ms(t0), ms(t1), label, ms(t1)) for k, t0, t1, label in found]
            + [(k, ms(t0), ms(t1), label, ms(used)) for k, t0, t1, label, used, *_ in wire])


def started_everywhere(steps):
    """For each collective of each rank (by id), the latest start of the same one (its kind's n-th) on any rank."""
    latest, count = {}, {}
    for found, wire, gaps in steps:
        seen = {}
        for w in sorted(wire, key=lambda w: w[1]):
            key = (w[0], seen.setdefault(w[0], 0))
            seen[w[0]] += 1
            latest[key] = max(latest.get(key, -math.inf), w[1])
            count[id(w)] = key
    return {i: latest[key] for i, key in count.items()}


def shares(spans, waits, start, end):
    """A rank's step [start, end] in parts: compute, waiting on the wire (exposed communication), idle (neither)."""
    compute = [(t0, t1) for kind, t0, t1, *_ in spans if kind in COMPUTE]
    if not waits:  # a GPU rank (or one that never waited): the wire's time with no compute of its own beside it
        wire = [(t0, used) for kind, t0, t1, label, used in spans if kind not in COMPUTE]
        waits = [(a, b) for a, b in wire if harness.union(compute, a, b) < b - a]  # partly exposed: counted below
        exposed = harness.union(compute + waits, start, end) - harness.union(compute, start, end)
    else:
        exposed = harness.union(waits, start, end)
    busy = harness.union(compute + waits, start, end)
    length = end - start
    return dict(compute=(busy - exposed) / length, wire=exposed / length, idle=1 - busy / length)


def pipeline_text(rows, lengths, stages):
    """A pipeline's idle time beside its schedule's bubble ((S-1)/(M+S-1) of a step, in theory), the rest being its
    sends' and receives' latency and uneven work; and the activations each stage holds at most: (lines, {rank: held})."""
    micro = max((int(label[1:]) + 1 for spans in rows.values() for kind, _, _, label, _ in spans if label[:1] == "F"),
                default=0)
    if not micro:
        return [], {}
    bubble = (stages - 1) / (micro + stages - 1)
    lines, held = [f"pipeline: {stages} stages x {micro} micro-batches; the schedule's bubble alone, in theory: "
                   f"{bubble:.0%} of a step idle on every stage"], {}
    for rank, spans in rows.items():
        chunks = sorted((t0, label) for kind, t0, t1, label, _ in spans if label[:1] in ("F", "B"))
        now = held[rank] = 0
        for _, label in chunks:  # a micro-batch's activations are held from its forward to its backward
            now += 1 if label[0] == "F" else -1
            held[rank] = max(held[rank], now)
        length = lengths[f"rank {rank}"]
        idle = 1 - harness.union([(t0, t1) for kind, t0, t1, label, _ in spans if label[:1] in ("F", "B")]) / length
        p2p = [used - t0 for kind, t0, t1, label, used in spans if kind in ("send", "recv")]
        sizes = " or ".join(sorted({label for kind, t0, t1, label, _ in spans if kind in ("send", "recv")}))
        lines.append(f"  stage {rank}: idle {idle:.0%} of its {length:.1f} ms: {bubble:.0%} the bubble, "
                     f"{idle - bubble:.0%} the rest: {len(p2p)} sends and receives of {sizes}, each "
                     f"{statistics.mean(p2p) if p2p else 0:.2f} ms from its start to its wait's end (the wire's "
                     f"latency and the wait for the other stage); activations held for up to {held[rank]} "
                     f"micro-batches")
    return lines, held


def draw(rows, waits, ends, numbers, path, title):
    """step.png: a row per rank (and chapter 1's), compute above with its waiting hatched, the wire below with bytes;
    False, with a note, without matplotlib."""
    plt = harness.pyplot(path)
    if plt is None:
        return False
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.15 * len(rows)))
    span = max([t1 for spans in rows.values() for _, _, t1, *_ in spans] + list(ends.values()))
    char = span * 0.0058  # about one label character's width at fontsize 7, in ms
    present = set()
    for i, name in enumerate(rows):
        y = len(rows) - 1 - i
        lanes, label_ends = [], {}  # the wire's sub-lanes (a collective that starts while another runs goes below)
        for kind, t0, t1, label, used in sorted(rows[name], key=lambda f: f[1]):
            present.add(kind)
            colour = COLOURS.get(kind, "#333333")
            if kind in COMPUTE:
                bottom, height, lane = y + 0.5, 0.4, None
            else:
                lane = next((j for j, end in enumerate(lanes) if end <= t0), len(lanes))
                lanes[lane:lane + 1] = [t1]
                bottom, height = y + 0.45 - 0.15 * (lane + 1), 0.13
            ax.broken_barh([(t0, max(used - t0, span / 2000))], (bottom, height), color=colour)
            if used < t1:  # after the rank went on with the result: the backend's thread still closing its range
                ax.broken_barh([(used, t1 - used)], (bottom, height), color=colour, alpha=0.3)
            if label and label_ends.get(lane, -math.inf) <= t0:  # a label that would run into the last is left out
                ax.text(t0, bottom + height / 2, label, fontsize=7, va="center", clip_on=True)
                label_ends[lane] = t0 + char * (len(label) + 1)
        for s, t in waits[name]:
            ax.broken_barh([(s, t - s)], (y + 0.5, 0.4), facecolor="none", edgecolor="#222222", hatch="////",
                           linewidth=0)
        ax.plot([ends[name]] * 2, [y + 0.02, y + 0.98], ls="--", lw=0.8, color="#222222")
    ax.set_yticks([len(rows) - 1 - i + 0.5 for i in range(len(rows))],
                  [f"{name}\n{numbers[name]}" for name in rows], fontsize=8)
    ax.set_xlabel("ms from the step's start (one clock for every rank)")
    ax.set_title(title, pad=34, fontsize=10)
    handles = [Patch(color=COLOURS[k], label=k) for k in COLOURS if k in present]
    handles += [Patch(facecolor="white", edgecolor="#222222", hatch="////", label="waiting on the wire"),
                Patch(color="#C44E52", alpha=0.3, label="after the rank went on"),
                Line2D([], [], ls="--", lw=0.8, color="#222222", label="the rank's step ends")]
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=8, ncol=6, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def record(args, out, ranks, worker_cmd):
    """Run the chapter's ranks under the profiler (on loopback or across the two machines): their traces in out."""
    if args.link:
        with harness.two_machines("reno") as net:
            harness.shape(net, args.link)
            harness.wait_for(harness.torchrun_on_two(net, worker_cmd), f"{args.chapter} at {args.link}")
        return
    printed = harness.run(harness.torchrun(ranks, worker_cmd), f"{args.chapter} under the profiler")
    (out / "chapter.log").write_text(printed)  # what the chapter printed (rank 0's lines)


def flags_chapter_1_takes(flags):
    """Of the chapter's flags, those every chapter takes (common/cli.py's Config: --batch-size, --data-dir, ...), with
    their values: chapter 1's row runs with them, on the same global batch and data. The chapter's own flags are left
    out, with their value (the word after one, unless it is a flag itself)."""
    switches = {f.name for f in fields(Config) if f.metadata["kind"] is bool}
    kept, i = [], 0
    while i < len(flags):
        name = flags[i][2:].split("=")[0].replace("-", "_") if flags[i].startswith("--") else None
        takes_value = bool(name) and "=" not in flags[i] and name not in switches and i + 1 < len(flags) \
            and not flags[i + 1].startswith("--")
        if name in FIELDS:
            kept += flags[i:i + 1 + takes_value]
        i += 1 + takes_value
    return kept


def drawn_steps(windows_of, window):
    """Which recorded steps are drawn: the median by length (first rank's start to last rank's end) for one, else
    the first `window`; their index and each rank's (start, end)."""
    steps = list(zip(*windows_of))
    if window > 1:
        return 0, [(mine[0][0], mine[window - 1][1]) for mine in windows_of]
    length = [max(b for a, b in w) - min(a for a, b in w) for w in steps]
    k = sorted(range(len(steps)), key=length.__getitem__)[(len(steps) - 1) // 2]
    return k, list(steps[k])


def main():
    if "--worker" in sys.argv:  # inside one rank
        return worker(*harness.worker_args(warmup=int, steps=int))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s CHAPTER [options] [the chapter's flags]")
    p.add_argument("chapter", help=f"one of {', '.join(TORCHRUN_CHAPTERS)}")
    p.add_argument("--nproc", type=int, default=2, help="ranks on this machine (default 2)")
    p.add_argument("--link", metavar="RATE", help="instead: one rank on each of two machines joined by a link of RATE "
                                                  "(10mbit, 100mbit, 1gbit, unlimited; needs root)")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps before the recording (default 3)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps recorded; the median one is drawn (default 5)")
    p.add_argument("--window", type=int, default=1, help="draw the first N recorded steps together instead (DiLoCo's "
                                                         "all-reduce runs under the steps after it)")
    p.add_argument("--no-baseline", action="store_true", help="leave out chapter 1's step (one process, same batch)")
    p.add_argument("--out", default="runs/timeline", help="folder for the traces and step.png (default runs/timeline)")
    p.add_argument("--png", help="where to draw the step (default OUT/step.png)")
    argv = sys.argv[1:]  # the chapter's own flags: after --, or any this script does not know
    own, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args, unknown = p.parse_known_args(own)
    args.flags = unknown + flags
    if args.chapter not in TORCHRUN_CHAPTERS:
        raise UsageError(f"{args.chapter}: the timeline runs the chapters torchrun starts ({', '.join(TORCHRUN_CHAPTERS)})")
    if not 1 <= args.window <= args.steps:
        raise UsageError(f"--window {args.window}: draw 1 to --steps ({args.steps}) steps")
    out = Path(args.out)
    (out / "baseline").mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("rank*.json"), *out.glob("baseline/rank*.json")]:
        old.unlink()
    steps, baseline_flags = args.warmup + args.steps, flags_chapter_1_takes(args.flags)
    common = ["--epochs", "1", "--log-every", "100000", "--test-samples", "1000", "--train-samples",
              str(steps * parse_config(baseline_flags).batch_size)]  # the global batch: the chapter's and chapter 1's
    command = lambda chapter, folder, flags: [
        *harness.worker_command(__file__, chapter, folder.resolve(), warmup=args.warmup, steps=args.steps), *common,
        "--output", str(folder / "run"), *flags]
    ranks = 2 if args.link else args.nproc
    record(args, out, ranks, command(args.chapter, out, args.flags))
    merged, offsets = merge(out, ranks)
    k, step = drawn_steps([windows(merged, rank) for rank in range(ranks)], args.window)
    origin = min(a for a, b in step)
    rows, waits, ends, numbers, lengths = {}, {}, {}, {}, {}
    steps = [step_events(merged, rank, step[rank]) for rank in range(ranks)]
    everyone_started = started_everywhere(steps)
    for rank, (found, wire, gaps) in enumerate(steps):
        name = f"rank {rank}"
        waits[name] = [((s - origin) / 1e3, (t - origin) / 1e3) for s, t in waiting(wire, gaps, everyone_started)]
        stepped_with(found, wire, everyone_started)
        rows[name] = step_spans((found, wire), origin)
        ends[name] = (step[rank][1] - origin) / 1e3
        lengths[name] = (step[rank][1] - step[rank][0]) / 1e3
    if not args.no_baseline:  # chapter 1 alone on the same global batch, its median step from its own start
        printed = harness.run(harness.torchrun(None, command(BASELINE, out / "baseline", baseline_flags)),
                              f"{BASELINE} under the profiler")
        (out / "baseline" / "chapter.log").write_text(printed)
        alone = json.loads((out / "baseline" / "rank0.json").read_text())["traceEvents"]
        alone = [dict(e, pid=0) for e in alone if "ts" in e]
        _, (window,) = drawn_steps([windows(alone, 0)], args.window)
        found, wire, gaps = step_events(alone, 0, window)
        rows["chapter 1"], waits["chapter 1"] = step_spans((found, wire), window[0]), []
        ends["chapter 1"] = lengths["chapter 1"] = (window[1] - window[0]) / 1e3
    print(f"clock: rank 0's; " + ", ".join(f"rank {r} {o / 1e3:+.3f} ms (± {e / 1e3:.3f})"
                                          for r, (o, e) in enumerate(offsets) if r) + " from it, measured")
    drawn = f"steps 1-{args.window} of {args.steps}" if args.window > 1 else f"step {k + 1} of {args.steps}, the median"
    print(f"{drawn} drawn" + ("" if args.window > 1 else " (by length)"))
    for name, spans in rows.items():  # the step in words: its collectives in order, its compute, its shares
        length = lengths[name]
        part = shares(spans, waits[name], ends[name] - length, ends[name])
        numbers[name] = " ".join(f"{key} {value:.0%}" for key, value in part.items())
        busy = {c: sum(t1 - t0 for kind, t0, t1, *_ in spans if kind == c) for c in COMPUTE}
        in_order = sorted(spans, key=lambda f: f[1])
        chunks = " ".join(label for kind, t0, t1, label, _ in in_order if kind in COMPUTE and label)  # a pipeline's
        wire = [f"{kind} {label}" for kind, t0, t1, label, _ in in_order if kind not in COMPUTE]
        print(f"{name}: {f'{chunks}; ' if chunks else ''}{', '.join(wire) or 'no collective'}; "
              + ", ".join(f"{c} {v:.1f} ms" for c, v in busy.items()) + f"; {length:.1f} ms: {numbers[name]}")
    lines, held = pipeline_text({r: rows[f"rank {r}"] for r in range(ranks)}, lengths, ranks)
    for line in lines:
        print(line)
    for rank, most in held.items():
        numbers[f"rank {rank}"] += f"\nactivations held: {most} micro-batches"
    (out / "step.json").write_text(json.dumps(dict(  # what the picture shows, as numbers
        step=k, offsets=offsets, rows={name: dict(spans=rows[name], waits=waits[name], end=ends[name],
                                                   length=lengths[name], numbers=numbers[name]) for name in rows})))
    png = Path(args.png or out / "step.png")
    png.parent.mkdir(parents=True, exist_ok=True)
    if draw(rows, waits, ends, numbers, png, f"{' '.join([args.chapter, *args.flags])}, {ranks} ranks"
            f"{f', {args.link}' if args.link else ', loopback'}: {drawn}"):
        print(f"Wrote {out / 'trace.json'} and {png}")
    else:
        print(f"Wrote {out / 'trace.json'} (no matplotlib: no step.png)")


if __name__ == "__main__":
    run_main(main)
