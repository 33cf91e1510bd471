"""sinkscope.analysis.reduce against a plain numpy brute force on tiny token stores."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import xarray as xr
import zarr

import sinkscope.analysis.reduce as reduce_module
from sinkscope.analysis.reduce import reduce_rows, reduce_token_store
from sinkscope.analysis.stores import open_frame_dataset
from sinkscope.frames import visible_frames
from sinkscope.storage import decoded_attrs
from tests.storefixtures import random_block_causal_logits, write_token_store

T = 6
SIZES = [1, 2, 2, 2]  # 7 frames
WINDOW, SINKS = 5, 1  # a rolling cache with one sink frame: frames 1-2 get evicted
TIMESTEPS = [937.5, 0.0]
PASS_KINDS = ["denoise", "cache"]


def brute_force(logits: np.ndarray, tokens_per_frame: int) -> dict[str, np.ndarray]:
    """Frame-level reductions with explicit loops and float64, one query row at a time."""
    num_steps, num_heads, num_tokens, _ = logits.shape
    num_frames = num_tokens // tokens_per_frame
    logit_mean = np.full((num_steps, num_heads, num_frames, num_frames), np.nan)
    prob_mass = np.full_like(logit_mean, np.nan)
    entropy = np.full((num_steps, num_heads, num_frames), np.nan)

    def tokens(frame):
        return slice(frame * tokens_per_frame, (frame + 1) * tokens_per_frame)

    for s in range(num_steps):
        for h in range(num_heads):
            for qf in range(num_frames):
                rows = logits[s, h, tokens(qf)]
                row_probs, row_entropies = [], []
                for row in rows:
                    visible = ~np.isnan(row)
                    if not visible.any():
                        continue
                    weights = np.exp(row[visible] - row[visible].max())
                    probs = np.zeros(num_tokens)
                    probs[visible] = weights / weights.sum()
                    row_probs.append(probs)
                    p = probs[visible]
                    row_entropies.append(-np.sum(p * np.log(p)))
                for kf in range(num_frames):
                    tile = rows[:, tokens(kf)]
                    if np.isnan(tile).all():
                        continue
                    logit_mean[s, h, qf, kf] = np.nanmean(tile)
                    if row_probs:
                        prob_mass[s, h, qf, kf] = np.mean([p[tokens(kf)].sum() for p in row_probs])
                if row_entropies:
                    entropy[s, h, qf] = np.mean(row_entropies)
    return {"logit_mean": logit_mean, "prob_mass": prob_mass, "entropy": entropy}


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """(logits, reduced dataset) of a 2-step, 2-head store with a sink and a rolling window."""
    rng = np.random.default_rng(7)
    logits = random_block_causal_logits(
        rng,
        num_steps=2,
        num_heads=2,
        T=T,
        block_sizes=SIZES,
        local_attn_size=WINDOW,
        sink_size=SINKS,
    )
    root = tmp_path_factory.mktemp("windowed")
    store = write_token_store(
        root / "layer3.zarr",
        logits,
        T=T,
        block_sizes=SIZES,
        timesteps=TIMESTEPS,
        pass_kinds=PASS_KINDS,
        attrs={"local_attn_size": WINDOW, "sink_size": SINKS},
    )
    out = root / "frames" / "layer3.zarr"
    reduce_token_store(store, out, threads=2)
    return logits, open_frame_dataset(out), out


def test_logit_mean_matches_brute_force(windowed):
    logits, ds, _ = windowed
    expected = brute_force(logits, T)["logit_mean"]
    np.testing.assert_allclose(ds["logit_mean"].values, expected, rtol=1e-6, atol=1e-6)


def test_prob_mass_matches_brute_force_and_sums_to_one(windowed):
    logits, ds, _ = windowed
    expected = brute_force(logits, T)["prob_mass"]
    got = ds["prob_mass"].values
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.nansum(got, axis=-1), 1.0, rtol=0, atol=1e-5)
    # The sink bias of the fixture makes the masses far from uniform: a weak check of the check.
    assert np.nanmax(got[..., 0]) > 0.5


def test_entropy_matches_brute_force(windowed):
    logits, ds, _ = windowed
    expected = brute_force(logits, T)["entropy"]
    np.testing.assert_allclose(ds["entropy"].values, expected, rtol=1e-5, atol=1e-5)


def test_nan_exactly_on_tiles_that_cannot_be_seen(windowed):
    _, ds, _ = windowed
    seen = visible_frames(SIZES, WINDOW, SINKS)
    assert not seen[6, 1] and seen[6, 0]  # the fixture really evicts frames but keeps the sink
    for name in ("logit_mean", "prob_mass"):
        unseen = np.isnan(ds[name].values)
        assert (unseen == ~seen[None, None]).all(), name
    assert not np.isnan(ds["entropy"].values).any()


def test_output_layout(windowed):
    _, _, out = windowed
    ds = xr.open_zarr(out)
    assert ds["logit_mean"].dims == ("step", "head", "query_frame", "key_frame")
    assert ds["prob_mass"].dims == ("step", "head", "query_frame", "key_frame")
    assert ds["entropy"].dims == ("step", "head", "query_frame")
    assert dict(ds.sizes) == {"step": 2, "head": 2, "query_frame": 7, "key_frame": 7}
    for name in ("logit_mean", "prob_mass", "entropy"):
        assert ds[name].dtype == np.float32
    assert ds["step"].values.tolist() == [0, 1]
    assert ds["head"].values.tolist() == [0, 1]
    assert ds["query_frame"].values.tolist() == list(range(7))
    assert ds["key_frame"].values.tolist() == list(range(7))
    assert ds["timestep"].dims == ("step",)
    assert ds["timestep"].values.tolist() == TIMESTEPS
    assert [str(kind) for kind in ds["pass_kind"].values] == PASS_KINDS
    assert ds["block"].dims == ("query_frame",)
    assert ds["block"].values.tolist() == [0, 1, 1, 2, 2, 3, 3]
    assert str(ds["checkpoint"].values) == "demo"
    assert str(ds["prompt"].values) == "cat"
    assert int(ds["layer"].values) == 3
    for name in ("timestep", "pass_kind", "block", "checkpoint", "prompt", "layer"):
        assert name in ds.coords, name
    assert ds.attrs["block_sizes"] == SIZES
    assert ds.attrs["local_attn_size"] == WINDOW
    assert decoded_attrs(ds)["config"] == {"model": "tiny", "num_steps": 2}
    assert not out.with_name(out.name + ".tmp").exists()


def test_blocks_are_one_query_frame_of_rows(tmp_path, monkeypatch, windowed):
    logits, ds, _ = windowed
    store = write_token_store(
        tmp_path / "in.zarr",
        logits,
        T=T,
        block_sizes=SIZES,
        timesteps=TIMESTEPS,
        pass_kinds=PASS_KINDS,
    )
    shapes = []
    original = reduce_module.reduce_rows

    def spy(rows, num_frames):
        shapes.append(rows.shape)
        return original(rows, num_frames)

    monkeypatch.setattr(reduce_module, "reduce_rows", spy)
    reduce_token_store(store, tmp_path / "out.zarr", threads=1)
    assert sorted(set(shapes)) == [(T, 7 * T)]
    assert len(shapes) == 2 * 2 * 7  # steps x heads x query frames, each read once
    again = open_frame_dataset(tmp_path / "out.zarr")
    xr.testing.assert_identical(again.drop_attrs(), ds.drop_attrs())


def test_reduce_rows_by_hand():
    # One query frame of 2 rows, 2 key frames of 2 tokens; row 0 sees weights 1, 1, 2, 2.
    rows = np.array(
        [
            [0.0, 0.0, np.log(2.0), np.log(2.0)],
            [1.0, 3.0, np.nan, np.nan],
        ]
    )
    out = reduce_rows(rows, num_frames=2)
    p0 = np.array([1, 1, 2, 2]) / 6
    p1 = np.array([1, np.e**2]) / (1 + np.e**2)
    np.testing.assert_allclose(out[:2], [(0 + 0 + 1 + 3) / 4, np.log(2.0)], rtol=1e-6)
    np.testing.assert_allclose(out[2:4], [(1 / 3 + 1) / 2, (2 / 3 + 0) / 2], rtol=1e-6)
    entropy = (-np.sum(p0 * np.log(p0)) - np.sum(p1 * np.log(p1))) / 2
    np.testing.assert_allclose(out[4], entropy, rtol=1e-6)


def _nan_bits_negative(rows: np.ndarray, columns: slice) -> None:
    """Give the NaNs in `columns` the sign bit: a NaN fill that is not the usual positive one."""
    rows.view(np.uint16)[:, columns] |= 0x8000


FAST_T, FAST_F = 8, 5
# Float64 logits [T, F * T] -> float64 logits with NaN where invisible; some also get a float16
# bit tweak after rounding.
FLOAT16_CASES = {
    "dense": lambda x: x,
    "causal": lambda x: _set(x, np.s_[:, 3 * FAST_T :], np.nan),
    "sink_and_window": lambda x: _set(x, np.s_[:, FAST_T : 3 * FAST_T], np.nan),
    "nan_row": lambda x: _set(_set(x, np.s_[:, 3 * FAST_T :], np.nan), np.s_[2], np.nan),
    "first_row_nan_in_one_tile": lambda x: _set(
        _set(x, np.s_[:, 3 * FAST_T :], np.nan), np.s_[0, FAST_T : 2 * FAST_T], np.nan
    ),
    "first_row_all_nan": lambda x: _set(x, np.s_[0], np.nan),
    "one_nan_inside": lambda x: _set(x, np.s_[5, 4], np.nan),
    "plus_inf": lambda x: _set(x, np.s_[4, 3], np.inf),
    "minus_inf": lambda x: _set(x, np.s_[4, 3], -np.inf),
    "negative_nan_fill": lambda x: _set(x, np.s_[:, 3 * FAST_T :], np.nan),
    "subnormal": lambda x: x * 1e-6,
    "all_negative": lambda x: -np.abs(x) - 3.0,
    "all_negative_wide": lambda x: -30.0 * np.abs(x) - 3.0,  # exp(x - min) would overflow
    "rows_far_below_the_top": lambda x: _set(x, np.s_[::2], x[::2] - 100.0),
    "rows_somewhat_below_the_top": lambda x: _set(x, np.s_[::2], x[::2] - 25.0),
    "all_nan": lambda x: np.full_like(x, np.nan),
}


def _set(x: np.ndarray, where, value) -> np.ndarray:
    x = x.copy()
    x[where] = value
    return x


def _float16_rows(case: str) -> np.ndarray:
    rng = np.random.default_rng(5)
    x = rng.normal(0.0, 3.0, size=(FAST_T, FAST_F * FAST_T))
    x[:, :FAST_T] += 5.0  # a sink
    with np.errstate(over="ignore"):
        rows = FLOAT16_CASES[case](x).astype(np.float16)
    if case == "negative_nan_fill":
        _nan_bits_negative(rows, np.s_[3 * FAST_T :])
    return rows


@pytest.mark.parametrize("sub_block_rows", [None, 3])
@pytest.mark.parametrize("case", sorted(FLOAT16_CASES))
def test_float16_rows_match_the_exact_path(case, sub_block_rows, monkeypatch):
    """float16 rows take the fast path (visible key frames only, table exponentials, sub-blocks
    of rows); the same values as float64 take the exact one. They agree, NaN and inf included."""
    if sub_block_rows is not None:
        monkeypatch.setattr(reduce_module, "SUB_BLOCK_VALUES", sub_block_rows * FAST_F * FAST_T)
    rows = _float16_rows(case)
    with np.errstate(invalid="ignore", divide="ignore"):
        expected = reduce_rows(rows.astype(np.float64), FAST_F)
        got = reduce_rows(rows, FAST_F)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "case", ["dense", "causal", "sink_and_window", "negative_nan_fill", "all_negative_wide"]
)
def test_float16_rows_without_nan_inside_skip_the_exact_path(case, monkeypatch):
    calls = []
    original = reduce_module._RowSums.add_exact

    def spy(self, rows):
        calls.append(rows.shape)
        return original(self, rows)

    monkeypatch.setattr(reduce_module._RowSums, "add_exact", spy)
    reduce_rows(_float16_rows(case), FAST_F)
    assert calls == []


def test_degenerate_store_single_block_one_head_all_nan_rows(tmp_path):
    rng = np.random.default_rng(3)
    sizes = [4]
    logits = random_block_causal_logits(rng, num_steps=2, num_heads=1, T=T, block_sizes=sizes)
    logits[0, 0, 2 * T + 1, :] = np.nan  # one invisible row inside frame 2
    logits[1, 0, T : 2 * T, :] = np.nan  # all of frame 1 at step 1: never written
    store = write_token_store(
        tmp_path / "in.zarr",
        logits,
        T=T,
        block_sizes=sizes,
        timesteps=[500.0, 0.0],
        pass_kinds=["denoise", "cache"],
    )
    reduce_token_store(store, tmp_path / "out.zarr")
    ds = open_frame_dataset(tmp_path / "out.zarr")
    expected = brute_force(logits, T)
    for name in ("logit_mean", "prob_mass", "entropy"):
        np.testing.assert_allclose(ds[name].values, expected[name], rtol=1e-5, atol=1e-5)
    assert np.isnan(ds["prob_mass"].values[1, 0, 1]).all()
    assert np.isnan(ds["logit_mean"].values[1, 0, 1]).all()
    assert np.isnan(ds["entropy"].values[1, 0, 1])
    # The row with nothing visible is left out; the other rows of frame 2 still sum to 1.
    np.testing.assert_allclose(ds["prob_mass"].values[0, 0, 2].sum(), 1.0, atol=1e-5)
    assert ds["block"].values.tolist() == [0, 0, 0, 0]


def _small_store(tmp_path):
    rng = np.random.default_rng(11)
    logits = random_block_causal_logits(rng, num_steps=1, num_heads=1, T=T, block_sizes=[1, 2])
    return write_token_store(
        tmp_path / "in.zarr",
        logits,
        T=T,
        block_sizes=[1, 2],
        timesteps=[900.0],
        pass_kinds=["denoise"],
    )


def test_failure_while_reducing_leaves_no_output(tmp_path, monkeypatch):
    store = _small_store(tmp_path)
    out = tmp_path / "frames" / "layer3.zarr"

    def broken(rows, num_frames):
        raise RuntimeError("injected")

    monkeypatch.setattr(reduce_module, "reduce_rows", broken)
    with pytest.raises(RuntimeError, match="injected"):
        reduce_token_store(store, out)
    assert not out.exists()
    assert not out.with_name(out.name + ".tmp").exists()


def test_failure_after_partial_write_leaves_no_output(tmp_path, monkeypatch):
    store = _small_store(tmp_path)
    out = tmp_path / "layer3.zarr"
    original = xr.Dataset.to_zarr

    def write_then_fail(self, *args, **kwargs):
        original(self, *args, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(xr.Dataset, "to_zarr", write_then_fail)
    with pytest.raises(OSError, match="disk full"):
        reduce_token_store(store, out)
    assert not out.exists()
    assert not out.with_name(out.name + ".tmp").exists()


def test_a_frame_dataset_is_marked_complete_last(tmp_path, monkeypatch):
    """A write killed before the mark leaves a temporary that readers refuse (the kill test in
    tests/test_kills.py shows the rerun); the mark is the last write."""
    store = _small_store(tmp_path)
    out = tmp_path / "layer3.zarr"
    original = xr.Dataset.to_zarr
    written = {}

    def write_and_keep_a_copy(self, path, *args, **kwargs):
        original(self, path, *args, **kwargs)
        written["attrs"] = xr.open_zarr(path, consolidated=False).attrs

    monkeypatch.setattr(xr.Dataset, "to_zarr", write_and_keep_a_copy)
    reduce_token_store(store, out)
    assert "complete" not in written["attrs"]  # the data were written unmarked
    assert decoded_attrs(xr.open_zarr(out))["complete"] is True
    unmarked = tmp_path / "unmarked.zarr"
    open_frame_dataset(out).drop_attrs().to_zarr(unmarked, zarr_format=3)
    with pytest.raises(ValueError, match=rf"{unmarked}: not marked complete: its reduce was"):
        open_frame_dataset(unmarked)


def test_rerun_replaces_output_and_stale_tmp(tmp_path):
    store = _small_store(tmp_path)
    out = tmp_path / "layer3.zarr"
    stale_tmp = tmp_path / "layer3.zarr.tmp"
    out.mkdir()
    (out / "old").write_text("previous run")
    stale_tmp.mkdir()
    (stale_tmp / "junk").write_text("crashed run")
    reduce_token_store(store, out)
    assert not (out / "old").exists()
    assert not stale_tmp.exists()
    assert open_frame_dataset(out).sizes["query_frame"] == 3


def test_inconsistent_attributes_name_the_store(tmp_path):
    rng = np.random.default_rng(0)
    logits = random_block_causal_logits(rng, num_steps=1, num_heads=1, T=T, block_sizes=[1, 2])
    store = write_token_store(
        tmp_path / "bad.zarr",
        logits,
        T=T,
        block_sizes=[1, 2],
        timesteps=[900.0],
        pass_kinds=["denoise"],
        attrs={"num_frames": 4, "block_sizes": [2, 2]},
    )
    with pytest.raises(ValueError, match=r"bad\.zarr.*query_token"):
        reduce_token_store(store, tmp_path / "out.zarr")
    assert not (tmp_path / "out.zarr").exists()


def test_token_frame_map_is_checked(tmp_path):
    store = _small_store(tmp_path)
    group = zarr.open_group(store, mode="r+", zarr_format=3)
    group["key_frame"][:] = group["key_frame"][:][::-1]
    zarr.consolidate_metadata(store)
    with pytest.raises(ValueError, match="key_frame"):
        reduce_token_store(store, tmp_path / "out.zarr")


def test_reduction_logs_its_progress_with_an_estimate(tmp_path, monkeypatch, caplog):
    """Every `every` seconds (here: every task) a line with tasks done and the time left."""
    import logging

    from sinkscope.analysis import reduce

    monkeypatch.setattr(reduce, "PROGRESS_SECONDS", 0.0)
    store = _small_store(tmp_path)
    with caplog.at_level(logging.INFO, logger="sinkscope.analysis.reduce"):
        reduce_token_store(store, tmp_path / "out.zarr", threads=1)
    lines = [r.getMessage() for r in caplog.records if " tasks (" in r.getMessage()]
    assert len(lines) >= 2 and all("s left" in line and str(store) in line for line in lines)
    counts = [re.search(r": (\d+)/(\d+) tasks", line).groups() for line in lines]
    done = [int(d) for d, _ in counts]
    total = int(counts[-1][1])
    assert done == sorted(done) and done[-1] == total > 1 and "(100 %)" in lines[-1]


def test_analysis_imports_dask_only_for_what_uses_it(tmp_path):
    """`stores.defer_dask_import`: in a fresh interpreter, building, writing and reading frame
    datasets leaves dask.array unimported (0.7 s of every analysis job); once something imports
    it, xarray knows dask arrays again (a lazy dataset computes through it)."""
    script = f"""
import sys
import numpy as np
import xarray as xr
import sinkscope.analysis.stores
ds = xr.Dataset({{"a": (("x",), np.arange(4.0))}}, coords={{"x": np.arange(4)}})
ds.to_zarr({str(tmp_path / "d.zarr")!r}, mode="w", zarr_format=3, consolidated=False)
back = xr.open_zarr({str(tmp_path / "d.zarr")!r}, chunks=None, consolidated=False).load()
assert back.a.isel(x=2).item() == 2.0
assert "dask.array" not in sys.modules, "dask.array imported"
import dask.array as da
from xarray.namedarray.pycompat import array_type
lazy = xr.DataArray(da.arange(4.0, chunks=2), dims="x")
assert isinstance(lazy.data, array_type("dask")) and lazy.chunks == ((2, 2),)
assert (lazy * 2).sum().compute().item() == 12.0
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
