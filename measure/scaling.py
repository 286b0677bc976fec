"""Why is DDP slower than one process? Two machines on a link of a known rate, each step split into compute and
communication, and the communication against the least time the link allows.

    python measure/scaling.py                                   # the sweep (about 4 minutes on 2 CPU cores)
    python measure/scaling.py --whole                           # whole 5-epoch runs, 3 of each, with accuracy (15 min)
    python measure/scaling.py --json runs/scaling.json --png docs/scaling.png
    python measure/scaling.py --rows ddp --rates 10mbit,100mbit # some of it
    python measure/scaling.py --from-json runs/scaling.json --png docs/scaling.png   # the table and chart again
    python measure/scaling.py --rows ddp,fsdp --rates 10mbit --congestion-control bbr   # another TCP
    python measure/scaling.py --order                           # why gloo's all-gather misses the floor (15 s)

Needs root and iproute2: the two machines are network namespaces joined by a veth pair (measure/netns.py), one
rank on each, and `tc qdisc ... tbf` on both ends limits each direction of the link to the rate. tbf shapes the
rate only: netem, which adds delay, is not in every kernel (not in this project's), so the link is slow, not far.
Both machines run TCP reno unless --congestion-control names another: every kernel lets a namespace pick reno, and
on this link, which loses no packets, it measured as cubic (Linux's usual default) did. BBR, this machine's own
default, came to 1.07-1.35x the floor for DDP where reno and cubic came to 1.06x (docs/scaling.md).

Each run is a chapter unchanged, under torchrun on both machines (nodea hosts the rendezvous), on the CPU with gloo
and one thread per rank, for WARMUP optimizer steps and then STEPS measured ones. Inside every rank:
- step: the time of the measured steps (an optimizer step hook marks them), per step;
- communication: the time gloo's threads spent in collectives, from torch's profiler (its gloo:* events, each
  timed on the thread that ran it), the union of those intervals, per step;
- bytes: the sizes of the same events (record_shapes), counted as a ring algorithm sends them (2(n-1)/n of an
  all-reduce, measure/harness.py's sent_by_ring), per rank and step. gloo runs FSDP2's reduce-scatter as an
  all-reduce of the whole tensor, so its bytes are an all-reduce's.
Then, per run:
- compute: the step time of the same chapter at world size 1 with the same per-rank batch (a run on its own);
- exposed: step - compute, the time the step waited for the network; hidden: communication - exposed, what ran
  while the rank computed (DDP launches a bucket's all-reduce as soon as its gradients are ready);
- floor: the ring's bytes over the link's rate: no all-reduce can take less; measured communication / floor says
  how close gloo comes to the link's limit.

Each run's communication against the floor, the goal at most FLOOR_GOAL at 10 and 100 Mbit/s, is printed under the
table; a run with collectives of several kinds (FSDP2) also gets each kind against its own floor. --order shows why
gloo's all-gather misses it: gloo sends nothing until the peer has said it is ready to receive, and that message
travels behind whatever the peer has already sent.

--whole runs each chapter unchanged instead, for WHOLE_EPOCHS epochs on the full data, and reads its metrics.jsonl:
the epochs' training time (from each epoch's first step to its last, so PowerSGD's full-size first steps count), the
final test accuracy of the same run, and the wall time around it; chapter 1 and each row --repeats times, the mean
with min-max, each row's speed against chapter 1's mean. Chapter 12's DiLoCo rows (ft_*) start torchft's lighthouse
on nodea and a replica group on each machine, and read group 0's metrics.

Why the profiler, not DDP's own timing (DDP._get_ddp_logging_data()): it times FSDP2's collectives too, so every
row is measured the same way; it sees DDP's two buckets run at once on gloo's two threads (their union, not their
sum, is the time on the link); and DDP's averages start at the first iteration, warm-up included, and skip the
no_sync micro-batches of --accum-steps.
"""
import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean, median
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for measure/ and common/

from common.cli import FatalError, run_main  # noqa: E402
from common.ranks import destroy_process_group  # noqa: E402
from measure import harness  # noqa: E402
from measure.harness import NODES, PORT, PROFILER_DTYPES, RATES, kib, sent_by_ring, write_json  # noqa: E402
from measure.netns import tc_bits  # noqa: E402
from measure.restart_or_heal import LIGHTHOUSE_PORT, start_lighthouse  # noqa: E402

WARMUP = 3  # optimizer steps before the measurement (allocations, the buckets' first all-reduces)
STEPS = {None: 10, "unlimited": 10, "1gbit": 10, "100mbit": 5, "10mbit": 5}  # measured, per link (None: alone)
SHORT_STEPS = 20  # measured at every link for a row whose steps send little (PowerSGD's): their times vary more
BATCH = 1024  # global batch: 512 images per rank, enough compute per step to hide some communication behind


class Row(NamedTuple):
    chapter: str
    flags: list
    rates: tuple  # the links it runs on (besides world size 1)
    what: str  # its name in the table
    short: str  # its label in the chart
    batch: int = BATCH  # global
    bucket_cap_mb: float = None  # DDP's, where not its default


ROWS = {
    "single": Row("single_gpu.py", [], (), "chapter 1, one process", "chapter 1"),
    "ddp": Row("ddp_launch.py", [], tuple(RATES), "DDP (chapter 3)", "DDP"),
    "accum": Row("ddp_launch.py", ["--accum-steps", "4"], tuple(RATES), "DDP, --accum-steps 4, 4x the batch",
                 "DDP\naccum 4", batch=4 * BATCH),
    "bucket25": Row("ddp_launch.py", [], ("1gbit", "100mbit"), "DDP, one bucket (bucket_cap_mb=25)", "DDP\n1 bucket",
                    bucket_cap_mb=25),
    "fsdp": Row("fsdp.py", [], tuple(RATES), "FSDP2 (chapter 7)", "FSDP2"),
    # The remedies for a slow link: torch's communication hooks (chapter 11b's --comm-hook), alone and with
    # accumulation.
    "bf16": Row("ddp_comm_hooks.py", ["--comm-hook", "bf16"], tuple(RATES), "DDP, --comm-hook bf16", "DDP\nbf16"),
    "powersgd": Row("ddp_comm_hooks.py", ["--comm-hook", "powersgd"], tuple(RATES), "DDP, --comm-hook powersgd (rank 1)",
                    "DDP\nPowerSGD 1"),
    "powersgd4": Row("ddp_comm_hooks.py", ["--comm-hook", "powersgd:4"], tuple(RATES), "DDP, --comm-hook powersgd:4",
                     "DDP\nPowerSGD 4"),
    "accum_powersgd": Row("ddp_comm_hooks.py", ["--accum-steps", "4", "--comm-hook", "powersgd"], ("10mbit",),
                          "DDP, --accum-steps 4, 4x the batch, --comm-hook powersgd", "DDP accum 4\nPowerSGD 1",
                          batch=4 * BATCH),
}
FLOOR_GOAL = 1.25  # measured communication / floor, at 10 and 100 Mbit/s
REMEDIES = ("ddp", "accum", "bf16", "powersgd", "powersgd4", "accum_powersgd")
SPEED_GOAL = {"100mbit": 1.3, "10mbit": 0.75}  # two ranks with a remedy against chapter 1's images/s
# --whole: whole runs as a user times them. The quickstart's 5 epochs on the full data at the sweep's global batch,
# with the learning rate scaled as the batch (x16 of the quickstart's 64 and 1e-3): at 1e-3, batch 1,024 reaches
# 20.8% after 5 epochs for everyone; at 0.016 chapter 1 reaches 64.8%, as at the quickstart's batch (64.9%).
WHOLE_EPOCHS, WHOLE_LR = 5, 0.016
WHOLE_STEPS = WHOLE_EPOCHS * -(-60_000 // BATCH)  # 295 optimizer steps; PowerSGD from 10% of them is START 29
DILOCO_RATES = ("unlimited", "100mbit", "10mbit")
WHOLE_ROWS = {  # name: (its flags, link rates); chapter 1 runs alone, the others on the two machines (ddp_launch.py)
    "single": ([], ()),
    "ddp": ([], ("100mbit", "1gbit")),  # at 10 Mbit/s a whole run takes 11 minutes (2.3 s a step): 0.02x a step
    "by_hand": ([], ("100mbit", "1gbit")),  # chapter 3b, ddp_by_hand.py: DDP's job by hand, beside DDP
    "powersgd": (["--comm-hook", "powersgd"], ("100mbit", "10mbit")),  # start 2, the chapters' default
    "powersgd_10pct": (["--comm-hook", f"powersgd:1:{WHOLE_STEPS // 10}"], ("100mbit", "10mbit")),  # torch's advice
    # post-local SGD: no all-reduce after step START; the weights averaged every 16 steps (at 10 Mbit/s its 22
    # averages alone would take 47 s), or only at each epoch's end (the epoch's 59 steps), from step 2 or from the first
    "localsgd": (["--comm-hook", "localsgd:16"], ("100mbit",)),
    "localsgd_epoch": (["--comm-hook", f"localsgd:{WHOLE_STEPS // WHOLE_EPOCHS}"], ("100mbit", "10mbit")),
    "localsgd_epoch_0": (["--comm-hook", f"localsgd:{WHOLE_STEPS // WHOLE_EPOCHS}:0"], ("100mbit", "10mbit")),
    # DiLoCo (chapter 11, diloco.py): H inner steps between a fragment's syncs, F fragments, each all-reduce waited K
    # steps after its start; the outer SGD's lr and Nesterov momentum. Run with --rows (not by default), with the
    # unshaped link too (its goal: within 15% of the time there). An epoch is 59 steps at batch 1,024.
    "diloco_h59": (["--sync-every", "59", "--wire-dtype", "bf16"], DILOCO_RATES),
    "diloco_h59_fp32": (["--sync-every", "59", "--wire-dtype", "fp32"], DILOCO_RATES),
    "diloco_h30": (["--sync-every", "30"], DILOCO_RATES),
    "diloco_f4_k10": (["--sync-every", "59", "--fragments", "4", "--overlap", "10"], DILOCO_RATES),
    "diloco_f8_k7": (["--sync-every", "59", "--fragments", "8", "--overlap", "7"], DILOCO_RATES),
    "diloco_f4_k10_lr1": (["--sync-every", "59", "--fragments", "4", "--overlap", "10", "--outer-lr", "1"],
                          DILOCO_RATES),
    "diloco_f3_h60_k10_fp32": (["--sync-every", "60", "--fragments", "3", "--overlap", "10", "--wire-dtype", "fp32"],
                               DILOCO_RATES),
    # torchft's own DiLoCo (ddp_ft.py --sync-every, chapter 12): a replica group on each machine, torchft's lighthouse
    # on nodea, fp32 on the wire (torchft quantizes only to fp8, with Triton on a GPU); its fragments are whole layers
    # (3 here), H a multiple of them: beside chapter 11's fp32 rows with the same H, F and K
    "ft_diloco_h59": (["--sync-every", "59"], DILOCO_RATES),
    "ft_diloco_f3_h60_k10": (["--sync-every", "60", "--fragments", "3", "--overlap", "10"], DILOCO_RATES),
}
DILOCO_GOAL = {"10mbit": 1.5, "100mbit": 1.6}  # x chapter 1's speed; and within 0.5 points of its accuracy
DILOCO_UNSHAPED, DILOCO_FEWER_BYTES = 1.15, 50  # at 10 Mbit/s at most 1.15x its unshaped time; 50x fewer than DDP's
WHOLE_NAMES = {"single": "chapter 1, one process", "ddp": "DDP (chapter 3)", "by_hand": "DDP by hand (chapter 3b)",
               "powersgd": "DDP, --comm-hook powersgd (rank 1, start 2)",
               "powersgd_10pct": f"DDP, --comm-hook powersgd:1:{WHOLE_STEPS // 10} (start at 10%)",
               "localsgd": "DDP, --comm-hook localsgd:16 (post-local SGD, start 2)",
               "localsgd_epoch": f"DDP, --comm-hook localsgd:{WHOLE_STEPS // WHOLE_EPOCHS} (averaged once an epoch)",
               "localsgd_epoch_0": f"DDP, --comm-hook localsgd:{WHOLE_STEPS // WHOLE_EPOCHS}:0 (once an epoch, "
                                   f"local from step 1)"}
DILOCO_ROWS = [name for name in WHOLE_ROWS if "diloco" in name]
FT_ROWS = [name for name in DILOCO_ROWS if name.startswith("ft_")]
WHOLE_NAMES.update({name: ("torchft's DiLoCo (chapter 12), " if name in FT_ROWS else "DiLoCo (chapter 11), ")
                    + " ".join(WHOLE_ROWS[name][0]) for name in DILOCO_ROWS})
WHOLE_SCRIPTS = {"by_hand": "ddp_by_hand.py", **{name: "ddp_ft.py" if name in FT_ROWS else "diloco.py"
                                                 for name in DILOCO_ROWS},
                 **{name: "ddp_comm_hooks.py" for name, (flags, _) in WHOLE_ROWS.items() if "--comm-hook" in flags}}


# --- Inside each rank: run the chapter, time its steps and collectives, write what was measured ---

def as_collective(event, ranks):
    """One of gloo's collectives as the profiler saw it, as the flight recorder logs one (for sent_by_ring)."""
    shape = (event.input_shapes or [[]])[0]
    dtype = PROFILER_DTYPES.get((getattr(event, "input_dtypes", None) or ["float"])[0], "Float")
    kind = event.name.split(":", 1)[1]
    gathered = [ranks * math.prod(shape)] if kind == "all_gather" else shape  # its input is this rank's piece
    return dict(kind=kind, ranks=ranks, sizes=[shape], out_sizes=[gathered], dtypes=[dtype])


def worker(known, args):
    """Run the chapter with args in this process; measure known.steps optimizer steps after WARMUP; out/<rank>.json."""
    import torch
    import torch.distributed as dist
    from torch.profiler import record_function

    chapter, bucket_cap_mb, measured = known.worker, known.bucket_cap_mb, known.steps
    if bucket_cap_mb is not None:  # the chapter's DDP(...) with another bucket size, its file unchanged
        ddp_init = torch.nn.parallel.DistributedDataParallel.__init__

        def init_with_bucket(self, *a, **kw):
            ddp_init(self, *a, **dict(kw, bucket_cap_mb=bucket_cap_mb))

        torch.nn.parallel.DistributedDataParallel.__init__ = init_with_bucket

    profiler, record = harness.profiler(), {}

    def after_step(n, optimizer):
        if n == WARMUP:
            record["ranks"] = dist.get_world_size() if dist.is_initialized() else 1
            profiler.start()
        if WARMUP <= n <= WARMUP + measured:
            with record_function("scaling:step"):  # the steps' ends, on the profiler's own clock
                pass
        if n == WARMUP + measured:
            profiler.stop()

    done = harness.after_steps(after_step)

    def write(code):
        code = code or harness.too_few_steps(chapter, done[0], WARMUP + measured)
        if code == 0:
            events = profiler.events()
            ends = sorted(e.time_range.start / 1e6 for e in events if e.name == "scaling:step")
            ranks = record["ranks"]
            gloo = [e for e in events if e.name.startswith("gloo:") and e.time_range.start / 1e6 < ends[-1]]

            def timed(events):  # the union of the events' intervals in each step, and their ring bytes per step
                spans = [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in events]
                return dict(communication=[harness.union(spans, a, b) for a, b in zip(ends, ends[1:])],
                            ring_bytes=sum(sent_by_ring(as_collective(e, ranks)) for e in events) / measured)

            kinds = sorted({e.name.split(":", 1)[1] for e in gloo})
            Path(known.out, f"{harness.rank()}.json").write_text(json.dumps(dict(
                steps=[b - a for a, b in zip(ends, ends[1:])], ranks=ranks, **timed(gloo),
                kinds={kind: timed([e for e in gloo if e.name == f"gloo:{kind}"]) for kind in kinds})))
        return code

    harness.run_chapter(chapter, args, write)


# --- The driver ---

def chapter_args(batch, flags, out, data_dir, steps):
    """The chapter's flags for a run of WARMUP + steps optimizer steps of `batch` images, one epoch, one test batch."""
    return [*flags, "--batch-size", str(batch), "--train-samples", str((WARMUP + steps) * batch),
            "--test-samples", str(BATCH),
            "--epochs", "1", "--log-every", "100000", "--device", "cpu", "--output", str(out),
            *(["--data-dir", str(data_dir)] if data_dir else [])]


def collect(out, ranks, procs, what):
    """Wait for procs (a run's launchers); every rank's measurement, or FatalError with the run's last lines."""
    harness.wait_for(procs, what)
    return harness.records(out, ranks, what)


def worker_command(row, out, steps):
    """The row's chapter inside this script's worker, measuring `steps` steps, its flags to follow."""
    return harness.worker_command(__file__, row.chapter, out, steps=steps, bucket_cap_mb=row.bucket_cap_mb)


def run_alone(name, data_dir, tmp):
    """A row's chapter at world size 1 with the per-rank batch of its 2-rank runs (chapter 1: the whole batch)."""
    row = ROWS[name]
    out = Path(tempfile.mkdtemp(prefix=f"{name}-alone-", dir=tmp))
    alone = row.chapter == "single_gpu.py"
    cmd = harness.torchrun(None if alone else 1, [
        *worker_command(row, out, STEPS[None]),
        *chapter_args(row.batch if alone else row.batch // 2, row.flags, out / "run", data_dir, STEPS[None])])
    # One thread, as each rank on the two machines has
    return collect(out, 1, [harness.start(cmd, harness.env(OMP_NUM_THREADS="1"))], f"{row.chapter} at world size 1")[0]


def tcp_counters(net):
    """TCP's segments sent again, and the timeouts among them, on both machines so far (their own /proc/net)."""
    total = dict(RetransSegs=0, TCPTimeouts=0)
    for ns in net.ns.values():
        text = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp", "/proc/net/netstat"],
                              capture_output=True, text=True).stdout.splitlines()
        for names, values in zip(text[::2], text[1::2]):  # "Tcp: name name ..." then "Tcp: value value ..."
            for key, value in zip(names.split()[1:], values.split()[1:]):
                if key in total:
                    total[key] += int(value)
    return total


def run_on_two(name, rate, net, data_dir, tmp):
    """A row's chapter with one rank on each machine, over the link as it is shaped now."""
    row = ROWS[name]
    # PowerSGD's short steps: more of them, as many as 60,000 images allow
    steps = min(SHORT_STEPS, 60_000 // row.batch - WARMUP) if "powersgd" in " ".join(row.flags) else STEPS[rate]
    out = Path(tempfile.mkdtemp(prefix=f"{name}-two-", dir=tmp))
    procs = harness.torchrun_on_two(net, [*worker_command(row, out, steps),
                                          *chapter_args(row.batch, row.flags, out / "run", data_dir, steps)])
    return collect(out, 2, procs, f"{row.chapter} on two machines")


def measure(rows, rates, data_dir, congestion_control=None):
    """Every chosen run: {"alone": {row: record}, "runs": [one dict per row and rate], "tcp": congestion control}."""
    chosen = [(name, rate) for name in rows for rate in ROWS[name].rates if rate in rates]
    alone, runs = {}, []
    with tempfile.TemporaryDirectory(prefix="scaling-") as tmp, harness.two_machines(congestion_control) as net:
        for name in rows:
            alone[name] = run_alone(name, data_dir, tmp)
            print(f"measured {name} at world size 1", file=sys.stderr, flush=True)
        for rate in rates:
            harness.shape(net, rate)
            for name in [n for n, r in chosen if r == rate]:
                before = tcp_counters(net)
                records = run_on_two(name, rate, net, data_dir, tmp)
                after = tcp_counters(net)
                runs.append(dict(row=name, rate=rate, ranks=records,
                                 tcp={key: after[key] - before[key] for key in after}))
                print(f"measured {name} at {rate}", file=sys.stderr, flush=True)
    return dict(alone=alone, runs=runs, tcp=net.tcp)


# --- Why gloo's all-gather misses the floor: who speaks first on a slow link ---

ORDER_NUMEL = 200_960  # floats each rank sends: half of the first Linear's weights, FSDP2's largest all-gather here
ORDER_LATE = 0.05  # seconds the second rank starts after the first, as ranks drift apart between collectives
ORDER_WAYS = {"receive first (irecv, then isend)": "receive",
              "send first (isend, then irecv)": "send",
              "dist.all_gather_into_tensor": "all_gather"}


def order_worker(rank, reps):
    """One rank of --order: each way of swapping ORDER_NUMEL floats, reps times, rank 1 ORDER_LATE late; its times."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{NODES['nodea']}:{PORT}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    peer = 1 - rank
    mine, out = torch.full((ORDER_NUMEL,), float(rank + 1)), torch.zeros(2 * ORDER_NUMEL)
    theirs = out[peer * ORDER_NUMEL:(peer + 1) * ORDER_NUMEL]

    def swap(way):
        if way == "all_gather":
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # 2.14's name, older's
            gather(out, mine)
            return
        # posted in the order the way names: that order is what is measured
        posted = [dist.irecv(theirs, peer), dist.isend(mine, peer)] if way == "receive" else \
            [dist.isend(mine, peer), dist.irecv(theirs, peer)]
        for work in posted:
            work.wait()

    seconds = {way: [] for way in ORDER_WAYS.values()}
    for _ in range(reps):
        for way in seconds:
            out.zero_()
            dist.barrier()
            time.sleep(0.3)  # what the last swap left in the sockets has crossed: the link starts empty
            time.sleep(ORDER_LATE * rank)
            start = time.perf_counter()
            swap(way)
            seconds[way].append(time.perf_counter() - start)
            if theirs[0].item() != peer + 1 or theirs[-1].item() != peer + 1:
                raise FatalError(f"{way}: rank {rank} received {theirs[0].item()}, not rank {peer}'s {peer + 1}")
    dist.barrier()
    print(json.dumps(seconds), flush=True)
    destroy_process_group()


def order(rate, reps, congestion_control=None):
    """--order: the time each way of swapping ORDER_NUMEL floats takes the late rank, at rate, against the floor."""
    with harness.two_machines(congestion_control) as net:
        harness.shape(net, rate)
        procs = harness.on_two(net, lambda i, node: [sys.executable, str(Path(__file__).resolve()), "--order-worker",
                                                     str(i), "--reps", str(reps)], subprocess.PIPE)
        outputs = [json.loads(out.strip().splitlines()[-1]) for out in harness.wait_for(procs, "--order's swaps", 300)]
    floor = ORDER_NUMEL * 4 * 8 / tc_bits(rate)  # each direction carries one rank's floats
    return dict(rate=rate, late=ORDER_LATE, nbytes=ORDER_NUMEL * 4, floor=floor, tcp=net.tcp, reps=reps,
                seconds=outputs, late_rank={way: median(outputs[1][way]) / floor for way in ORDER_WAYS.values()})


def order_report(result):
    print(f"Two machines, one rank each, gloo, TCP {result['tcp']}; each rank sends {result['nbytes'] / 1024:,.0f} KiB "
          f"to the other over {RATES.get(result['rate']) or result['rate']} each way (floor {ms(result['floor'])} ms); "
          f"rank 1 starts {result['late'] * 1e3:.0f} ms after rank 0. Rank 1's time against the floor, the median of "
          f"{result['reps']}:")
    for label, way in ORDER_WAYS.items():
        print(f"  {label:36} {result['late_rank'][way]:.2f}x")


def derive(measured):
    """Per run: step, compute, communication (hidden + exposed), floor, images/s, against chapter 1."""
    alone = measured["alone"]
    single = alone.get("single")
    results = []
    for run in measured["runs"]:
        name, rate, ranks = run["row"], run["rate"], run["ranks"]
        batch = ROWS[name].batch
        step = median(s for r in ranks for s in r["steps"])
        communication = median(c for r in ranks for c in r["communication"])
        compute = median(alone[name]["steps"])
        exposed = min(max(step - compute, 0.0), communication)
        ring = max(r["ring_bytes"] for r in ranks)
        floor = ring * 8 / tc_bits(rate) if RATES[rate] else None
        by_kind = {}  # each kind of collective on its own: its time (a union, as above) against its own floor
        for kind in ranks[0]["kinds"]:
            seconds = median(c for r in ranks for c in r["kinds"][kind]["communication"])
            sent = max(r["kinds"][kind]["ring_bytes"] for r in ranks)
            by_kind[kind] = dict(communication=seconds, ring_bytes=sent,
                                 over_floor=seconds / (sent * 8 / tc_bits(rate)) if RATES[rate] else None,
                                 per_rank=[median(r["kinds"][kind]["communication"]) / (sent * 8 / tc_bits(rate))
                                           for r in ranks] if RATES[rate] else None)
        images_per_s = batch / step
        results.append(dict(
            row=name, rate=rate, batch=batch, step=step, compute=compute, communication=communication,
            exposed=exposed, hidden=communication - exposed, other=max(step - compute - exposed, 0.0),
            ring_bytes=ring, floor=floor, over_floor=communication / floor if floor else None, by_kind=by_kind,
            images_per_s=images_per_s, resent=run["tcp"]["RetransSegs"], timeouts=run["tcp"]["TCPTimeouts"],
            vs_single=images_per_s / (ROWS["single"].batch / median(single["steps"])) if single else None))
    return results


def ms(seconds):
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def times(ratio):
    return "-" if ratio is None else f"{ratio:.2f}"


def table(results, measured):
    """The results as a Markdown table, chapter 1's row first."""
    lines = ["| strategy | link | images/step | step ms | compute ms | communication ms | hidden ms | exposed ms "
             "| ring KiB/step | floor ms | comm / floor | TCP resent (timeouts) | images/s | vs chapter 1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    single = measured["alone"].get("single")
    if single:
        step = median(single["steps"])
        lines.append(f"| {ROWS['single'].what} | none | {ROWS['single'].batch} | {ms(step)} | {ms(step)} | - | - | - | - "
                     f"| - | - | - | {ROWS['single'].batch / step:,.0f} | 1.00 |")
    for r in results:
        lines.append(
            f"| {ROWS[r['row']].what} | {RATES[r['rate']] or r['rate']} | {r['batch']} | {ms(r['step'])} | "
            f"{ms(r['compute'])} | {ms(r['communication'])} | {ms(r['hidden'])} | {ms(r['exposed'])} | "
            f"{kib(r['ring_bytes'])} | {ms(r['floor'])} | {times(r['over_floor'])} | {r['resent']} "
            f"({r['timeouts']}) | {r['images_per_s']:,.0f} | {times(r['vs_single'])} |")
    return "\n".join(lines)


def checks(results):
    """The goal, a report: each run's communication within FLOOR_GOAL of its floor at 10 and 100 Mbit/s; where a
    run has collectives of several kinds, each kind against its own floor says which of them missed it."""
    lines = []
    for r in results:
        if r["rate"] in ("10mbit", "100mbit"):
            each = [f"{kind} {x['over_floor']:.2f}x (" + ", ".join(f"rank {i} {v:.2f}x" for i, v in
                                                                   enumerate(x.get("per_rank") or [])) + ")"
                    for kind, x in r["by_kind"].items()]
            kinds = f"; by kind: {', '.join(each)}" if len(each) > 1 else ""
            lines.append(f"{'PASS' if r['over_floor'] <= FLOOR_GOAL else 'MISS'}: {ROWS[r['row']].what} at "
                         f"{RATES[r['rate']]}: communication {r['over_floor']:.2f}x its floor ({ms(r['communication'])}"
                         f" ms against {ms(r['floor'])} ms; goal <= {FLOOR_GOAL}x){kinds}")
    for r in results:  # the link itself: no row's bytes may cross faster than the rate (netns.burst_bytes)
        if r["floor"] and r["over_floor"] < 1:
            lines.append(f"FAST LINK: {ROWS[r['row']].what} at {RATES[r['rate']]}: communication {ms(r['communication'])}"
                         f" ms is under the {ms(r['floor'])} ms its bytes need on the wire: the shaper let them through")
    for r in results:  # the remedies against chapter 1's speed
        goal = SPEED_GOAL.get(r["rate"])
        if goal and r["row"] in REMEDIES and r["vs_single"] is not None:
            lines.append(f"{'PASS' if r['vs_single'] >= goal else 'MISS'}: {ROWS[r['row']].what} at {RATES[r['rate']]}: "
                         f"{r['vs_single']:.2f}x chapter 1's images/s (goal >= {goal}x)")
    return lines


def remedies(results):
    """The remedies side by side: bytes each rank sends per step, speed against chapter 1 per link rate (their
    accuracy over whole runs: --whole)."""
    rates = [rate for rate in ("1gbit", "100mbit", "10mbit") if any(r["rate"] == rate for r in results)]
    lines = [f"| remedy | images/step | KiB sent per step | {' | '.join(f'vs chapter 1 at {RATES[x]}' for x in rates)} "
             f"|", "|---" * (3 + len(rates)) + "|"]
    for name in [n for n in REMEDIES if any(r["row"] == n for r in results)]:
        here = {r["rate"]: r for r in results if r["row"] == name}
        lines.append(f"| {ROWS[name].what} | {ROWS[name].batch} | {kib(next(iter(here.values()))['ring_bytes'])} | "
                     f"{' | '.join(times(here[x]['vs_single']) if x in here else '-' for x in rates)} |")
    return "\n".join(lines)


def chart(results, measured, path):
    """Per link rate, a panel of stacked bars: compute, hidden and exposed communication per 1,000 images."""
    plt = harness.pyplot(path)
    if plt is None:
        return
    rates = [rate for rate in RATES if any(r["rate"] == rate for r in results)]
    single = measured["alone"].get("single")
    fig, axes = plt.subplots(1, len(rates), figsize=(3.3 * len(rates) + 1, 4.6), dpi=90, squeeze=False)
    per_k = lambda r, s: s * 1000 / r["batch"]  # seconds per 1,000 images
    for ax, rate in zip(axes[0], rates):
        here = [r for r in results if r["rate"] == rate]
        x = range(len(here))
        alone = [per_k(r, r["compute"] - min(r["hidden"], r["compute"])) for r in here]
        hidden = [per_k(r, min(r["hidden"], r["compute"])) for r in here]
        exposed = [per_k(r, r["exposed"] + r["other"]) for r in here]
        ax.bar(x, alone, color="tab:blue", label="compute")
        ax.bar(x, hidden, bottom=alone, color="tab:blue", hatch="///", edgecolor="white",
               label="compute, communication hidden behind it")
        ax.bar(x, exposed, bottom=[a + h for a, h in zip(alone, hidden)], color="tab:red",
               label="exposed communication (the step waits)")
        if single:
            ax.axhline(median(single["steps"]) * 1000 / ROWS["single"].batch, color="black", ls="--", lw=1,
                       label="chapter 1, one process")
        ax.set_xticks(list(x), [ROWS[r["row"]].short for r in here], fontsize=8)
        ax.set_title(f"link: {RATES[rate] or rate}", fontsize=10)
        for i, r in enumerate(here):
            if r["over_floor"]:
                ax.text(i, alone[i] + hidden[i] + exposed[i], f"{r['over_floor']:.2f}x\nfloor", ha="center",
                        va="bottom", fontsize=7)
        ax.margins(y=0.15)
    axes[0][0].set_ylabel("seconds per 1,000 images (lower is better)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"Two machines, one rank each (gloo, TCP {measured.get('tcp')}, 1 CPU thread per rank), global "
                 f"batch {BATCH} ({4 * BATCH} with --accum-steps 4); "
                 "'x floor': communication / (ring bytes / link rate)", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    harness.save(fig, path)


def speed_chart(results, measured, path):
    """Speed against chapter 1 per link rate, one line per strategy and remedy, the break-even line at 1.0."""
    plt = harness.pyplot(path)
    if plt is None:
        return
    bits = {"10mbit": 1e7, "100mbit": 1e8, "1gbit": 1e9, "unlimited": 1e10}  # unlimited: drawn right of 1 Gbit/s
    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=90)
    for name in [n for n in ROWS if any(r["row"] == n and r["vs_single"] for r in results)]:
        here = sorted((bits[r["rate"]], r["vs_single"]) for r in results if r["row"] == name)
        ax.plot(*zip(*here), marker="o", label=ROWS[name].what, lw=2 if name in REMEDIES[2:] else 1,
                ls="-" if name in REMEDIES else ":")
    ax.axhline(1.0, color="black", lw=1, ls="--")
    ax.text(1.1e7, 1.03, "chapter 1, one process (break-even)", fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(list(bits.values()), ["10 Mbit/s", "100 Mbit/s", "1 Gbit/s", "unlimited"])
    ax.set_xlabel("link between the two machines")
    ax.set_ylabel("images/s against chapter 1 (log)")
    ax.set_title(f"Two machines, one rank each (gloo, TCP {measured.get('tcp')}), global batch {BATCH}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    harness.save(fig, path)


def report(measured, args):
    results = derive(measured)
    env_ = measured.get("environment", {})
    print(f"\nTwo machines (network namespaces), one rank each, gloo, 1 thread per rank, TCP {measured.get('tcp')}; "
          f"the median of 5-{SHORT_STEPS} steps after {WARMUP}; torch {env_.get('torch')}, {env_.get('cpu_count')} cores\n")
    print(table(results, measured))
    print()
    for line in checks(results):
        print(line)
    if any(r["row"] in REMEDIES[1:] for r in results):
        print("\nThe remedies side by side (their accuracy over whole runs: --whole)\n")
        print(remedies(results))
    if args.png:
        chart(results, measured, args.png)
    if args.speed_png:
        speed_chart(results, measured, args.speed_png)


def run_whole(name, rate, net, data_dir, tmp):
    """One whole run of a --whole row (chapter 1 alone, the others with one rank on each machine over the link as it
    is shaped now): its time from the first step to the last (the epochs' train_seconds), its wall time from start
    to exit (imports, rendezvous, DDP's first broadcast and the evaluations too) and its final test accuracy."""
    flags, _ = WHOLE_ROWS[name]
    out = Path(tempfile.mkdtemp(prefix=f"{name}-whole-", dir=tmp))
    args = [*flags, "--batch-size", str(BATCH), "--lr", str(WHOLE_LR), "--epochs", str(WHOLE_EPOCHS), "--log-every",
            "100000", "--device", "cpu", "--output", str(out), *(["--data-dir", data_dir] if data_dir else [])]
    start, lighthouse = time.perf_counter(), None
    if name == "single":  # one thread, as each rank on the two machines has
        procs = [harness.start(harness.torchrun(None, ["single_gpu.py", *args]), harness.env(OMP_NUM_THREADS="1"))]
    elif name in FT_ROWS:  # the lighthouse on nodea (--min_replicas 2: the first sync waits for both groups), then
        sent = net.sent_bytes()  # a replica group on each machine, its own torchrun, saving beside the other's
        lighthouse = start_lighthouse(net, min_replicas=2)
        procs = harness.on_two(net, lambda i, node: [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "ddp_ft.py",
            "--replica-group", str(i), "--lighthouse", f"http://{NODES['nodea']}:{LIGHTHOUSE_PORT}", *args,
            "--output", str(out / f"group_{i}")])
        out = out / "group_0"
    else:
        sent = net.sent_bytes()
        procs = harness.torchrun_on_two(net, [WHOLE_SCRIPTS.get(name, "ddp_launch.py"), *args])
    try:
        harness.wait_for(procs, f"{WHOLE_NAMES[name]} at {rate or 'no link'}", timeout=1800)
    finally:
        if lighthouse is not None:
            lighthouse.kill()
            lighthouse.wait()
    epochs = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "epoch"]
    return dict(row=name, rate=rate, train_seconds=sum(r["train_seconds"] for r in epochs),
                wall_seconds=time.perf_counter() - start, accuracy=epochs[-1]["test_accuracy"],
                link_bytes=None if name == "single" else net.sent_bytes() - sent)


def measure_whole(rows, rates, repeats, data_dir, congestion_control=None):
    """--whole: every row at each of its rates, `repeats` rounds of all of them (chapter 1 in each, so that a slow
    spell of the machine falls on every row alike), after one untimed run of chapter 1 (caches): {"runs": [...]}."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="scaling-whole-") as tmp, harness.two_machines(congestion_control) as net:
        run_whole("single", None, net, data_dir, tmp)  # warm-up: the first run after a while pays for cold caches
        for _ in range(repeats):
            for rate in [None, *rates]:  # chapter 1 alone; then each rate's rows on the two machines
                if rate:
                    harness.shape(net, rate)
                for name in ["single"] if rate is None else [n for n in rows if rate in WHOLE_ROWS[n][1]]:
                    runs.append(run_whole(name, rate, net, data_dir, tmp))
                    print(f"{name} at {rate or 'no link'}: {runs[-1]['train_seconds']:.1f} s, "
                          f"{100 * runs[-1]['accuracy']:.1f}%", file=sys.stderr, flush=True)
    return dict(runs=runs, epochs=WHOLE_EPOCHS, batch=BATCH, lr=WHOLE_LR, tcp=net.tcp)


def spread(values, fmt):
    return f"{fmt(mean(values))} ({fmt(min(values))}-{fmt(max(values))})"


def whole_report(measured):
    """--whole's table (each figure the mean of the repeats, min-max after it) and the goals judged on it."""
    runs, env_ = measured["runs"], measured.get("environment", {})
    single = [r for r in runs if r["row"] == "single"]
    base, base_accuracy = mean(r["train_seconds"] for r in single), mean(r["accuracy"] for r in single)
    print(f"\nWhole runs: {measured['epochs']} epochs of the 60,000 images at global batch {measured['batch']} (512 per "
          f"rank), --lr {measured['lr']}; one rank per machine, gloo, 1 thread per rank, TCP {measured['tcp']}, no "
          f"delay; the mean of {len(single)} runs (min-max); torch {env_.get('torch')}, {env_.get('cpu_count')} cores\n")
    counted = any(r.get("link_bytes") for r in runs)  # the link's bytes, counted on its interfaces (not in old JSON)
    print("| run | link | first step to last, s | vs chapter 1 | wall time, s | test accuracy |" +
          " sent over the link, MB |" * counted + "\n|---|---|---|---|---|---|" + "---|" * counted)
    groups = {}
    for r in runs:
        groups.setdefault((r["row"], r["rate"]), []).append(r)
    for (name, rate), group in groups.items():
        print(f"| {WHOLE_NAMES[name]} | {RATES.get(rate) or 'none'} | "
              f"{spread([r['train_seconds'] for r in group], lambda v: f'{v:,.1f}')} | "
              f"{spread([base / r['train_seconds'] for r in group], lambda v: f'{v:.2f}')} | "
              f"{spread([r['wall_seconds'] for r in group], lambda v: f'{v:,.1f}')} | "
              f"{spread([100 * r['accuracy'] for r in group], lambda v: f'{v:.1f}%')} |" +
              ("" if not counted else " |" if name == "single" else
               f" {spread([r['link_bytes'] / 1e6 for r in group], lambda v: f'{v:,.2f}')} |"))
    print()
    ddp_bytes = [r["link_bytes"] for r in runs if r["row"] == "ddp" and r.get("link_bytes")]
    for (name, rate), group in groups.items():
        if name in DILOCO_ROWS and rate in DILOCO_GOAL:
            print(diloco_goals(name, rate, group, groups.get((name, "unlimited")), base, base_accuracy, ddp_bytes))
            continue
        goal = SPEED_GOAL.get(rate)
        if goal:
            speed, accuracy = mean(base / r["train_seconds"] for r in group), mean(r["accuracy"] for r in group)
            ok = speed >= goal and accuracy >= base_accuracy - 0.01
            print(f"{'PASS' if ok else 'MISS'}: {WHOLE_NAMES[name]} at {RATES[rate]}: {speed:.2f}x chapter 1 over whole "
                  f"runs (goal >= {goal}x), {100 * accuracy:.1f}% against chapter 1's {100 * base_accuracy:.1f}% "
                  f"(goal: within 1 point)")


def diloco_goals(name, rate, group, unshaped, base, base_accuracy, ddp_bytes):
    """Chapter 11's goals for one row at one rate, in one line: its speed against chapter 1's, its accuracy within
    0.5 points, its time within 15% of its own on the unshaped link, and 50x fewer bytes on the link than DDP's."""
    speed, accuracy = mean(base / r["train_seconds"] for r in group), mean(r["accuracy"] for r in group)
    goals = [(speed >= DILOCO_GOAL[rate], f"{speed:.2f}x chapter 1 (goal >= {DILOCO_GOAL[rate]}x)"),
             (accuracy >= base_accuracy - 0.005, f"{100 * accuracy:.1f}% against chapter 1's {100 * base_accuracy:.1f}% "
                                                 f"(goal: within 0.5 points)")]
    if rate == "10mbit" and unshaped:
        slower = mean(r["train_seconds"] for r in group) / mean(r["train_seconds"] for r in unshaped)
        goals.append((slower <= DILOCO_UNSHAPED, f"{slower:.2f}x its time on the unshaped link (goal <= "
                                                 f"{DILOCO_UNSHAPED})"))
    if ddp_bytes and group[0].get("link_bytes"):
        fewer = mean(ddp_bytes) / mean(r["link_bytes"] for r in group)
        goals.append((fewer >= DILOCO_FEWER_BYTES, f"{fewer:,.0f}x fewer bytes on the link than DDP (goal >= "
                                                   f"{DILOCO_FEWER_BYTES}x)"))
    return (f"{'PASS' if all(ok for ok, _ in goals) else 'MISS'}: {WHOLE_NAMES[name]} at {RATES[rate]}: "
            + ", ".join(text for _, text in goals))


def main():
    if "--worker" in sys.argv:  # inside one rank of a run
        return worker(*harness.worker_args(steps=int, bucket_cap_mb=float))
    if "--order-worker" in sys.argv:  # inside one rank of --order
        p = argparse.ArgumentParser()
        p.add_argument("--order-worker", type=int)
        p.add_argument("--reps", type=int)
        known = p.parse_args()
        return order_worker(known.order_worker, known.reps)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    swept = [name for name in ROWS if ROWS[name].rates or name == "single"]
    p.add_argument("--rows", default=",".join(swept), help=f"rows to run, of {','.join(ROWS)} (default "
                   f"{','.join(swept)})")
    p.add_argument("--rates", default=",".join(RATES), help=f"link rates, of {','.join(RATES)} (default all)")
    p.add_argument("--data-dir", default=None, help="FashionMNIST folder (default: the chapters' own search)")
    p.add_argument("--json", metavar="PATH", help="also write every measurement as JSON")
    p.add_argument("--png", metavar="PATH", help="also draw the chart (needs matplotlib)")
    p.add_argument("--speed-png", metavar="PATH", help="also draw speed against chapter 1 per link rate (matplotlib)")
    p.add_argument("--from-json", metavar="PATH", help="run nothing: the table and chart of a saved --json file")
    p.add_argument("--congestion-control", metavar="NAME", default="reno",
                   help="TCP's congestion control on the two machines: reno (the default: every kernel lets a "
                        "namespace pick it, and on this lossless link it measured as cubic did), cubic, bbr, ...")
    p.add_argument("--order", nargs="?", const="10mbit", metavar="RATE",
                   help="instead of the sweep: swap 785 KiB between the two machines, one rank late, receive first, "
                        "send first and with all_gather_into_tensor, on a link of RATE (default 10mbit)")
    p.add_argument("--reps", type=int, default=3, help="--order's swaps of each kind; the median counts (default 3)")
    p.add_argument("--whole", action="store_true",
                   help=f"instead of the sweep: whole {WHOLE_EPOCHS}-epoch runs as a user times them, --repeats times "
                        f"each, with their test accuracy (rows of {','.join(WHOLE_ROWS)}; all but by_hand and "
                        f"DiLoCo's by default, about 20 minutes on 2 cores)")
    p.add_argument("--repeats", type=int, default=3, help="--whole's runs of each row and rate (default 3)")
    args = p.parse_args()
    if args.whole:
        if args.from_json:
            return whole_report(harness.read_json(args.from_json))
        rows = args.rows.split(",") if "--rows" in sys.argv else [n for n in WHOLE_ROWS if n not in WHOLE_SCRIPTS]
        rates = args.rates.split(",") if "--rates" in sys.argv else ["100mbit", "10mbit"]
        unknown = [r for r in rows if r not in WHOLE_ROWS] + [r for r in rates if r not in RATES]
        if unknown or "single" not in rows or args.repeats < 1:
            p.error(f"--whole: rows of {','.join(WHOLE_ROWS)} (single among them), rates of {','.join(RATES)}, "
                    f"--repeats >= 1")
        measured = measure_whole(rows, rates, args.repeats, args.data_dir, args.congestion_control)
        measured["environment"] = harness.environment()
        write_json(args.json, measured)
        return whole_report(measured)
    if args.order:
        try:
            tc_bits(args.order)
        except ValueError as e:
            p.error(f"--order: {e}")
        result = order(args.order, args.reps, args.congestion_control)
        write_json(args.json, result)
        return order_report(result)
    if args.from_json:
        return report(harness.read_json(args.from_json), args)
    rows, rates = args.rows.split(","), args.rates.split(",")
    for given, known, flag in ((rows, ROWS, "--rows"), (rates, RATES, "--rates")):
        unknown = [g for g in given if g not in known]
        if unknown:
            p.error(f"{flag}: no {', '.join(unknown)}; choose from {', '.join(known)}")
    measured = measure(rows, [r for r in RATES if r in rates], args.data_dir, args.congestion_control)
    measured["environment"] = harness.environment()
    write_json(args.json, measured)
    report(measured, args)


if __name__ == "__main__":
    run_main(main)
