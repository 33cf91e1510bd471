"""A private one-node SLURM cluster for tests: munged + slurmctld + slurmd, with fake GPUs.

Everything (config, state, spool, munge socket, logs) lives under one directory; the daemons
run in the foreground as children of the test process and are stopped by PID on exit. The node
offers ``gpus`` fake GPUs (gres/gpu on device nodes nothing opens), so SLURM schedules them and
sets ``CUDA_VISIBLE_DEVICES`` / ``SLURM_JOB_GPUS`` in jobs as on a real GPU node.

    with one_node_cluster(tmp_path / "slurm", gpus=2) as cluster:
        subprocess.run([...snakemake...], env=cluster.command_env())
        cluster.job_records()  # scontrol show job -d of each finished job: TresPerJob=gres:gpu:1

Needs root and Debian's ``slurmctld``, ``slurmd`` and ``munge`` (``.ci/install-slurm``). This
module imports without them: tests call :func:`skip_unless_slurm`, which skips, or fails when
``SINKSCOPE_REQUIRE_SLURM=1`` (CI) so that a broken install cannot pass as a skip.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REQUIRE_ENV = "SINKSCOPE_REQUIRE_SLURM"
# Set on the daemons only; slurmstepd inherits it from slurmd, so it marks what is ours.
MARKER_ENV = "SINKSCOPE_SLURMCLUSTER"
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "sinfo", "scontrol", "scancel", "srun")
_SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *_SBIN]))


def slurm_unavailable_reason() -> str | None:
    """Why a private cluster cannot start here; None when it can."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]
    if missing:
        return f"SLURM/munge binaries missing: {' '.join(missing)} (run .ci/install-slurm)"
    if os.geteuid() != 0:
        return "a private SLURM cluster needs root (slurmd and SlurmUser run as root)"
    return None


def slurm_available() -> bool:
    """True when the binaries are installed and we are root."""
    return slurm_unavailable_reason() is None


def slurm_required() -> bool:
    """True when a missing SLURM must fail rather than skip (``SINKSCOPE_REQUIRE_SLURM=1``)."""
    return os.environ.get(REQUIRE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def skip_unless_slurm() -> None:
    """Call first in a test: skip without SLURM, or fail if SINKSCOPE_REQUIRE_SLURM=1."""
    import pytest

    reason = slurm_unavailable_reason()
    if reason is None:
        return
    if slurm_required():
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def parse_record(line: str) -> dict[str, str]:
    """``Key=Value Key=Value ...`` as jobcomp/filetxt and ``scontrol -o`` write it.

    Values may hold spaces; keys may hold ``/`` and ``:`` (``CPUs/Task``, ``ReqB:S:C:T``).
    A repeated key keeps its last value.
    """
    parts = re.split(r"\s+(?=[A-Za-z_][\w/:]*=)", line.strip())
    return dict(part.split("=", 1) for part in parts if "=" in part)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"<{exc}>"
    return "\n".join(text[-lines:])


@dataclass
class SlurmCluster:
    root: Path
    nodename: str
    partition: str
    gpus: int
    cpus: int
    memory_mb: int
    conf: Path
    jobcomp: Path
    job_records_dir: Path
    logs: dict[str, Path]
    env: dict[str, str]
    marker: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def pids(self) -> dict[str, int]:
        """PIDs of the daemons this cluster started: munged, slurmctld, slurmd."""
        return {name: proc.pid for name, proc in self.procs.items()}

    def command_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default os.environ) plus ``env``: for subprocesses using this cluster."""
        return {**(os.environ if base is None else base), **self.env}

    def run(
        self, *args: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """Run a SLURM client command (``sbatch``, ``squeue``...) against this cluster."""
        return subprocess.run(
            [_which(args[0]) or args[0], *args[1:]],
            env=self.command_env(),
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )

    def jobcomp_records(self) -> list[dict[str, str]]:
        """One dict per finished job from jobcomp/filetxt: JobId, JobState, NodeList, Tres...

        Without slurmdbd there is no gres/gpu TRES, so ``Tres`` never shows GPUs; use
        :meth:`job_records` for those.
        """
        if not self.jobcomp.exists():
            return []
        lines = self.jobcomp.read_text(errors="replace").splitlines()
        return [parse_record(line) for line in lines if line.strip()]

    def jobcomp_record(self, jobid: str | int) -> dict[str, str] | None:
        return next((r for r in self.jobcomp_records() if r.get("JobId") == str(jobid)), None)

    def job_records(self) -> dict[str, dict[str, str]]:
        """``scontrol show job -d -o`` of each finished job (EpilogSlurmctld), by job id.

        GPU requests show as ``TresPerJob=gres:gpu:1`` (sbatch ``--gpus=1``) or
        ``TresPerNode=gres:gpu:1`` (``--gres=gpu:1``), the allocation as ``JOB_GRES=gpu:1``;
        ``Comment`` is the Snakemake plugin's ``rule_<rule>_wildcards_<values>``.
        """
        records = {}
        for path in sorted(self.job_records_dir.glob("*.txt")):
            lines = path.read_text(errors="replace").splitlines()
            if lines:
                records[path.stem] = parse_record(lines[0])
        return records

    def job_record(self, jobid: str | int) -> dict[str, str] | None:
        return self.job_records().get(str(jobid))

    def wait_for_job(self, jobid: str | int, timeout: float = 60) -> dict[str, str]:
        """Wait until the job's jobcomp and epilog records exist; return the jobcomp one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            record = self.jobcomp_record(jobid)
            if record is not None and self.job_record(jobid) is not None:
                return record
            time.sleep(0.1)
        raise TimeoutError(f"job {jobid} did not finish in {timeout}s\n{self.diagnostics()}")

    def queued_jobs(self) -> list[str]:
        """Ids of jobs not yet finished (squeue's default: pending, running, completing)."""
        out = self.run("squeue", "-h", "-o", "%i", check=False, timeout=15).stdout
        return out.split()

    def leftover_processes(self) -> list[str]:
        """Daemons or job steps of this cluster still alive (empty after a clean stop)."""
        left = [f"{name}={p.pid}" for name, p in self.procs.items() if p.poll() is None]
        return left + [f"marked={pid}" for pid in _marked_pids(self.marker)]

    def diagnostics(self) -> str:
        parts = [f"--- {name}: {path} ---\n{_tail(path)}" for name, path in self.logs.items()]
        parts += [f"--- {p} ---\n{_tail(p)}" for p in sorted(self.root.glob("*.out"))]
        with contextlib.suppress(Exception):
            parts.append("--- sinfo ---\n" + self.run("sinfo", "-N", "-l", check=False).stdout)
            parts.append("--- squeue ---\n" + self.run("squeue", check=False).stdout)
        return "\n".join(parts)


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _node_hardware() -> tuple[str, int, int]:
    """(NodeName, CPUs, RealMemory MB) as ``slurmd -C`` sees this machine."""
    out = subprocess.run(
        [_which("slurmd"), "-C"], capture_output=True, text=True, check=True
    ).stdout
    fields = parse_record(out.splitlines()[0])
    return fields["NodeName"], int(fields["CPUs"]), int(fields["RealMemory"])


def _fake_device(path: Path, minor: int) -> None:
    """slurmd wants gres.conf ``File=`` to be a character or block device; only stat()s it."""
    if path.exists() or path.is_symlink():
        return
    try:
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(195, minor))  # nvidia's major number
    except OSError:  # no CAP_MKNOD: a link to any character device passes the check too
        path.symlink_to("/dev/null")


def _srun_wrapper(bin_dir: Path, conf: Path) -> Path:
    """An ``srun`` first on PATH that puts back ``SLURM_CONF`` when a caller dropped it.

    snakemake-executor-plugin-slurm-jobstep 0.6 removes every ``SLURM_*`` variable except the
    job's identity before its inner ``srun``; with slurm.conf anywhere but /etc/slurm that srun
    finds no configuration ("Could not establish a configuration source"). Jobs inherit PATH
    (sbatch --export=ALL), so they find this wrapper.
    """
    bin_dir.mkdir(parents=True, exist_ok=True)
    wrapper = bin_dir / "srun"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'SLURM_CONF="${{SLURM_CONF:-{conf}}}"\n'
        "export SLURM_CONF\n"
        f'exec {_which("srun")} "$@"\n'
    )
    wrapper.chmod(0o755)
    return bin_dir


def _write_configs(cluster: SlurmCluster, hw: tuple[int, int], munge_socket: Path) -> None:
    root, node = cluster.root, cluster.nodename
    for sub in ("state", "dev", cluster.job_records_dir.name, f"spool/{node}"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    # Records of an earlier cluster in the same root would mix with this one's.
    cluster.jobcomp.unlink(missing_ok=True)
    for old in cluster.job_records_dir.glob("*"):
        old.unlink()
    for i in range(cluster.gpus):
        _fake_device(root / "dev" / f"nvidia{i}", minor=i)
    ctld_port, slurmd_port = _free_ports(2)
    # More CPUs or memory than the machine has: slurmd must not drain the node for it.
    bigger = cluster.cpus > hw[0] or cluster.memory_mb > hw[1]
    overrides = "SlurmdParameters=config_overrides\n" if bigger else ""
    gres = f" Gres=gpu:{cluster.gpus}" if cluster.gpus else ""
    epilog = root / "epilog_slurmctld.sh"
    cluster.conf.write_text(
        f"""\
# Written by tests/slurmcluster.py: a private one-node cluster, no slurmdbd.
ClusterName=sinkscope-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={cluster.logs["slurmctld"]}
SlurmdLogFile={cluster.logs["slurmd"]}
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={root}/plugstack.conf
MailProg=/bin/true
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={cluster.jobcomp}
# No gres/gpu TRES without slurmdbd (AccountingStorageTRES=gres/gpu: slurmctld refuses to
# start), so jobcomp never shows GPUs; this epilog keeps `scontrol show job -d` of each job.
EpilogSlurmctld={epilog}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Jobs without --mem would otherwise hold all of the node's memory.
DefMemPerCPU=1024
GresTypes=gpu
ReturnToService=2
# Start jobs within a second: backfill and the main loop every second (defaults 30 s, 60 s).
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1,sched_min_interval=0,batch_sched_delay=0
# squeue must still list finished jobs when Snakemake polls (the plugin's squeue mode).
MinJobAge=300
KillWait=2
InactiveLimit=0
{overrides}\
NodeName={node} NodeAddr=127.0.0.1 CPUs={cluster.cpus} RealMemory={cluster.memory_mb}{gres} \
State=UNKNOWN
PartitionName={cluster.partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""
    )
    (root / "gres.conf").write_text(
        "AutoDetect=off\n"
        + "".join(
            f"NodeName={node} Name=gpu File={root}/dev/nvidia{i}\n" for i in range(cluster.gpus)
        )
    )
    (root / "plugstack.conf").write_text("")
    epilog.write_text(
        "#!/bin/sh\n"
        "# EpilogSlurmctld: slurmctld passes no SLURM_CONF to it.\n"
        f"export SLURM_CONF={cluster.conf}\n"
        f'out={cluster.job_records_dir}/"$SLURM_JOB_ID"\n'
        f'{_which("scontrol")} show job -d -o "$SLURM_JOB_ID" > "$out.tmp" 2>&1\n'
        'mv "$out.tmp" "$out.txt"\n'
        "exit 0\n"
    )
    epilog.chmod(0o755)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies (even by SIGKILL)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _start(cluster: SlurmCluster, name: str, argv: list[str], env: dict[str, str]) -> None:
    with open(cluster.root / f"{name}.out", "ab") as out:
        cluster.procs[name] = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=_die_with_parent,
        )


def _wait(cluster: SlurmCluster, ready: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {proc.returncode} while waiting for {what}\n"
                    f"{cluster.diagnostics()}"
                )
        if ready():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout}s\n{cluster.diagnostics()}")
        time.sleep(0.2)


def _node_idle(cluster: SlurmCluster) -> bool:
    res = cluster.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=10)
    states = dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)
    return states.get(cluster.nodename) == "idle"


def _marked_pids(marker: str) -> list[int]:
    """Live (not zombie) processes whose environment holds ``MARKER_ENV=marker``."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _terminate(pid: int, proc: subprocess.Popen | None, timeout: float) -> None:
    """SIGTERM, wait up to ``timeout``, then SIGKILL: one PID, ours."""

    def gone() -> bool:
        if proc is not None:
            return proc.poll() is not None
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        return state == "Z"

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not gone():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if proc is not None:
            proc.wait(timeout=10)


def _stop(cluster: SlurmCluster) -> None:
    ctld = cluster.procs.get("slurmctld")
    if ctld is not None and ctld.poll() is None:
        # Cancel what is left so that no job step outlives slurmd.
        with contextlib.suppress(Exception):
            cluster.run("scancel", "--full", "--user=root", check=False, timeout=15)
            deadline = time.monotonic() + 15
            while cluster.queued_jobs() and time.monotonic() < deadline:
                time.sleep(0.2)
    for name in ("slurmd", "slurmctld", "munged"):
        proc = cluster.procs.get(name)
        if proc is not None and proc.poll() is None:
            _terminate(proc.pid, proc, timeout=15)
    # slurmstepd daemonizes away from slurmd; it carries the marker, so find it by that.
    for pid in _marked_pids(cluster.marker):
        _terminate(pid, None, timeout=5)
    left = cluster.leftover_processes()
    if left:
        raise RuntimeError(f"SLURM test cluster processes still alive: {', '.join(left)}")


@contextlib.contextmanager
def one_node_cluster(
    root: Path,
    gpus: int = 2,
    *,
    cpus: int | None = None,
    memory_mb: int | None = None,
    partition: str = "debug",
    timeout: float = 60,
) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd under ``root``; yield the idle cluster.

    ``cpus`` / ``memory_mb`` default to what the machine has; larger values are advertised
    anyway (jobs that ask for more than the machine has can then still be scheduled).
    Merge ``cluster.env`` (SLURM_CONF, PATH) into the environment of ``sbatch`` or
    ``snakemake``. On exit remaining jobs are cancelled and every daemon is stopped by PID.
    """
    reason = slurm_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    root = Path(root).resolve()
    munge_dir = root / "munge"
    munge_socket = munge_dir / "munge.socket"
    if len(str(munge_socket)) > _MAX_SOCKET_PATH:
        raise ValueError(f"{root} is too long a path for the munge socket: {munge_socket}")
    munge_dir.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    munge_dir.chmod(0o755)  # munged refuses a socket directory others can write
    nodename, hw_cpus, hw_mem = _node_hardware()
    conf = root / "slurm.conf"
    bin_dir = _srun_wrapper(root / "bin", conf)
    cluster = SlurmCluster(
        root=root,
        nodename=nodename,
        partition=partition,
        gpus=gpus,
        cpus=cpus or hw_cpus,
        memory_mb=memory_mb or hw_mem,
        conf=conf,
        jobcomp=root / "jobcomp.log",
        job_records_dir=root / "job_records",
        logs={
            "munged": munge_dir / "munged.log",
            "slurmctld": root / "slurmctld.log",
            "slurmd": root / "slurmd.log",
        },
        env={
            "SLURM_CONF": str(conf),
            "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", os.defpath)]),
        },
        marker=f"{root}:{os.getpid()}",
    )
    _write_configs(cluster, (hw_cpus, hw_mem), munge_socket)
    key = munge_dir / "munge.key"
    if not key.exists():
        subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}"], check=True)
    key.chmod(0o400)
    daemon_env = cluster.command_env() | {MARKER_ENV: cluster.marker}
    try:
        munged = [
            _which("munged"),
            "--foreground",
            "--force",
            f"--socket={munge_socket}",
            f"--key-file={key}",
            f"--pid-file={munge_dir / 'munged.pid'}",
            f"--log-file={cluster.logs['munged']}",
            f"--seed-file={munge_dir / 'munged.seed'}",
        ]
        _start(cluster, "munged", munged, daemon_env)
        _wait(cluster, munge_socket.exists, "munge socket", timeout)
        # -c: no state from an earlier cluster in this root.
        _start(cluster, "slurmctld", [_which("slurmctld"), "-D", "-c", "-f", str(conf)], daemon_env)
        _start(cluster, "slurmd", [_which("slurmd"), "-D", "-f", str(conf)], daemon_env)
        _wait(cluster, lambda: _node_idle(cluster), f"idle node {nodename} in sinfo", timeout)
        yield cluster
    finally:
        _stop(cluster)
