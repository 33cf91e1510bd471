"""Exports in the seed notebooks' layouts: a real token store of a tiny rollout and its frame
dataset, exported, loaded back with torch.load(weights_only=True) and checked key by key against
the stores (float64 numpy softmax, the stored logits, the frame dataset)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import xarray as xr

from sinkscope.analysis.reduce import reduce_token_store
from sinkscope.exports import notebooks
from sinkscope.exports.notebooks import export_bytes, export_run, visible_softmax
from sinkscope.extraction.job import extract
from sinkscope.frames import visible_frames
from sinkscope.workflow.entries import ConfigError, export_layers

from .conftest import TINY
from .test_capture import _write_inputs
from .test_config import checked
from .workflowtools import demo_copy, planned_jobs, snakemake

T = TINY.tokens_per_frame(4, 6)  # 6 tokens per frame; 6 frames in blocks of 2
F, H = 6, TINY.num_heads
LAST = [4, 5]  # the last block's frames
FILES = ("attention_cache_figure4.pt", "attention_cache_wan_base.pt", "attention_cache.pt")


def _run(tmp_path, *, window: int = -1, layers=(0, 1)) -> dict:
    """Token stores of `layers` from one tiny rollout (window `window`) and their frame
    datasets."""
    prompt, settings = _write_inputs(tmp_path)
    settings["sampler"]["local_attn_size"] = window
    stores = [tmp_path / "logits" / f"layer{layer}.zarr" for layer in layers]
    extract(
        checkpoint_name="tiny",
        prompt_name="p",
        prompt_embeddings=prompt,
        layers=list(layers),
        outputs=stores,
        settings=settings,
        progress=False,
    )
    frames = [tmp_path / "frames" / f"layer{layer}.zarr" for layer in layers]
    for store, out in zip(stores, frames, strict=True):
        reduce_token_store(store, out, threads=1)
    return {"layers": list(layers), "stores": stores, "frames": frames}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`_run` of each (window, layers) once for the module: the exports only read the stores
    (a test that changes one copies it first, `_copy`), each into its own tmp_path."""
    made: dict[tuple, dict] = {}

    def run(*, window: int = -1, layers=(0, 1)) -> dict:
        key = (window, tuple(layers))
        if key not in made:
            made[key] = _run(tmp_path_factory.mktemp("run"), window=window, layers=layers)
        return made[key]

    return run


def _copy(run: dict, folder) -> dict:
    """The run's stores and frame datasets copied into `folder`, for a test that changes them."""
    copied = {"layers": run["layers"]}
    for name in ("stores", "frames"):
        copied[name] = [folder / name / path.name for path in run[name]]
        for source, target in zip(run[name], copied[name], strict=True):
            shutil.copytree(source, target)
    return copied


def _export(tmp_path, run, *, step=0, measure="logits", token_layers=None) -> dict:
    out = tmp_path / "export"
    paths = {
        "figure4": out / FILES[0],
        "logit_cache": out / FILES[1],
        "shapes_cache": out / FILES[2],
    }
    export_run(
        token_stores=run["stores"],
        token_layers=run["layers"] if token_layers is None else token_layers,
        frame_datasets=run["frames"],
        frame_layers=run["layers"],
        frame_outputs=[out / f"layer{layer}.pt" for layer in run["layers"]],
        step=step,
        measure=measure,
        **paths,
    )
    return paths


def _load(path):
    return torch.load(path, weights_only=True)


def _reference_softmax(rows: np.ndarray) -> np.ndarray:
    """float64 softmax over the non-NaN keys of each row, 0 elsewhere."""
    x = rows.astype(np.float64)
    visible = ~np.isnan(x)
    x = np.where(visible, x, -np.inf)
    with np.errstate(invalid="ignore"):  # rows with nothing visible: NaN
        weights = np.exp(x - x.max(axis=-1, keepdims=True))
        return weights / weights.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize(("window", "step"), [(-1, 0), (4, 4)], ids=["full-cache", "window-cache"])
def test_token_layouts_equal_the_token_store(tmp_path, runs, window, step):
    run = runs(window=window)
    paths = _export(tmp_path, run, step=step)
    seen = visible_frames([2, 2, 2], window, 0)[F - 1]  # key frames the last block sees
    if window != -1:
        assert not seen.all()  # frames 0 and 1 left the cache: the -inf fill is exercised

    figure4 = _load(paths["figure4"])
    assert set(figure4) == {
        "attention_weights",
        "prompt",
        "num_frames",
        "frame_seq_length",
        "num_frame_per_block",
        "layer_indices",
    }
    assert figure4["prompt"] == "a test prompt"
    assert (figure4["num_frames"], figure4["frame_seq_length"]) == (F, T)
    assert figure4["num_frame_per_block"] == 2 and figure4["layer_indices"] == [0, 1]
    logit_cache = _load(paths["logit_cache"])
    shapes_cache = _load(paths["shapes_cache"])
    run_keys = {"attention_weights", "prompt", "num_frames", "frame_seq_length"}
    run_keys |= {"query_frames", "key_frames"}
    assert set(logit_cache) == run_keys
    assert set(shapes_cache) == run_keys | {"is_logits"} and shapes_cache["is_logits"] is True
    for cache in (logit_cache, shapes_cache):
        assert cache["prompt"] == "a test prompt"
        assert (cache["num_frames"], cache["frame_seq_length"]) == (F, T)
        assert cache["query_frames"] == LAST and cache["key_frames"] == list(range(F))

    for index, layer in enumerate(run["layers"]):
        stored = xr.open_zarr(run["stores"][index], chunks=None).logits.values[
            step
        ]  # [H, N, N] float16
        rows = stored[:, LAST[0] * T :, :]  # the last block's queries over every key
        key_seen = np.repeat(seen, T)
        assert not np.isnan(rows[..., key_seen]).any() and np.isnan(rows[..., ~key_seen]).all()

        entry = figure4["attention_weights"][index]
        assert set(entry) == {
            "layer_idx",
            "attn_weights",
            "last_block_start_frame",
            "frame_seq_length",
        }
        assert (entry["layer_idx"], entry["last_block_start_frame"]) == (layer, LAST[0])
        assert entry["frame_seq_length"] == T
        weights = entry["attn_weights"]
        assert weights.dtype == torch.float32 and tuple(weights.shape) == (1, H, 2 * T, F * T)
        weights = weights.numpy()[0]
        np.testing.assert_allclose(weights, _reference_softmax(rows), rtol=1e-6, atol=1e-9)
        assert (weights[..., ~key_seen] == 0).all()
        np.testing.assert_allclose(weights.sum(axis=-1, dtype=np.float64), 1.0, atol=1e-6)

        expected_logits = np.where(np.isnan(rows), np.float16(-np.inf), rows)
        entry = logit_cache["attention_weights"][index]
        assert set(entry) == {"layer_idx", "attn_logits", "num_key_frames", "frame_seq_length"}
        assert entry["layer_idx"] == layer
        assert (entry["num_key_frames"], entry["frame_seq_length"]) == (F, T)
        # The capture fork's entry: attn_weights beside q_shape, k_shape and is_logits.
        fork = shapes_cache["attention_weights"][index]
        assert set(fork) == {"layer_idx", "attn_weights", "q_shape", "k_shape", "is_logits"}
        assert fork["layer_idx"] == layer and fork["is_logits"] is True
        head_dim = TINY.dim // TINY.num_heads
        assert fork["q_shape"] == [1, 2 * T, H, head_dim]
        assert fork["k_shape"] == [1, int(seen.sum()) * T, H, head_dim]
        for logits in (entry["attn_logits"], fork["attn_weights"]):
            assert logits.dtype == torch.float16 and tuple(logits.shape) == (1, H, 2 * T, F * T)
            np.testing.assert_array_equal(logits.numpy()[0], expected_logits)
            # What a notebook does with them: softmax over the keys, -inf giving 0.
            np.testing.assert_allclose(
                torch.softmax(logits.double(), dim=-1).numpy()[0], weights, rtol=1e-6, atol=1e-9
            )


def test_fork_entries_hold_probabilities_when_asked(tmp_path, runs):
    """export.measure: probabilities puts the softmax (figure-4's weights) in attention_cache.pt's
    attn_weights, is_logits False, the shapes as with logits."""
    run = runs(window=4)
    paths = _export(tmp_path, run, step=1, measure="probabilities")
    figure4 = _load(paths["figure4"])["attention_weights"]
    shapes_cache = _load(paths["shapes_cache"])
    assert shapes_cache["is_logits"] is False
    seen = visible_frames([2, 2, 2], 4, 0)[F - 1]
    for index, entry in enumerate(shapes_cache["attention_weights"]):
        assert entry["is_logits"] is False
        weights = entry["attn_weights"]
        assert weights.dtype == torch.float32 and tuple(weights.shape) == (1, H, 2 * T, F * T)
        torch.testing.assert_close(weights, figure4[index]["attn_weights"], rtol=0, atol=0)
        assert (weights.numpy()[0][..., ~np.repeat(seen, T)] == 0).all()
        assert entry["k_shape"][1] == int(seen.sum()) * T


@pytest.mark.parametrize("measure", ["logits", "probabilities"])
def test_frame_layout_equals_the_frame_dataset(tmp_path, runs, measure):
    run = runs()
    step = 1
    _export(tmp_path, run, step=step, measure=measure)
    variable = {"logits": "logit_mean", "probabilities": "prob_mass"}[measure]
    for layer, frames_path in zip(run["layers"], run["frames"], strict=True):
        exported = _load(tmp_path / "export" / f"layer{layer}.pt")
        assert set(exported) == {
            "layer_index",
            "num_heads",
            "full_frame_attention",
            "is_logits",
            "last_block_frame_attention",
            "last_block_query_frames",
            "block_sizes",
            "prompt",
            "num_frames",
            "frame_seq_length",
            "orig_num_frames",
            "vae_stride_t",
        }
        frames = xr.open_zarr(frames_path, chunks=None)[variable].values[step]  # [H, F, F]
        assert np.isnan(frames).any()  # the causal mask: the NaN -> 0 below is exercised
        full = exported["full_frame_attention"]
        assert full.dtype == torch.float32 and tuple(full.shape) == (H, F, F)
        np.testing.assert_array_equal(full.numpy(), np.nan_to_num(frames, nan=0.0))
        last = exported["last_block_frame_attention"]
        assert tuple(last.shape) == (H, F)
        np.testing.assert_allclose(
            last.numpy(), np.nan_to_num(frames, nan=0.0)[:, LAST].mean(axis=1), rtol=1e-6
        )
        assert exported["layer_index"] == layer and exported["num_heads"] == H
        assert exported["is_logits"] is (measure == "logits")
        assert exported["last_block_query_frames"] == LAST
        assert exported["block_sizes"] == [2, 2, 2]
        assert exported["prompt"] == "a test prompt"
        assert (exported["num_frames"], exported["frame_seq_length"]) == (F, T)
        assert exported["orig_num_frames"] == 21 and exported["vae_stride_t"] == 4
        if measure == "probabilities":
            np.testing.assert_allclose(last.numpy().sum(axis=1), 1.0, atol=1e-5)


def test_figure4_weights_agree_with_the_reducer(tmp_path, runs):
    """Independent paths to one number: the export's token softmax summed per key frame and
    averaged over a query frame's tokens is the frame dataset's prob_mass."""
    run = runs()
    paths = _export(tmp_path, run, step=2)
    weights = _load(paths["figure4"])["attention_weights"][0]["attn_weights"].numpy()[0]
    per_frame = weights.reshape(H, 2, T, F, T).sum(axis=4).mean(axis=2)  # [H, query frame, key]
    prob_mass = xr.open_zarr(run["frames"][0], chunks=None).prob_mass.values[2][:, LAST]
    np.testing.assert_allclose(per_frame, np.nan_to_num(prob_mass, nan=0.0), atol=2e-6)


def test_softmax_in_chunks_and_rows_that_see_nothing(monkeypatch):
    monkeypatch.setattr(notebooks, "SOFTMAX_CHUNK_VALUES", 7)  # one row per chunk
    rng = np.random.default_rng(0)
    rows = rng.normal(0, 4, size=(5, 6)).astype(np.float16)
    rows[1, :2] = np.nan
    rows[3] = np.nan  # nothing visible: all 0, not NaN
    out = visible_softmax(rows, np.empty(rows.shape, np.float32))
    expected = _reference_softmax(rows)
    expected[3] = 0.0
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-9)
    assert (out[1, :2] == 0).all() and (out[3] == 0).all()


def test_bad_inputs_are_named_and_leave_nothing(tmp_path, runs, monkeypatch):
    run = _copy(runs(), tmp_path)  # its last check writes a NaN into a store
    out = tmp_path / "export"
    # The store of layer 1 given as layer 0.
    with pytest.raises(ValueError, match=r"layer1\.zarr: holds layer 1, not layer 0 of export"):
        _export(tmp_path, run, token_layers=[0, 0])
    with pytest.raises(ValueError, match=r"layer0\.zarr: export\.step=5, but it holds 5"):
        _export(tmp_path, run, step=5)
    assert not list(out.glob("*.pt*")) and not list(out.glob("*.scratch"))
    # A failure while writing leaves neither the file, its temporary nor the scratch folder.
    real_save = torch.save

    def failing_save(obj, path):
        real_save(obj, path)
        if "figure4" in str(path):
            raise OSError("disk full")

    monkeypatch.setattr(notebooks.torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        _export(tmp_path, run)
    assert not (out / FILES[0]).exists()
    assert not list(out.glob("*.tmp")) and not list(out.glob("*.scratch"))
    monkeypatch.setattr(notebooks.torch, "save", real_save)
    # A visible tile of the last block that reads NaN: the store contradicts its attributes.
    import zarr

    logits = zarr.open_array(str(run["stores"][1] / "logits"), mode="r+")
    logits[0, 1, 5 * T, 3 * T] = np.nan
    with pytest.raises(ValueError, match=r"layer1\.zarr: step 0, head 1: .*key frame 3 are partly"):
        _export(tmp_path, run)
    assert not (out / FILES[0]).exists() and not list(out.glob("*.scratch"))


def test_export_bytes_at_real_geometry_and_on_disk(tmp_path, runs):
    real = export_bytes(num_heads=12, frame_seq_length=1560, num_frames=21, last_block_frames=3)
    assert real["figure4"] == 12 * 4680 * 32760 * 4 == 7_359_206_400  # 7.4 GB per layer
    assert real["logit_cache"] == real["shapes_cache"] == 12 * 4680 * 32760 * 2
    probabilities = export_bytes(
        num_heads=12,
        frame_seq_length=1560,
        num_frames=21,
        last_block_frames=3,
        measure="probabilities",
    )
    assert probabilities["shapes_cache"] == real["figure4"]  # float32 like figure-4's
    assert real["frames"] == 12 * 21 * 21 * 4 + 12 * 21 * 4
    # The files hold these bytes and a few kB of pickle and zip headers.
    run = runs()
    paths = _export(tmp_path, run)
    tiny = export_bytes(num_heads=H, frame_seq_length=T, num_frames=F, last_block_frames=2)
    for name, path in paths.items():
        size = path.stat().st_size
        assert 2 * tiny[name] < size < 2 * tiny[name] + 8192, name  # two layers
    size = (tmp_path / "export" / "layer0.pt").stat().st_size
    assert tiny["frames"] < size < tiny["frames"] + 8192


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(export={"layers": [0, 1]}), "export.layers: [1] have no token store"),
        (
            lambda c: (c["capture"].update(keep_tokens=False, survey=[1, 2, 3]),),
            None,  # the default export.layers: none, so nothing is refused
        ),
        (
            lambda c: (
                c["capture"].update(keep_tokens=False, survey=[1, 2, 3]),
                c.update(export={"layers": [0]}),
            ),
            "export.layers: [0] have no token logits to export: capture.keep_tokens: false",
        ),
        (
            lambda c: (c["capture"].update(tokens=False), c.update(export={"layers": [0]})),
            "export.layers: [0] have no token logits to export: capture.tokens: false",
        ),
        (lambda c: c.update(export={"step": 5}), "export.step=5 but only 5 passes are captured"),
        (lambda c: c.update(export={"step": 1.0}), "export.step: 1.0 must be an integer"),
        (
            lambda c: (
                c["capture"].update(tokens=False, survey=[1, 2, 3]),
                c.update(export={"measure": "probabilities"}),
            ),
            "export.measure: probabilities need the token logits or a survey",
        ),
    ],
    ids=[
        "layer-without-token-store",
        "temporary-token-stores-default",
        "temporary-token-stores",
        "no-token-logits",
        "step-not-captured",
        "step-not-integer",
        "probabilities-without-tokens",
    ],
)
def test_export_config_is_checked(change, message):
    if message is None:
        config = checked(change)
        assert export_layers(config) == []
        return
    with pytest.raises(ConfigError) as raised:
        checked(change)
    assert message in str(raised.value)


def test_export_config_defaults():
    config = checked()
    assert config["export"] == {"step": 0, "measure": "logits"}
    assert export_layers(config) == [0]  # the token layers
    config = checked(lambda c: c.update(export={"layers": []}))
    assert export_layers(config) == []


@pytest.mark.workflow
def test_export_target_on_the_demo(demo_run, tmp_path):
    workdir = demo_copy(demo_run, tmp_path / "w")
    # Not part of the default run; its own target, one job per run with the token stores
    # (capture.token_runs: demo_a/eagle alone).
    jobs = planned_jobs(workdir, "export")
    assert jobs == {("export", ""), ("export_run", "checkpoint=demo_a, prompt=eagle")}
    snakemake(workdir, "export")
    run = workdir / "results/export/demo_a/eagle"
    names = {p.name for p in run.iterdir()}
    assert names == {*FILES, "layer0.pt", "layer1.pt", "layer2.pt", "layer3.pt"}
    t, frames, heads = 24, 21, 4
    figure4 = _load(run / FILES[0])
    entry = figure4["attention_weights"][0]
    assert figure4["layer_indices"] == [0] and entry["last_block_start_frame"] == 18
    assert tuple(entry["attn_weights"].shape) == (1, heads, 3 * t, frames * t)
    np.testing.assert_allclose(entry["attn_weights"].sum(-1).numpy(), 1.0, atol=1e-5)
    stored = xr.open_zarr(workdir / "results/logits/demo_a/eagle/layer0.zarr").logits
    rows = stored.values[0, :, 18 * t :, :]
    logits = _load(run / FILES[1])["attention_weights"][0]["attn_logits"]
    np.testing.assert_array_equal(logits.numpy()[0], rows)  # no window: all visible
    fork = _load(run / FILES[2])["attention_weights"][0]
    np.testing.assert_array_equal(fork["attn_weights"].numpy()[0], rows)
    assert fork["is_logits"] is True and fork["k_shape"] == [1, 504, heads, 16]
    layer = _load(run / "layer3.pt")  # a surveyed layer: its frame dataset
    assert tuple(layer["full_frame_attention"].shape) == (heads, frames, frames)
    assert layer["orig_num_frames"] == 81 and layer["is_logits"] is True
    assert (workdir / "results/logs/export/demo_a/eagle.log").read_text()
    assert planned_jobs(workdir, "export") == set()
    assert planned_jobs(workdir) == set()  # the default target is untouched
