"""measure/timeline.py: each rank's trace holds the collectives its strategy makes in a step, with their bytes, when;
a pipeline's trace holds each stage's micro-batches in the order the chapter prints; every rank is on one clock, so
the merged trace obeys physics (nothing received before it was sent) in every recorded step."""
import json
import re
import shutil
import subprocess
import sys

import pytest

from measure.timeline import ROUNDS, clock_offsets, collective_bytes, merge, step_events
from support import REPO
from support.run import BASE_ENV
from support.traces import COLLECTIVES, recorded_steps
from support.two_machines import cannot_shape, need_namespaces

# Which collectives leave while the step still computes: DDP's first bucket and FSDP2's first gradient before the
# backward's last op, by hand's and PowerSGD's (one bucket) only after it; FSDP2's gathers and tensor parallel's
# all-reduce inside the forward.
BEFORE_BACKWARD_ENDS = {"ddp_launch.py", "fsdp.py", "ddp_comm_hooks.py --comm-hook bf16", "ddp_comm_hooks.py --comm-hook fp16"}
STEPS = 5  # the script's default: every recorded step is checked
TOLERANCE_MS = 0.1  # beyond the clock offset's own error bound (half the fastest round trip, printed by the script)
IN_FORWARD = {"fsdp.py": "all_gather", "tensor_parallel.py": "all_reduce"}


def timeline(tmp_path, chapter, *flags, ranks=2, baseline=False):
    """measure/timeline.py on loopback, its defaults: (the merged trace's events, what the chapter printed)."""
    proc = subprocess.run([sys.executable, "measure/timeline.py", chapter, "--nproc", str(ranks), "--out",
                           str(tmp_path), *([] if baseline else ["--no-baseline"]), "--", *flags], cwd=REPO,
                          env=BASE_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", proc.stdout
    return json.loads((tmp_path / "trace.json").read_text())["traceEvents"], (tmp_path / "chapter.log").read_text()


def first_step(events, rank):
    """The rank's complete events in its first recorded step (from the barrier's mark to the first step's end)."""
    return recorded_steps(events, rank)[0]


def assert_obeys_physics(out, ranks, steps=STEPS):
    """On the merged trace's one clock, in every recorded step: no rank ends a collective (the n-th of its kind) before
    every rank started it, as drawn (step.json's ends, where the rank went on) and as recorded; a pipeline stage
    starts micro-batch i's forward only after the stage before ended it, its backward only after the stage after
    ended it. Allowed: the clock offsets' own error bound, plus TOLERANCE_MS."""
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    drawn = json.loads((out / "step.json").read_text())
    slack = (max(bound for _, bound in drawn["offsets"]) + TOLERANCE_MS * 1e3) / 1e3  # ms
    recorded = steps
    steps = [recorded_steps(events, rank) for rank in range(ranks)]
    assert {len(s) for s in steps} == {recorded}, [len(s) for s in steps]
    ms = lambda e: (e["ts"] / 1e3, (e["ts"] + e.get("dur", 0)) / 1e3)
    # collectives matched by their order over the whole recording (one a step's hook starts may fall either side of
    # the step's end on different ranks), a pipeline's micro-batches within each step
    wire = [{} for _ in range(ranks)]
    for rank in range(ranks):
        for e in (e for step in steps[rank] for e in step):
            if re.match(r"(gloo|nccl):", e["name"]) and e["name"] not in ("gloo:send", "gloo:recv"):
                wire[rank].setdefault(e["name"], []).append(ms(e))
    assert all(len(wire[r].get(kind, [])) == len(wire[0][kind]) for kind in wire[0] for r in range(ranks)), wire
    for kind in wire[0]:
        for n in range(len(wire[0][kind])):
            started = max(wire[r][kind][n][0] for r in range(ranks))
            ended = min(wire[r][kind][n][1] for r in range(ranks))
            assert ended >= started - slack, (kind, n, [wire[r][kind][n] for r in range(ranks)])
    for k in range(recorded):
        chunks = [{m[1]: ms(e) for e in steps[rank][k] if (m := re.fullmatch(r"timeline:([FB]\d+)", e["name"]))}
                  for rank in range(ranks)]
        for stage in range(1, ranks if chunks[0] else 0):
            for label, (start, _) in chunks[stage].items():
                if label[0] == "F":
                    assert start >= chunks[stage - 1][label][1] - slack, (k, stage, label, chunks)
            for label, (start, _) in chunks[stage - 1].items():
                if label[0] == "B":
                    assert start >= chunks[stage][label][1] - slack, (k, stage - 1, label, chunks)
    # the drawn step: each collective's drawn end (where its rank went on) no earlier than every rank's start of it
    origin = {name: row for name, row in drawn["rows"].items() if name.startswith("rank ")}
    for kind in {s[0] for row in origin.values() for s in row["spans"] if s[0] not in ("forward", "backward",
                                                                                     "optimizer", "send", "recv")}:
        per_rank = [[s for s in row["spans"] if s[0] == kind] for row in origin.values()]
        for n in range(len(per_rank[0])):
            started = max(spans[n][1] for spans in per_rank)
            assert all(spans[n][4] >= started - slack for spans in per_rank), (kind, n, per_rank)


@pytest.mark.parametrize("case", COLLECTIVES)
def test_each_ranks_trace_holds_its_strategys_collectives(case, tmp_path):
    """Both ranks in one trace, each the step's collectives with their bytes, each started where the strategy
    starts it (what the picture shows)."""
    chapter, *flags = case.split()
    events, _ = timeline(tmp_path, chapter, *flags)
    assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1}
    for rank in (0, 1):
        step = first_step(events, rank)
        for kind, sizes in COLLECTIVES[case].items():
            sent = [e for e in step if e["name"] == f"gloo:{kind}"]
            assert sorted(collective_bytes(e) for e in sent) == sorted(sizes), (kind, sent)
        assert {e["name"][5:] for e in step if e["name"].startswith("gloo:")} == set(COLLECTIVES[case])
        # when each all-reduce was started (c10d's op, on the thread that called it; gloo may run it later)
        last_backward = max(e["ts"] for e in step if e["name"].startswith("autograd::engine::"))  # its last op's start
        gradients = [e["ts"] for e in step if e["name"] in ("c10d::allreduce_", "c10d::_reduce_scatter_base_")]
        if case != "tensor_parallel.py":
            assert (min(gradients) < last_backward) == (case in BEFORE_BACKWARD_ENDS), (min(gradients), last_backward)
        forward = next(e for e in step if e["name"] == "timeline:forward")
        in_forward = [e for e in step if e["name"] == f"gloo:{IN_FORWARD.get(case)}"
                      and forward["ts"] <= e["ts"] < forward["ts"] + forward["dur"]]
        assert len(in_forward) == (3 if chapter == "fsdp.py" else 1 if chapter == "tensor_parallel.py" else 0), in_forward
    assert_obeys_physics(tmp_path, 2)


PIPELINES = [(2, "gpipe"), (2, "1f1b"), (3, "gpipe"), (3, "1f1b")]


@pytest.mark.parametrize("ranks,schedule", PIPELINES, ids=[f"{r}-stages-{s}" for r, s in PIPELINES])
def test_pipeline_trace_follows_the_timetable_the_chapter_prints(ranks, schedule, tmp_path):
    """Each stage's micro-batch forwards (F2) and backwards (B2) come in the trace in the order chapter 10 prints for
    its first step: the schedule's, which 1F1B makes differ from stage to stage."""
    events, printed = timeline(tmp_path, "pipeline.py", "--schedule", schedule, ranks=ranks)
    table = dict(re.findall(r"^  stage (\d+): (.*)$", printed, re.M))
    assert len(table) == ranks, printed
    for rank in range(ranks):
        traced = [e["name"][len("timeline:"):] for e in first_step(events, rank)
                  if re.fullmatch(r"timeline:[FB]\d+", e["name"])]
        assert traced == table[str(rank)].split(), (rank, printed)
    assert_obeys_physics(tmp_path, ranks)


def test_timeline_across_two_machines_waits_for_the_link(tmp_path):
    """--link 100mbit: one rank on each of the two machines, the link between them shaped. Each rank's all-reduces
    must last at least the wire time of what it has to receive (at 2 ranks, half of each bucket: 1,339,412 bytes
    in all, 107 ms at 100 Mbit/s), from the first one's start to the last one's end."""
    need_namespaces()
    proc = subprocess.run([sys.executable, "measure/timeline.py", "ddp_launch.py", "--link", "100mbit", "--out",
                           str(tmp_path)], cwd=REPO, env=BASE_ENV, capture_output=True, text=True, timeout=300)
    if "cannot shape" in proc.stderr:
        cannot_shape(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    for rank in (0, 1):
        sent = [e for e in first_step(events, rank) if e["name"] == "gloo:all_reduce"]
        assert sorted(collective_bytes(e) for e in sent) == sorted(COLLECTIVES["ddp_launch.py"]["all_reduce"])
        span_s = (max(e["ts"] + e["dur"] for e in sent) - min(e["ts"] for e in sent)) / 1e6
        assert span_s >= sum(COLLECTIVES["ddp_launch.py"]["all_reduce"]) / 2 * 8 / 100e6, span_s
    assert_obeys_physics(tmp_path, 2)


def test_diloco_outer_all_reduce_runs_under_the_inner_steps(tmp_path):
    """Chapter 11 across the two machines at 10 Mbit/s, --sync-every 4 --overlap 2, 8 steps drawn together: each outer
    all-reduce (the pseudo-gradient in bf16, 1,339,412 bytes, about 1 s on this link) starts in an inner step's hook
    and the next inner steps' forwards run while it is on the wire, until the wait two steps later. Waited at once,
    no forward would start before it ended. The span starts on gloo's own thread, which a busy machine may wake
    after those forwards began: they are counted from its launch on the main thread (c10d::allreduce_)."""
    need_namespaces()
    proc = subprocess.run([sys.executable, "measure/timeline.py", "diloco.py", "--link", "10mbit", "--steps", "8",
                           "--window", "8", "--no-baseline", "--out", str(tmp_path), "--", "--sync-every", "4",
                           "--overlap", "2"], cwd=REPO, env=BASE_ENV, capture_output=True, text=True, timeout=300)
    if "cannot shape" in proc.stderr:
        cannot_shape(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr
    assert "steps 1-8 of 8 drawn" in proc.stdout, proc.stdout
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    for rank in (0, 1):
        mine = [e for e in events if e.get("pid") == rank and e.get("ph") == "X"]
        outer = [e for e in mine if e["name"] == "gloo:all_reduce" and collective_bytes(e) == 669_706 * 2]
        assert len(outer) == 2, [(e["name"], collective_bytes(e)) for e in mine if e["name"].startswith("gloo:")]
        forwards = [e for e in mine if e["name"] == "timeline:forward"]
        main_tid = forwards[0]["tid"]
        launches = [e["ts"] for e in mine if e["tid"] == main_tid and e["name"] == "c10d::allreduce_"]
        for e in outer:
            launch = max(t for t in launches if t <= e["ts"])
            under = [f for f in forwards if launch < f["ts"] and f["ts"] + f["dur"] < e["ts"] + e["dur"]]
            assert len(under) >= 2, (rank, e, under)  # the model's forward (and its loss's) in the steps after
    assert_obeys_physics(tmp_path, 2, steps=8)


def bounced(offset, delays):
    """Two ranks' clock marks as clock_marks() records them, made up: rank 1's clock `offset` µs ahead of rank 0's,
    each round's tensor taking (there, back) µs on the wire; the rounds 1 ms apart."""
    rank0, rank1 = [], []
    for i, (there, back) in enumerate(delays):
        sent = 1_000_000.0 + 1000 * i
        rank0 += [dict(name=f"timeline:clock 1 {i} send", ts=sent), dict(name=f"timeline:clock 1 {i} back",
                                                                          ts=sent + there + back)]
        rank1.append(dict(name=f"timeline:clock 1 {i} got", ts=sent + there + offset))
    return [rank0, rank1]


SLOWER_ROUNDS = [(40.0 + i, 45.0 + 2 * i) for i in range(1, ROUNDS)]  # the fastest round is the one that counts


@pytest.mark.parametrize("offset", [0.0, 5_000_000.0, -123_456.789])
def test_the_clock_offset_is_the_skew_when_the_wire_is_symmetric(offset):
    """A tensor that takes as long there as back arrives halfway through rank 0's round trip: the offset read from
    the fastest round is the skew exactly (to float rounding), its bound half that round's trip."""
    measured, bound = clock_offsets(bounced(offset, [(12.5, 12.5), *SLOWER_ROUNDS]))[1]
    assert measured == pytest.approx(offset, abs=1e-6) and bound == 12.5


@pytest.mark.parametrize("there,back", [(24.0, 1.0), (1.0, 24.0), (0.0, 25.0)])
def test_an_asymmetric_wire_moves_the_offset_by_at_most_the_bound_it_prints(there, back):
    """Where the way there and the way back differ (one direction queued behind other traffic), the offset is off by
    half their difference: never more than the bound the script prints (half the round trip), and by exactly that
    half-difference, so the bound is tight where one way takes all the time."""
    measured, bound = clock_offsets(bounced(777.0, [(there, back), *SLOWER_ROUNDS]))[1]
    assert bound == (there + back) / 2
    assert measured - 777.0 == pytest.approx((there - back) / 2, abs=1e-6)
    assert abs(measured - 777.0) <= bound


def test_merge_recovers_a_clock_skew_planted_in_one_rank(real_data, tmp_path):
    """Ranks on two machines read two clocks. Rank 1's whole trace moved 5 s ahead (as another machine's clock
    would be) merges into the same trace: the offset the script measures from the bounced tensor is the skew, to
    float rounding; unskewed, the two ranks share this machine's clock and the offset is 0 within its stated error.
    Then chapter 1's baseline row and each rank's shares are drawn: compute, waiting on the wire and idle add up to
    the step. The data is outside ./data and the global batch is not the default: chapter 1's row runs with both."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "FashionMNIST").symlink_to(real_data / "FashionMNIST")
    timeline(tmp_path / "run", "ddp_launch.py", "--data-dir", elsewhere, "--batch-size", "128", baseline=True)
    chapter_1 = (tmp_path / "run" / "baseline" / "chapter.log").read_text()
    assert "batch_size=128" in chapter_1 and f"data_dir={elsewhere}" in chapter_1, chapter_1
    assert f"train_samples={8 * 128}" in chapter_1, chapter_1  # 3 steps' warm-up and 5 recorded, each of 128 images
    printed = json.loads((tmp_path / "run" / "step.json").read_text())
    assert set(printed["rows"]) == {"rank 0", "rank 1", "chapter 1"}, printed["rows"].keys()
    for name, row in printed["rows"].items():
        parts = dict(re.findall(r"(\w+) (\d+)%", row["numbers"]))
        assert set(parts) == {"compute", "wire", "idle"} and abs(sum(map(int, parts.values())) - 100) <= 2, row
    skewed = tmp_path / "skewed"
    shutil.copytree(tmp_path / "run", skewed)
    trace = json.loads((skewed / "rank1.json").read_text())
    for e in trace["traceEvents"]:
        if "ts" in e:
            e["ts"] += 5_000_000  # µs
    (skewed / "rank1.json").write_text(json.dumps(trace))
    (straight, offsets), (moved, moved_offsets) = merge(tmp_path / "run", 2), merge(skewed, 2)
    assert abs(moved_offsets[1][0] - offsets[1][0] - 5_000_000) < 1e-3, (offsets, moved_offsets)
    assert moved_offsets[1][1] == pytest.approx(offsets[1][1])  # the same rounds, the same error bound
    assert max(abs(a["ts"] - b["ts"]) for a, b in zip(straight, moved) if "ts" in a) < 1e-3
    assert offsets[1][1] < 5_000, offsets  # half the fastest round trip on loopback: well under 5 ms
    assert abs(offsets[1][0]) <= offsets[1][1], offsets  # one machine, one clock: 0 to within the stated error


# A trace of CUDA's shape, as torch's profiler (Kineto) exports one from an NCCL rank (torch 2.14's
# export_chrome_trace; the fields torch's own DDP profiling test and Kineto's ChromeTraceLogger name): each collective
# twice, the CPU op (its launch, with its shapes) and a `gpu_user_annotation` copy on the GPU's row; the CPU op launches
# the NCCL kernel (`cudaLaunchKernel`, a `cuda_runtime` event; `cuLaunchKernel`, a `cuda_driver` one, for cuBLASLt's
# GEMMs) that runs later on the GPU's stream (a `kernel` event with the same `correlation`); the model's kernels
# likewise, launched inside the forward, backward and optimizer. tests/recorded/ holds a real one, from an H100.
def cuda_shaped_trace():
    events, stream = [], dict(pid=0, tid=7)
    cpu = lambda name, ts, dur, cat="user_annotation", **args: events.append(
        dict(ph="X", cat=cat, name=name, pid=100, tid=100, ts=ts, dur=dur, args=args))
    launch = lambda ts, correlation, api="cuda_runtime": cpu(
        dict(cuda_runtime="cudaLaunchKernel", cuda_driver="cuLaunchKernel")[api], ts, 5, api, correlation=correlation)
    kernel = lambda name, ts, dur, correlation: events.append(
        dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur, args=dict(correlation=correlation, stream=7), **stream))
    cpu("timeline:start", 0, 1)
    cpu("timeline:forward", 10, 100)
    launch(20, 1)
    kernel("void gemmSN_TN_kernel<float>", 40, 300, 1)
    cpu("autograd::engine::evaluate_function: AddmmBackward0", 120, 80, "cpu_op")
    launch(130, 2, "cuda_driver")  # cuBLASLt's GEMMs launch through the driver (an H100's trace, tests/recorded/)
    kernel("void gemmSN_NN_kernel<float>", 350, 400, 2)
    for i, (floats, at) in enumerate([(267_786, 210), (401_920, 260)]):  # DDP's two buckets
        cpu("nccl:all_reduce", at, 30, **{"Input Dims": [[floats]], "Input type": ["float"]})
        launch(at + 10, 10 + i)
        kernel(f"ncclDevKernel_AllReduce_Sum_f32_RING_LL", 800 + 500 * i, 450, 10 + i)
        events.append(dict(ph="X", cat="gpu_user_annotation", name="nccl:all_reduce", ts=800 + 500 * i, dur=450,
                           args={}, **stream))
    cpu("Optimizer.step#SGD.step", 320, 60)
    launch(330, 3)
    kernel("void multi_tensor_apply_kernel", 1800, 100, 3)
    cpu("timeline:step", 2000, 1)
    return events


def test_a_gpu_ranks_wire_is_its_nccl_kernels_each_collective_once(tmp_path):
    """On a CUDA trace: each collective drawn once (its GPU copy dropped), with its bytes, where its NCCL kernel ran
    on the GPU, not where the CPU launched it; the compute as the GPU ran it, in the phase that launched each kernel."""
    (tmp_path / "rank0.json").write_text(json.dumps(dict(traceEvents=cuda_shaped_trace())))
    merged, offsets = merge(tmp_path, 1)
    found, wire, gaps = step_events(merged, 0, (0, 2000))
    assert [(w[0], w[1], w[2], w[5]) for w in wire] == [("all_reduce", 800, 1250, 267_786 * 4),
                                                         ("all_reduce", 1300, 1750, 401_920 * 4)]
    assert sorted((kind, t0, t1) for kind, t0, t1, _ in found) == [
        ("backward", 350, 750), ("forward", 40, 340), ("optimizer", 1800, 1900)]
    assert gaps == []  # a GPU rank's waiting is on its stream, not in its CPU thread


def test_a_real_h100_trace_draws_each_step_as_the_gpu_ran_it(tmp_path):
    """The trace measure/timeline.py recorded on an NVIDIA H100 (torch 2.11, NCCL 2.28, `ddp_launch.py --nproc 1`,
    tests/recorded/): every recorded step holds DDP's two all-reduces once each with their bytes (the trace holds
    each twice, its `gpu_user_annotation` copy dropped), and the step's compute is the GPU's kernels, each drawn
    where the GPU ran it and after the CPU launched it, in the phase that launched it."""
    import gzip
    from measure.timeline import windows
    trace = gzip.decompress((REPO / "tests/recorded/h100_ddp_launch_one_rank.json.gz").read_bytes())
    (tmp_path / "rank0.json").write_bytes(trace)
    merged, _ = merge(tmp_path, 1)
    kernels = {(e["ts"], e["ts"] + e["dur"]): e for e in merged if e.get("cat") == "kernel"}
    launched = {e["args"]["correlation"]: e["ts"] for e in merged if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    steps = windows(merged, 0)
    assert len(steps) == 5, steps
    for window in steps:
        found, wire, gaps = step_events(merged, 0, window)
        assert sorted(w[5] for w in wire) == sorted(COLLECTIVES["ddp_launch.py"]["all_reduce"]), wire
        assert {kind for kind, *_ in found} == {"forward", "backward", "optimizer"}, found
        for kind, t0, t1, label in found:
            kernel = kernels[(t0, t1)]  # a kernel's own range, not the CPU op that launched it
            assert launched[kernel["args"]["correlation"]] <= t0, kernel  # nothing runs before it was launched
        assert gaps == []


def test_the_chapters_gain_no_profiling_line():
    """Profiling is the script's: no chapter and nothing in common/ starts a profiler or marks a range, so a chapter
    run without measure/timeline.py runs exactly as before it existed."""
    for path in [*REPO.glob("*.py"), *REPO.glob("common/*.py")]:
        assert not re.search(r"profiler|record_function", path.read_text()), path
