"""A real SLURM cluster (munged + slurmctld + one slurmd per node) in a temporary directory, for tests.

LocalSlurm is one node on 127.0.0.1; TwoNodeSlurm is two nodes, each a network namespace of measure/netns.py with
its own address and host name (nodea runs slurmctld too).
"""
import getpass
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from support.ports import free_port

BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel", "munged", "mungekey")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
# Pending reasons this one-node cluster can never get past (e.g. more CPUs or nodes than it has).
HOPELESS_REASONS = {"PartitionNodeLimit", "PartitionConfig", "PartitionTimeLimit", "BadConstraints", "ReqNodeNotAvail"}
# Job states after which a job will not run again (scontrol's JobState).
FINAL_STATES = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
    "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT", "SPECIAL_EXIT", "REVOKED",
}


def _missing_binaries():
    """The SLURM/munge programs that are not on PATH (sbin included)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


def ensure_slurm_installed():
    """Install SLURM and munge with apt-get where missing; None when usable, else the reason why not."""
    missing = _missing_binaries()
    if os.geteuid() != 0:
        # slurmd has to run as root to start jobs; so does apt-get.
        return "a local SLURM cluster needs root" + (f" ({', '.join(missing)} missing)" if missing else "")
    if not missing:
        return None
    if shutil.which("apt-get") is None:
        return f"SLURM not installed ({', '.join(missing)} missing) and no apt-get to install it"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{' '.join(cmd)} failed: {exc}"
        if proc.returncode != 0:
            return f"{' '.join(cmd)} failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-1000:]}"
    missing = _missing_binaries()
    return f"still missing after apt-get install: {', '.join(missing)}" if missing else None


def _sbin(name):
    """Full path of a daemon binary, which may live in an sbin folder not on PATH."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])
    return shutil.which(name, path=path) or name


def _free_port():
    """A TCP port nothing listens on now, on every address (support/ports.py: no other test or connection takes it)."""
    return free_port(host="")


def _mem_total_mb():
    """MemTotal in MiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024


def _searchable_by_all(folder):
    """Whether folder and all folders above it have the execute bit for others."""
    folder = Path(folder).resolve()
    return all(os.stat(f).st_mode & 0o001 for f in (folder, *folder.parents))


def _tail(path, n=30):
    """The last n lines of a log file, or a note that it is absent."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no file)"


def _stat(pid):
    """(state, parent pid, start time) of a process from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name may hold spaces and parentheses; fields resume after the last ')'.
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _processes():
    """{pid: (state, parent pid, start time)} for every process we can see."""
    procs = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _stat(int(entry))
            if info:
                procs[int(entry)] = info
    return procs


def _has_env(pid, marker):
    """Whether process pid's environment holds the KEY=VALUE marker."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker.encode() in f.read().split(b"\0")
    except OSError:
        return False


def _alive(pid, started=None):
    """Whether pid exists, is not a zombie, and (given started) is still the process that started then."""
    info = _stat(pid)
    return bool(info) and info[0] != "Z" and (started is None or info[2] == started)


class SbatchResult(tuple):
    """(job_id, returncode) that also carries sbatch's stdout and stderr."""

    def __new__(cls, job_id, returncode, stdout="", stderr=""):
        self = super().__new__(cls, (job_id, returncode))
        self.stdout, self.stderr = stdout, stderr
        return self

    job_id = property(lambda self: self[0])
    returncode = property(lambda self: self[1])


class LocalSlurm:
    """A SLURM cluster on this machine whose config, state, logs and munge key live in workdir: one node, localhost."""

    # node name -> address; the first node also runs slurmctld.
    nodes = {"localhost": "127.0.0.1"}

    def __init__(self, workdir, cpus=None, gpus=0, extra_conf=""):
        self.workdir = Path(workdir).resolve()
        self.cpus = cpus or os.cpu_count() or 1
        # gpus > 0 declares that many fake GPUs (links to /dev/null), so --gres=gpu / --gpus-per-node jobs run.
        self.gpus = gpus
        self.extra_conf = extra_conf
        self.conf = self.workdir / "slurm.conf"
        self.procs = {}
        # Every daemon (and so every slurmstepd they fork) carries this, so stop() can find strays.
        self._marker_value = f"{os.getpid()}-{id(self)}-{time.time_ns()}"
        self._marker = f"LOCAL_SLURM_ID={self._marker_value}"
        self._socket_dir = self.spool = None

    @property
    def env(self):
        """Environment additions client commands (sbatch, srun, squeue, ...) need to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def _env(self, extra=None):
        """os.environ plus this cluster's variables (and extra), with any outer SLURM job's variables removed."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        env.update(self.env)
        env.update(extra or {})
        return env

    def on_node(self, node, cmd):
        """cmd as it runs on node (a daemon); here every node is this machine."""
        return cmd

    def client(self, cmd):
        """cmd as a client command (sbatch, scontrol, ...) runs where it reaches slurmctld."""
        return cmd

    def run(self, *cmd, timeout=30, **kwargs):
        """Run a client command (sinfo, squeue, scontrol, ...) against this cluster; returns the CompletedProcess."""
        kwargs.setdefault("env", self._env())
        return subprocess.run(self.client(list(map(str, cmd))), capture_output=True, text=True, timeout=timeout,
                              **kwargs)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def _write_config(self):
        """Write the munge key, slurm.conf and gres.conf; returns the munge socket path.

        No cgroup.conf: proctrack/linuxproc and task/none do not need one (slurmd starts fine without).
        """
        # A restart in the same workdir starts afresh: no jobs, node state or cluster name from before.
        shutil.rmtree(self.workdir / "state", ignore_errors=True)
        for sub in ("state", "log"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        # The daemons' unix sockets live in a short folder of their own in /tmp: a socket's path must fit in
        # 108 bytes, and each slurmstepd's (SPOOL/NODE_JOBID.STEPID) is about 30 past the spool's, which a
        # test's tmp_path under pytest-xdist overruns ("Unix socket path ... is too long. (109 > 108)": the job
        # is requeued and never runs). munged also wants every folder above its socket searchable by all
        # (pytest's tmp folders are 0700).
        self._remove_socket_dir()
        self._socket_dir = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp" if _searchable_by_all("/tmp") else None))
        munge_dir, self.spool = self._socket_dir / "munge", self._socket_dir / "spool"
        for path in (self._socket_dir, munge_dir, self.spool):
            path.mkdir(exist_ok=True)
            os.chmod(path, 0o711)
        key = self.workdir / "munge.key"
        if not key.exists():
            subprocess.run([_sbin("mungekey"), "-c", "-k", str(key)], check=True, capture_output=True)
        os.chmod(key, 0o600)
        socket_path = munge_dir / "munge.socket"
        ctld_port, slurmd_port = _free_port(), _free_port()
        while slurmd_port == ctld_port:
            slurmd_port = _free_port()
        user = getpass.getuser()
        head = next(iter(self.nodes))
        many = len(self.nodes) > 1  # then each slurmd has its own spool, pid and log file (%n: its node name)
        w = self.workdir
        # Leave some memory for the OS; a node with more RealMemory than it has would be drained.
        real_mem = max(_mem_total_mb() - 1024, _mem_total_mb() // 2)
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        node_lines = "".join(f"NodeName={node} NodeAddr={addr} NodeHostname={node} CPUs={self.cpus} "
                             f"RealMemory={real_mem}{gres} State=UNKNOWN\n" for node, addr in self.nodes.items())
        # SLURM drops GPUs without a File, and warns unless it is a device: links to /dev/null stand in.
        lines = []
        for i in range(self.gpus):
            dev = w / f"fakegpu{i}"
            if not dev.is_symlink():
                dev.symlink_to("/dev/null")
            lines += [f"NodeName={node} Name=gpu File={dev}\n" for node in self.nodes]
        (w / "gres.conf").write_text("".join(lines))
        self.conf.write_text(f"""\
ClusterName=local{ctld_port}
SlurmctldHost={head}({self.nodes[head]})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket={socket_path},cred_expire=10
StateSaveLocation={w / "state"}
SlurmdSpoolDir={self.spool / ("%n" if many else "")}
SlurmctldPidFile={w / "slurmctld.pid"}
SlurmdPidFile={w / ("slurmd-%n.pid" if many else "slurmd.pid")}
SlurmctldLogFile={w / "log" / "slurmctld.log"}
SlurmdLogFile={w / "log" / ("slurmd-%n.log" if many else "slurmd.log")}
SlurmctldDebug=info
SlurmdDebug=info
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
{"GresTypes=gpu" if self.gpus else ""}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Job ids (and so ddp_slurm.py's port, 20000 + id % 10000) differ between clusters started side by side.
FirstJobId={random.randint(1, 9999) * 100}
# Start a submitted batch job at once (batch_sched_delay defaults to 3 s).
SchedulerParameters=batch_sched_delay=0
MailProg=/bin/true
ReturnToService=2
# Keep finished jobs visible to `scontrol show job` (no slurmdbd, so no sacct).
MinJobAge=3600
# Seconds between SIGTERM and SIGKILL on cancel/timeout (default 30 would slow every stop()).
KillWait=2
InactiveLimit=0
# Refuse at submission what this one node can never run (e.g. --nodes=2) instead of pending forever.
EnforcePartLimits=ALL
SlurmdTimeout=300
MessageTimeout=10
{node_lines}PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
{self.extra_conf}
""")
        return socket_path

    def _spawn(self, name, cmd):
        """Start a daemon in its own session with stdio to a file in workdir."""
        log = open(self.workdir / "log" / f"{name}.out", "ab")
        env = self._env({"LOCAL_SLURM_ID": self._marker_value})
        with log:
            self.procs[name] = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, cwd=self.workdir, start_new_session=True,
            )

    def _logs(self):
        """Tails of every daemon's logs, for error messages."""
        parts = []
        for path in sorted((self.workdir / "log").glob("*")):
            parts.append(f"--- {path.name} ---\n{_tail(path)}")
        return "\n".join(parts)

    def start(self, timeout=30):
        """Write the config, start munged, slurmctld and slurmd, and wait until the node is idle."""
        if self.procs:
            raise RuntimeError("cluster already started")
        w, conf = self.workdir, str(self.conf)
        try:
            w.mkdir(parents=True, exist_ok=True)
            socket_path = self._write_config()
            self._spawn("munged", [
                _sbin("munged"), "-F", f"--socket={socket_path}", f"--key-file={w / 'munge.key'}",
                f"--pid-file={w / 'munged.pid'}", f"--seed-file={w / 'munged.seed'}",
                f"--log-file={w / 'log' / 'munged.log'}",
            ])
            self._wait_for(lambda: socket_path.exists(), 10, "munged socket")
            head = next(iter(self.nodes))
            self._spawn("slurmctld", self.on_node(head, [_sbin("slurmctld"), "-D", "-c", "-i", "-f", conf]))
            for node in self.nodes:
                if len(self.nodes) > 1:
                    (self.spool / node).mkdir(parents=True, exist_ok=True)
                self._spawn(self._slurmd(node), self.on_node(node, [_sbin("slurmd"), "-D", "-N", node, "-f", conf]))
            self._wait_for(self._idle, timeout, "node idle")
        except BaseException as exc:
            logs = self._logs()
            self.stop()
            if not isinstance(exc, Exception):  # Ctrl-C: stopped, and on its way
                raise
            raise RuntimeError(f"SLURM cluster in {w} did not start: {exc}\n{logs}") from None

    def _slurmd(self, node):
        """The name of node's slurmd in self.procs."""
        return "slurmd" if len(self.nodes) == 1 else f"slurmd-{node}"

    def _wait_for(self, ready, timeout, what):
        """Poll ready() until true; fail early when a daemon died."""
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [f"{n} exited {p.returncode}" for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"waiting for {what}: {', '.join(dead)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.2)

    def _idle(self):
        """Whether sinfo reports the node idle."""
        try:
            proc = self.run("sinfo", "-h", "-o", "%T", timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0 and proc.stdout.strip() == "idle"

    def sbatch(self, script, *args, script_args=(), cwd=None, env=None, timeout=120, wait=True):
        """Submit script (a path, or the script's text) with sbatch options args; returns (job_id, returncode).

        script_args follow the script on the command line: the batch script gets them as "$@".

        With wait, blocks until the job ends (scancel-ing it on timeout) and returncode is the job's exit
        code the way `sbatch --wait` reports it; without, returncode is sbatch's own.  A refused submission
        gives job_id None and sbatch's returncode; .stderr holds its message either way.
        """
        text = None
        if "\n" in str(script):
            text, script = str(script), None
        cmd = ["sbatch", "--parsable", *map(str, args)] + ([str(script), *map(str, script_args)] if script else [])
        # Not `sbatch --wait`: in 22.05 it polls every 2-10 s, while scontrol answers at once.
        proc = subprocess.run(self.client(cmd), input=text, capture_output=True, text=True, cwd=cwd,
                              env=self._env(env), timeout=30)
        if proc.returncode != 0:
            return SbatchResult(None, proc.returncode, proc.stdout, proc.stderr)
        job_id = proc.stdout.strip().splitlines()[-1].split(";")[0]
        if not wait:
            return SbatchResult(job_id, 0, proc.stdout, proc.stderr)
        state = self.wait_job(job_id, timeout)
        return SbatchResult(job_id, state["returncode"], proc.stdout, proc.stderr)

    def job_state(self, job_id):
        """{'state', 'exit_code', 'signal', 'returncode', 'reason', 'fields'} of a job from `scontrol show job`."""
        proc = self.run("scontrol", "show", "job", "-o", job_id, timeout=15)
        if proc.returncode != 0:
            raise RuntimeError(f"scontrol show job {job_id}: {proc.stderr.strip()}")
        fields = dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", proc.stdout))
        code, _, sig = fields.get("ExitCode", "0:0").partition(":")
        code, sig = int(code), int(sig or 0)
        state = fields.get("JobState", "")
        # sbatch --wait's rule (22.05): the script's exit code, but 1 when a signal ended it (scancel, kill -9).
        returncode = 1 if sig else code
        # Also 1 where sbatch --wait would say 0 for a job that did not complete (e.g. NODE_FAIL).
        if state in FINAL_STATES - {"COMPLETED"} and not returncode:
            returncode = 1
        return {"state": state, "exit_code": code, "signal": sig, "returncode": returncode,
                "reason": fields.get("Reason", ""), "fields": fields}

    def wait_job(self, job_id, timeout=120, poll=0.25):
        """Block until job_id is in a final state and return its job_state(); scancel it on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(job_id)
            if state["state"] in FINAL_STATES:
                return state
            if state["state"] == "PENDING" and state["reason"] in HOPELESS_REASONS:
                self.run("scancel", job_id)
                raise RuntimeError(f"job {job_id} can never run here: pending with reason {state['reason']}")
            if time.monotonic() > deadline:
                self.run("scancel", job_id)
                raise TimeoutError(f"job {job_id} still {state['state']} after {timeout}s\n{self._logs()}")
            time.sleep(poll)

    def stray_processes(self):
        """{pid: start time} of live processes our daemons started (slurmstepd, job tasks, slurmscriptd)."""
        procs = _processes()
        children = {}
        for pid, (_, ppid, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        # slurmstepd re-parents itself to init but keeps the daemons' environment, marker included.
        roots = [pid for pid in procs if pid != os.getpid() and _has_env(pid, self._marker)]
        roots += [p.pid for p in self.procs.values()]
        found, stack = {}, list(roots)
        while stack:
            pid = stack.pop()
            if pid in found or pid == os.getpid() or pid not in procs or procs[pid][0] == "Z":
                continue
            found[pid] = procs[pid][2]
            stack.extend(children.get(pid, ()))
        for p in self.procs.values():
            found.pop(p.pid, None)
        return found

    def _cancel_jobs(self, grace=10):
        """scancel every job and wait briefly until none is running any more."""
        try:
            self.run("scancel", "--user", getpass.getuser(), timeout=15)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                # squeue's default states are the unfinished ones (pending, running, completing, ...).
                proc = self.run("squeue", "-h", "-o", "%i", timeout=15)
                if proc.returncode != 0 or not proc.stdout.strip():
                    return
                time.sleep(0.2)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def stop(self, grace=5):
        """Cancel all jobs, then end slurmd, slurmctld, munged and any stray slurmstepd or task; idempotent."""
        if self.procs:
            self._stop_processes(grace)
        self._remove_socket_dir()

    def _remove_socket_dir(self):
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None

    def _stop_processes(self, grace):
        """stop() for a cluster whose daemons were started."""
        daemons = [*map(self._slurmd, self.nodes), "slurmctld", "munged"]
        if all(n in self.procs and self.procs[n].poll() is None for n in daemons):
            self._cancel_jobs()
        strays = self.stray_processes()
        for name in daemons:
            proc = self.procs.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        strays.update(self.stray_processes())
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid, started in strays.items():
                if _alive(pid, started):  # not a new process that reuses the number
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + (1 if sig == signal.SIGTERM else grace)
            while any(_alive(*item) for item in strays.items()) and time.monotonic() < deadline:
                time.sleep(0.1)
        self.procs = {}


class TwoNodeSlurm(LocalSlurm):
    """Two nodes, nodea (slurmctld and a slurmd) and nodeb (a slurmd), on the namespaces of a netns.TwoMachines.

    Each slurmd, and so every job step it starts, runs in its node's namespace under its node's host name; client
    commands run in nodea's namespace, where slurmctld listens.
    """

    def __init__(self, workdir, net, **kwargs):
        from measure.netns import NODES

        super().__init__(workdir, **kwargs)
        self.net = net
        self.nodes = dict(NODES)

    def on_node(self, node, cmd):
        # As net.command(node, cmd), but without `ip netns exec`, whose fresh /sys hides the cgroup folders slurmd
        # needs: enter the node's network, then a mount namespace of our own for its /etc/hosts.
        ns = self.net.ns[node]
        return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount", "sh", "-c",
                f'mount --bind /etc/netns/{ns}/hosts /etc/hosts && hostname {node} && exec "$@"', "sh", *cmd]

    def client(self, cmd):
        return ["ip", "netns", "exec", self.net.ns[next(iter(self.nodes))], *cmd]
