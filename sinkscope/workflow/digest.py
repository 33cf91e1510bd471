"""Content digests of checkpoint files, computed once per change of the file.

Snakemake re-runs a job when an input is newer than its outputs. Checkpoints are copied between
machines and touched by sync tools without changing a byte, and re-extracting a 5.7 GB model over
every layer and prompt for that is hours of GPU time. So extraction jobs take checkpoint files as
`ancient()` inputs and their sha256 as params: the bytes, not the timestamps, decide.

Hashing runs at ~1.2 GB/s from the page cache (5 s for 5.7 GB; a cold network disk is slower) and
the workflow is parsed again by every job on a cluster, so digests are cached on disk, keyed by
the file's path, size, mtime, ctime and inode (not the device number, which differs between the
nodes mounting one network filesystem): a file is read again only after it changed (or was
touched or copied, which costs one read and re-runs nothing). No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from sinkscope.storage import atomic_path, locked

DIGEST_CACHE = ".snakemake/sinkscope/sha256.json"
_CHUNK_BYTES = 1 << 24
# Hashing smaller files is quicker than saying so.
_QUIET_BELOW_BYTES = 1 << 28
# A file modified this recently may change again within the same mtime tick (coarse on some
# filesystems): its digest is not cached, as git does for "racily clean" files.
_RACY_SECONDS = 2.0


def sha256_file(path: str | Path, progress: bool = False) -> str:
    """sha256 of one file's bytes."""
    digest = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        bar = None
        if progress and size >= _QUIET_BELOW_BYTES:
            from tqdm import tqdm

            bar = tqdm(
                total=size, unit="B", unit_scale=True, desc=f"sha256 {path}", file=sys.stderr
            )
        while block := handle.read(_CHUNK_BYTES):
            digest.update(block)
            if bar is not None:
                bar.update(len(block))
        if bar is not None:
            bar.close()
    return digest.hexdigest()


def combine(digests: Iterable[str]) -> str:
    """One digest for an ordered list of file digests (a sharded checkpoint, a base + generator)."""
    digests = list(digests)
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


def _stamp(stat: os.stat_result) -> list[int]:
    # ctime too: bytes rewritten in place with the mtime restored (rsync -t, a careless script)
    # keep size, mtime and inode, but every write sets ctime, and no user call can set it back.
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


def _read(cache: Path) -> dict:
    try:
        with open(cache) as handle:
            entries = json.load(handle)
    except (FileNotFoundError, json.JSONDecodeError):
        # A cache that cannot be read is only a cache: rebuild it.
        return {}
    return entries if isinstance(entries, dict) else {}


def _write(cache: Path, entries: dict) -> None:
    # Unique temporaries: jobs on several nodes may rewrite the cache at once without flock.
    with atomic_path(cache, unique=True) as temporary:
        temporary.write_text(json.dumps(entries, indent=1, sort_keys=True))


def cached_sha256(paths: Iterable[str | Path], cache: str | Path = DIGEST_CACHE) -> str:
    """sha256 of the bytes of `paths` (one digest per file, combined in order), cached in `cache`.

    A file is read only when its (size, mtime, ctime, inode) differs from the cached entry.
    """
    cache = Path(cache)
    paths = [Path(p) for p in paths]
    # One read-modify-write at a time between jobs parsing the workflow at once; unlocked (no
    # flock on the filesystem), the write stays atomic and the worst case is a file hashed twice.
    with locked(cache.with_name(cache.name + ".lock")):
        entries = _read(cache)
        digests = []
        changed = False
        for path in paths:
            try:
                stat = path.stat()
            except FileNotFoundError:
                raise FileNotFoundError(f"checkpoint file not found: {path}") from None
            key = str(path.resolve())
            entry = entries.get(key)
            if entry is None or entry.get("stamp") != _stamp(stat):
                if stat.st_size >= _QUIET_BELOW_BYTES:
                    print(
                        f"sinkscope: hashing {path} ({stat.st_size / 1e9:.2f} GB), once per change",
                        file=sys.stderr,
                    )
                entry = {"stamp": _stamp(stat), "sha256": sha256_file(path, progress=True)}
                if time.time() - stat.st_mtime > _RACY_SECONDS:
                    entries[key] = entry
                    changed = True
            digests.append(entry["sha256"])
        if changed:
            _write(cache, entries)
    return combine(digests)
