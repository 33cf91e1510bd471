"""Which GPU a job runs on.

With `--resources gpu=N` Snakemake runs up to N GPU jobs at once on a workstation, but it does not
say which GPU each may use (it sets no CUDA_VISIBLE_DEVICES locally), so every job would land on
cuda:0. Each job therefore claims one visible GPU with an exclusive `flock` on a per-GPU lock
file: the kernel drops the lock when the process ends, however it ends, so a killed job never
leaves a GPU claimed. Under SLURM the job's allocation is its own (SLURM sets
CUDA_VISIBLE_DEVICES to the allocated GPUs), so the first GPU of it is used as is, without locks.

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
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_DIR_ENV = "SINKSCOPE_GPU_LOCK_DIR"
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
    extra: dict = field(default_factory=dict)

    def record(self) -> dict:
        record = {
            "device": self.device,
            "index": self.index,
            "visible_id": self.visible_id,
            "claimed_by": self.claimed_by,
            "fake": self.fake,
            "host": socket.gethostname(),
            **self.extra,
        }
        if self.lock_file is not None:
            record["lock_file"] = self.lock_file
        for name in ("SLURM_JOB_ID", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
            if name in os.environ:
                record[name.lower()] = os.environ[name]
        return record


def lock_dir() -> Path:
    """Machine-local lock folder shared by every user's jobs (sticky and world-writable)."""
    folder = Path(
        os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "sinkscope-gpu-locks"
    )
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(PermissionError):
            folder.chmod(0o1777)
    return folder


def fake_gpus() -> int:
    value = os.environ.get(FAKE_GPUS_ENV, "")
    if not value:
        return 0
    if not value.isdigit():
        raise ValueError(f"{FAKE_GPUS_ENV}={value!r}: expected a number of GPUs")
    return int(value)


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
            # Read-only open suffices for flock, so lock files made by another user still work.
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
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
    if under_slurm():
        # The allocation is this job's own: SLURM made only its GPUs visible.
        yield GpuClaim(
            device="cpu" if fakes else "cuda:0",
            index=0,
            visible_id=gpu_ids[0],
            claimed_by="slurm",
            fake=bool(fakes),
        )
        return
    with claim_gpu(gpu_ids) as (index, path):
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
