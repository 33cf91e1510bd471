"""The attention store's shards, written as files (sinkscope.extraction.shards), against zarr's
own writes of the same data: the same bytes, file for file, and zarr reads them back."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr
from zarr.codecs import Crc32cCodec

from sinkscope.extraction import shards
from sinkscope.extraction.shards import direct_io_works, shard_key, write_shard


def _array(root, name, dtype, shape, chunks, shards, separator="/", checksums=True):
    group = zarr.open_group(str(root), mode="a", zarr_format=3)
    return group.create_array(
        name,
        shape=shape,
        chunks=chunks,
        shards=shards,
        dtype=dtype,
        fill_value=np.nan,
        compressors=(Crc32cCodec(),) if checksums else (),
        config={"write_empty_chunks": False},
        chunk_key_encoding={"name": "default", "separator": separator},
    )


def _zarrs_twin(ours: zarr.Array, path) -> zarr.Array:
    """A new array at `path` with the metadata of `ours`, for zarr's own write of the same
    values."""
    return zarr.create_array(
        str(path),
        shape=ours.shape,
        dtype=ours.dtype,
        chunks=ours.shards,  # the sharding serializer given: chunks are its shards
        serializer=ours.metadata.codecs[0],
        compressors=None,
        fill_value=np.nan,
        chunk_key_encoding={"name": "default", "separator": "."},
        config={"write_empty_chunks": False},
    )


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
@pytest.mark.parametrize("checksums", [True, False], ids=["crc32c", "bare"])
@pytest.mark.parametrize("separator", ["/", "."])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("visible", [[0, 1, 2, 3, 4], [0, 2, 3], [4]], ids=["all", "gaps", "one"])
def test_a_shard_written_as_a_file_is_the_one_zarr_writes(
    tmp_path, dtype, visible, separator, checksums, direct
):
    heads, frames, t, keys = 3, 2, 6, 5  # a shard (1, heads, frames, keys * t) of chunks per key
    shape, chunks, shards = (
        (2, heads, 4, keys * t),
        (1, heads, frames, t),
        (1, heads, frames, keys * t),
    )
    rng = np.random.default_rng(0)
    values = rng.random((heads, frames, keys * t)).astype(dtype)
    rows = np.full((1, heads, frames, keys * t), np.nan, dtype)
    for key in visible:
        rows[..., key * t : (key + 1) * t] = values[..., key * t : (key + 1) * t]
    layout = (dtype, shape, chunks, shards, separator, checksums)
    theirs = _array(tmp_path / "zarr.zarr", "a", *layout)
    theirs[1:2, :, 2:4, :] = rows
    # its metadata alone: the shard comes from write_shard
    _array(tmp_path / "ours.zarr", "a", *layout)
    packed = np.stack([rows[..., key * t : (key + 1) * t] for key in visible])
    shard = shard_key(tmp_path / "ours.zarr" / "a", (1, 0, 1, 0), separator)
    shard.parent.mkdir(parents=True, exist_ok=True)
    written = write_shard(shard, packed, visible, keys, checksums=checksums, direct=direct)
    path = shard_key(tmp_path / "zarr.zarr" / "a", (1, 0, 1, 0), separator)
    assert path.read_bytes() == shard.read_bytes()
    assert written == path.stat().st_size
    back = zarr.open_array(str(tmp_path / "ours.zarr" / "a"), mode="r")[...]
    np.testing.assert_array_equal(back[1:2, :, 2:4], rows)
    assert np.isnan(back[0]).all() and np.isnan(back[1, :, :2]).all()


def test_nothing_to_write_writes_no_file(tmp_path):
    path = shard_key(tmp_path / "a", (0, 0))
    assert write_shard(path, np.empty((0, 2), "float32"), [], 3) == 0
    assert not path.exists()
    with pytest.raises(ValueError, match="C-contiguous"):
        write_shard(path, np.ones((2, 4), "float32")[:, ::2], [0, 1], 2)


def test_a_token_store_row_is_the_shard_zarr_writes(tmp_path):
    """TokenStoreWriter's rows (key frames given in any order, with gaps as a sink and a window
    leave them) are the files zarr writes for the same logits into the same array, and read back
    as written, NaN where no key frame was given."""
    from sinkscope.extraction.store import TokenStoreWriter

    t, frames, heads = 4, 5, 2
    rows = {  # (step, head, query frame): key frames, as a capture hands them
        (0, 0, 0): [0],
        (0, 1, 4): [4, 0, 3],  # a sink frame and a window, out of order
        (1, 0, 2): [0, 1, 2],
    }
    rng = np.random.default_rng(1)
    tiles = {
        key: rng.standard_normal((len(keys), t, t)).astype(np.float16) for key, keys in rows.items()
    }
    store = tmp_path / "tokens.zarr"
    with TokenStoreWriter(
        store,
        num_heads=heads,
        num_frames=frames,
        frame_seq_length=t,
        timesteps=[500.0, 0.0],
        pass_kinds=["denoise", "cache"],
        attrs={},
    ) as writer:
        for (step, head, query), keys in rows.items():
            writer.write_row(step, head, query, tiles[(step, head, query)], np.array(keys))
    expected = np.full((2, heads, frames * t, frames * t), np.nan, np.float16)
    for (step, head, query), keys in rows.items():
        for tile, key in zip(tiles[(step, head, query)], keys, strict=True):
            expected[step, head, query * t : (query + 1) * t, key * t : (key + 1) * t] = tile
    ours = zarr.open_array(str(store / "logits"), mode="r")
    np.testing.assert_array_equal(ours[...], expected)
    # zarr's own write of the same rows into an array of the same metadata
    theirs = _zarrs_twin(ours, tmp_path / "theirs")
    for step, head, query in rows:
        block = np.s_[step, head, query * t : (query + 1) * t]
        theirs[block] = expected[block]
    files = sorted(path.name for path in (store / "logits").glob("c.*"))
    assert files == sorted(f"c.{s}.{h}.{q}.0" for s, h, q in rows)
    for name in files:
        assert (store / "logits" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes()


@pytest.mark.parametrize("precision", ["float16", "float32"])
def test_an_attention_store_block_is_the_shard_zarr_writes(tmp_path, precision):
    """AttentionStoreWriter keeps a block's passes (in any order, each with its own key frames,
    as a rolling window gives them) and writes them as one shard file per array, the chunks in
    zarr's Morton order: file for file the bytes zarr writes for the same values into the same
    array. A block that never gets every pass is written at close with the passes it got."""
    from sinkscope.extraction.attention_store import KEY_MASS_SCALE, AttentionStoreWriter

    heads, t, fpb, frames, steps = 2, 4, 2, 6, 3
    calls = [  # (step, first query frame, key frames), in call order
        (1, 0, [0, 1]),
        (0, 0, [0, 1]),
        (2, 0, [1, 0]),
        (0, 2, [0, 1, 2, 3]),
        (2, 2, [2, 3]),  # a window that dropped frames 0 and 1
        (1, 2, [0, 3, 2]),
        (0, 4, [4, 5, 0]),  # block 2 never gets steps 1 and 2
    ]
    rng = np.random.default_rng(2)
    store = tmp_path / "layer0.zarr"
    mass_name = "key_mass"
    logits_name = "key_logit_mean" if precision == "float32" else "key_logit_head_sum"
    expected = {
        mass_name: np.full((steps, heads, frames, frames * t), np.nan, precision),
        logits_name: np.full(
            (steps, heads, frames, frames * t)
            if precision == "float32"
            else (steps, frames, frames * t),
            np.nan,
            "float32",
        ),
    }
    with AttentionStoreWriter(
        store,
        num_heads=heads,
        num_frames=frames,
        frame_seq_length=t,
        frames_per_block=fpb,
        timesteps=[900.0, 500.0, 0.0],
        pass_kinds=["denoise", "denoise", "cache"],
        attrs={},
        precision=precision,
    ) as writer:
        for step, first, keys in calls:
            mass = rng.random((heads, fpb, len(keys) * t)).astype(np.float32) / 8
            logits = rng.standard_normal((heads, fpb, len(keys) * t)).astype(np.float32)
            entropy = rng.random((heads, fpb)).astype(np.float32)
            writer.write_block(step, first, np.array(keys), mass, entropy, logits)
            queries = slice(first, first + fpb)
            for number, key in enumerate(keys):
                columns = slice(number * t, (number + 1) * t)
                tokens = slice(key * t, (key + 1) * t)
                if precision == "float16":
                    stored = (mass[..., columns] * KEY_MASS_SCALE).astype(np.float16)
                    expected[logits_name][step, queries, tokens] = logits[..., columns].sum(axis=0)
                else:
                    stored = mass[..., columns]
                    expected[logits_name][step, :, queries, tokens] = logits[..., columns]
                expected[mass_name][step, :, queries, tokens] = stored
    for name, values in expected.items():
        ours = zarr.open_array(str(store / name), mode="r")
        np.testing.assert_array_equal(ours[...], values)
        theirs = _zarrs_twin(ours, tmp_path / name)
        theirs[...] = values
        files = sorted(path.name for path in (store / name).glob("c.*"))
        assert len(files) == 3  # one file per block, every pass in it
        assert files == sorted(path.name for path in (tmp_path / name).glob("c.*"))
        for file in files:
            assert (store / name / file).read_bytes() == (tmp_path / name / file).read_bytes()


def test_zarrs_morton_order():
    """The order of chunks in a shard file: zarr's own enumeration of the grid, for grids of
    one, two and four dimensions with sides that are not powers of two."""
    from zarr.core.indexing import morton_order_iter

    for grid in [(7,), (5, 21), (3, 1, 1, 6), (2, 3, 5)]:
        positions = np.arange(np.prod(grid))
        theirs = [np.ravel_multi_index(coords, grid) for coords in morton_order_iter(grid)]
        assert list(positions[shards.morton_order(positions, grid)]) == theirs


def _one_shard(folder):
    """A float32 shard of 3 chunks, 2 of them written (`positions`), and its expected bytes
    (zarr's)."""
    values = np.arange(2 * 5, dtype="float32").reshape(2, 5) / 7
    expected = _array(folder / "zarr.zarr", "a", "float32", (3 * 5,), (5,), (3 * 5,))
    expected[0:5], expected[10:15] = values
    return values, [0, 2], shard_key(folder / "zarr.zarr" / "a", (0,))


def test_a_file_system_without_direct_io_gets_the_same_bytes(tmp_path, monkeypatch):
    """Where O_DIRECT is refused (EINVAL, as tmpfs refuses it), the shard goes through the page
    cache, the same bytes; the file system is not asked again."""
    monkeypatch.setattr(shards, "_direct_works", {})
    tries = []

    def refuse(path, image, size):
        tries.append(path)
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(shards, "_write_direct", refuse)
    values, positions, expected = _one_shard(tmp_path)
    for name in ("c.0", "c.1"):
        write_shard(tmp_path / name, values, positions, 3)
        assert (tmp_path / name).read_bytes() == expected.read_bytes()
    assert len(tries) == 1 and direct_io_works(tmp_path) is False


def test_other_write_errors_are_raised(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "_direct_works", {})

    def full(path, image, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shards, "_write_direct", full)
    values, positions, _ = _one_shard(tmp_path)
    with pytest.raises(OSError, match="No space"):
        write_shard(tmp_path / "c.0", values, positions, 3)


def test_direct_io_is_used_where_the_file_system_takes_it(tmp_path, monkeypatch):
    """On this machine's file system (pytest's tmp_path): direct I/O where the platform has it
    and the file system takes it (told apart by opening a file with O_DIRECT), else the page
    cache."""
    monkeypatch.setattr(shards, "_direct_works", {})
    values, positions, expected = _one_shard(tmp_path)
    write_shard(tmp_path / "c.0", values, positions, 3)
    assert (tmp_path / "c.0").read_bytes() == expected.read_bytes()
    takes_it = False
    if shards._O_DIRECT:
        try:
            os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | shards._O_DIRECT))
            takes_it = True
        except OSError:
            pass
    assert direct_io_works(tmp_path) is takes_it
