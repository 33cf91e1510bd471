"""Which GPU a job runs on.

With `--resources gpu=N` Snakemake runs up to N GPU jobs at once on a workstation, but it does not
say which GPU each may use (it sets no CUDA_VISIBLE_DEVICES locally), so every job would land on
cuda:0. Each job therefore claims one visible GPU with an exclusive `flock` on a per-GPU lock
file: the kernel drops the lock when the process ends, however it ends, so a killed job never
leaves a GPU claimed. A SLURM job with one GPU uses it as is: the allocation is its own (SLURM
sets CUDA_VISIBLE_DEVICES). An allocation with several (`salloc --gpus=4`, then a local
`snakemake --resources gpu=4` inside it) is a workstation again: its jobs claim GPUs with locks
kept apart per allocation, since every allocation numbers its GPUs from 0.

SINKSCOPE_FAKE_GPUS=N pretends N GPUs exist and computes on the CPU: it exercises the claims and
the scheduling on machines without GPUs (the tests and CI), and is recorded in the store.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_DIR_ENV = "SINKSCOPE_GPU_LOCK_DIR"
# Fixed and machine-local, not $TMPDIR: Snakemake points TMPDIR at each job's tmpdir resource,
# and every job and user on the machine must see the same locks.
DEFAULT_LOCK_DIR = "/tmp/sinkscope-gpu-locks"
FAKE_GPUS_ENV = "SINKSCOPE_FAKE_GPUS"
_POLL_SECONDS = 0.5
_WAIT_LOG_SECONDS = 60.0


@dataclass
class GpuClaim:
    """The device a job computes on and how it came to it; `record()` goes into store attributes."""

    device: str
    index: int | None = None
    visible_id: str | None = None
    claimed_by: str = "none"
    fake: bool = False
    lock_file: str | None = None

    def record(self) -> dict:
        record = {
            "device": self.device,
            "index": self.index,
            "visible_id": self.visible_id,
            "claimed_by": self.claimed_by,
            "fake": self.fake,
            "host": socket.gethostname(),
        }
        if self.lock_file is not None:
            record["lock_file"] = self.lock_file
        for name in ("SLURM_JOB_ID", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
            if name in os.environ:
                record[name.lower()] = os.environ[name]
        return record


def lock_dir() -> Path:
    """Machine-local lock folder shared by every user's jobs (sticky and world-writable)."""
    folders = [Path(os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)]
    if under_slurm():
        folders.append(folders[0] / f"slurm-{os.environ['SLURM_JOB_ID']}")
    for folder in folders:
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(PermissionError):
                folder.chmod(0o1777)
    return folders[-1]


def fake_gpus() -> int:
    value = os.environ.get(FAKE_GPUS_ENV, "")
    if not value:
        return 0
    if not value.isdigit():
        raise ValueError(f"{FAKE_GPUS_ENV}={value!r}: expected a number of GPUs")
    return int(value)


def host_has_gpu() -> bool:
    """Whether this machine shows a GPU a job could use (or fakes some), seen without torch: the
    device nodes of NVIDIA's and AMD's drivers. Snakemake asks while it parses."""
    if fake_gpus():
        return True
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    nodes = [*Path("/dev").glob("nvidia[0-9]*"), Path("/dev/kfd")]
    return any(node.exists() for node in nodes)


def visible_gpu_ids(count: int) -> list[str]:
    """Names of the `count` GPUs this process sees, as the machine knows them (lock names).

    CUDA_VISIBLE_DEVICES=2,3 makes cuda:0 the machine's GPU 2: locking "2" keeps two workflows
    with different visible sets from sharing it.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [part.strip() for part in visible.split(",") if part.strip()]
        if len(ids) >= count:
            return ids[:count]
    return [str(index) for index in range(count)]


def under_slurm() -> bool:
    return "SLURM_JOB_ID" in os.environ


def _lock_name(gpu_id: str) -> str:
    return "gpu-" + re.sub(r"[^A-Za-z0-9_.-]", "_", gpu_id) + ".lock"


def _open_lock(path: Path) -> int:
    """A read-only descriptor of the lock file (enough for flock), made world-readable if new.

    Opened without O_CREAT first: with fs.protected_regular (systemd's default) an O_CREAT open
    of another user's file in a sticky folder fails even read-only.
    """
    while True:
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue  # another job made it just now
        with contextlib.suppress(PermissionError):
            os.fchmod(fd, 0o644)
        return fd


@contextlib.contextmanager
def claim_gpu(gpu_ids: list[str], folder: Path | None = None) -> Iterator[tuple[int, Path]]:
    """Hold an exclusive lock on one of `gpu_ids` (the first free one) while the block runs.

    Yields (index into gpu_ids, lock file). Waits while all are held: another workflow (or a
    `--resources gpu` larger than the GPUs there are) is using them.
    """
    if not gpu_ids:
        raise RuntimeError("no GPU to claim")
    folder = lock_dir() if folder is None else folder
    started = time.monotonic()
    next_log = started
    while True:
        for index, gpu_id in enumerate(gpu_ids):
            path = folder / _lock_name(gpu_id)
            fd = _open_lock(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield index, path
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            return
        now = time.monotonic()
        if now >= next_log:
            log.warning(
                "all %d GPUs (%s) are claimed by other jobs (locks in %s); waiting "
                "(%.0f s so far). Is --resources gpu larger than the GPUs there are?",
                len(gpu_ids),
                ",".join(gpu_ids),
                folder,
                now - started,
            )
            next_log = now + _WAIT_LOG_SECONDS
        time.sleep(_POLL_SECONDS)


@contextlib.contextmanager
def job_device(spec: str = "auto") -> Iterator[GpuClaim]:
    """The device a job computes on, held for the duration of the block.

    spec: `auto` (a GPU if there is one, else the CPU), `cpu`, `cuda` (any free GPU) or `cuda:N`
    (that GPU, no claim: the user chose it).
    """
    import torch

    fakes = fake_gpus()
    if spec == "cpu":
        yield GpuClaim(device="cpu")
        return
    if spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"device: {spec!r} requested but CUDA is not available")
        yield GpuClaim(device=spec, index=int(spec.split(":", 1)[1]), claimed_by="config")
        return
    count = fakes or (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if count == 0:
        if spec == "cuda":
            raise RuntimeError("device: 'cuda' requested but CUDA is not available")
        yield GpuClaim(device="cpu")
        return
    gpu_ids = visible_gpu_ids(count)
    if under_slurm() and count == 1:
        # The allocation is this job's own: SLURM made only its GPU visible.
        yield GpuClaim(
            device="cpu" if fakes else "cuda:0",
            index=0,
            visible_id=gpu_ids[0],
            claimed_by="slurm",
            fake=bool(fakes),
        )
        return
    with claim_gpu(gpu_ids) as (index, path):
        if not fakes:
            # Code that uses the current device (not an explicit one) must not touch GPU 0.
            torch.cuda.set_device(index)
        claim = GpuClaim(
            device="cpu" if fakes else f"cuda:{index}",
            index=index,
            visible_id=gpu_ids[index],
            claimed_by="lock",
            fake=bool(fakes),
            lock_file=str(path),
        )
        log.info(
            "claimed GPU %s (%s)%s",
            index,
            gpu_ids[index],
            " [fake: computing on the CPU]" if fakes else "",
        )
        yield claim
