"""Damaged stores fail loudly: checksums on every chunk, errors that name the store, the variable
and the chunk, and no silently different numbers (token store written by TokenStoreWriter)."""

from __future__ import annotations

import json
import re
import shutil
import warnings

import google_crc32c
import numcodecs
import numpy as np
import pytest
import xarray as xr
import zarr
from zarr.codecs import Crc32cCodec

from sinkscope.analysis.reduce import reduce_rows, reduce_token_store
from sinkscope.analysis.stores import open_frame_dataset
from sinkscope.extraction.store import TokenStoreWriter
from sinkscope.frames import visible_frames
from tests.storefixtures import default_attrs, random_block_causal_logits, write_token_store

T = 16  # tokens per frame: a +0.25 on one logit moves its tile's mean by 0.001, below the
# reducer's cross-check against the pooled logits, so only a checksum can catch it
SIZES = [2, 2, 2]
F = sum(SIZES)
STEPS, HEADS = 2, 2
TIMESTEPS = [937.5, 0.0]
PASS_KINDS = ["denoise", "cache"]
# The shard of step 1, head 0, query frame 5: a whole row, all 6 key frames visible.
STEP, HEAD, FRAME = 1, 0, 5
SHARD = f"c.{STEP}.{HEAD}.{FRAME}.0"
FLIPS = 40


def write_with_writer(path, logits: np.ndarray):
    """logits [S, H, N, N] (NaN = unseen) through TokenStoreWriter, as the capture writes them."""
    seen = visible_frames(SIZES)
    attrs = default_attrs(
        T=T, num_frames=F, block_sizes=SIZES, timesteps=TIMESTEPS, num_heads=HEADS
    )
    del attrs["complete"]  # the writer sets it when it closes
    with (
        warnings.catch_warnings(),
        TokenStoreWriter(
            path,
            num_heads=HEADS,
            num_frames=F,
            frame_seq_length=T,
            timesteps=TIMESTEPS,
            pass_kinds=PASS_KINDS,
            attrs=attrs,
        ) as writer,
    ):
        warnings.simplefilter("ignore", RuntimeWarning)  # nanmean of the unseen tiles
        for step in range(STEPS):
            tiles = logits[step].reshape(HEADS, F, T, F, T)
            writer.write_pooled(step, 0, np.arange(F), np.nanmean(tiles, axis=(2, 4)))
            for head in range(HEADS):
                for frame in range(F):
                    keys = np.flatnonzero(seen[frame])
                    rows = logits[step, head, frame * T : (frame + 1) * T]
                    tiles = rows.reshape(T, F, T)[:, keys].transpose(1, 0, 2)
                    writer.write_row(step, head, frame, tiles.astype(np.float16), keys)
    return path


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(token store, its frame dataset, the logits) written once; tests damage copies."""
    root = tmp_path_factory.mktemp("corruption")
    logits = random_block_causal_logits(
        np.random.default_rng(3), num_steps=STEPS, num_heads=HEADS, T=T, block_sizes=SIZES
    )
    store = write_with_writer(root / "layer3.zarr", logits)
    frames = root / "frames.zarr"
    reduce_token_store(store, frames, threads=1)
    return store, frames, logits


@pytest.fixture
def copy(stores, tmp_path):
    """A fresh copy of the token store."""
    return shutil.copytree(stores[0], tmp_path / "layer3.zarr")


def shard_layout(data: bytes) -> tuple[list[tuple[int, int]], int]:
    """(offset, length) of each key frame's chunk in a logits shard, and where its index starts
    (zarr's sharding codec: index at the end, uint64 pairs, then a crc32c)."""
    index_start = len(data) - (16 * F + 4)
    index = np.frombuffer(data[index_start : index_start + 16 * F], dtype="<u8").reshape(F, 2)
    return [(int(offset), int(length)) for offset, length in index], index_start


def add_to_one_value(data: bytes, key_frame: int, delta: float = 0.25) -> bytes:
    """The shard with one float16 of the key frame's tile changed by `delta`, its stored checksum
    kept, so that only the chunk's checksum can tell."""
    chunks, index_start = shard_layout(data)
    pieces = [data[offset : offset + length] for offset, length in chunks]
    chunk = pieces[key_frame]
    payload, checksum = chunk[:-4], chunk[-4:]
    values = np.frombuffer(payload, dtype=np.float16).copy()
    values[7] += np.float16(delta)
    pieces[key_frame] = values.tobytes() + checksum
    index, offset = [], 0
    for piece in pieces:
        index.append((offset, len(piece)))
        offset += len(piece)
    index_bytes = np.asarray(index, dtype="<u8").tobytes()
    crc = np.uint32(google_crc32c.value(index_bytes)).astype("<u4").tobytes()
    assert len(data) - index_start == len(index_bytes) + 4
    return b"".join(pieces) + index_bytes + crc


def corrupt(store, relative: str, damage) -> None:
    file = store / relative
    file.write_bytes(damage(file.read_bytes()))


def assert_names(error: pytest.ExceptionInfo, store, variable: str, chunk: str) -> str:
    message = str(error.value)
    assert str(store) in message
    assert f"variable '{variable}'" in message
    assert f"chunk {chunk}" in message
    return message


def test_store_arrays_carry_checksums(stores):
    store = stores[0]
    group = zarr.open_group(store, mode="r")
    sharding = group["logits"].metadata.codecs[0]
    assert isinstance(sharding.codecs[-1], Crc32cCodec)  # on each chunk's stored bytes
    assert isinstance(sharding.index_codecs[-1], Crc32cCodec)
    for name in ("logit_mean_pooled", "timestep", "pass_kind", "query_frame", "key_frame"):
        assert isinstance(group[name].metadata.codecs[-1], Crc32cCodec), name


def test_checksums_change_no_number(stores, tmp_path):
    """The reduction of the checksummed store equals that of the same logits written without
    checksums (the test fixture's plain zarr writer)."""
    _, frames, logits = stores
    plain = write_token_store(
        tmp_path / "plain.zarr",
        logits,
        T=T,
        block_sizes=SIZES,
        timesteps=TIMESTEPS,
        pass_kinds=PASS_KINDS,
    )
    reduce_token_store(plain, tmp_path / "plain_frames.zarr", threads=1)
    expected = xr.open_zarr(tmp_path / "plain_frames.zarr").load().drop_attrs()
    got = open_frame_dataset(frames)
    xr.testing.assert_identical(got.drop_attrs(), expected)


SHARD_DAMAGE = {
    "random bytes": lambda data: np.random.default_rng(0).bytes(len(data)),
    "truncated to half": lambda data: data[: len(data) // 2],
    "shard index cut off": lambda data: data[: shard_layout(data)[1]],
    "shard index emptied": lambda data: data[: shard_layout(data)[1]] + b"\xff" * (16 * F + 4),
}


@pytest.mark.parametrize("kind", sorted(SHARD_DAMAGE))
def test_damaged_shard_is_named(copy, tmp_path, kind):
    corrupt(copy, f"logits/{SHARD}", SHARD_DAMAGE[kind])
    out = tmp_path / "frames.zarr"
    with pytest.raises(ValueError) as error:
        reduce_token_store(copy, out, threads=1)
    message = assert_names(error, copy, "logits", SHARD)
    assert f"step {STEP}, head {HEAD}, query frame {FRAME}" in message
    assert not out.exists()


def test_a_value_changed_by_a_quarter_is_named(copy, tmp_path):
    corrupt(copy, f"logits/{SHARD}", lambda data: add_to_one_value(data, key_frame=2))
    with pytest.raises(ValueError) as error:
        reduce_token_store(copy, tmp_path / "frames.zarr", threads=1)
    message = assert_names(error, copy, "logits", SHARD)
    assert "key frame(s) 2)" in message
    assert "checksum" in message


def test_the_changed_value_is_really_stored(stores, tmp_path):
    """The damage of the test above, read past the checksum: one stored logit is 0.25 higher,
    which changes the reduction of its rows."""
    store, _, logits = stores
    copy = shutil.copytree(store, tmp_path / "layer3.zarr")
    corrupt(copy, f"logits/{SHARD}", lambda data: add_to_one_value(data, key_frame=2))
    data = (copy / "logits" / SHARD).read_bytes()
    offset, length = shard_layout(data)[0][2]
    payload = data[offset : offset + length - 4]  # the chunk without its checksum
    tile = np.frombuffer(payload, dtype=np.float16).reshape(T, T)
    rows = logits[STEP, HEAD, FRAME * T : (FRAME + 1) * T].astype(np.float16)
    difference = tile.astype(np.float64) - rows[:, 2 * T : 3 * T]
    assert np.count_nonzero(difference) == 1
    assert difference.flat[7] == pytest.approx(0.25, abs=0.01)
    damaged = rows.copy()
    damaged[:, 2 * T : 3 * T] = tile
    assert not np.array_equal(reduce_rows(damaged, F), reduce_rows(rows, F))


def test_random_bit_flips_are_named(stores, copy, tmp_path):
    """40 single-bit flips anywhere in a shard, each in a fresh copy: every one fails the read,
    naming the chunk's key frame when it hit a chunk, the whole shard when it hit the index."""
    shard = copy / "logits" / SHARD
    original = shard.read_bytes()
    chunks, index_start = shard_layout(original)
    rng = np.random.default_rng(11)
    out = tmp_path / "frames.zarr"
    for bit in rng.choice(len(original) * 8, size=FLIPS, replace=False):
        damaged = bytearray(original)
        damaged[bit // 8] ^= 1 << (bit % 8)
        shard.write_bytes(bytes(damaged))
        with pytest.raises(ValueError) as error:
            reduce_token_store(copy, out, threads=1)
        message = assert_names(error, copy, "logits", SHARD)
        hit = [
            k for k, (offset, length) in enumerate(chunks) if offset <= bit // 8 < offset + length
        ]
        if hit:
            assert f"key frame(s) {hit[0]})" in message, (bit, message)
        else:
            assert bit // 8 >= index_start
            assert "every tile" in message, (bit, message)
        assert not out.exists()
        shard.write_bytes(original)
    reduce_token_store(copy, out, threads=1)  # the restored copy reduces again


@pytest.mark.parametrize(
    "variable", ["logit_mean_pooled", "timestep", "pass_kind", "query_frame", "key_frame"]
)
def test_damaged_small_arrays_are_named(copy, tmp_path, variable):
    """One byte of the array's data changed and compressed again, the chunk's checksum kept: only
    the checksum can tell."""
    array = zarr.open_group(copy, mode="r")[variable]
    chunk = array.metadata.encode_chunk_key((0,) * array.ndim)
    checksummed = isinstance(array.metadata.codecs[-1], Crc32cCodec)

    def change(data: bytes) -> bytes:
        payload, checksum = (data[:-4], data[-4:]) if checksummed else (data, b"")
        raw = bytearray(numcodecs.Zstd().decode(payload))
        raw[-1] ^= 0x01  # the last element (the last string's last letter)
        return bytes(numcodecs.Zstd(level=0).encode(bytes(raw))) + checksum

    corrupt(copy, f"{variable}/{chunk}", change)
    with pytest.raises(ValueError) as error:
        reduce_token_store(copy, tmp_path / "frames.zarr", threads=1)
    assert_names(error, copy, variable, chunk)


def test_missing_shard_is_named(copy, tmp_path):
    """A deleted shard reads as never written (NaN): the pooled logits show where."""
    (copy / "logits" / SHARD).unlink()
    with pytest.raises(ValueError, match=re.escape(f"step {STEP}, head {HEAD}, query frame")):
        reduce_token_store(copy, tmp_path / "frames.zarr", threads=1)


def test_damaged_metadata_is_named(copy, tmp_path):
    out = tmp_path / "frames.zarr"
    root = copy / "zarr.json"
    original = root.read_text()
    root.write_text(original[: len(original) // 2])
    with pytest.raises(ValueError, match=re.escape(f"token store {copy}: its zarr.json")):
        reduce_token_store(copy, out, threads=1)
    # A valid JSON with one attribute changed: the attributes' checksum tells.
    metadata = json.loads(original)
    metadata["attributes"]["layer"] = 4
    root.write_text(json.dumps(metadata, indent=2))
    with pytest.raises(ValueError, match=r"attributes \(in zarr.json\) fail their checksum"):
        reduce_token_store(copy, out, threads=1)
    root.write_text(original)
    # An array's own zarr.json that disagrees with the consolidated copy.
    own = copy / "logits" / "zarr.json"
    metadata = json.loads(own.read_text())
    metadata["fill_value"] = 0.0
    own.write_text(json.dumps(metadata, indent=2))
    with pytest.raises(ValueError, match=re.escape("variable 'logits': logits/zarr.json differs")):
        reduce_token_store(copy, out, threads=1)
    assert not out.exists()


def test_root_metadata_bit_flips_never_pass(stores, copy, tmp_path):
    """Bit flips in the store's zarr.json (attributes, consolidated metadata): each fails, or
    reduces to exactly the same frame dataset (a flip that zarr ignores)."""
    root = copy / "zarr.json"
    original = root.read_bytes()
    expected = open_frame_dataset(stores[1])
    out = tmp_path / "frames.zarr"
    rng = np.random.default_rng(5)
    for bit in rng.choice(len(original) * 8, size=20, replace=False):
        damaged = bytearray(original)
        damaged[bit // 8] ^= 1 << (bit % 8)
        root.write_bytes(bytes(damaged))
        try:
            reduce_token_store(copy, out, threads=1)
        except ValueError as error:
            assert str(copy) in str(error)
        else:
            xr.testing.assert_identical(open_frame_dataset(out), expected)
    root.write_bytes(original)


def test_frame_dataset_carries_checksums(stores, tmp_path):
    frames = stores[1]
    with xr.open_zarr(frames) as ds:  # plain xarray opens it
        for name in ds.variables:
            assert isinstance(ds[name].encoding["compressors"][-1], Crc32cCodec), name
    copy = shutil.copytree(frames, tmp_path / "frames.zarr")
    chunk = copy / "prob_mass" / "c" / "0" / "0" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x04
    chunk.write_bytes(bytes(data))
    with pytest.raises(ValueError) as error:
        open_frame_dataset(copy)
    message = str(error.value)
    assert f"frame dataset {copy}" in message
    assert "variable 'prob_mass', chunk c/0/0/0/0" in message
