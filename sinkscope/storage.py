"""How sinkscope writes files: atomically, and with the zarr settings every store shares.

Every output is written under a temporary sibling name and renamed into place only when it is
whole, so a killed or failed job never leaves something at the final path that looks finished,
and a stale temporary from an earlier kill is removed before the next write. Shared by every
world (jobs, analysis, the parse-time digest cache); no torch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

TEMPORARY_SUFFIX = ".tmp"
# zarr's default pipeline runs every inner chunk of a shard through the codecs on its own; batching
# them halves write and read time when tiles are small (measured on the demo's 24 x 24 tiles).
ZARR_TUNING = {"codec_pipeline.batch_size": 32}


def tune_zarr() -> None:
    """Apply ZARR_TUNING to this process (extraction and reduction jobs call it)."""
    import zarr  # here: the parse-time digest cache uses this module and needs no zarr

    zarr.config.set(ZARR_TUNING)


def temporary_path(
    path: str | os.PathLike, suffix: str = TEMPORARY_SUFFIX, *, unique: bool = False
) -> Path:
    """The sibling `path` is built under. `unique` adds host and process, for files that several
    processes (on several nodes of one filesystem) may rewrite at once."""
    path = Path(path)
    if unique:
        suffix = f".{socket.gethostname()}.{os.getpid()}{suffix}"
    return path.with_name(path.name + suffix)


def remove(path: str | os.PathLike) -> None:
    """Delete a file or a directory tree; nothing there is fine."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def replace(temporary: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Move a finished `temporary` to `path`, replacing a file or directory already there."""
    path = Path(path)
    if Path(temporary).is_dir() and path.exists():
        remove(path)  # os.replace cannot replace a non-empty directory
    os.replace(temporary, path)
    return path


@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike, suffix: str = TEMPORARY_SUFFIX, *, unique: bool = False
) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write a file or directory to; on success it
    replaces `path`, on any failure it is deleted. A stale temporary is removed first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(path, suffix, unique=unique)
    remove(temporary)
    try:
        yield temporary
        replace(temporary, path)
    except BaseException:
        remove(temporary)
        raise


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    with atomic_path(path) as temporary:
        temporary.write_text(text)
    return Path(path)
