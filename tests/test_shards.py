"""The attention store's shards, written as files (sinkscope.extraction.shards), against zarr's
own writes of the same data: the same bytes, file for file, and zarr reads them back."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from zarr.codecs import Crc32cCodec

from sinkscope.extraction.shards import shard_key, write_shard


def _array(root, name, dtype, shape, chunks, shards, separator="/"):
    group = zarr.open_group(str(root), mode="a", zarr_format=3)
    return group.create_array(
        name,
        shape=shape,
        chunks=chunks,
        shards=shards,
        dtype=dtype,
        fill_value=np.nan,
        compressors=(Crc32cCodec(),),
        config={"write_empty_chunks": False},
        chunk_key_encoding={"name": "default", "separator": separator},
    )


@pytest.mark.parametrize("separator", ["/", "."])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("visible", [[0, 1, 2, 3, 4], [0, 2, 3], [4]], ids=["all", "gaps", "one"])
def test_a_shard_written_as_a_file_is_the_one_zarr_writes(tmp_path, dtype, visible, separator):
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
    theirs = _array(tmp_path / "zarr.zarr", "a", dtype, shape, chunks, shards, separator)
    theirs[1:2, :, 2:4, :] = rows
    # its metadata alone: the shard comes from write_shard
    _array(tmp_path / "ours.zarr", "a", dtype, shape, chunks, shards, separator)
    packed = np.stack([rows[..., key * t : (key + 1) * t] for key in visible])
    shard = shard_key(tmp_path / "ours.zarr" / "a", (1, 0, 1, 0), separator)
    shard.parent.mkdir(parents=True, exist_ok=True)
    written = write_shard(shard, packed, visible, keys)
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
