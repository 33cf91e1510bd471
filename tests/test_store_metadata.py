"""Stores a scientist can hand on (docs/DATA.md): every variable and coordinate of the token store
(Contract 1), the attention store (Contract 4) and the frame dataset (Contract 2) has a long_name
and units, the attributes are netCDF-safe and decode back to what the job recorded, the stores
carry step and head coordinates, and frame indices stay integers in every CSV."""

from __future__ import annotations

import importlib.util
import json
import numbers

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from sinkscope.analysis.policies import write_policies
from sinkscope.analysis.reduce import reduce_attention_store, reduce_token_store
from sinkscope.analysis.stats import FRAME_COLUMNS, read_stats, write_stats, write_summary
from sinkscope.analysis.stores import open_frame_dataset
from sinkscope.extraction.job import extract
from sinkscope.storage import (
    JSON_ATTRIBUTES,
    VARIABLE_ATTRS,
    decoded_attrs,
    encode_attrs,
    mark_complete,
)

from .test_capture import _write_inputs

NUM_FRAMES, NUM_PASSES = 4, 3  # two blocks of 2 frames; 2 denoising steps and the cache pass
UNITS = {
    "logits": "logit",
    "logit_mean_pooled": "logit",
    "logit_mean": "logit",
    "key_mass": "1",
    "prob_mass": "1",
    "entropy": "nats",
    "timestep": "1",
    "step": "1",
    "head": "1",
}
INT32 = (-(2**31), 2**31 - 1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A token store and an attention store of layer 0 of one tiny rollout, and their frame
    datasets: {kind: path} with kinds tokens, attention, frames_tokens, frames_attention."""
    root = tmp_path_factory.mktemp("metadata")
    prompt, settings = _write_inputs(
        root,
        video={
            "num_frames": NUM_FRAMES,
            "frames_per_block": 2,
            "latent_height": 4,
            "latent_width": 6,
        },
    )
    settings["sampler"]["steps"] = [1000, 500]
    paths = {}
    for kind in ("tokens", "attention"):
        paths[kind] = root / kind / "layer0.zarr"
        extract(
            checkpoint_name="tiny",
            prompt_name="p",
            prompt_embeddings=prompt,
            layers=[0],
            outputs=[paths[kind]],
            settings=settings,
            store=kind,
            progress=False,
        )
    paths["frames_tokens"] = root / "frames_tokens.zarr"
    paths["frames_attention"] = root / "frames_attention.zarr"
    reduce_token_store(paths["tokens"], paths["frames_tokens"], threads=1)
    reduce_attention_store(paths["attention"], paths["frames_attention"], threads=1)
    paths["settings"] = settings
    return paths


KINDS = ["tokens", "attention", "frames_tokens", "frames_attention"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_variable_and_coordinate_has_long_name_and_units(run, kind):
    with xr.open_zarr(run[kind]) as ds:  # plain xarray, as a scientist opens it
        assert ds.variables
        for name, variable in ds.variables.items():
            for key in ("long_name", "units"):
                value = variable.attrs.get(key)
                assert isinstance(value, str) and value, (kind, name, key)
            assert variable.attrs == VARIABLE_ATTRS[name], (kind, name)
            if name in UNITS:
                assert variable.attrs["units"] == UNITS[name], (kind, name)
        assert {"step", "head", "timestep", "pass_kind"} <= set(ds.coords)


def netcdf_problems(ds: xr.Dataset) -> list[str]:
    """The attributes netCDF (the classic format too) cannot hold: anything but text, numbers
    (no booleans; integers within int32) and non-empty flat lists of such numbers."""

    def number(value) -> bool:
        if isinstance(value, bool | np.bool_):
            return False
        if isinstance(value, numbers.Integral):
            return INT32[0] <= value <= INT32[1]
        return isinstance(value, numbers.Real)

    def safe(value) -> bool:
        if isinstance(value, str) or number(value):
            return True
        return isinstance(value, list | tuple) and len(value) > 0 and all(map(number, value))

    owners = [("dataset", ds.attrs), *((name, v.attrs) for name, v in ds.variables.items())]
    return [
        f"{owner}: {key}={value!r}"
        for owner, attrs in owners
        for key, value in attrs.items()
        if not (isinstance(key, str) and key and safe(value))
    ]


NETCDF_ENGINES = [
    engine
    for engine, module in (("netcdf4", "netCDF4"), ("h5netcdf", "h5netcdf"), ("scipy", "scipy"))
    if importlib.util.find_spec(module) is not None
]


@pytest.mark.parametrize("kind", KINDS)
def test_attributes_are_netcdf_safe(run, kind, tmp_path):
    """No netCDF engine is a dependency: the attribute types are checked against what netCDF
    holds (the check xarray's to_netcdf runs before it writes, and stricter); where an engine is
    installed, the store is written to netCDF and read back too (logits and a float16 key_mass
    need float32 there: netCDF has no 16-bit float)."""
    with xr.open_zarr(run[kind]) as ds:
        assert netcdf_problems(ds) == []
        from xarray.backends import writers

        writers._validate_attrs(ds, engine="netcdf4")
        for engine in NETCDF_ENGINES:
            encoding = {
                name: {"dtype": "float32"}
                for name in ("logits", "key_mass")
                if name in ds and ds[name].encoding.get("dtype") == np.float16
            }
            out = tmp_path / f"{kind}.{engine}.nc"
            ds.to_netcdf(out, engine=engine, encoding=encoding)
            with xr.open_dataset(out, engine=engine) as back:
                attrs = decoded_attrs(back)
                assert attrs["config"] == decoded_attrs(ds)["config"], engine
                assert attrs["complete"] is True, engine
                for name, variable in ds.variables.items():
                    assert back[name].attrs["units"] == variable.attrs["units"], (engine, name)


def test_the_checker_catches_what_netcdf_cannot_hold():
    assert netcdf_problems(xr.Dataset(attrs={"a": "text", "b": 3, "c": [1.5, 2], "d": 0.5})) == []
    for bad in ({"x": 1}, True, None, [], ["a", "b"], [1, [2]], 2**32):
        assert netcdf_problems(xr.Dataset(attrs={"bad": bad})) == ["dataset: bad=" + repr(bad)]


ATTRIBUTES = {
    "config": {"sampler": {"steps": [1000, 500], "warp": True}, "note": None},
    "gpu": {"claimed_by": "lock", "index": 1, "fake": True},
    "complete": True,
    "prompt_truncated": False,
    "nothing": None,
    "empty": [],
    "names": ["denoise", "cache"],
    "nested": [[1, 2], [3]],
    "crc": 2**32 - 1,
    "negative": -(2**40),
    "prompt_text": "un chat sur un canapé",
    "text_like_json": '{"not": "decoded"}',
    "layer": 3,
    "logit_scale": 0.25,
    "latent_grid": [21, 60, 104],
    "timesteps": [1000.0, 937.5],
}


def test_encoded_attributes_decode_to_what_was_given():
    encoded = encode_attrs(ATTRIBUTES)
    assert netcdf_problems(xr.Dataset(attrs=encoded)) == []
    assert decoded_attrs(encoded) == ATTRIBUTES
    assert encode_attrs(encoded) == encoded  # encoding twice changes nothing
    # What netCDF holds stays as it is; the rest is JSON text, named.
    for key in ("prompt_text", "text_like_json", "layer", "logit_scale", "latent_grid"):
        assert encoded[key] == ATTRIBUTES[key], key
    assert json.loads(encoded["gpu"]) == ATTRIBUTES["gpu"]
    named = set(encoded[JSON_ATTRIBUTES].split())
    assert named == {"config", "gpu", "complete", "prompt_truncated", "nothing", "empty"} | {
        "names",
        "nested",
        "crc",
        "negative",
    }
    # Attributes written without the list (older stores, other writers) come back unchanged.
    assert decoded_attrs({"complete": True, "config": "{}"}) == {"complete": True, "config": "{}"}


@pytest.mark.parametrize("kind", KINDS)
def test_job_attributes_round_trip(run, kind):
    with xr.open_zarr(run[kind]) as ds:
        raw = dict(ds.attrs)
        attrs = decoded_attrs(ds)
    # Nested and boolean attributes are JSON text in the store, their values once decoded.
    assert isinstance(raw["gpu"], str) and isinstance(raw["config"], str)
    assert attrs["gpu"]["claimed_by"] == "none" and attrs["gpu"]["device"] == "cpu"
    assert attrs["config"] == run["settings"]
    assert attrs["complete"] is True and raw["complete"] == "true"
    assert JSON_ATTRIBUTES not in attrs
    assert attrs["block_sizes"] == [2, 2] and attrs["latent_grid"] == [NUM_FRAMES, 2, 3]
    assert attrs["store"] == kind.removeprefix("frames_")
    if kind.endswith("tokens"):
        assert attrs["tokens"] is True
    assert isinstance(attrs["attributes_crc32"], int)


def test_the_frame_dataset_keeps_the_store_provenance_and_its_checksum(run, tmp_path):
    store = decoded_attrs(xr.open_zarr(run["tokens"]))
    frames = decoded_attrs(open_frame_dataset(run["frames_tokens"]))  # checks the checksum
    per_dataset = {"completed_at", "attributes_crc32"}
    assert {k: v for k, v in frames.items() if k not in per_dataset} == {
        k: v for k, v in store.items() if k not in per_dataset
    }
    # A changed JSON attribute fails the checksum like any other.
    copy = tmp_path / "frames.zarr"
    xr.open_zarr(run["frames_tokens"]).load().to_zarr(copy, zarr_format=3)
    mark_complete(copy)
    metadata = json.loads((copy / "zarr.json").read_text())
    gpu = json.loads(metadata["attributes"]["gpu"])
    metadata["attributes"]["gpu"] = json.dumps({**gpu, "claimed_by": "lock"})
    (copy / "zarr.json").write_text(json.dumps(metadata))
    with pytest.raises(ValueError, match="fail their checksum"):
        open_frame_dataset(copy)


@pytest.mark.parametrize("kind", ["tokens", "attention"])
def test_stores_have_step_and_head_coordinates(run, kind):
    with xr.open_zarr(run[kind]) as ds:
        heads = int(decoded_attrs(ds)["num_heads"])
        for name, size in (("step", NUM_PASSES), ("head", heads)):
            assert name in ds.coords and ds[name].dims == (name,), name
            assert np.issubdtype(ds[name].dtype, np.integer), name
            np.testing.assert_array_equal(ds[name].values, np.arange(size))
        data = "logits" if kind == "tokens" else "key_mass"
        assert ds[data].dims[:2] == ("step", "head")
        assert ds[data].sel(step=NUM_PASSES - 1, head=heads - 1).shape == ds[data].shape[2:]


def _csv_text(path, columns) -> list[list[str]]:
    return pd.read_csv(path, dtype=str, keep_default_na=False)[columns].values.tolist()


def test_frame_indices_stay_integers_in_every_csv(run, tmp_path):
    """argmax_frame and min_frame with empty rows (a head that saw nothing) are written as
    integers or empty, read back as Int64, and written the same in summary.csv's run rows."""
    frames = open_frame_dataset(run["frames_tokens"])
    blind = frames.copy(deep=True)
    blind["prob_mass"][:, 0] = np.nan  # head 0's probabilities unknown: empty frame indices
    blind_path = tmp_path / "blind.zarr"
    blind.to_zarr(blind_path, zarr_format=3)
    mark_complete(blind_path)
    csvs = [tmp_path / "a.csv", tmp_path / "b.csv"]
    write_stats(run["frames_tokens"], csvs[0])
    write_stats(blind_path, csvs[1])
    table = read_stats(csvs[1])
    for column in FRAME_COLUMNS:
        assert str(table[column].dtype) == "Int64", column
        assert table[column].isna().any() and table[column].notna().any(), column
    for path in csvs:
        for row in _csv_text(path, FRAME_COLUMNS):
            assert all(value == "" or value.isdigit() for value in row), (path, row)
    summary = tmp_path / "summary.csv"
    write_summary(csvs, summary)
    runs = pd.read_csv(summary, dtype=str, keep_default_na=False)
    runs = runs[runs["aggregate"] == "run"][FRAME_COLUMNS].values.tolist()
    assert runs == _csv_text(csvs[0], FRAME_COLUMNS) + _csv_text(csvs[1], FRAME_COLUMNS)

    # The recall table: sink_frames and recent_frames integers or empty, never 1.0.
    recall = tmp_path / "policies.csv"
    write_policies(
        [run["frames_attention"]],
        [run["attention"]],
        recall,
        budgets=[1, 2],
        sinks=[1],
        recent_frames=0,
    )
    text = _csv_text(recall, ["policy", "budget", "sink_frames", "recent_frames"])
    assert {row[0] for row in text} >= {"window", "sink_window", "top_c_oracle"}
    assert all(value == "" or value.isdigit() for row in text for value in row[1:]), text


def test_the_data_dictionary_names_every_variable_and_column():
    from pathlib import Path

    from sinkscope.analysis import closed_loop, policies, stats
    from sinkscope.tables import DEVIATION_COLUMNS

    text = (Path(__file__).parents[1] / "docs" / "DATA.md").read_text()
    sink_rate = ["sink_heads", "num_heads", "sink_rate", "threshold"]
    names = [
        *VARIABLE_ATTRS,
        *stats.COLUMNS,
        "aggregate",
        *sink_rate,
        *policies.COLUMNS,
        *DEVIATION_COLUMNS,
        *closed_loop.SUMMARY_COLUMNS,
        JSON_ATTRIBUTES,
    ]
    assert [name for name in names if f"`{name}`" not in text] == []
    # Each store variable's first row in the stores' tables gives its units.
    rows = [line.split("|") for line in text[: text.index("## The tables")].splitlines()]
    rows = [cells for cells in rows if len(cells) == 7]  # | variable | dims | dtype | units | ...
    for name, attrs in VARIABLE_ATTRS.items():
        units = next(cells[4] for cells in rows if f"`{name}`" in cells[1])
        assert units.strip() == attrs["units"], name
