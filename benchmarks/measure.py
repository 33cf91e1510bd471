"""Measurements shared by the benchmark scripts: memory, CPU time, bytes on disk, formatting."""

from __future__ import annotations

import os
import resource
from pathlib import Path


def _status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status (VmHWM, VmRSS) in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss() -> int:
    """Peak resident set size of this process so far (VmHWM, else ru_maxrss)."""
    peak = _status_bytes("VmHWM")
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    return peak


def current_rss() -> int:
    rss = _status_bytes("VmRSS")
    return peak_rss() if rss is None else rss


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    times = os.times()
    return times.user + times.system


def tree_bytes(path: Path) -> tuple[int, int]:
    """(apparent bytes, allocated bytes on disk) of all files under `path`."""
    apparent = allocated = 0
    for root, _, files in os.walk(path):
        for name in files:
            stat = os.stat(os.path.join(root, name))
            apparent += stat.st_size
            allocated += stat.st_blocks * 512
    return apparent, allocated


def gb(value: float) -> str:
    return f"{value / 1e9:.2f} GB"


def mbps(value: float) -> str:
    return f"{value / 1e6:.0f} MB/s"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def without_checksums() -> None:
    """Make TokenStoreWriter, in this process, write the store without its chunk checksums: the
    logits chunks bare, zarr's default zstd alone on the small arrays (the shard index keeps the
    crc32c it always had)."""
    from zarr.codecs import ZstdCodec

    import sinkscope.extraction.store as store

    store.logits_compressors = lambda: ()
    store.checked_compressors = lambda: (ZstdCodec(level=0),)


def add_checksums_option(parser) -> None:
    """--checksums yes | no | both: the store as TokenStoreWriter writes it (crc32c), as it did
    before (`without_checksums`), or both, measured taking turns."""
    parser.add_argument(
        "--checksums",
        choices=("yes", "no", "both"),
        default="yes",
        help="the store with crc32c chunk checksums (yes, as TokenStoreWriter writes it), "
        "without (no, as it wrote it before), or both, measured taking turns (default yes)",
    )
