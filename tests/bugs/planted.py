"""Planted bugs: each one a small patch to the project, with the tests that must fail once it is in.

A test counts only if it fails when the feature it names is broken. This file keeps that proof runnable: every
entry below breaks one promise of docs/tests.md the way a real mistake would (drop set_epoch, weight micro-batches
1/K, ignore --precision, ...), and names the tests that must turn red. The runner applies one entry at a time to a
fresh copy of the project (your working tree is never touched), runs the named tests there, and reports CAUGHT,
with the tests that failed, or MISSED.

    python tests/bugs/planted.py                    # every planted bug (make mutations; about 30 minutes on 2 cores)
    python tests/bugs/planted.py --list             # names, what each one breaks, and its tests
    python tests/bugs/planted.py no-set-epoch accum-one-over-k    # some of them
    python tests/bugs/planted.py --baseline no-set-epoch          # also run the tests unpatched: they must pass
    python tests/bugs/planted.py --check            # plants nothing: every named test exists, every patch applies

It exits 0 when every planted bug was caught; 1 when one was missed, when a patch no longer applies (the code it
changes has moved on: update the entry), or when --baseline finds a named test failing without the bug. --check
(about 20 seconds: it collects the suite once) exits 1 when an entry names a test pytest does not collect or holds a
patch whose text is not in its file exactly once.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    """One planted bug: replace `old` (found exactly once) with `new` in each file; `tests` must then fail."""

    name: str
    breaks: str  # the promise it breaks, in docs/tests.md's words
    patches: tuple  # ((file, old, new), ...)
    tests: tuple  # pytest node ids


def bug(name, breaks, tests, *patches):
    return Mutation(name, breaks, tuple(patches), tuple(tests))


TRAIN_FLAGS = "tests/test_training_flags.py"
ENGINE = "tests/test_model_engine.py"
GPU_PATH = "tests/test_gpu_path_with_fake_gpus.py"
GPU_SUITE = "tests/test_gpu_suite_coverage.py"
DESCRIBE = "    print0(ctx, cfg.describe())\n"
IGNORE_PRECISION = DESCRIBE + '    cfg.precision = "fp32"  # planted: the run says bf16 and trains fp32\n'

MUTATIONS = [
    # --- Same model: every DDP chapter, any world size, one machine or two, trains chapter 1's model ---
    bug("no-set-epoch", "same model: every epoch draws a new shuffle from seed + epoch",
        ["tests/test_ddp.py::test_ddp_trains_the_same_model[torchrun-2]"],
        ("ddp_launch.py", "        train_sampler.set_epoch(epoch)", "        pass")),
    bug("every-rank-reads-shard-0", "same model: the ranks' k-th batches together are chapter 1's k-th batch",
        ["tests/test_ddp.py::test_ddp_trains_the_same_model[mp-2]"],
        ("ddp_mp.py", "num_replicas=ctx.world_size, rank=ctx.rank, seed=cfg.seed)",
         "num_replicas=ctx.world_size, rank=0, seed=cfg.seed)")),
    bug("rank-from-local-rank", "same model on several machines: rank is global, local rank only picks the device",
        ["tests/test_ddp.py::test_two_torchrun_nodes_on_one_machine"],
        ("ddp_launch.py", 'rank = int(os.environ["RANK"])', 'rank = int(os.environ["LOCAL_RANK"])')),
    bug("eval-on-rank0-shard-only", "exact metrics: the test counts are summed over every rank's shard",
        ["tests/test_ddp.py::test_ddp_trains_the_same_model[mp-2]"],
        ("common/engine.py", "total_loss, total_correct, total = all_reduce_sum([loss_sum, correct, seen], ctx, ctx.data_group)",
         "total_loss, total_correct, total = float(loss_sum), float(correct), float(seen)")),
    bug("eval-counts-sampler-padding", "exact metrics: no padded duplicates in the test shards",
        ["tests/test_ddp.py::test_ddp_trains_the_same_model[mp-3]"],
        ("ddp_mp.py", "test_set = Subset(test_set, range(ctx.rank, len(test_set), ctx.world_size))\n"
         "    test_loader = DataLoader(test_set, batch_size=1000,", "test_loader = DataLoader(test_set, batch_size=1000, "
         "sampler=DistributedSampler(test_set, ctx.world_size, ctx.rank, shuffle=False),")),
    bug("teardown-before-the-error-line", "a rank that fails says its line before its teardown, which it leaves "
        "without a wait (NCCL since torch 2.6 finishes every queued collective first: one no peer joins never ends)",
        ["tests/test_errors.py::test_a_rank_that_fails_with_a_collective_in_flight_says_its_line_and_leaves_at_once"],
        ("common/ranks.py", "    if error is not None and dist.is_initialized():\n", "    if False:\n")),
    bug("teardown-holds-the-gil", "nothing hangs: a rank leaves the group right after a collective (caught on torch "
        "2.6, `python tests/bugs/planted.py` under .venv-floor; torch 2.14 has no such hang to catch)",
        ["tests/test_rendezvous.py::test_leaving_the_group_after_a_collective_never_hangs"],
        ("common/ranks.py", "    backends = [pg._get_backend(d) for pg in dist.distributed_c10d._world.pg_map "
         "for d in pg._device_types]\n", "    backends = []\n")),
    bug("destroy-not-in-finally", "the lesson is in the chapter: destroy_process_group in a finally",
        ["tests/test_chapters_read_as_the_lesson.py::test_each_ddp_chapter_reads_as_the_lesson_top_to_bottom[ddp_mp.py]"],
        ("ddp_mp.py", "    try:\n        train(cfg, ctx)  # steps 4 to 7, below\n    finally:",
         "    if True:\n        train(cfg, ctx)  # steps 4 to 7, below\n    if True:")),

    # --- Accumulation, bf16, compile ---
    bug("accum-one-over-k", "accumulation: each micro-batch weighted by its share of the step's images",
        [f"{TRAIN_FLAGS}::test_accumulation_trains_the_same_model[torchrun-2-K2]",
         f"{TRAIN_FLAGS}::test_accumulation_trains_the_same_model[single-1-K4]"],
        ("common/engine.py", "loss = loss_fn(model(X), y) * (len(y) / images)",
         "loss = loss_fn(model(X), y) / cfg.accum_steps")),
    bug("no-no-sync", "accumulation under DDP: one all-reduce per optimizer step, not one per micro-batch",
        ["tests/test_chapters_read_as_the_lesson.py::test_each_chapter_passes_its_own_way_to_hold_gradients_back[ddp_launch.py]"],
        ("ddp_launch.py", "metrics, no_sync=model.no_sync)", "metrics)")),
    bug("no-set-requires-gradient-sync", "accumulation under FSDP2: one reduce-scatter per unit per optimizer step",
        [f"{TRAIN_FLAGS}::test_one_gradient_sync_per_optimizer_step[fsdp]"],
        ("common/engine.py", "                gradient_sync(last)\n", "                pass\n")),
    *[bug(f"precision-ignored-{launcher}", f"--precision bf16 really runs under {launcher}",
          [test], (script, DESCRIBE, IGNORE_PRECISION))
      for launcher, script, test in [
          ("python", "single_gpu.py", f"{TRAIN_FLAGS}::test_bf16_through_every_launcher[single-1]"),
          ("dataparallel", "dataparallel.py", f"{TRAIN_FLAGS}::test_bf16_through_every_launcher[dataparallel-1]"),
          ("torchrun", "ddp_launch.py", f"{TRAIN_FLAGS}::test_bf16_through_every_launcher[torchrun-2]"),
          ("mp.spawn", "ddp_mp.py", f"{TRAIN_FLAGS}::test_bf16_through_every_launcher[mp-3]"),
          ("tcp", "ddp_tcp_manual.py", f"{TRAIN_FLAGS}::test_bf16_through_every_launcher[tcp-2]"),
          ("srun", "ddp_slurm.py", f"{TRAIN_FLAGS}::test_16_bits_under_srun[bf16]"),
          ("fsdp", "fsdp.py", f"{TRAIN_FLAGS}::test_bf16_through_every_launcher[fsdp-2]")]],
    *[bug(f"fp16-ignored-{launcher}", f"--precision fp16 really runs, with its GradScaler, under {launcher}",
          [test], (script, DESCRIBE, IGNORE_PRECISION))
      for launcher, script, test in [
          ("torchrun", "ddp_launch.py", f"{TRAIN_FLAGS}::test_fp16_with_its_scaler_through_every_launcher[torchrun-2]"),
          ("srun", "ddp_slurm.py", f"{TRAIN_FLAGS}::test_16_bits_under_srun[fp16]")]],
    bug("fp16-scale-never-updated", "fp16: a step with inf/NaN gradients is skipped and the scale halved",
        [f"{ENGINE}::test_fp16_scaler_skips_an_overflowing_step_then_steps_at_the_lower_scale"],
        ("common/engine.py", "        scaler.update()\n", "")),
    bug("fp16-unscaled-step", "fp16: the optimizer steps on unscaled gradients, through the scaler",
        [f"{ENGINE}::test_fp16_scaler_skips_an_overflowing_step_then_steps_at_the_lower_scale"],
        ("common/engine.py", "        scaler.step(optimizer)", "        optimizer.step()")),
    bug("dataparallel-replicas-in-default-dtype", "chapter 2: the replicas compute in the dtype --precision names",
        [f"{ENGINE}::test_dataparallel_replicas_compute_in_the_dtype_precision_names"],
        ("dataparallel.py", "super().parallel_apply([in_callers_autocast(r) for r in replicas], inputs, kwargs)",
         "super().parallel_apply(replicas, inputs, kwargs)")),
    bug("fsdp-bf16-outputs", "chapter 7 in bf16: the test loss is summed from float32 outputs",
        [f"{TRAIN_FLAGS}::test_bf16_through_every_launcher[fsdp-2]"],
        ("fsdp.py", ", output_dtype=torch.float32 if bf16 else None))", "))")),
    bug("sharded-snapshot-folder-unchecked-at-save", "a sharded snapshot's folder is one every machine shares: every "
        "rank sees rank 0's snapshot.pt at each save, or all stop in one line",
        ["tests/test_fsdp.py::test_a_snapshot_folder_the_machines_do_not_share_stops_every_rank_with_one_line[saving]"],
        ("common/checkpoint.py", "    check_one_folder(f\"{'sees' if seen else 'does not see'} rank 0's {folder.name}/snapshot.pt\", ctx, cfg)\n", "")),
    bug("sharded-snapshot-folder-unchecked-at-resume", "every rank of a resumed sharded run finds the same snapshot, or "
        "all stop in one line",
        ["tests/test_fsdp.py::test_a_snapshot_folder_the_machines_do_not_share_stops_every_rank_with_one_line[resuming]"],
        ("common/checkpoint.py", '    check_one_folder(f"finds {finished[-1].name}" if finished else "finds no finished snapshot", ctx, cfg)\n', "")),
    bug("slurm-master-on-the-jobs-first-node", "chapter 6's ranks meet on their step's first node (a step may run on "
        "some of the job's nodes)",
        ["tests/test_slurm_env.py::test_a_step_on_some_of_the_jobs_nodes_meets_on_its_own_first_node"],
        ("ddp_slurm.py", 'first_node(os.environ["SLURM_STEP_NODELIST"])', 'first_node(os.environ["SLURM_JOB_NODELIST"])')),
    bug("srun-cpus-per-task-not-passed-on", "each SLURM step asks for the job's --cpus-per-task (Slurm 22.05+ srun "
        "does not take it from the job)",
        ["tests/test_slurm_env.py::test_each_step_asks_for_the_jobs_cores_per_task[job.sh]"],
        ("scripts/job.sh", '    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"\n', "")),
    bug("torchrun-job-workers-one-thread", "job_torchrun.sh's workers share the task's cores (torchrun would give "
        "each 1 thread)", ["tests/test_slurm_env.py::test_each_step_asks_for_the_jobs_cores_per_task[job_torchrun.sh-4-workers]"],
        ("scripts/job_torchrun.sh", '           export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$((share > 0 ? share : 1))}" ;;',
         "           ;;")),
    bug("compile-ignored", "--compile compiles: torch's own count of captured graphs",
        [f"{TRAIN_FLAGS}::test_compile_trains_the_same_model[chapter1]"],
        ("single_gpu.py", "        model.compile()", "        pass")),
    bug("compile-ignored-under-ddp", "--compile compiles under DDP, cut at the gradient buckets",
        [f"{TRAIN_FLAGS}::test_compile_trains_the_same_model[torchrun-2-K2]"],
        ("ddp_launch.py", "        model.compile()", "        pass")),

    # --- Slow links: DDP's communication hooks (--comm-hook) ---
    bug("by-hand-sums-without-dividing", "chapter 3b averages the ranks' gradients: summed, then divided by the "
        "world size", ["tests/test_ddp.py::test_ddp_trains_the_same_model[by-hand-2]"],
        ("ddp_by_hand.py", "        param.grad /= world_size\n", "")),
    bug("by-hand-no-all-reduce", "chapter 3b steps on every rank's gradients, all-reduced",
        ["tests/test_ddp.py::test_ddp_trains_the_same_model[by-hand-2]",
         "tests/test_training_flags.py::test_one_gradient_sync_per_optimizer_step[by_hand]"],
        ("ddp_by_hand.py", "        dist.all_reduce(param.grad)  # the sum", "        pass  # the sum")),
    bug("by-hand-no-broadcast", "chapter 3b starts every rank from rank 0's weights",
        ["tests/test_ddp.py::test_every_rank_starts_from_rank_0s_weights[ddp_by_hand.py]"],
        ("ddp_by_hand.py", "        dist.broadcast(tensor, src=0)", "        pass")),
    bug("mp-port-chosen-then-bound-later", "no program can take ddp_mp.py's rendezvous port while its workers start",
        ["tests/test_rendezvous.py::test_mp_port_cannot_be_taken_while_the_workers_start"],
        ("ddp_mp.py", """    listener = socket.create_server(("127.0.0.1", 0))  # handed over: the store closes it (libuv's takes one from 2.8)
    store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=cfg.timeout), master_listen_fd=listener.detach(),
                          use_libuv=False)
    try:
        mp.spawn(worker, args=(cfg, world_size, store.port), nprocs=world_size)""", """    import os
    import socket
    with socket.socket() as s:  # a port free now, bound by rank 0 once the workers have started
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    try:
        mp.spawn(worker, args=(cfg, world_size, 0), nprocs=world_size)"""),
        ("ddp_mp.py", """    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=cfg.timeout))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,""",
         """    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://", rank=rank,""")),
    # A store that binds its own port listens on every interface, whatever host it is given.
    bug("mp-store-on-every-interface", "the store of mp.spawn's ranks listens on loopback alone (chapter 4)",
        ["tests/test_rendezvous.py::test_spawned_ranks_store_listens_on_loopback_only[ddp_mp]"],
        ("ddp_mp.py", """listener.getsockname()[1], is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=cfg.timeout), master_listen_fd=listener.detach(),
                          use_libuv=False)""", """0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=cfg.timeout))""")),
    bug("preflight-store-on-every-interface", "the store of preflight's spawned ranks listens on MASTER_ADDR alone",
        ["tests/test_rendezvous.py::test_spawned_ranks_store_listens_on_loopback_only[preflight]"],
        ("scripts/preflight.py", """listener.getsockname()[1], is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=cfg.timeout),
                              master_listen_fd=listener.detach(), use_libuv=False)""",
         """0, is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=cfg.timeout))""")),
    bug("benchmark-store-on-every-interface", "the store of the benchmark's spawned ranks listens on loopback alone",
        ["tests/test_rendezvous.py::test_spawned_ranks_store_listens_on_loopback_only[benchmark-floor]"],
        ("measure/benchmark.py", """listener.getsockname()[1], is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120), master_listen_fd=listener.detach(), use_libuv=False)""",
         """0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))""")),
    bug("benchmark-by-hand-row-runs-ddp", "the benchmark times chapter 3b itself, beside DDP",
        ["tests/test_tools.py::test_benchmark_times_chapter_3b_itself_beside_ddp"],
        ("measure/benchmark.py", 'chapter(TORCHRUN, "ddp_by_hand.py")', 'chapter(TORCHRUN, "ddp_launch.py")')),
    bug("pipeline-timetable-not-gathered", "chapter 10 prints each stage's own order of work, as the trace shows it",
        ["tests/test_timeline.py::test_pipeline_trace_follows_the_timetable_the_chapter_prints[3-stages-1f1b]"],
        ("pipeline.py", """    dist.all_gather_object(everyone, " ".join(order))""",
         """    everyone = [" ".join(order)] * ctx.world_size""")),
    bug("timeline-pipeline-chunk-misnamed", "the timeline names each micro-batch's backward B, its forward F",
        ["tests/test_timeline.py::test_pipeline_trace_follows_the_timetable_the_chapter_prints[2-stages-1f1b]"],
        ("measure/timeline.py", """    PipelineStage.backward_one_chunk = chunk("B", PipelineStage.backward_one_chunk)""",
         """    PipelineStage.backward_one_chunk = chunk("F", PipelineStage.backward_one_chunk)""")),
    bug("timeline-link-unshaped", "measure/timeline.py --link RATE runs the two machines on a link of that rate",
        ["tests/test_timeline.py::test_timeline_across_two_machines_waits_for_the_link"],
        ("measure/timeline.py", "            harness.shape(net, args.link)",
         '            harness.shape(net, "unlimited")')),
    bug("timeline-main-thread-only", "the timeline records every thread: PowerSGD starts two all-reduces on gloo's",
        ["tests/test_timeline.py::test_each_ranks_trace_holds_its_strategys_collectives"
         "[ddp_comm_hooks.py --comm-hook powersgd]"],
        ("measure/harness.py", "        every_thread = dict(experimental_config=_ExperimentalConfig(profile_all_threads=True))",
         "        every_thread = {}")),
    bug("timeline-counts-elements", "the timeline labels each collective with its bytes",
        ["tests/test_timeline.py::test_each_ranks_trace_holds_its_strategys_collectives[ddp_by_hand.py]"],
        ("measure/timeline.py", '    return math.prod(dims[0] or [0]) * DTYPE_BYTES[PROFILER_DTYPES.get(types[0], "Float")]',
         "    return math.prod(dims[0] or [0])")),
    bug("timeline-ranks-keep-their-pids", "the merged trace has one process row per rank",
        ["tests/test_timeline.py::test_each_ranks_trace_holds_its_strategys_collectives[ddp_launch.py]"],
        ("measure/timeline.py", '            merged.append(dict(e, pid=rank) if "pid" in e else e)',
         "            merged.append(e)")),
    bug("timeline-ranks-on-their-own-clocks", "the timeline puts every rank on one clock (each rank's offset "
        "measured), not each on its own start",
        ["tests/test_timeline.py::test_merge_recovers_a_clock_skew_planted_in_one_rank",
         "tests/test_timeline.py::test_pipeline_trace_follows_the_timetable_the_chapter_prints[3-stages-1f1b]"],
        ("measure/timeline.py", "    offsets = clock_offsets(traces)\n",
         '    starts = [min(e["ts"] for e in t if e.get("name") == MARK + "start") for t in traces]\n'
         "    offsets = [(s - starts[0], 0.0) for s in starts]\n")),
    bug("timeline-offset-biased-by-its-bound", "the timeline's clock offset is the skew where the wire is symmetric, "
        "off by at most the bound it prints where it is not",
        ["tests/test_timeline.py::test_the_clock_offset_is_the_skew_when_the_wire_is_symmetric[0.0]"],
        ("measure/timeline.py", 'marks[peer][str(peer), i, "got"] - (sent + back) / 2', 'marks[peer][str(peer), i, "got"] - sent')),
    bug("timeline-baseline-without-the-chapters-flags", "the timeline's chapter-1 row runs on the chapter's global "
        "batch and data folder", ["tests/test_timeline.py::test_merge_recovers_a_clock_skew_planted_in_one_rank"],
        ("measure/timeline.py", 'command(BASELINE, out / "baseline", baseline_flags)', 'command(BASELINE, out / "baseline", [])')),
    bug("timeline-gpu-copy-counted", "the timeline draws each NCCL collective once (torch's trace holds a GPU copy)",
        ["tests/test_timeline.py::test_a_gpu_ranks_wire_is_its_nccl_kernels_each_collective_once"],
        ("measure/timeline.py", """    return e["name"].startswith(("gloo:", "nccl:")) and e.get("cat") != "gpu_user_annotation\"""",
         """    return e["name"].startswith(("gloo:", "nccl:"))""")),
    bug("diloco-goal-forgets-the-unshaped-link", "--whole judges a DiLoCo row at 10 Mbit/s against its own time on the "
        "unshaped link too", ["tests/test_scaling.py::test_diloco_rows_are_judged_by_chapter_11s_goals"],
        ("measure/scaling.py", "goals.append((slower <= DILOCO_UNSHAPED,", "goals.append((True,")),
    bug("timeline-driver-launches-missed", "a kernel launched through CUDA's driver (cuBLASLt's GEMMs) is drawn in "
        "the phase that launched it, not where the GPU ran it",
        ["tests/test_timeline.py::test_a_gpu_ranks_wire_is_its_nccl_kernels_each_collective_once"],
        ("measure/timeline.py", 'LAUNCHES = ("cuda_runtime", "cuda_driver")', 'LAUNCHES = ("cuda_runtime",)')),
    bug("timeline-wire-from-launch", "a GPU rank's wire is its NCCL kernels' time on the GPU, not the CPU's launch",
        ["tests/test_timeline.py::test_a_gpu_ranks_wire_is_its_nccl_kernels_each_collective_once"],
        ("measure/timeline.py", "            on_gpu = gpu_kernels(mine, e) if kernels else []",
         "            on_gpu = []")),
    bug("timeline-bytes-as-float32", "the timeline's bytes follow each collective's dtype (the bf16 and fp16 hooks)",
        ["tests/test_timeline.py::test_each_ranks_trace_holds_its_strategys_collectives[ddp_comm_hooks.py --comm-hook bf16]"],
        ("measure/timeline.py", '    return math.prod(dims[0] or [0]) * DTYPE_BYTES[PROFILER_DTYPES.get(types[0], "Float")]',
         "    return math.prod(dims[0] or [0]) * 4")),
    bug("hooks-chapter-sampler-not-sharded", "chapter 11b without a hook (--comm-hook none) trains chapter 1's model",
        ["tests/test_ddp.py::test_ddp_trains_the_same_model[hooks-2]"],
        ("ddp_comm_hooks.py", "DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, seed=cfg.seed)",
         "DistributedSampler(train_set, num_replicas=1, rank=0, seed=cfg.seed)")),
    bug("comm-hook-not-registered", "--comm-hook bf16 sends half the bytes: counted in gloo's collectives",
        ["tests/test_scaling.py::test_scaling_counts_the_bytes_each_strategy_sends[bf16]"],
        ("common/comm_hooks.py", '        model.register_comm_hook(None, getattr(default_hooks, f"{name}_compress_hook"))',
         "        pass")),
    bug("powersgd-state-not-resumed", "nothing lost: PowerSGD's residuals and factors go into --snapshot",
        ["tests/test_comm_hooks.py::test_a_hook_with_state_resumes_as_the_uninterrupted_run[powersgd]"],
        ("common/checkpoint.py", '        hook_state.load(snapshot.get("comm_hook"), ctx, path)\n', "        pass\n")),
    bug("powersgd-residuals-out-of-order", "nothing lost: a resumed run's first step puts PowerSGD's residuals in its "
        "bucket's order", ["tests/test_comm_hooks.py::test_a_hook_with_state_resumes_as_the_uninterrupted_run[powersgd]"],
        ("common/comm_hooks.py", "if self.orders.get(b, order) == order or b not in state.error_dict:",
         "if True:")),
    bug("powersgd-with-two-buckets", "PowerSGD on gloo in one bucket: two buckets' callbacks race, and gloo aborts",
        ["tests/test_comm_hooks.py::test_a_hook_with_state_resumes_as_the_uninterrupted_run[powersgd]"],
        ("ddp_comm_hooks.py", 'bucket_cap_mb=ONE_BUCKET_MB if cfg.comm_hook.startswith("powersgd") else None)',
         "bucket_cap_mb=None)")),
    bug("spawn-threads-set-after-start", "same command, same model, where the user runs it: chapter 4's workers start "
        "with their CPU threads (torch.set_num_threads() later leaves gloo's threads, which run PowerSGD, all cores)",
        ["tests/test_comm_hooks.py::test_the_same_command_trains_the_same_model_as_users_run_it[mp-none]",
         "tests/test_comm_hooks.py::test_chapter_4s_workers_start_with_their_share_of_the_cores_as_a_user_runs_it"],
        ("ddp_mp.py", '        os.environ.setdefault("OMP_NUM_THREADS", str(cpu_threads(world_size)))', "        pass")),
    bug("localsgd-still-all-reduces", "post-local SGD: after START steps no gradient crosses the wire",
        ["tests/test_comm_hooks.py::test_each_comm_hook_value_sends_what_it_names[localsgd:4]"],
        ("common/comm_hooks.py", "post_local_gradient_allreduce=False)", "post_local_gradient_allreduce=True)")),
    bug("localsgd-period-ignored", "post-local SGD: the weights averaged every H steps of an epoch and at its end",
        ["tests/test_comm_hooks.py::test_each_comm_hook_value_sends_what_it_names[localsgd:2:3]"],
        ("common/comm_hooks.py", "self.step % self.steps_per_epoch % self.period == 0:",
         "self.step % self.steps_per_epoch == 0:")),
    bug("localsgd-no-average-at-epoch-end", "post-local SGD: each epoch ends with one model on every rank (tested and "
        "snapshot)", ["tests/test_comm_hooks.py::test_each_comm_hook_value_sends_what_it_names[localsgd:4]",
                      "tests/test_comm_hooks.py::test_a_hook_with_state_resumes_as_the_uninterrupted_run"
                      "[localsgd:4:3-momentum]"],
        ("common/comm_hooks.py", "self.step % self.steps_per_epoch % self.period == 0:", "self.step % self.period == 0:")),
    bug("localsgd-momentum-left-apart", "post-local SGD: at an epoch's end SGD's momentum is averaged too, so rank 0's "
        "snapshot holds every rank's", ["tests/test_comm_hooks.py::test_a_hook_with_state_resumes_as_the_uninterrupted_run"
                                        "[localsgd:4:3-momentum]"],
        ("common/comm_hooks.py", 'g["params"]] + momentum\n', 'g["params"]]\n')),
    bug("localsgd-leaves-views", "post-local SGD saves the weights alone: its average leaves each tensor its own "
        "memory", ["tests/test_comm_hooks.py::test_localsgd_saves_the_weights_alone"],
        ("common/comm_hooks.py", "t.copy_(mean.view_as(t))", "t.data = mean.view_as(t)")),
    bug("localsgd-steps-not-resumed", "post-local SGD: its step counts go into --snapshot",
        ["tests/test_comm_hooks.py::test_a_hook_with_state_resumes_as_the_uninterrupted_run"
         "[localsgd:4:3-momentum]"],
        ("common/comm_hooks.py", '        self.step, self.state.iter = saved["step"], saved["iter"]',
         '        self.step = saved["step"]')),
    bug("localsgd-fp16-allowed", "post-local SGD refuses fp16 in one line (each rank's scaler skips its own steps)",
        ["tests/test_comm_hooks.py::test_a_hook_that_cannot_work_is_one_line[localsgd-fp16]"],
        ("common/comm_hooks.py", 'if cfg.comm_hook.startswith("localsgd") and cfg.precision == "fp16":',
         'if False:')),
    # --- Chapter 11: DiLoCo by hand (diloco.py) ---
    bug("diloco-pseudo-gradient-sign-flipped", "DiLoCo's pseudo-gradient is the shared weights minus this rank's",
        ["tests/test_diloco.py::test_diloco_trains_post_local_sgds_model[2]",
         "tests/test_diloco.py::test_the_outer_step_is_nesterov_sgd_on_the_pseudo_gradient[fp32]"],
        ("diloco.py", "(self.fragments[i] - self.mine[i])", "(self.mine[i] - self.fragments[i])")),
    bug("diloco-outer-momentum-not-kept", "DiLoCo's outer momentum is kept from sync to sync",
        ["tests/test_diloco.py::test_the_outer_step_is_nesterov_sgd_on_the_pseudo_gradient[fp32]"],
        ("diloco.py", "        self.fragments[i].grad = None\n",
         "        self.fragments[i].grad = None\n        self.outer.state.clear()\n")),
    bug("diloco-outer-momentum-not-resumed", "DiLoCo's outer momentum goes into --snapshot",
        ["tests/test_diloco.py::test_a_resumed_run_ends_as_the_uninterrupted_one_as_a_user_runs_it"],
        ("diloco.py", '        self.outer.load_state_dict(saved["outer"])\n', "")),
    bug("diloco-fragment-never-synced", "streaming DiLoCo syncs every fragment",
        ["tests/test_diloco.py::test_each_sync_sends_its_fragment_in_the_wire_dtype_and_waits_k_steps_later[fragments-overlap]"],
        ("diloco.py", "            if self.step % self.cfg.sync_every == offset:",
         "            if self.step % self.cfg.sync_every == offset and i > 0:")),
    bug("diloco-async-waited-at-once", "streaming DiLoCo waits for a fragment's all-reduce K inner steps later",
        ["tests/test_diloco.py::test_each_sync_sends_its_fragment_in_the_wire_dtype_and_waits_k_steps_later[fragments-overlap]",
         "tests/test_timeline.py::test_diloco_outer_all_reduce_runs_under_the_inner_steps"],
        ("diloco.py", "        work = dist.all_reduce(wire.chunk(n)[self.ctx.rank % n], group=self.across, async_op=True)  # returns at once\n",
         "        work = dist.all_reduce(wire.chunk(n)[self.ctx.rank % n], group=self.across, async_op=True)  # returns at once\n"
         "        work.wait()\n")),
    bug("diloco-wire-dtype-ignored", "DiLoCo sends the pseudo-gradients in --wire-dtype (bf16: half the bytes)",
        ["tests/test_diloco.py::test_each_sync_sends_its_fragment_in_the_wire_dtype_and_waits_k_steps_later[bf16]"],
        ("diloco.py", "pad(pseudo_gradient.to(WIRE[self.cfg.wire_dtype]), ", "pad(pseudo_gradient, ")),
    bug("diloco-copy-sees-its-own-shuffle", "DiLoCo with --ranks-per-replica N: a copy's ranks take what one rank of "
        "a run with a rank per copy takes, so it trains that run's model",
        ["tests/test_diloco.py::test_a_machines_ranks_train_one_copy_and_resume_exactly"],
        ("diloco.py", "dealt = ctx.rank // n + ctx.rank % n * copies", "dealt = ctx.rank")),
    bug("diloco-snapshot-holds-one-part", "DiLoCo with --ranks-per-replica N: a fragment in flight is gathered in the "
        "copy before the snapshot holds it", ["tests/test_diloco.py::test_a_machines_ranks_train_one_copy_and_resume_exactly"],
        ("diloco.py", "            self.gather(flight)\n        everyone", "            pass\n        everyone")),
    bug("diloco-copy-spans-machines", "DiLoCo with --ranks-per-replica N: a copy is N ranks in a row (one machine), so "
        "only the outer sync crosses the link", ["tests/test_multinode.py::"
                                                "test_diloco_on_two_machines_of_two_ranks_syncs_only_the_outer_step_across"],
        ("diloco.py", "new_subgroups_by_enumeration([list(ranks[r:r + n]) for r in ranks[::n]]",
         "new_subgroups_by_enumeration([list(ranks[i::n]) for i in range(n)]")),
    bug("diloco-groups-wait-torchs-default", "every process group a chapter makes waits --timeout at most (torch's "
        "default for a new group: 10 minutes on NCCL, 30 on gloo)",
        ["tests/test_diloco.py::test_every_group_waits_timeout_and_the_outer_sync_has_its_own[two-ranks-per-copy]"],
        ("diloco.py", "for i in range(n)], timeout=wait)", "for i in range(n)])")),
    bug("diloco-outer-sync-on-the-default-group", "DiLoCo's outer all-reduce runs in a group of its own, never in the "
        "one the loss lines' sums use (NCCL: a stream per group)",
        ["tests/test_diloco.py::test_every_group_waits_timeout_and_the_outer_sync_has_its_own[one-rank-per-copy]"],
        ("diloco.py", "    across, _ = dist.new_subgroups_by_enumeration([list(ranks[i::n]) for i in range(n)], timeout=wait)\n",
         "    across, _ = dist.new_subgroups_by_enumeration([list(ranks[i::n]) for i in range(n)], timeout=wait)\n"
         "    across = None if n == 1 else across\n")),
    # --- Chapter 12: torchft's quorum, its average, healing ---
    bug("ft-healed-keeps-stale-weights", "ddp_ft.py: a restarted group heals from a live one: its weights",
        ["tests/test_fault_tolerance.py::test_a_killed_group_heals_from_the_live_one_which_never_restarts"],
        ("ddp_ft.py", '    model.load_state_dict(state["model"])\n', "    pass\n")),
    bug("ft-optimizer-state-not-sent", "ddp_ft.py: a restarted group heals from a live one: its optimizer state",
        ["tests/test_fault_tolerance.py::test_a_killed_group_heals_from_the_live_one_which_never_restarts"],
        ("ddp_ft.py", '"optim": inner.state_dict(),', '"optim": {**inner.state_dict(), "state": {}},')),
    bug("ft-dead-group-still-averaged", "ddp_ft.py: a step's gradient is the mean over the groups in its quorum",
        ["tests/test_fault_tolerance.py::test_a_group_alone_steps_with_its_own_batch"],
        ("ddp_ft.py", "    manager.allreduce(flat).wait()", "    manager.allreduce(flat.div_(2), "
         "reduce_op=torch.distributed.ReduceOp.SUM).wait()")),
    bug("ft-an-all-reduce-per-tensor", "ddp_ft.py sends a step's gradients in one all-reduce (one flat buffer, as "
        "DDP's bucket), not one per tensor",
        ["tests/test_fault_tolerance.py::test_a_steps_gradients_cross_in_one_all_reduce_and_come_back_averaged"],
        ("ddp_ft.py", "    grads = [param.grad for param in model.parameters()]\n",
         "    for work in [manager.allreduce(param.grad) for param in model.parameters()]:\n        work.wait()\n"
         "    return\n")),
    bug("ft-groups-take-every-core", "ddp_ft.py on the CPU in a user's shell: the groups on one machine share its "
        "cores, as torchrun's ranks do", ["tests/test_fault_tolerance.py::test_two_groups_train_chapter_1s_model"],
        ("ddp_ft.py", "        self.cores.gather(self.manager)  # the groups now in the quorum: which machine each is on\n", "")),
    bug("ft-healed-group-takes-every-core", "ddp_ft.py: a healed group takes its share of its machine's cores too",
        ["tests/test_fault_tolerance.py::test_a_killed_group_heals_from_the_live_one_which_never_restarts"],
        ("ddp_ft.py", '    cores.take(state["hosts"])\n', "")),
    bug("ft-alone-without-a-word", "ddp_ft.py: a group that found no live group to heal from within --timeout says "
        "it trains a run of its own", ["tests/test_fault_tolerance.py::test_a_group_alone_steps_with_its_own_batch"],
        ("ddp_ft.py", "        if here < self.cfg.replica_groups:  # --timeout is over", "        if False:  # --timeout is over")),
    bug("ft-wait-spins", "ddp_ft.py: a group waiting for all groups asks the lighthouse twice a second, not 60 times",
        ["tests/test_fault_tolerance.py::test_a_group_alone_steps_with_its_own_batch"],
        ("ddp_ft.py", "            time.sleep(0.5)\n", "")),
    bug("restart-or-heal-table-not-its-runs", "docs/multinode.md: a restart against a heal, the table of its runs",
        ["tests/test_fault_tolerance_across_machines.py::"
         "test_the_docs_table_of_a_restart_against_a_heal_is_what_its_runs_measured"],
        ("measure/restart_or_heal.py", "| {column(killed, 'wall', '.1f')} ", "| {column(alone, 'wall', '.1f')} ")),
    bug("ft-silent-store-called-a-missing-rank-0", "errors do not lie: chapter 12's silent quorum store, its own words",
        ["tests/test_errors.py::test_a_step_of_chapter_12_not_committed_names_a_silent_quorum_store_in_its_own_words"],
        ("ddp_ft.py", "    silent = re.search(CONNECT_TIMED_OUT, str(error))", "    silent = None")),
    bug("ft-quorum-line-never-printed", "ddp_ft.py: one line when the quorum's size changes",
        ["tests/test_fault_tolerance.py::test_two_groups_train_chapter_1s_model"],
        ("ddp_ft.py", "        if size != self.size and size:", "        if False:")),
    bug("ft-diloco-one-outer-optimizer", "ddp_ft.py --sync-every: each fragment's outer step is its own (one outer "
        "SGD over the model would step the fragments not synced with their inner gradients)",
        ["tests/test_fault_tolerance.py::test_torchfts_streaming_diloco_saves_the_same_weights_in_both_groups"],
        ("ddp_ft.py", "    outer = [torch.optim.SGD(fragment.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum,\n"
         "                             nesterov=cfg.outer_momentum > 0) for fragment in fragments]\n",
         "    outer = torch.optim.SGD(model.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum,\n"
         "                            nesterov=cfg.outer_momentum > 0)\n")),
    bug("ft-diloco-saves-its-own-weights", "ddp_ft.py --sync-every: every group evaluates and saves the shared "
        "weights (each fragment's last sync), the same in every group",
        ["tests/test_fault_tolerance.py::test_torchfts_streaming_diloco_saves_the_same_weights_in_both_groups"],
        ("ddp_ft.py", "        return evaluated\n", "        return model\n")),
    bug("ft-diloco-gradients-averaged-too", "ddp_ft.py --sync-every: between syncs each group trains alone "
        "(chapter 11's model)", ["tests/test_fault_tolerance.py::test_torchfts_diloco_trains_chapter_11s_model"],
        ("ddp_ft.py", "        if diloco is None:\n            average_gradients",
         "        if True:\n            average_gradients")),
    bug("ft-cut-off-group-ends-in-a-traceback", "ddp_ft.py: a group that gets no quorum within --timeout (its "
        "machine cut off from the lighthouse) ends in one line naming it",
        ["tests/test_fault_tolerance_across_machines.py::"
         "test_a_cut_longer_than_the_timeout_ends_the_cut_off_group_in_one_line"],
        ("ddp_ft.py", 'if not any(frame.name == "_async_quorum" for frame', 'if any(frame.name == "_async_quorum" for frame')),
    bug("ft-heal-time-not-the-transfer", "ddp_ft.py: the healed line says how long the live group's state took to "
        "arrive", ["tests/test_fault_tolerance_across_machines.py::"
                   "test_a_killed_machine_heals_from_the_other_over_the_link[10mbit]"],
        ("ddp_ft.py", "            begin = time.perf_counter()\n            state = super().recv_checkpoint(src_rank, "
         "metadata, step, timeout)\n", "            state = super().recv_checkpoint(src_rank, metadata, step, "
         "timeout)\n            begin = time.perf_counter()\n")),
    bug("diloco-evaluates-own-weights", "DiLoCo evaluates the shared weights of the last outer step",
        ["tests/test_diloco.py::test_the_epoch_is_evaluated_on_the_shared_weights"],
        ("diloco.py", "        evaluate(diloco.shared_model(), test_loader, epoch, ctx, metrics)",
         "        evaluate(model, test_loader, epoch, ctx, metrics)")),
    bug("diloco-fp16-allowed", "DiLoCo refuses fp16 in one line (each rank's scaler skips its own steps)",
        ["tests/test_diloco.py::test_flags_that_cannot_work_are_one_line"],
        ("diloco.py", '    if cfg.precision == "fp16":  # GradScaler', '    if False:  # GradScaler')),
    bug("powersgd-fp16-allowed", "PowerSGD refuses fp16 in one line (one overflow leaves NaN in its residuals for "
        "good)", ["tests/test_comm_hooks.py::test_a_hook_that_cannot_work_is_one_line[powersgd-fp16]",
                  "tests/test_comm_hooks.py::test_powersgd_never_recovers_from_one_fp16_overflow_so_it_is_refused"],
        ("common/comm_hooks.py", 'if cfg.comm_hook.startswith("powersgd") and cfg.precision == "fp16":', 'if False:')),
    bug("comm-hook-not-a-trajectory-flag", "a snapshot resumes only with the --comm-hook it was made with",
        ["tests/test_comm_hooks.py::test_resuming_with_another_hook_is_one_line_per_rank"],
        ("common/checkpoint.py", '"precision", "comm_hook")', '"precision")')),

    # --- A link that fails between two machines ---
    bug("timeout-not-passed-to-the-group", "a link down for good: every rank ends within its --timeout",
        ["tests/test_partition.py::test_a_link_down_for_good_ends_every_rank_within_the_timeout[ddp-torchrun]"],
        ("ddp_launch.py", "world_size=world_size, timeout=timedelta(seconds=cfg.timeout),", "world_size=world_size,")),
    bug("pair-closure-not-explained", "a link down for good: each rank's one line names the network",
        ["tests/test_partition.py::test_a_link_down_for_good_ends_every_rank_within_the_timeout[ddp-tcp]"],
        ("common/ranks.py", 'r"Timed out waiting (\\d+)ms for (?:recv|send) operation|Application timeout caused pair closure"',
         'r"(never)(matches)"')),
    bug("snapshot-not-read-on-restart", "an elastic job resumes from its snapshot once the link is back",
        ["tests/test_partition.py::test_an_elastic_job_resumes_once_the_link_is_back"],
        ("common/checkpoint.py", "    if not cfg.snapshot or not path.exists():\n        return 0\n", "    return 0\n")),

    # --- Nothing lost ---
    bug("snapshot-without-optimizer-state", "nothing lost: a resumed run ends with the uninterrupted run's weights",
        ["tests/test_snapshots_and_resume.py::test_single_gpu_killed_mid_epoch_resumes_to_the_same_weights"],
        ("common/checkpoint.py", '        optimizer.load_state_dict(snapshot["optimizer"])\n', "")),
    bug("sharded-snapshot-without-optimizer-state", "chapter 7: a sharded snapshot reshards the optimizer state too",
        ["tests/test_fsdp.py::test_snapshot_saved_on_2_ranks_resumes_on_another_count[2-to-3]"],
        ("fsdp.py", 'dcp.save({"model": model_state, "optimizer": optimizer_state}', 'dcp.save({"model": model_state}'),
        ("fsdp.py", 'state = {"model": model_state, "optimizer": optimizer_state}', 'state = {"model": model_state}'),
        ("fsdp.py", 'optim_state_dict=state["optimizer"],', "optim_state_dict=optimizer_state,")),
    bug("save-in-place", "nothing lost: a failed save leaves the previous snapshot as it was",
        ["tests/test_snapshots_and_resume.py::test_full_disk_keeps_the_previous_snapshot"],
        ("common/checkpoint.py", 'tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # this process\'s own',
         "tmp = path")),

    # --- Nothing hangs, errors do not lie ---
    bug("stalled-rank-called-lost", "errors do not lie: a stopped rank is not reported as lost",
        ["tests/test_killed_and_stopped_ranks.py::test_a_stalled_rank_times_out"],
        ("common/ranks.py", 'f"no answer from another rank within --timeout', 'f"lost contact with the other ranks')),
    bug("suite-ports-in-the-ephemeral-range", "nothing hangs or fails by chance: at 16 workers no test's port is taken",
        ["tests/test_rendezvous.py::test_the_suites_ports_lie_below_the_ephemeral_range_for_any_worker_count[16]"],
        ("tests/support/ports.py", "size = min(2000, (low - 10000) // workers)", "size = 2000")),
    bug("zero-epochs-accepted", "bad flags: every entry script refuses them with one line, exit 2",
        ["tests/test_bad_flags.py::test_bad_flag_exits_2_with_one_line[single_gpu.py:--epochs 0]"],
        ("common/cli.py", "if not ok(kind(text)):", "if False:")),

    # --- Chapters 1, 2, 6 and the tools ---
    bug("dataparallel-other-shuffle", "chapter 2 trains chapter 1's model, bit for bit",
        ["tests/test_chapters_1_and_2.py::test_dataparallel_trains_the_same_model"],
        ("dataparallel.py", "num_replicas=1, rank=0, seed=cfg.seed)", "num_replicas=1, rank=0, seed=cfg.seed + 1)")),
    bug("sigusr1-not-summed", "time limits: the ranks sum the warning, so all stop after the same epoch",
        ["tests/test_snapshots_and_resume.py::test_sigusr1_to_one_rank_stops_every_rank_after_the_same_epoch"],
        ("common/checkpoint.py", "warned = all_reduce_sum([TIME_LIMIT_WARNING.is_set()], ctx)[0]",
         "warned = TIME_LIMIT_WARNING.is_set()")),
    bug("warned-job-not-requeued", "time limits: a warned job requeues itself and resumes",
        ["tests/test_slurm_requeue.py::test_a_warned_job_requeues_itself_and_ends_as_if_left_alone[srun-tasks]"],
        ("scripts/job.sh", 'scontrol requeue "$SLURM_JOB_ID" ;;', "true ;;")),
    bug("compare-models-always-agrees", "compare_models.py judges against --atol",
        ["tests/test_tools.py::test_a_difference_is_named_and_judged_against_atol"],
        ("scripts/compare_models.py", "agree = agree and diff <= atol", "agree = agree or diff <= atol")),

    # --- Chapter 7, chapter 8 and the preflight ---
    bug("fsdp-test-batches-from-own-shard", "chapter 7: every rank runs as many test batches (no hang)",
        ["tests/test_fsdp.py::test_uneven_test_shards_run_the_same_number_of_batches"],
        ("fsdp.py", "largest = math.ceil(len(test_set) / ctx.world_size)",
         "largest = len(range(ctx.rank, len(test_set), ctx.world_size))")),
    bug("early-stop-fix-not-shared", "chapter 8: --fix shares the stop decision with every rank",
        ["tests/test_debug_hang.py::test_fix_trains_chapter_1s_model[early-stop]"],
        ("debug_hang.py", "                dist.all_reduce(stop, op=dist.ReduceOp.MAX)\n", "")),
    bug("busbw-factor-dropped", "preflight: bus bandwidth as nccl-tests defines it",
        ["tests/test_preflight.py::test_bus_bandwidth_is_nccl_tests_busbw"],
        ("scripts/preflight.py", '"all_reduce": lambda n: 2 * (n - 1) / n', '"all_reduce": lambda n: 1')),
    bug("preflight-sweep-skips-sizes", "preflight: a size sweep as nccl-tests, every size timed",
        ["tests/test_preflight.py::test_preflight_on_one_machine[torchrun]"],
        ("scripts/preflight.py", "        size *= 4\n", "        size *= 16\n")),
    bug("uneven-fix-without-the-loss-line", "chapter 8: the uneven-batches fix holds at any --log-every",
        ["tests/test_debug_hang.py::test_fix_trains_chapter_1s_model[uneven-batches]"],
        ("debug_hang.py", "with Join([self.model, LossLine(len(self.loader), self.cfg, self.ctx)],",
         "with Join([self.model],")),
    bug("early-stop-plateau-1-percent", "chapter 8: --bug early-stop alone shows the bug on the full data",
        ["tests/test_debug_hang.py::test_early_stop_alone_stops_after_epoch_2_on_the_full_data"],
        ("debug_hang.py", "PLATEAU = 0.15", "PLATEAU = 0.01")),
    bug("unused-parameters-fix-dropped", "chapter 8: --fix passes find_unused_parameters=True to DDP",
        ["tests/test_debug_hang.py::test_fix_trains_chapter_1s_model[unused-parameters]"],
        ("debug_hang.py", 'find_unused = bug == "unused-parameters" and fix', "find_unused = False")),
    bug("slow-save-fix-on-the-main-thread", "chapter 8: --fix writes the checkpoint off the training path",
        ["tests/test_debug_hang.py::test_fix_trains_chapter_1s_model[slow-save]"],
        ("debug_hang.py", "        self.thread = threading.Thread(target=self._write, args=(cpu_copy(module), path, "
         "seconds))\n        self.thread.start()\n", "        self._write(cpu_copy(module), path, seconds)\n")),
    bug("slow-save-last-write-not-joined", "chapter 8: --fix joins the last checkpoint's write before the end",
        ["tests/test_debug_hang.py::test_fix_trains_chapter_1s_model[slow-save]"],
        ("debug_hang.py", "        writer.wait()  # slow-save:", "        pass  # slow-save:")),
    bug("augmentation-fix-ignores-the-index", "chapter 8: --fix draws image i's shift from (seed, epoch, i)",
        ["tests/test_debug_hang.py::test_silent_fix_trains_one_process_model[same-augmentation]"],
        ("debug_hang.py", "shifts = self.table[indices]", "shifts = self.table[:len(indices)]")),
    bug("batchnorm-fix-without-the-all-reduce", "chapter 8: --fix normalises by the global batch's statistics",
        ["tests/test_debug_hang.py::test_silent_fix_trains_one_process_model[batchnorm]"],
        ("debug_hang.py", "mean = SumOverRanks.apply(x.sum(0)) / count", "mean = x.sum(0) / len(x)"),
        ("debug_hang.py", "var = SumOverRanks.apply(((x - mean) ** 2).sum(0)) / count",
         "var = ((x - mean) ** 2).sum(0) / len(x)")),
    bug("batchnorm-fix-gradient-not-summed", "chapter 8: the hand-made batch norm's backward sums its gradients",
        ["tests/test_debug_hang.py::test_silent_fix_trains_one_process_model[batchnorm]"],
        ("debug_hang.py", "        grad = grad.clone()\n        dist.all_reduce(grad)\n        return grad\n",
         "        return grad\n")),
    bug("batchnorm-fix-biased-running-var", "chapter 8: the hand-made batch norm keeps torch's running statistics",
        ["tests/test_debug_hang.py::test_silent_fix_trains_one_process_model[batchnorm]"],
        ("debug_hang.py", "self.running_var.lerp_(var * count / (count - 1), self.momentum)",
         "self.running_var.lerp_(var, self.momentum)")),
    bug("clip-norm-not-all-reduced", "chapter 8: --fix clips by the whole gradient's norm, summed over the ranks",
        ["tests/test_debug_hang.py::test_silent_fix_trains_one_process_model[shard-grad-norm]"],
        ("debug_hang.py", "        dist.all_reduce(squares)  # FIX:", "        pass  # FIX:")),
    bug("save-wrapped-fix-saves-the-wrapper", "chapter 8: --fix saves model.module, whose keys are chapter 1's",
        ["tests/test_debug_hang.py::test_fix_trains_chapter_1s_model[save-wrapped]"],
        ("debug_hang.py", 'if bug == "save-wrapped" and not fix:', 'if bug == "save-wrapped":')),

    # --- The template (scripts/template.py): one plain file a reader copies, training chapter 1's model ---
    # Each one verified with planted.py's own copy_of_project/apply/run_tests on the whole of tests/test_template.py
    # (torch 2.14.1, CPU, 2 cores); the tests named turned red, and "also red" lists the others that did.
    # Also red: prints_chapter_1s_lines at every case, and the file test (its calls in order).
    bug("template-no-set-epoch", "same model: every epoch draws a new shuffle from seed + epoch",
        ["tests/test_template.py::test_the_template_trains_chapter_1s_model[python]",
         "tests/test_template.py::test_the_template_trains_chapter_1s_model[torchrun-2]"],
        ("scripts/template.py", "        train_sampler.set_epoch(epoch)  # without it, every epoch would repeat "
         "epoch 0's order\n", "        pass\n")),
    # Also red: prints_chapter_1s_lines[torchrun-2] and the file test.
    bug("template-whole-batch-per-rank", "same model: the global batch is --batch-size, split over the ranks",
        ["tests/test_template.py::test_the_template_trains_chapter_1s_model[torchrun-2]"],
        ("scripts/template.py", "batch_size=args.batch_size // world_size,", "batch_size=args.batch_size,")),
    # Also red: prints_chapter_1s_lines[torchrun-2] and the file test.
    bug("template-every-rank-reads-shard-0", "same model: the ranks' k-th batches together are chapter 1's k-th batch",
        ["tests/test_template.py::test_the_template_trains_chapter_1s_model[torchrun-2]"],
        ("scripts/template.py", "num_replicas=world_size, rank=rank, seed=args.seed",
         "num_replicas=world_size, rank=0, seed=args.seed")),
    # Also red: prints_chapter_1s_lines at every case.
    bug("template-seed-after-model", "same model: torch.manual_seed(seed) right before the model is built",
        ["tests/test_template.py::test_the_template_trains_chapter_1s_model[torchrun-2]"],
        ("scripts/template.py", "    torch.manual_seed(args.seed)  # the same initial weights in every chapter\n"
         "    model = build_model().to(device)\n", "    model = build_model().to(device)\n"
         "    torch.manual_seed(args.seed)  # the same initial weights in every chapter\n")),
    # Also red: prints_chapter_1s_lines at every case.
    bug("template-momentum", "same model: chapter 1's optimizer, plain SGD (momentum 0)",
        ["tests/test_template.py::test_the_template_trains_chapter_1s_model[python]"],
        ("scripts/template.py", "torch.optim.SGD(model.parameters(), lr=args.lr)",
         "torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)")),
    bug("template-test-shard-not-reduced", "exact metrics: the test counts are summed over every rank's shard",
        ["tests/test_template.py::test_the_template_prints_chapter_1s_lines[torchrun-2]"],
        ("scripts/template.py", "        dist.all_reduce(t)  # all ranks' sums: the whole test set's\n", "")),
    bug("template-loss-not-reduced", "the loss line is the global batch's mean loss, from every rank's share",
        ["tests/test_template.py::test_the_template_prints_chapter_1s_lines[torchrun-2]"],
        ("scripts/template.py", "                dist.all_reduce(t)\n", "")),
    # Also red: prints_chapter_1s_lines[torchrun-2] (Done! twice).
    bug("template-every-rank-prints", "rank 0 alone prints the tutorial lines",
        ["tests/test_template.py::test_only_rank_0_prints[torchrun-2]"],
        ("scripts/template.py", "print(*line, flush=True) if rank == 0 else None", "print(*line, flush=True)")),
    # Also red: trains_chapter_1s_model[python] and prints_chapter_1s_lines[python].
    bug("template-no-hashstore", "the template runs without torchrun too, as a world of one",
        ["tests/test_template.py::test_only_rank_0_prints[python]"],
        ("scripts/template.py", 'store = None if "RANK" in os.environ else dist.HashStore()', "store = None")),
    bug("template-batch-check-dropped", "a global batch that does not split over the ranks is refused in one line",
        ["tests/test_template.py::test_a_batch_that_does_not_split_is_refused_in_one_line"],
        ("scripts/template.py", "    if args.batch_size % world_size:\n", "    if False:\n")),
    # Also red: every test that runs the file (run from scripts/, `common` is not importable: the copy would break).
    bug("template-imports-common", "the template is one file of plain torch + torchvision, never common/",
        ["tests/test_template.py::test_the_template_is_one_plain_file_marked_like_chapter_3"],
        ("scripts/template.py", "import argparse\n",
         "import argparse\nfrom common.model import NeuralNetwork as _  # noqa: F401\n")),
    bug("template-121-lines", "the template is at most 120 lines",
        ["tests/test_template.py::test_the_template_is_one_plain_file_marked_like_chapter_3"],
        ("scripts/template.py", "import argparse\n",
         "import argparse\nimport sys  # noqa: F401  (planted: two lines too many)\nimport io  # noqa: F401\n")),
    bug("template-step-renamed", "the lesson is in the file: the 8 steps marked as chapter 3 marks them",
        ["tests/test_template.py::test_the_template_is_one_plain_file_marked_like_chapter_3"],
        ("scripts/template.py", "# Step 5, wrap:", "# Step 5, DDP:")),

    # --- docs/your_model.md: the learning rate when the global batch grows ---
    bug("chapter-1-ignores-batch-size", "a 4x global batch at the same lr trains slower; at 4x the lr it catches up",
        ["tests/test_your_model.py::test_a_4x_global_batch_at_the_same_lr_trains_slower_and_a_4x_lr_catches_up"],
        ("single_gpu.py", "batch_size=cfg.batch_size // cfg.accum_steps,", "batch_size=48 // cfg.accum_steps,")),

    # --- Chapter 9: tensor parallel, and 2-D with FSDP2 ---
    bug("tp-plan-swapped", "chapter 9: the first Linear split by its outputs, the second by its inputs",
        ["tests/test_tensor_parallel.py::test_tensor_parallel_trains_the_same_model[2ranks-dp1]"],
        ("tensor_parallel.py", '{"0": ColwiseParallel(), "2": RowwiseParallel()}', '{"0": RowwiseParallel(), "2": ColwiseParallel()}')),
    bug("tp-no-plan", "chapter 9: each rank holds its slices of the weights, not the whole model",
        ["tests/test_tensor_parallel.py::test_each_rank_holds_the_slices_of_the_plan"],
        ("tensor_parallel.py", '    parallelize_module(model.linear_relu_stack, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})\n', "")),
    bug("tp-batch-split-over-every-rank", "chapter 9: the ranks of one tp group work on the same batch",
        ["tests/test_tensor_parallel.py::test_tensor_parallel_trains_the_same_model[2ranks-dp1]"],
        ("tensor_parallel.py", "num_replicas=cfg.dp, rank=dp_rank, seed=cfg.seed)", "num_replicas=ctx.world_size, rank=ctx.rank, seed=cfg.seed)"),
        ("tensor_parallel.py", "batch_size=cfg.batch_size // (cfg.dp * cfg.accum_steps)", "batch_size=cfg.batch_size // (ctx.world_size * cfg.accum_steps)")),
    bug("2d-without-fsdp", "chapter 9 in 2-D: FSDP2 shards the tp slices over the dp rows and averages the rows",
        ["tests/test_tensor_parallel.py::test_tensor_parallel_trains_the_same_model[4ranks-dp2]"],
        ("tensor_parallel.py", "    if cfg.dp > 1:  # 2-D", "    if False:  # 2-D")),

    # --- Chapter 10: pipeline parallel ---
    bug("tp-sums-over-every-rank", "chapter 9: the loss lines and images/s count each image once (ctx.data_group)",
        ["tests/test_tensor_parallel.py::test_tensor_parallel_trains_the_same_model[2ranks-dp1]"],
        ("tensor_parallel.py", '    ctx = replace(ctx, data_group=mesh.get_group("dp"))\n', "")),
    bug("tp-mesh-tp-by-dp", "chapter 9: the mesh is dp rows of tp neighbours, not tp rows of dp",
        ["tests/test_tensor_parallel.py::test_tensor_parallel_trains_the_same_model[4ranks-dp2]"],
        ("tensor_parallel.py", "grid = torch.arange(ctx.world_size).reshape(cfg.dp, tp)",
         "grid = torch.arange(ctx.world_size).reshape(tp, cfg.dp).T")),
    bug("tp-test-batches-of-1000", "chapter 9: every row runs as many test batches (each forward is collective)",
        ["tests/test_tensor_parallel.py::test_2d_with_uneven_test_shards_runs_as_many_test_batches_on_every_row"],
        ("tensor_parallel.py", "batch_size=math.ceil(largest / math.ceil(largest / 1000)),", "batch_size=1000,")),
    bug("tp-mesh-waits-torchs-default", "chapter 9 in 2-D: a rank that stops answering ends the others at --timeout",
        ["tests/test_tensor_parallel.py::test_a_2d_rank_whose_peer_stops_answering_ends_within_the_timeout"],
        ("tensor_parallel.py", "timeout=wait)  # a column", "timeout=None)  # a column"),
        ("tensor_parallel.py", "timeout=wait)  # a row", "timeout=None)  # a row")),
    bug("pp-1f1b-runs-gpipe", "chapter 10: --schedule 1f1b runs one forward, one backward",
        ["tests/test_pipeline.py::test_the_timetable_shows_the_schedule[2stages-1f1b]"],
        ("pipeline.py", '"1f1b": Schedule1F1B}', '"1f1b": ScheduleGPipe}')),
    bug("pp-grads-divided-by-microbatches", "chapter 10: the micro-batches' losses add up to the step's mean loss",
        ["tests/test_pipeline.py::test_the_pipeline_trains_the_same_model[2stages-gpipe]"],
        ("pipeline.py", "loss_fn=loss_fn, scale_grads=False)", "loss_fn=loss_fn, scale_grads=True)")),
    bug("pp-micro-batch-loss-is-its-mean", "chapter 10: each micro-batch's loss is its share of the step's images",
        ["tests/test_pipeline.py::test_the_pipeline_trains_the_same_model[3stages-1f1b]"],
        ("pipeline.py", 'reduction="sum", ignore_index=PADDING) / self.images', 'ignore_index=PADDING)')),
    bug("pp-padding-labelled-0", "chapter 10: a short step's padding adds no loss and no gradient",
        ["tests/test_pipeline.py::test_a_short_last_step_is_padded_and_counts_only_its_images[2-gpipe]"],
        ("pipeline.py", "y.new_full((missing,), PADDING)", "y.new_zeros(missing)")),
    bug("pp-padding-counted-in-test", "chapter 10: every test image counted once, no padding",
        ["tests/test_pipeline.py::test_the_pipeline_trains_the_same_model[2stages-gpipe]"],
        ("pipeline.py", "            real = y != PADDING\n", "            real = y == y\n")),
    bug("pp-optimizer-state-not-flattened", "chapter 10: a snapshot of 2 stages resumes on 3, momentum and all",
        ["tests/test_pipeline.py::test_a_snapshot_of_2_stages_resumes_on_3"],
        ("common/checkpoint.py", "StateDictOptions(flatten_optimizer_state_dict=True)", "StateDictOptions()")),
    bug("ddp-picture-buckets-reversed", "README's DDP picture: the buckets a real DDP makes, in the order it sends them",
        ["tests/test_tools.py::test_the_ddp_picture_draws_the_buckets_a_real_ddp_makes"],
        ("measure/draw_ddp.py", "for group, size in zip(indices, sizes)]", "for group, size in zip(indices[::-1], sizes[::-1])]")),
    bug("table-without-the-ring-factor", "the strategy table: bytes sent as a ring algorithm sends them",
        ["tests/test_strategy_table.py::test_the_numbers_are_what_each_strategy_must_hold_and_send"],
        ("measure/harness.py", "return 2 * (n - 1) / n * size(c[\"sizes\"])", "return size(c[\"sizes\"])")),
    bug("table-p2p-not-counted", "the strategy table: the pipeline's sends are counted",
        ["tests/test_strategy_table.py::test_the_numbers_are_what_each_strategy_must_hold_and_send"],
        ("measure/strategy_table.py", "    dist.P2POp = CountedP2POp\n", "")),
    bug("fsdp-cpu-check-skips-one-rank", "fsdp.py on a torch whose FSDP2 cannot run on the CPU stops in one line, "
        "one rank too", ["tests/test_cli.py::test_fsdp_on_a_torch_without_cpu_stream_events_is_one_line[1]"],
        ("fsdp.py", 'check_fsdp2(cfg, "fsdp.py", int(os.environ.get("WORLD_SIZE", 1)))',
         'check_fsdp2(cfg, "fsdp.py", int(os.environ.get("WORLD_SIZE", 1)), uses_fsdp2=int(os.environ.get("WORLD_SIZE", 1)) > 1)')),
    bug("link-shaped-one-way", "scaling: each direction of the two machines' link carries no more than its rate",
        ["tests/test_scaling.py::test_a_shaped_link_is_no_faster_than_its_rate"],
        ("measure/netns.py", "        for ns in self.ns.values():\n            subprocess.run([\"ip\", \"netns\", \"exec\", ns, \"tc\"",
         "        for ns in list(self.ns.values())[:1]:\n            subprocess.run([\"ip\", \"netns\", \"exec\", ns, \"tc\"")),
    bug("link-bursts-a-whole-step", "scaling: a small all-reduce after an idle gap takes at least its wire time",
        ["tests/test_scaling.py::test_a_small_all_reduce_after_an_idle_gap_takes_its_wire_time[10mbit]"],
        ("measure/netns.py", "    return max(1600, bits", "    return max(32 * 1024, bits")),
    bug("docs-keep-a-run-faster-than-the-link", "no figure in docs/scaling.md is under its bytes' wire time",
        ["tests/test_scaling.py::test_no_run_in_docs_crossed_the_link_faster_than_its_rate"],
        ("docs/scaling.json", """   "row": "powersgd",
   "rate": "100mbit",""", """   "row": "powersgd",
   "rate": "10mbit",""")),  # a PowerSGD step's 8.6 ms at 10 Mbit/s, as the bursty link let the dropped runs through
    bug("doc-link-to-a-moved-run", "the docs' links lead to a file and a heading it has",
        ["tests/test_docs.py::test_every_link_between_the_docs_leads_to_a_file_and_its_heading"],
        ("RUN.md", "(docs/scaling.md#the-runs-as-they-printed)", "(RUN.md#why-is-ddp-slower-than-one-process)")),
    bug("bf16-hook-is-fp16s", "each --comm-hook value is the hook it names: bf16 sends bfloat16",
        ["tests/test_comm_hooks.py::test_each_comm_hook_value_sends_what_it_names[bf16]"],
        ("common/comm_hooks.py", 'getattr(default_hooks, f"{name}_compress_hook")', "default_hooks.fp16_compress_hook")),
    bug("powersgd-rank-ignored", "each --comm-hook value is the hook it names: powersgd:RANK sends RANK columns",
        ["tests/test_comm_hooks.py::test_each_comm_hook_value_sends_what_it_names[powersgd:2:5]"],
        ("common/comm_hooks.py", "matrix_approximation_rank=rank,", "matrix_approximation_rank=1,")),
    bug("powersgd-start-ignored", "each --comm-hook value is the hook it names: powersgd:R:START compresses from START",
        ["tests/test_comm_hooks.py::test_each_comm_hook_value_sends_what_it_names[powersgd:2:5]"],
        ("common/comm_hooks.py", "start_powerSGD_iter=start)", "start_powerSGD_iter=POWERSGD_START)")),
    bug("whole-runs-best-of", "scaling: a whole-run figure is the mean of its repeats, min-max beside it",
        ["tests/test_scaling.py::test_whole_runs_are_timed_and_scored_as_a_user_runs_them"],
        ("measure/scaling.py", '    return f"{fmt(mean(values))} ({fmt(min(values))}-{fmt(max(values))})"',
         '    return f"{fmt(max(values))} ({fmt(min(values))}-{fmt(max(values))})"')),
    bug("scaling-adds-overlapping-collectives", "scaling: communication is the time on the link, not the sum of "
        "collectives running at once", ["tests/test_scaling.py::test_scaling_times_the_communication_on_the_link[ddp]"],
        ("measure/harness.py", "        a, b = max(a, reach), min(b, end)", "        a, b = max(a, start), min(b, end)")),
    bug("scaling-compute-from-the-two-rank-run", "scaling: compute is the step at world size 1; the rest is waiting",
        ["tests/test_scaling.py::test_scaling_times_the_communication_on_the_link[ddp]"],
        ("measure/scaling.py", 'compute = median(alone[name]["steps"])', "compute = step")),
    bug("scaling-all-gather-counts-its-input", "scaling: an all-gather brings every other rank's piece",
        ["tests/test_scaling.py::test_scaling_counts_the_bytes_each_strategy_sends[fsdp]"],
        ("measure/scaling.py", 'gathered = [ranks * math.prod(shape)] if kind == "all_gather" else shape',
         "gathered = shape")),
    bug("scaling-by-kind-counts-every-collective", "scaling: each kind of collective against its own floor",
        ["tests/test_scaling.py::test_scaling_counts_the_bytes_each_strategy_sends[fsdp]"],
        ("measure/scaling.py", 'kinds={kind: timed([e for e in gloo if e.name == f"gloo:{kind}"]) for kind in kinds}',
         "kinds={kind: timed(gloo) for kind in kinds}")),
    bug("order-receive-first-sends-first", "scaling --order: a receive posted first lets both directions run at once",
        ["tests/test_scaling.py::test_gloo_sends_nothing_until_the_peer_is_ready_to_receive"],
        ("measure/scaling.py", "posted = [dist.irecv(theirs, peer), dist.isend(mine, peer)] if",
         "posted = [dist.isend(mine, peer), dist.irecv(theirs, peer)] if")),
    bug("congestion-control-unchecked", "scaling: a congestion control the kernel lacks is one line",
        ["tests/test_scaling.py::test_a_congestion_control_the_kernel_lacks_is_one_line"],
        ("measure/harness.py", "        if congestion_control not in kernel:\n",
         "        if False:\n")),

    # --- The GPU path, played on the CPU ---
    bug("every-rank-downloads", "the ranks of one machine fetch the data once",
        ["tests/test_data.py::test_the_ranks_of_one_machine_download_the_data_once"],
        ("common/ranks.py", "    if ctx.local_rank != 0:\n        dist.barrier()  # It meets", "    if False:\n        dist.barrier()  # It meets"),
        ("common/ranks.py", "    if ctx.local_rank == 0:\n        dist.barrier()\n", "    if True:\n        dist.barrier()\n")),
    bug("own-gpu-refused", "srun --gpus-per-task 1: a rank that sees one GPU uses it",
        [f"{GPU_PATH}::test_each_rank_finds_its_gpu[srun-gpu-per-task]"],
        ("common/ranks.py", "    if gpus == 1 and not ranks_here:", "    if False:")),
    bug("nccl-connects-lazily", "NCCL connects inside init_process_group (device_id)",
        [f"{GPU_PATH}::test_nccl_is_bound_to_the_ranks_gpu_at_init[ddp_slurm.py]"],
        ("ddp_slurm.py", 'device_id=device if device.type == "cuda" else None)', "device_id=None)")),
    bug("unknown-error-loses-its-traceback", "errors: anything not recognised keeps its whole message and traceback",
        ["tests/test_errors.py::test_an_unknown_error_keeps_every_line_and_its_traceback"],
        ("common/cli.py", 'shown = "".join(traceback.format_exception(error))', 'shown = ""')),
    bug("no-nccl-flight-record", "chapter 8 on NCCL: the watchdog writes the flight record",
        [f"{GPU_PATH}::test_chapter_8_lets_the_nccl_watchdog_write_the_flight_record"],
        ("debug_hang.py", '        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")\n', "")),
    bug("tp-last-linear-left-plain", "chapter 9: every weight a DTensor, so a GPU's foreach optimizer step runs",
        ["tests/test_tensor_parallel.py::test_tensor_parallel_trains_the_same_model[2ranks-dp1]"],
        ("tensor_parallel.py", "    distribute_module(model.linear_relu_stack[4], mesh[\"tp\"],\n",
         "    if False:  # planted: the last Linear stays a plain tensor\n        distribute_module(model.linear_relu_stack[4], mesh[\"tp\"],\n")),
    bug("cpu-defaults-in-the-suite", "the suite takes CUDA's defaults (foreach, autocast's dtype) in every process",
        ["tests/test_cuda_defaults_and_no_host_sync.py::test_every_process_the_suite_starts_takes_cudas_defaults"],
        ("tests/programs/cuda_defaults/sitecustomize.py", 'if __name__ == "sitecustomize" and', "if False and"),
        ("tests/conftest.py", 'if os.environ.get("TUTORIAL_CPU_DEFAULTS") != "1":', "if False:")),
    bug("labels-from-the-host", "no host sync per step: the labels live on the training device",
        ["tests/test_cuda_defaults_and_no_host_sync.py::test_a_training_step_reads_and_copies_nothing_on_the_host"],
        ("common/data.py", "s.targets[:n].to(device))", "s.targets[:n])")),
    bug("batch-index-copy-blocks", "no host sync per step: the batch's index goes to the device without waiting",
        ["tests/test_cuda_defaults_and_no_host_sync.py::test_a_training_step_reads_and_copies_nothing_on_the_host"],
        ("common/data.py", ".to(self.labels.device, non_blocking=True)", ".to(self.labels.device)")),
    bug("ddp-wraps-on-the-local-rank", "DDP's device_ids name the GPU the rank computes on, not its local rank",
        [f"{GPU_PATH}::test_ddp_wraps_the_model_on_the_gpu_the_rank_computes_on[ddp_slurm.py]"],
        ("ddp_slurm.py", 'device_ids=[ctx.device] if ctx.device.type == "cuda"',
         'device_ids=[ctx.local_rank] if ctx.device.type == "cuda"')),
    bug("nccl-record-from-the-generic-recorder", "chapter 8 on NCCL: a rank writes NCCL's own flight record",
        ["tests/test_debug_hang.py::test_on_nccl_the_record_comes_from_nccls_own_recorder"],
        ("debug_hang.py", 'c10d._dump_nccl_trace() if dist.get_backend() == "nccl" else c10d._dump_fr_trace()',
         "c10d._dump_fr_trace()")),
    bug("1f1b-too-few-microbatches-after-rendezvous", "pipeline.py refuses 1F1B with fewer micro-batches than stages "
        "before the rendezvous", ["tests/test_pipeline.py::test_bad_flag_exits_2_with_one_line[1f1b-too-few]"],
        ("pipeline.py", 'if cfg.schedule == "1f1b" and cfg.microbatches < world_size:', "if False:")),
    bug("triton-compiler-error-raw", "--compile on a GPU without a C compiler is one line that names it",
        ["tests/test_errors.py::test_recognised_errors_are_explained"],
        ("common/cli.py", 'r"Failed to find C\\+?\\+? compiler|', 'r"Failed to find the C compiler|')),
    # --- Proved where it runs: the GPU path's third reading, the twins, the seed ---
    bug("powersgd-residuals-not-saved", "--snapshot with PowerSGD resumes on a GPU: the state comes back whole",
        ["tests/test_comm_hooks.py::test_a_powersgd_snapshot_loads_onto_a_gpu"],
        ("common/comm_hooks.py", "error=cpu(self.state.error_dict)", "error={}")),
    bug("powersgd-on-the-cpu-of-a-gpu-machine", "--comm-hook powersgd with --device cpu where a GPU is visible is "
        "refused in one line", ["tests/test_comm_hooks.py::test_powersgd_on_the_cpu_where_a_gpu_is_visible_is_one_line"],
        ("common/comm_hooks.py", 'if cfg.comm_hook.startswith("powersgd") and cfg.device == "cpu" and',
         'if False and cfg.device == "cpu" and')),
    bug("localsgd-syncs-the-gpu-on-the-cpu", "--comm-hook localsgd with --device cpu where a GPU is visible opens "
        "no CUDA context",
        ["tests/test_comm_hooks.py::test_localsgd_on_the_cpu_where_a_gpu_is_visible_opens_no_cuda_context"],
        ("common/comm_hooks.py", 'if flat.device.type != "cpu":', "if torch.accelerator.is_available():")),
    bug("gpu-suite-expects-a-moved-class", "the GPU suite names what the code has",
        [f"{GPU_SUITE}::test_the_gpu_suite_names_what_the_code_has"],
        ("tests/test_gpu.py", 'f"{DataParallel.__module__} DataParallel', '"common.engine DataParallel')),
    bug("flight-recorder-under-deprecated-names", "chapter 8 sets the flight recorder's variables under the names "
        "its torch reads", [f"{GPU_PATH}::test_chapter_8_lets_the_nccl_watchdog_write_the_flight_record"],
        ("debug_hang.py", '("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE") if', '("TORCH_NCCL_TRACE_BUFFER_SIZE", '
         '"TORCH_NCCL_DEBUG_INFO_TEMP_FILE") if')),
    bug("docs-say-fp16-never-syncs", "the docs say which modes read back from the GPU each step",
        ["tests/test_cuda_defaults_and_no_host_sync.py::test_the_docs_say_which_modes_read_back_each_step"],
        ("docs/benchmark.md", "| `--precision fp16` | one: `GradScaler.step()`", "| `--precision fp16` | none: `GradScaler.step()`")),
    bug("loss-read-back-every-step", "no host sync per step: the loss is summed on the device",
        ["tests/test_cuda_defaults_and_no_host_sync.py::test_a_training_step_reads_and_copies_nothing_on_the_host[fp32]"],
        ("common/engine.py", "        loss_sum.add_(step_loss, alpha=images)\n",
         "        loss_sum.add_(float(step_loss) * images)\n")),
    bug("tp-sampler-ignores-seed", "same model at any seed: every chapter's shuffle comes from --seed",
        ["tests/test_ddp.py::test_another_seed_trains_chapter_1s_model_at_that_seed[tensor_parallel.py]"],
        ("tensor_parallel.py", "num_replicas=cfg.dp, rank=dp_rank, seed=cfg.seed)", "num_replicas=cfg.dp, rank=dp_rank)")),
    bug("srun-sampler-ignores-seed", "same model at any seed: every chapter's shuffle comes from --seed",
        ["tests/test_ddp.py::test_another_seed_trains_chapter_1s_model_at_that_seed[srun-env]"],
        ("ddp_slurm.py", "rank=ctx.rank, seed=cfg.seed)", "rank=ctx.rank)")),
    bug("a-flag-without-a-cuda-twin", "every flag and mode has a CUDA twin in tests/test_gpu.py",
        [f"{GPU_SUITE}::test_every_flag_has_a_cuda_twin"],
        ("tests/support/cuda_twins.py", '    Twin("pipeline.py", ("--microbatches", "2")),\n', "")),
    bug("a-chapter-resumes-no-twin", "every chapter that takes --snapshot resumes on CUDA in tests/test_gpu.py",
        [f"{GPU_SUITE}::test_every_flag_has_a_cuda_twin"],
        ("tests/support/cuda_twins.py", '    Twin("pipeline.py", MOMENTUM, "resume"),\n', "")),
    bug("a-step-that-died-of-138-waited-for", "batch scripts: a step that ended 138 ends the job with 138",
        ["tests/test_slurm_env.py::test_a_step_that_ends_with_138_ends_the_job_with_its_status[job.sh-exec sleep 30]"],
        ("scripts/job.sh", 'while [ "$status" = 138 ] && kill -0 "$step" 2>/dev/null; do',
         'while [ -n "$warned" ] && [ "$status" = 138 ]; do')),
    bug("job-torchrun-runs-chapter-3-only", "scripts/job_torchrun.sh runs the torchrun chapter named first",
        ["tests/test_slurm.py::test_a_torchrun_job_runs_the_chapter_named_first"],
        ("scripts/job_torchrun.sh", 'case "$1" in *.py) chapter=$1; shift ;; esac\n', "")),
    bug("torchrun-needs-coreutils-8.31", "batch scripts: torchrun ignores SIGUSR1 on any cluster's coreutils",
        ["tests/test_slurm_env.py::test_torchrun_starts_with_the_warning_ignored_without_coreutils_8_31"],
        ("scripts/job_torchrun.sh", """bash -c 'trap "" USR1; exec torchrun "$@"' torchrun""",
         "env --ignore-signal=USR1 torchrun")),
    # --- Warm starts: the zygote changes nothing but the cost of a worker's start, and never a cold test's ---
    bug("zygote-warms-every-test", "the tests of the start, QUICK and 'as a user runs it' start cold",
        ["tests/test_errors.py::test_a_rank_that_fails_with_a_collective_in_flight_says_its_line_and_leaves_at_once",
         "tests/test_ddp.py::test_ddp_trains_the_same_model[torchrun-2]"],
        ("tests/support/zygote.py", "    if not allowed or list(cmd", "    if list(cmd")),
    bug("zygote-loses-unclosed-files", "a warm worker's exit writes its unclosed files, as the interpreter's does",
        ["tests/test_warm_starts.py::test_a_warm_worker_exits_as_a_cold_one[0-0]"],
        ("tests/programs/zygote.py", "obj.closed or obj.flush()", "obj.closed")),
    bug("zygote-signals-not-forwarded", "a signal to the zygote's executable reaches the worker",
        ["tests/test_warm_starts.py::test_signals_reach_the_worker_and_its_executables_death_ends_it"],
        ("tests/programs/zygote_exec.py", "        signal.signal(sig, forward)\n", "")),
    bug("zygote-orphans-its-worker", "a SIGKILLed executable takes its warm worker with it",
        ["tests/test_warm_starts.py::test_signals_reach_the_worker_and_its_executables_death_ends_it"],
        ("tests/programs/zygote.py", '    threading.Thread(target=watch, daemon=True, name="zygote-watch").start()\n', "")),
    bug("forkrun-forks-what-must-start-cold", "a forked case whose environment sets a variable read at the start "
        "runs in a new interpreter (here a PYTHONPATH whose sitecustomize shows torch two GPUs)",
        ["tests/test_docs.py::test_troubleshooting_message_is_what_the_script_prints[error: 4 ranks on this machine "
         "but 2 GPU(s) visible ...]"],
        ("tests/programs/forkrun.py", "    if differs(env, STARTED_WITH):\n", "    if False:\n")),
    bug("zygote-ignores-import-time-variables", "a request whose import-time variables differ runs cold",
        ["tests/test_warm_starts.py::test_a_request_whose_start_differs_runs_cold"],
        ("tests/programs/import_time.py", "    return sorted(k for k in keys if env.get(k) != started_with.get(k))",
         "    return []")),
    # --- The exercises (docs/exercises.md, README's "Try it") ---
    bug("set-epoch-hidden-in-the-loop", "the exercise: without the chapter's set_epoch, epoch 2 repeats epoch 1's order",
        ["tests/test_exercises.py::test_without_set_epoch_epoch_2_repeats_epoch_1s_order"],
        ("common/engine.py", "    model.train()\n", "    model.train()\n    loader.sampler.set_epoch(epoch)\n")),
    bug("chapter-1-shuffle-unseeded", "the exercise: chapter 1 run twice trains the same model",
        ["tests/test_exercises.py::test_chapter_1_twice_is_the_same_model"],
        ("single_gpu.py", "num_replicas=1, rank=0, seed=cfg.seed)", "num_replicas=1, rank=0, seed=torch.seed() % 2**31)")),
    bug("chapter-1-trains-past-the-warning", "time limits: chapter 1 alone stops at its snapshot when SLURM warns",
        ["tests/test_snapshots_and_resume.py::test_sigusr1_stops_chapter_1_after_the_epoch_at_its_snapshot"],
        ("single_gpu.py", "            return  # SLURM warned of its time limit", "            pass  # SLURM warned of its time limit")),
]


def copy_of_project(folder):
    """The project's files (tracked, and untracked ones git does not ignore) copied into folder; ./data linked."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    if (REPO / "data").is_dir():
        (folder / "data").symlink_to(REPO / "data")
    return folder


def apply(mutation, folder):
    """Patch the copy in folder; raises ValueError when a patch's text is not there exactly once."""
    for file, old, new in mutation.patches:
        path = folder / file
        text = path.read_text()
        if text.count(old) != 1:
            raise ValueError(f"{mutation.name}: {file} holds {text.count(old)} copies of {old!r}, not 1: "
                             f"update the entry")
        path.write_text(text.replace(old, new))


def run_tests(folder, tests, timeout):
    """pytest on the named tests in folder: ({node id: outcome}, seconds). CI is unset, so a skip stays a skip."""
    report = folder / "report.xml"
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    start = time.monotonic()
    try:
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                        *tests], cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {test: "timeout" for test in tests}, time.monotonic() - start
    outcomes = {}
    if report.exists():
        for case in ET.parse(report).iter("testcase"):
            node = f"{case.get('file') or case.get('classname').replace('.', '/') + '.py'}::{case.get('name')}"
            kinds = {child.tag for child in case}
            outcomes[node] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
    return outcomes, time.monotonic() - start


def check(mutation, baseline, timeout):
    """Run one planted bug (and, with baseline, its tests unpatched first); returns (ok, line to print)."""
    with tempfile.TemporaryDirectory(prefix=f"mutation-{mutation.name}-") as tmp:
        folder = copy_of_project(Path(tmp))
        if baseline:
            outcomes, seconds = run_tests(folder, mutation.tests, timeout)
            bad = {t: o for t, o in outcomes.items() if o != "passed"}
            if bad or not outcomes:
                return False, f"BASELINE FAILS {mutation.name}: without the bug {bad or 'no test ran'} ({seconds:.0f}s)"
        try:
            apply(mutation, folder)
        except ValueError as e:
            return False, f"STALE  {e}"
        outcomes, seconds = run_tests(folder, mutation.tests, timeout)
    red = sorted(f"{t} ({o})" for t, o in outcomes.items() if o in ("failure", "error", "timeout"))
    if red:  # (failure): an assertion; (error): a fixture, e.g. the reference run, broke; (timeout): it hung
        return True, f"CAUGHT {mutation.name} ({seconds:.0f}s) by {', '.join(red)}"
    return False, f"MISSED {mutation.name} ({seconds:.0f}s): {outcomes or 'no test ran'}"


def check_entries(chosen):
    """Without planting anything: every test the chosen entries name is collected, every patch finds its text once.
    Returns the problems, one line each."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"], cwd=REPO,
                          capture_output=True, text=True)
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    if proc.returncode != 0 or not collected:
        return [f"pytest --collect-only failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"]
    problems = []
    for m in chosen:
        for test in m.tests:  # a test id, or a test named without its case: all its cases
            if not any(node == test or node.startswith(f"{test}[") for node in collected):
                problems.append(f"NO TEST {m.name}: {test} is not collected")
        for file, old, new in m.patches:
            path = REPO / file
            if not path.is_file():
                problems.append(f"STALE  {m.name}: no file {file}")
            elif path.read_text().count(old) != 1:
                problems.append(f"STALE  {m.name}: {file} holds {path.read_text().count(old)} copies of {old!r}, not 1")
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="planted bugs to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the planted bugs and their tests")
    parser.add_argument("--baseline", action="store_true", help="first run each one's tests unpatched")
    parser.add_argument("--check", action="store_true",
                        help="plant nothing: check that every named test is collected and every patch applies")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds for one planted bug's tests")
    args = parser.parse_args()
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"no planted bug named {', '.join(unknown)} (see --list)")
    chosen = [known[n] for n in args.names] or MUTATIONS
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.breaks}\n    " + "\n    ".join(m.tests))
        return 0
    if args.check:
        problems = check_entries(chosen)
        print("\n".join(problems) or f"{len(chosen)} planted bugs: every test they name is collected, every patch "
                                     "applies", flush=True)
        return 1 if problems else 0
    start, missed = time.monotonic(), 0
    for m in chosen:
        ok, line = check(m, args.baseline, args.timeout)
        missed += not ok
        print(line, flush=True)
    minutes = (time.monotonic() - start) / 60
    print(f"{len(chosen) - missed} of {len(chosen)} planted bugs caught in {minutes:.1f} minutes", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
