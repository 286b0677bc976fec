"""The docs cannot drift: every command in README.md, the docs/ pages it links and RUN.md is run here, or listed below
with the reason it can't be.

Commands are the ```bash lines of README.md and docs/*.md, and the `$ ` lines of ```console blocks. Each document's
commands run in order, in a scratch folder that links to the scripts (later commands use what earlier ones wrote:
runs/..., snapshots), with the training scripts on a small slice of the real data, and port 29500 swapped for a free
one: one test per document, and per `## ` section for the long ones (SPLIT), each section in a folder of its own. A
command must end with the exit status RUN.md shows for it (`[exit status N]`), or 0.

The troubleshooting messages (docs/troubleshooting.md) are real too: each one is made to happen (MAKE_IT_PRINT) and
must start a line the script prints, with `...` standing for the parts that vary.
"""
import ast
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from common.model import NeuralNetwork
from support import REPO
from support.data import make_fake_fashion_mnist
from support.launchers import stale_rendezvous_file
from support.ports import free_port
from support.shared_runs import made_once
from support.run import BASE_ENV, TORCHRUN, no_abort_at_exit, run_forked, run_script

# (pattern, reason): commands that are not run here, and why. A doc command must match one, or run.
NOT_RUN_HERE = [
    (r"^make test$|^python -m pytest", "the test suite itself: .ci/run runs it"),
    (r"^make run$", "set-up plus `python single_gpu.py`, which RUN.md's chapter 1 command runs here"),
    (r"^source \.venv/bin/activate$", "the suite's commands run with the venv's python and torchrun on PATH already"),
    (r"10\.0\.0\.1|/shared/", "needs two machines: tests/test_multinode.py runs these on two network namespaces"),
    (r"(^|\s)(sbatch|sinfo|squeue|scontrol)(\s|$)|^cat fmnist-", "needs a SLURM cluster: tests/test_slurm.py submits "
                                                           "job.sh and job_torchrun.sh with the CPU overrides"),
    (r"benchmark\.py --before", "needs a second checkout beside this one (a git worktree of main)"),
    (r"measure/scaling\.py", "needs root and network namespaces, and the sweep takes minutes: tests/test_scaling.py runs "
                              "its DDP and FSDP2 rows at 100 Mbit/s and checks their numbers"),
    (r"measure/restart_or_heal\.py", "needs root, network namespaces and torchft, and takes 12 minutes: "
                                     "tests/test_fault_tolerance_across_machines.py checks docs/multinode.md's table "
                                     "against its runs' JSON; test_multinode.py and that file run each way's kill"),
    (r"timeline\.py .*--link", "needs root and network namespaces: tests/test_timeline.py runs it and checks that the "
                               "link held the all-reduces back"),
    (r"torchft_lighthouse|ddp_ft\.py|replica-group|runs/ft_diloco_", "a lighthouse and a job per machine (one killed "
                                                                   "and started again), and what they saved: "
                                                                   "tests/test_fault_tolerance.py starts them as these "
                                                                   "commands do and compares the groups' weights"),
    (r"timeline\.py (fsdp|tensor_parallel|pipeline)\.py", "tests/test_timeline.py runs these (FSDP2, tensor parallel, the "
                                                          "pipeline at 2 and 3 stages) and checks each trace"),
]
SLICE = "--train-samples 960 --test-samples 500"
CHAPTER_NAMES = ("single_gpu", "dataparallel", "ddp_launch", "ddp_by_hand", "ddp_mp", "ddp_tcp_manual", "ddp_slurm",
                 "fsdp", "debug_hang", "tensor_parallel", "pipeline", "diloco", "ddp_comm_hooks", "scripts/template")
# A chapter or the template started by python or torchrun (not one named as a pattern: `pgrep -f ddp_launch.py`).
CHAPTER = re.compile(r"((?:python3?|torchrun)\s(?:[^;&|()]*?\s)?(?:" + "|".join(CHAPTER_NAMES) + r")\.py)\b")


def docs():
    """README.md, the docs/*.md pages it links, then RUN.md: every document whose commands must work."""
    linked = re.findall(r"\]\((docs/[\w-]+\.md)\)", (REPO / "README.md").read_text())
    return ["README.md", *dict.fromkeys(linked), "RUN.md"]


def doc_commands(name):
    """[(command, expected exit status or None)] in document order."""
    return [command for _, commands in doc_sections(name) for command in commands]


def doc_sections(name):
    """[(heading, its commands as doc_commands gives them)] per `## ` section (a `### ` stays in its section); the
    text above the first heading is the section "top"."""
    text, title, sections = (REPO / name).read_text(), "top", []
    in_block, lines = False, []
    for line in text.splitlines(keepends=True):
        in_block ^= line.startswith("```")
        if line.startswith("## ") and not in_block:
            sections.append((title, _commands(name, "".join(lines))))
            title, lines = line[3:].strip(), []
        else:
            lines.append(line)
    return [*sections, (title, _commands(name, "".join(lines)))]


def _commands(name, text):
    found = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        lines = body.splitlines()
        for i, line in enumerate(lines):
            if name != "RUN.md" and lang == "bash":
                command = line.split("  #")[0].strip()
                if command and not command.startswith("#"):
                    found.append((command, None))
            elif lang == "console" and line.startswith("$ "):
                output = []
                for later in lines[i + 1:]:
                    if later.startswith("$ "):
                        break
                    output.append(later)
                status = re.findall(r"^\[exit status (\d+)\]$", "\n".join(output), re.M)
                found.append((line[2:], int(status[-1]) if status else None))
    return found


def reason_not_run(command):
    return next((reason for pattern, reason in NOT_RUN_HERE if re.search(pattern, command)), None)


def runnable(command, data_dir, port):
    """The command as the test runs it: the chapters on a slice of the data, the benchmark on two rows, once each."""
    command = CHAPTER.sub(lambda m: f"{m.group(1)} --data-dir {data_dir} {SLICE}", command)
    command = re.sub(r"(measure/benchmark\.py[^;&|]*)", r"\1 --epochs 1 --rounds 1 --cases single_gpu,floor ", command)
    if "kill -9" in command:  # the kill demos: an epoch of the slice takes a fraction of a second, so kill sooner
        command = re.sub(r"sleep \d+;", "sleep 0.05;", command.replace("sleep 0.5;", "sleep 0.02;"))
    return command.replace("29500", str(port))


# Documents long enough to run per `## ` section, in parallel (pytest -n): RUN.md took 685 s as one test.
SPLIT = ("README.md", "RUN.md")
RUN_PATH = re.compile(r"runs/[\w.-]+")  # a run's folder (runs/single_gpu) or a snapshot file (runs/snap.pt)


def to_run(doc, commands):
    """The commands of doc the test runs: not one with a reason not to, and on another page not one RUN.md shows (it
    runs there, word for word, with its output; a page's commands that use what it wrote are RUN.md's too, or the
    page's own run fails)."""
    in_run_md = {command for command, _ in doc_commands("RUN.md")} if doc != "RUN.md" else set()
    return [(command, status) for command, status in commands if not reason_not_run(command) and command not in in_run_md]


def written(command):
    """The runs/ paths a command writes: each chapter it starts (python or torchrun, the chapter the first script
    named) writes its --output (else runs/<chapter>) and its --snapshot."""
    paths = set()
    for part in re.split(r"[;&|()]", command):
        script = re.search(r"(?:^|\s)(\S+)\.py(?:\s|$)", part)
        if script and script[1] in CHAPTER_NAMES and CHAPTER.search(part):
            output = re.search(r"--output\s+(\S+)", part)
            paths |= {output[1] if output else f"runs/{Path(script[1]).name}", *re.findall(r"--snapshot\s+(\S+)", part)}
    return paths


def doc_runs():
    """(doc, section) for each test: a document with a command to run, whole (section None), or each section of a
    SPLIT one with a command to run."""
    return [(doc, title) for doc in docs()
            for title, commands in (doc_sections(doc) if doc in SPLIT else [(None, doc_commands(doc))])
            if to_run(doc, commands)]


def run_id(doc, section):
    """README.md, or RUN.md-chapter-3 for `## Chapter 3: ...`: a SPLIT section by its heading's words up to : or ?"""
    if section is None:
        return doc
    return doc + "-" + re.sub(r"\W+", "-", re.split(r"[:?]", section)[0]).strip("-").lower()


def commands_of(doc, section):
    """What the test of (doc, section) runs, in order: the section's commands (a whole document's if section is None),
    after the earlier sections' commands that wrote what they read (runs/NAME), each the first to write it."""
    sections = doc_sections(doc)
    if section is None:
        return to_run(doc, [command for _, commands in sections for command in commands])
    index = [title for title, _ in sections].index(section)
    earlier = [(c, s) for _, commands in sections[:index] for c, s in to_run(doc, commands) if not s]
    mine, needed, have = to_run(doc, sections[index][1]), [], set()
    for command, _ in mine:
        for path in sorted(set(RUN_PATH.findall(command)) - written(command) - have):
            writer = next(((c, s) for c, s in earlier if path in written(c)), None)
            if writer and writer not in needed:
                needed.append(writer)
                have |= written(writer[0])
        have |= written(command)
    return [c for c in earlier if c in needed] + mine


@pytest.fixture
def workspace(tmp_path):
    """A scratch folder where `python single_gpu.py`, `scripts/...`, `measure/...`, `common` and `data` resolve to this repository."""
    for entry in [*REPO.glob("*.py"), REPO / "common", REPO / "scripts", REPO / "measure", REPO / "data"]:
        if entry.exists():
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


def test_every_doc_command_is_known():
    """Each command either runs (below) or has a reason; the lists above hold no stale patterns; a SPLIT document's
    sections hold all of its commands, and RUN.md's tests run at least 30 of them."""
    assert len(docs()) >= 8, docs()  # README, RUN.md and the six pages it links
    commands = [c for name in docs() for c, _ in doc_commands(name)]
    assert len(commands) > 30
    for doc in SPLIT:
        assert doc_commands(doc) == _commands(doc, (REPO / doc).read_text()), doc  # the sections lose none
        titles = [title for title, _ in doc_sections(doc)]
        assert len(set(titles)) == len(titles), titles  # a test finds its section by its heading
    assert sum(len(to_run("RUN.md", commands)) for _, commands in doc_sections("RUN.md")) >= 30
    for pattern, reason in NOT_RUN_HERE:
        assert any(re.search(pattern, c) for c in commands), f"no doc command matches {pattern!r} ({reason}) any more"


def test_every_link_between_the_docs_leads_to_a_file_and_its_heading():
    """Runs move between RUN.md and the docs pages: every relative link in README.md, RUN.md and docs/*.md names a
    file that exists and, after #, a heading it has (GitHub's anchor: lower case, punctuation dropped, spaces to -)."""
    pages = [REPO / "README.md", REPO / "RUN.md", *sorted((REPO / "docs").glob("*.md"))]
    prose = {page: re.sub(r"```.*?```", "", page.read_text(), flags=re.S) for page in pages}
    anchors = {page: {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
                      for title in re.findall(r"^#+ (.*)$", text, re.M)} for page, text in prose.items()}
    broken = []
    for page, text in prose.items():
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            path, _, anchor = link.partition("#")
            if re.match(r"\w+:", link):
                continue  # a web address
            target = (page.parent / path).resolve() if path else page
            if not target.exists() or anchor and target.suffix == ".md" and anchor not in anchors[target]:
                broken.append(f"{page.relative_to(REPO)}: ({link})")
    assert not broken, broken


@functools.cache
def earlier_runs():
    """The commands a section's test runs first for what they wrote (commands_of): another section's."""
    return {command for doc, section in doc_runs() if section for command in commands_of(doc, section)
            if command not in to_run(doc, dict(doc_sections(doc))[section])}


@pytest.mark.parametrize("doc,section", doc_runs(), ids=[run_id(*run) for run in doc_runs()])
def test_doc_commands_run(doc, section, real_data, workspace, tmp_path_factory):
    """The commands of a document, or of one `## ` section of a SPLIT one in a folder of its own: a section that
    reads what an earlier one wrote (runs/NAME) first takes what the earlier command wrote (commands_of), e.g.
    RUN.md's compares chapter 1's `python single_gpu.py`; each command exits as the document says, with no traceback
    of ours. An earlier section's command runs once in the suite, in a fresh folder like this one (its own section's
    test, or the first test to need it): what it wrote is copied into every other test's folder that needs it."""
    bin_dir = Path(sys.executable).parent  # python, torchrun: the ones the suite runs with
    env = dict(BASE_ENV, PATH=f"{bin_dir}{os.pathsep}{BASE_ENV.get('PATH', '')}")
    env.pop("SLURM_JOB_ID", None)
    port, shared, killed = free_port(), earlier_runs(), [False]
    mine = to_run(doc, dict(doc_sections(doc))[section]) if section else commands_of(doc, section)

    def keep(command, folder):
        """Copy what command wrote in the workspace into folder."""
        for path in written(command):
            if (workspace / path).exists():
                (folder / path).parent.mkdir(parents=True, exist_ok=True)
                (shutil.copytree if (workspace / path).is_dir() else shutil.copy2)(workspace / path, folder / path)

    for command, status in commands_of(doc, section):
        if (command, status) in mine:
            run_doc_command(doc, command, status, workspace, real_data, port, env, killed)
            if command in shared:  # what a later section takes, made by the very command it would run
                made_once(tmp_path_factory, "doc-run " + command, lambda folder: keep(command, folder))
            continue
        here = []
        made = made_once(tmp_path_factory, "doc-run " + command, lambda folder: (
            run_doc_command(doc, command, status, workspace, real_data, port, env, killed), keep(command, folder),
            here.append(True)))
        if not here:  # another test ran it: its files, as this one would have written them
            shutil.copytree(made, workspace, dirs_exist_ok=True)


def run_doc_command(doc, command, status, workspace, real_data, port, env, killed):
    """One command in workspace: it exits as doc says (status, or 0), with no traceback of ours; killed[0] says
    whether the one before killed a run, which this one must then resume."""
    cmd = runnable(command, real_data, port)
    slurm_run = workspace / "runs" / "ddp_slurm"
    if "runs/ddp_slurm" in command and not slurm_run.exists():
        # The SLURM chapter's run comes from a cluster (not started here); chapter 4's run, the same model by
        # construction, stands in for it. tests/test_slurm.py checks the real job's metrics against chapter 1.
        shutil.copytree(workspace / "runs" / "ddp_mp", slurm_run)
    proc = subprocess.run(["bash", "-c", cmd], cwd=workspace, env=env, capture_output=True, text=True, timeout=300)
    no_abort_at_exit(proc.stderr)
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode  # a signal, as a shell shows it
    assert code == (status or 0), f"{doc}: `{command}` exited {code}, expected {status or 0}\n" \
                                       f"ran: {cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    # No traceback of ours. torchrun ends a failed job with its own report (a traceback of its launcher, then
    # each worker's from its error file): that report is torchrun's, and is cut off before the check.
    ours = re.sub(r'Traceback \(most recent call last\):\n  File "[^"]*/torchrun".*', "", proc.stderr, flags=re.S)
    # Chapter 8's broken cases may end in an error torch explains itself (DDP's unused parameters, load_state_dict's
    # keys): shown whole, with its traceback, as every error we do not recognise is; that message is the lesson.
    broken_on_purpose = "debug_hang.py" in command and "--fix" not in command
    assert broken_on_purpose or "Traceback" not in ours, f"{doc}: `{command}`\n{proc.stderr[-3000:]}"
    # The kill demos really kill mid-run, and what runs next resumes: torchrun at once, a rerun by hand.
    # torchrun's report names the failure it dates first: the killed rank (exitcode -9), or rank 0 (exitcode 1),
    # which saw its peer's connection close and wrote its error file (@record) before torchrun's next poll came
    # (3 of 6 runs here). Either way a new group must start and resume from the snapshot before the last epoch.
    if "pgrep -f ddp_launch.py" in command:
        assert re.search(r"failed \(exitcode: (-9|1)\) local_rank", proc.stderr), proc.stderr
        assert proc.stdout.count("Config:") == 2, proc.stdout  # the group torchrun restarted
        resumed = re.search(r"Resuming from runs/snap-ddp\.pt: (\d) of 5 epochs done", proc.stdout)
        assert resumed and int(resumed[1]) < 5, proc.stdout
    if killed[0]:
        assert "Resuming from runs/snap.pt" in proc.stdout, proc.stdout
    killed[0] = "kill -9 $!" in command


# ---- docs/troubleshooting.md: every message it shows is one the scripts (or torchrun) really print ----

def troubleshooting_messages():
    """The messages in docs/troubleshooting.md: its examples and each table row's first column."""
    found = []
    for line in (REPO / "docs" / "troubleshooting.md").read_text().splitlines():
        cells = line.split(" | ")
        spans = re.findall(r"``\s?(.+?)\s?``|`([^`]+)`", cells[0] if line.startswith("| `") else line)
        found += [a or b for a, b in spans if re.search(r"(error|Error):", a or b)]
    return found


def message_pattern(shown):
    """A README message as a regex for the start of a real stderr line: `...` is any text, a number any number."""
    rx = ".*".join(re.escape(part) for part in re.split(r"\s*\.\.\.\s*", shown))  # "at ... :" or "set ..." alike
    return re.compile(re.sub(r"\d+", r"\\d+", rx))


def _fake_data(tmp):
    make_fake_fashion_mnist(tmp / "fmnist")
    return tmp / "fmnist"


def _damaged(tmp):
    """Fake data with the training labels cut short."""
    folder = _fake_data(tmp)
    labels = folder / "FashionMNIST" / "raw" / "train-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:-10])
    return ("single_gpu.py", ["--data-dir", folder], {})


def _snapshot_run(tmp, make, *flags):
    """single_gpu.py on fake data resuming from a snapshot made by make(path), with flags."""
    snap, data = tmp / "snap.pt", _fake_data(tmp)
    make(snap, data)
    return ("single_gpu.py", ["--data-dir", data, "--output", tmp / "run", "--snapshot", snap, *flags], {})


def _real_snapshot(path, data):
    """A real snapshot: 3 epochs at global batch 48."""
    proc = run_script("single_gpu.py", "--data-dir", data, "--output", path.parent / "made", "--snapshot", path,
                      "--batch-size", "48", "--epochs", "3")
    assert proc.returncode == 0, proc.stderr


def _weights_file(path, data):
    """A model.pth where a snapshot should be."""
    torch.save(NeuralNetwork().state_dict(), path)


def _tcp(init, rank=0, world=2):
    return ["--init-method", init, "--rank", str(rank), "--world-size", str(world), "--timeout", "2"]


def _tmpfs(tmp, stack, size, read_only=False):
    """A small tmpfs (a full disk, or a read-only one), unmounted at the end. Root only, as CI runs."""
    point = tmp / f"disk-{size}"
    point.mkdir()
    options = f"size={size}" + (",ro" if read_only else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True, text=True)
    if proc.returncode:
        reason = f"cannot mount a tmpfs here: {proc.stderr.strip()}"
        pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
    stack.callback(subprocess.run, ["umount", "-l", str(point)], capture_output=True)
    return point


def _two_ranks(tmp, stack, to_rank1=None, rank1_args=(), timeout="60"):
    """Chapter 5 on fake data, ranks 0 and 1: to_rank1 (a signal) hits rank 1 once rank 0 is in epoch 2.

    Returns rank 0's (returncode, stderr).
    """
    data, init = _fake_data(tmp), f"tcp://127.0.0.1:{free_port()}"
    ranks = []
    for rank, extra in ((0, ()), (1, rank1_args)):
        cmd = [sys.executable, str(REPO / "ddp_tcp_manual.py"), "--data-dir", data, "--output", tmp / f"run{rank}",
               *_tcp(init, rank), "--timeout", timeout, "--epochs", "10000", "--train-samples", "256", *extra]
        p = subprocess.Popen(list(map(str, cmd)), cwd=tmp, env=BASE_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
        stack.callback(lambda p=p: (p.poll() is None and os.killpg(p.pid, signal.SIGKILL), p.communicate()))
        ranks.append(p)
    if to_rank1 is not None:
        for line in ranks[0].stdout:
            if line.startswith("Epoch 2"):
                os.kill(ranks[1].pid, to_rank1)
                break
    _, err = ranks[0].communicate(timeout=120)
    return ranks[0].returncode, err


def _restartable_torchrun(tmp, stack):
    """torchrun --max-restarts 1 with its default shared store: each attempt's worker prints the same refusal.

    Returns the workers' error lines, each once (torchrun's own failure summary follows them, traceback and all).
    """
    proc = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
                           str(REPO / "ddp_launch.py")], cwd=tmp, env=BASE_ENV, capture_output=True, text=True, timeout=120)
    return proc.returncode, "".join(dict.fromkeys(x for x in proc.stderr.splitlines(keepends=True) if x.startswith("error:")))


def _fake_gpus(tmp, n=2):
    """An environment in which torch sees n GPUs that are never used: the device rules refuse before any CUDA call."""
    shim = tmp / "fake_gpus"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(f"import torch\ntorch.cuda.is_available = lambda: True\n"
                                           f"torch.cuda.device_count = lambda: {n}\n")
    return dict(PYTHONPATH=str(shim), CUDA_VISIBLE_DEVICES="")


NO_PROXY = dict(http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9", no_proxy="", NO_PROXY="")

# A troubleshooting message (a piece of it) -> how to make it happen here: fn(tmp, stack) giving (script, args,
# extra env) for one run, or (returncode, stderr) for a scene of its own; or, for what only a GPU or two machines
# can print, "tests/FILE.py::test_name", a test whose own body asserts the words.
MAKE_IT_PRINT = {
    "argument --epochs: must be a positive integer": lambda tmp, stack: ("single_gpu.py", ["--epochs", "0"], {}),
    "RuntimeError:": "tests/test_errors.py::test_an_unknown_error_keeps_every_line_and_its_traceback",
    "GPU(s) visible here": lambda tmp, stack: ("single_gpu.py", ["--device", "cuda"], dict(CUDA_VISIBLE_DEVICES="")),
    "a DDP rank always uses the GPU of its local rank": lambda tmp, stack: (
        "ddp_mp.py", ["--device", "cuda:1"], _fake_gpus(tmp)),
    "ranks on this machine but": lambda tmp, stack: ("ddp_mp.py", ["--nprocs", "4"], _fake_gpus(tmp)),
    "local rank 2 but": lambda tmp, stack: (
        "ddp_tcp_manual.py", [*_tcp("tcp://127.0.0.1:1", world=3), "--batch-size", "48", "--local-rank", "2"],
        _fake_gpus(tmp)),
    "DistBackendError: NCCL error": "tests/test_gpu.py::test_two_nccl_ranks_on_one_gpu_are_refused",
    # No ./data, and a download that fails fast: the proxy is a closed port.
    "FashionMNIST is not in": lambda tmp, stack: ("single_gpu.py", [], dict(NO_PROXY, FASHION_MNIST_OFFLINE="")),
    "is not a readable folder": lambda tmp, stack: ("single_gpu.py", ["--data-dir", tmp / "typo"], {}),
    "cannot read FashionMNIST": lambda tmp, stack: _damaged(tmp),
    "cannot create folder": lambda tmp, stack: ("single_gpu.py", ["--output", "/proc/no/such/folder"], {}),
    "is not writable": lambda tmp, stack: (
        "single_gpu.py", ["--data-dir", _fake_data(tmp), "--output", _tmpfs(tmp, stack, "1m", read_only=True)], {}),
    "[rank 1] no rendezvous at": lambda tmp, stack: (
        "ddp_tcp_manual.py", _tcp(f"tcp://127.0.0.1:{free_port()}", rank=1), {}),
    "reached the rendezvous": lambda tmp, stack: ("ddp_tcp_manual.py", _tcp(f"tcp://127.0.0.1:{free_port()}"), {}),
    "GLOO_SOCKET_IFNAME=": lambda tmp, stack: (
        "ddp_tcp_manual.py", _tcp(f"tcp://127.0.0.1:{free_port()}", world=1), dict(GLOO_SOCKET_IFNAME="eth99")),
    "The connection to the C10d store has failed": "tests/test_multinode.py::test_c10d_endpoint_on_a_second_address_needs_is_host",
    "EADDRINUSE": "tests/test_rendezvous.py::test_busy_port_is_named",
    "must split evenly over 3 ranks": lambda tmp, stack: ("ddp_mp.py", ["--nprocs", "3"], {}),
    "must split into --accum-steps": lambda tmp, stack: ("single_gpu.py", ["--batch-size", "48", "--accum-steps", "5"], {}),
    "fsdp.py trains in --precision fp32 or bf16": lambda tmp, stack: ("fsdp.py", ["--precision", "fp16"], {}),
    "--compile needs a working C++ compiler": lambda tmp, stack: (
        "single_gpu.py", ["--data-dir", _fake_data(tmp), "--compile", "--epochs", "1"],
        dict(CXX="/nonexistent/g++", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")),
    "must be below --world-size": lambda tmp, stack: ("ddp_tcp_manual.py", _tcp("tcp://127.0.0.1:1", rank=2), {}),
    "is left over from an earlier run": lambda tmp, stack: (
        "ddp_tcp_manual.py", _tcp(f"file://{stale_rendezvous_file(tmp)}"), {}),
    "was started with --train-samples": lambda tmp, stack: _two_ranks(tmp, stack, rank1_args=["--train-samples", "128"]),
    "lost contact with the other ranks": lambda tmp, stack: _two_ranks(tmp, stack, to_rank1=signal.SIGKILL),
    "no answer from another rank": lambda tmp, stack: _two_ranks(tmp, stack, to_rank1=signal.SIGSTOP, timeout="3"),
    "cannot be read": lambda tmp, stack: _snapshot_run(tmp, lambda snap, data: snap.write_bytes(b"half a zip")),
    "is not a snapshot of this tutorial": lambda tmp, stack: _snapshot_run(tmp, _weights_file),
    "was made with --batch-size": lambda tmp, stack: _snapshot_run(tmp, _real_snapshot, "--batch-size", "64"),
    "epochs done, more than --epochs": lambda tmp, stack: _snapshot_run(
        tmp, _real_snapshot, "--batch-size", "48", "--epochs", "2"),
    "No space left on device": lambda tmp, stack: (  # model.pth is 2.7 MB
        "single_gpu.py", ["--data-dir", _fake_data(tmp), "--output", _tmpfs(tmp, stack, "1m"), "--epochs", "1"], {}),
    "RANK/LOCAL_RANK/WORLD_SIZE are not set": lambda tmp, stack: ("ddp_launch.py", [], {}),
    "needs a fresh store per restart": _restartable_torchrun,
    "not a task of an srun step": lambda tmp, stack: ("ddp_slurm.py", [], dict(SLURM_STEP_ID="")),
}


def make_it_print_key(message):
    """The one MAKE_IT_PRINT key that message holds."""
    (key,) = [key for key in MAKE_IT_PRINT if key in message]
    return key


def test_every_troubleshooting_message_has_a_way_to_print_it():
    """Each message shown is matched by exactly one entry above, and every entry by a message."""
    shown = troubleshooting_messages()
    assert len(shown) >= 25
    for message in shown:
        keys = [key for key in MAKE_IT_PRINT if key in message]
        assert len(keys) == 1, f"message {message!r} is matched by {keys} in MAKE_IT_PRINT"
        assert re.match(r"error: |\w+\.py: error: |RendezvousConnectionError: ", message), message
    for key in MAKE_IT_PRINT:
        assert any(key in message for message in shown), f"no troubleshooting message contains {key!r} any more"


def _test_body(nodeid):
    """The source of the test function FILE::NAME."""
    path, name = nodeid.split("::")
    source = (REPO / path).read_text()
    (function,) = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == name]
    return ast.get_source_segment(source, function)


@pytest.fixture(scope="module")
def troubleshooting_scenes(request, tmp_path_factory):
    """Each scene this session's tests ask for, each in a folder of its own: {message: (returncode, stderr)}. A scene
    that is one run of a script is forked from a process that imported torch once (run_forked), all of them at once,
    and one whose cause is in the start (a PYTHONPATH of its own, CUDA_*, the compiler's switches) starts a new
    interpreter there; the others (two ranks by hand, torchrun) run as they are."""
    test = "test_troubleshooting_message_is_what_the_script_prints"
    wanted = [item.callspec.params["message"] for item in request.session.items if item.path == request.node.path
              and getattr(item, "originalname", None) == test and hasattr(item, "callspec")]
    scenes, runs = {}, {}
    with ExitStack() as stack:
        for message in wanted:
            how = MAKE_IT_PRINT[make_it_print_key(message)]
            if not isinstance(how, str):  # a str: a test elsewhere asserts the words
                tmp = tmp_path_factory.mktemp("scene")
                scene = how(tmp, stack)
                if len(scene) == 3:
                    runs[message] = (*scene, tmp)
                else:
                    scenes[message] = scene
        for message, proc in zip(runs, run_forked(list(runs.values()))):
            scenes[message] = proc.returncode, proc.stderr
        yield scenes  # the tmpfs mounts stay until the module ends


@pytest.mark.parametrize("message", troubleshooting_messages())
def test_troubleshooting_message_is_what_the_script_prints(message, troubleshooting_scenes):
    """The message, with `...` for the parts that vary, starts a line the script really writes to stderr."""
    key = make_it_print_key(message)
    how = MAKE_IT_PRINT[key]
    if isinstance(how, str):  # only a GPU or two machines print it: that test asserts these words itself
        assert key in _test_body(how), f"{how} no longer checks {key!r}"
        return
    code, stderr = troubleshooting_scenes[message]
    no_abort_at_exit(stderr)
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert code in (1, 2) and "Traceback" not in stderr, stderr
    assert len(errors) == 1 and message_pattern(message).match(errors[0]), \
        f"troubleshooting.md shows\n  {message}\nthe script printed\n  {chr(10).join(errors) or stderr}"
