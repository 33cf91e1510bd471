"""Checkpoint digests: the bytes decide, and each file is read once per change."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from sinkscope.workflow import digest
from sinkscope.workflow.digest import cached_sha256


@pytest.fixture
def counted_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    real = digest.sha256_file

    def counting(path, progress=False):
        reads.append(str(path))
        return real(path, progress)

    monkeypatch.setattr(digest, "sha256_file", counting)
    return reads


def settle(path, seconds_ago: float = 60.0) -> None:
    """Date the file in the past: files modified within the last seconds are never cached."""
    stat = path.stat()
    os.utime(path, (stat.st_atime, stat.st_mtime - seconds_ago))


def test_digest_is_sha256_of_the_bytes(tmp_path):
    data = os.urandom(3 << 20)
    path = tmp_path / "w.safetensors"
    path.write_bytes(data)
    assert cached_sha256([path], tmp_path / "cache.json") == hashlib.sha256(data).hexdigest()


def test_each_file_is_read_once_per_change(tmp_path, counted_reads):
    cache = tmp_path / "cache.json"
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"weights" * 1000)
    settle(path)
    first = cached_sha256([path], cache)
    assert cached_sha256([path], cache) == first
    assert len(counted_reads) == 1

    path.touch()  # new mtime, same bytes: read again once, same digest
    settle(path, 30)
    assert cached_sha256([path], cache) == first
    assert cached_sha256([path], cache) == first
    assert len(counted_reads) == 2

    copy = tmp_path / "copy.safetensors"
    shutil.copy2(path, copy)  # same bytes, same mtime: only the inode tells it is another file
    os.replace(copy, path)
    assert cached_sha256([path], cache) == first
    assert len(counted_reads) == 3

    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    settle(path, 10)
    assert cached_sha256([path], cache) == hashlib.sha256(bytes(data)).hexdigest() != first
    assert len(counted_reads) == 4


def test_a_file_modified_just_now_is_not_cached(tmp_path, counted_reads):
    cache = tmp_path / "cache.json"
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"still being written")
    cached_sha256([path], cache)
    cached_sha256([path], cache)
    assert len(counted_reads) == 2


def test_several_files_combine_in_order(tmp_path):
    cache = tmp_path / "cache.json"
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"first shard")
    b.write_bytes(b"second shard")
    ab = cached_sha256([a, b], cache)
    assert ab != cached_sha256([b, a], cache)
    assert ab not in {cached_sha256([a], cache), cached_sha256([b], cache)}


def test_an_unreadable_cache_is_rebuilt(tmp_path):
    cache = tmp_path / "cache.json"
    cache.write_text("{not json")
    path = tmp_path / "w"
    path.write_bytes(b"x")
    settle(path)
    assert cached_sha256([path], cache) == hashlib.sha256(b"x").hexdigest()
    assert str(path.resolve()) in cache.read_text()


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.safetensors"):
        cached_sha256([tmp_path / "nope.safetensors"], tmp_path / "cache.json")


def test_bytes_rewritten_in_place_with_the_mtime_restored_are_hashed_again(tmp_path, counted_reads):
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"a" * 4096)
    settle(path)
    cache = tmp_path / "cache.json"
    before = cached_sha256([path], cache)
    stat = path.stat()
    with open(path, "r+b") as handle:  # same inode, same size
        handle.write(b"b")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        stat.st_size,
        stat.st_mtime_ns,
        stat.st_ino,
    )
    assert cached_sha256([path], cache) == hashlib.sha256(b"b" + b"a" * 4095).hexdigest() != before
    assert counted_reads == [str(path), str(path)]
