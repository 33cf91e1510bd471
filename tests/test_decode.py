"""The decode job (sinkscope.extraction.decode): a run's rollouts, latents -> one mp4 each, the
grid and the pixel metrics, checked against the whole-video reference decode
(`sinkscope.wan.vae.decode_latents`) and `video_metrics` of its frames; every failure and a kill
leave no mp4 that looks complete. A tiny random VAE (base_dim 1) as a diffusers folder, latents
[16, 7, 2, 3] in blocks [1, 3, 3]: 25 pixel frames of 16 x 24."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from sinkscope.extraction import decode
from sinkscope.extraction.decode import (
    Rollout,
    closed_loop_rollout,
    decode_videos,
    survey_rollout,
)
from sinkscope.extraction.latents import save_latents
from sinkscope.tables import FRAME_TABLE_COLUMNS
from sinkscope.video_grid import GridComposer, GridTile
from sinkscope.video_metrics import VIDEO_TABLE_COLUMNS, read_video_metrics, video_metrics
from sinkscope.videos import read_frames, read_video_info
from sinkscope.wan.vae import (
    CheckpointError,
    decode_latents,
    random_vae,
    save_diffusers_layout,
    tiny_vae_config,
)

BLOCKS = (1, 3, 3)
LATENT_FRAMES = sum(BLOCKS)  # 7
PIXEL_FRAMES = 4 * LATENT_FRAMES - 3  # 25
HEIGHT, WIDTH = 16, 24  # 8 x the latent's 2 x 3
SCALE = 8  # VideoWriter enlarges to a shorter side of 128: 16 x 8
SINK_FRAMES = 2  # not the first block's 1: the job must pass it on
# (policy, budget, sink frames, recent frames, capacity) of each closed-loop rollout, the label
# policy_label gives it, and its first evicting latent frame worked out by hand: the first block
# whose end (last frame + 1) exceeds the capacity, blocks [0], [1-3], [4-6].
POLICIES = {
    "window": ((3, 0, 0, 3), "window B=3", 1),  # block [1-3] ends at 4 > 3
    "full": ((0, 0, 0, 0), "full", None),  # not first: the reference found by name
    "sink_window": ((4, 1, 0, 4), "sink_window B=4 S=1", 4),  # [1-3] fits, [4-6] ends at 7
}
# Latent frame of each pixel frame: 0 -> 0, f >= 1 -> 4f - 3 .. 4f.
LATENT_OF_PIXEL = np.array([0] + [1 + (t - 1) // 4 for t in range(1, PIXEL_FRAMES)])


def frame_table(path: Path, policy: str, blocks=BLOCKS, shuffle: bool = True) -> Path:
    """A closed-loop frame table (FRAME_TABLE_COLUMNS) of `policy` over `blocks`, rows in a
    shuffled order (the job sorts by frame)."""
    budget, sinks, recent, capacity = POLICIES[policy][0]
    rows = []
    for block, size in enumerate(blocks):
        for _ in range(size):
            rows.append(
                {
                    "checkpoint": "ckpt",
                    "prompt": "fox",
                    "policy": policy,
                    "budget": budget,
                    "sink_frames": sinks,
                    "recent_frames": recent,
                    "capacity": capacity,
                    "jitter": 0.0,
                    "bias": 1.0,
                    "frame": len(rows),
                    "block": block,
                    "rel_l2": 0.0,
                    "cosine": 1.0,
                    "sink_distance": 0.0,
                }
            )
    table = pd.DataFrame(rows, columns=FRAME_TABLE_COLUMNS)
    if shuffle:
        table = table.sample(frac=1, random_state=1)
    table.to_csv(path, index=False)
    return path


def random_latents(seed: int, frames: int = LATENT_FRAMES, channels: int = 16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(channels, frames, 2, 3, generator=generator)


@pytest.fixture(scope="module")
def vae(tmp_path_factory):
    """(the in-memory tiny VAE, its diffusers folder)."""
    model = random_vae(tiny_vae_config(1), seed=5)
    folder = tmp_path_factory.mktemp("vae") / "vae"
    save_diffusers_layout(model, folder)
    return model, folder


def make_rollout(root: Path, policy: str, seed: int, blocks=BLOCKS, channels=16) -> Rollout:
    latents = root / f"{policy}.safetensors"
    save_latents(latents, random_latents(seed, sum(blocks), channels), {"seed": seed})
    return closed_loop_rollout(policy, latents, frame_table(root / f"{policy}.csv", policy, blocks))


def run_decode(out: Path, rollouts, vae_folder, *, grid: bool = True, **options) -> None:
    decode_videos(
        checkpoint_name="ckpt",
        prompt_name="fox",
        rollouts=rollouts,
        videos=[out / f"{r.name}.mp4" for r in rollouts],
        grid=out / "grid.mp4" if grid else None,
        metrics=out / "metrics.csv",
        vae=vae_folder,
        settings={"device": "cpu"},
        progress=False,
        **options,
    )


def assert_nothing_written(out: Path) -> None:
    """No mp4 (complete or partial), no metrics: the output folder is empty or absent."""
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []


@pytest.fixture(scope="module")
def decoded(vae, tmp_path_factory):
    """full, window and sink_window decoded once: (rollouts, latents, output folder)."""
    root = tmp_path_factory.mktemp("run")
    rollouts = [make_rollout(root, policy, seed) for seed, policy in enumerate(POLICIES)]
    latents = {r.name: random_latents(seed) for seed, r in enumerate(rollouts)}
    out = root / "videos"
    run_decode(out, rollouts, vae[1], sink_frames=SINK_FRAMES)
    return rollouts, latents, out


@pytest.fixture(scope="module")
def reference_frames(vae, decoded):
    """Each rollout decoded alone, the whole video at once: uint8 [25, 16, 24, 3]."""
    _, latents, _ = decoded
    return {name: decode_latents(vae[0], z).numpy() for name, z in latents.items()}


# --- the rollouts ------------------------------------------------------------------------------


def test_a_frame_table_gives_the_label_the_blocks_and_the_first_eviction(decoded):
    rollouts, _, _ = decoded
    for rollout in rollouts:
        _, label, evicting_from = POLICIES[rollout.name]
        assert rollout.label == label
        assert rollout.block_sizes == BLOCKS
        assert rollout.evicting_from == evicting_from


def test_a_frame_table_of_another_policy_is_refused_naming_it(tmp_path):
    table = frame_table(tmp_path / "sink_window.csv", "sink_window")
    with pytest.raises(ValueError, match=re.escape(str(table))) as raised:
        closed_loop_rollout("window", tmp_path / "window.safetensors", table)
    assert "'sink_window'" in str(raised.value) and "'window'" in str(raised.value)


def test_a_survey_rollout_takes_its_blocks_from_the_latents_metadata(tmp_path):
    path = tmp_path / "survey.safetensors"
    save_latents(path, random_latents(0), {"block_sizes": [1, 3, 3], "seed": 4})
    rollout = survey_rollout(path)
    assert rollout == Rollout("survey", path, "survey", (1, 3, 3), None)


@pytest.mark.parametrize("metadata", [{"seed": 4}, {}], ids=["other-metadata", "no-metadata"])
def test_latents_without_block_sizes_are_no_survey_rollout(tmp_path, metadata):
    path = tmp_path / "x0.safetensors"
    save_latents(path, random_latents(0), metadata)
    with pytest.raises(ValueError, match=re.escape(f"{path}: no block_sizes")):
        survey_rollout(path)


# --- what the job writes -----------------------------------------------------------------------


def test_each_rollout_becomes_one_video_of_4f_minus_3_frames_and_the_grid_too(decoded):
    rollouts, _, out = decoded
    names = [r.name for r in rollouts]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*(f"{n}.mp4" for n in names), "grid.mp4", "metrics.csv"]
    )
    for name in names:
        info = read_video_info(out / f"{name}.mp4")
        assert (info.frames, info.height, info.width) == (PIXEL_FRAMES, 128, 192)
        assert (info.codec, info.fps) == ("h264", 16)
    composer = GridComposer([GridTile(r.label) for r in rollouts], (HEIGHT, WIDTH))
    grid = read_video_info(out / "grid.mp4")
    assert (grid.frames, grid.height, grid.width) == (PIXEL_FRAMES, composer.height, composer.width)


def tile_samples(frames: np.ndarray, top: int = 0, left: int = 0) -> np.ndarray:
    """The centre pixel of each 8 x 8 square of an enlarged 16 x 24 frame: away from the square's
    edges, where yuv420p's chroma mixes in the neighbouring square."""
    centre = SCALE // 2 - 1
    rows = slice(top + centre, top + SCALE * HEIGHT, SCALE)
    columns = slice(left + centre, left + SCALE * WIDTH, SCALE)
    return frames[:, rows, columns].astype(np.int16)


def test_each_video_holds_its_own_rollouts_frames(decoded, reference_frames):
    """The mp4's frames against each rollout's reference decode: H.264 at crf 18 on frames of
    random colour noise keeps the mean error at ~2.3 levels; two different rollouts' frames are
    ~60 levels apart, so each video is its own rollout's, in its own order."""
    rollouts, _, out = decoded
    for rollout in rollouts:
        frames = tile_samples(np.stack(list(read_frames(out / f"{rollout.name}.mp4"))))
        errors = {
            name: float(np.abs(frames - reference).mean())
            for name, reference in reference_frames.items()
        }
        assert errors[rollout.name] < 5, errors
        assert min(e for n, e in errors.items() if n != rollout.name) > 20, errors


def test_the_metrics_are_video_metrics_of_the_reference_decode(decoded, reference_frames):
    """Rows equal `video_metrics` of each rollout's lone whole-video decode against the full
    cache's, with the run's sink frames. The job decodes the rollouts as one batch, whose frames
    may differ from a lone decode by 1-3 levels in a few values in 10,000 (iter_decoded_batch):
    means move by < 1e-3 levels then, so rtol 1e-3 tolerates that and nothing else."""
    rollouts, _, out = decoded
    raw = pd.read_csv(out / "metrics.csv")
    assert list(raw.columns) == VIDEO_TABLE_COLUMNS
    table = read_video_metrics(out / "metrics.csv")
    assert table["rollout"].tolist() == [r.name for r in rollouts for _ in range(PIXEL_FRAMES)]
    assert set(table["checkpoint"]) == {"ckpt"} and set(table["prompt"]) == {"fox"}
    for rollout in rollouts:
        rows = table[table["rollout"] == rollout.name].reset_index(drop=True)
        assert set(rows["label"]) == {POLICIES[rollout.name][1]}
        expected = video_metrics(
            reference_frames[rollout.name],
            BLOCKS,
            reference=reference_frames["full"],
            sink_frames=SINK_FRAMES,
            rollout=rollout.name,
        )
        assert rows["pixel_frame"].tolist() == list(range(PIXEL_FRAMES))
        assert rows["latent_frame"].tolist() == LATENT_OF_PIXEL.tolist()
        assert rows["block"].tolist() == expected["block"].tolist()
        for column in expected.columns[4:]:
            np.testing.assert_allclose(
                rows[column].to_numpy(float),
                expected[column].to_numpy(float),
                rtol=1e-3,
                atol=1e-6,
                err_msg=f"{rollout.name} {column}",
            )
    # The reference against itself: PSNR inf (written 'inf', read back as float inf), SSIM 1;
    # every other rollout finite, no NaN anywhere.
    full = table[table["rollout"] == "full"]
    assert np.isposinf(full["psnr"]).all() and (full["ssim"] == 1.0).all()
    others = table[table["rollout"] != "full"]
    assert np.isfinite(others[["psnr", "ssim"]].to_numpy()).all()
    assert (others["psnr"] < 30).all()  # random latents: nothing like the reference


def test_the_sink_distance_follows_the_sink_frames_given(decoded, reference_frames):
    """`sink_frames` reaches the metrics: the first block's default gives other values."""
    _, _, out = decoded
    window = read_video_metrics(out / "metrics.csv").query("rollout == 'window'")
    default = video_metrics(reference_frames["window"], BLOCKS)
    assert not np.allclose(window["sink_mae"], default["sink_mae"], rtol=1e-3)


def band_colour(frame: np.ndarray, top: int, left: int, width: int) -> np.ndarray:
    """The median colour of a label band's top rows (above the label's text)."""
    return np.median(frame[top + 1 : top + 3, left + 2 : left + width - 2].reshape(-1, 3), axis=0)


def test_a_tiles_band_is_red_exactly_from_its_first_eviction(decoded, reference_frames):
    rollouts, _, out = decoded
    composer = GridComposer([GridTile(r.label) for r in rollouts], (HEIGHT, WIDTH))
    frames = np.stack(list(read_frames(out / "grid.mp4")))
    for index, rollout in enumerate(rollouts):
        top, left = composer.cell_origin(index)
        colours = np.stack([band_colour(f, top, left, composer.tile_width) for f in frames])
        red = (colours[:, 0] > 120) & (colours[:, 1] < 70) & (colours[:, 2] < 70)
        grey = (np.abs(colours - 48) < 20).all(axis=1)
        start = POLICIES[rollout.name][2]
        expected = np.zeros(PIXEL_FRAMES, bool) if start is None else LATENT_OF_PIXEL >= start
        assert (red == expected).all() and (grey == ~expected).all(), (rollout.name, colours)
        # Under the band: the rollout's own frames, enlarged 8 x nearest.
        tile = tile_samples(frames, top + composer.band, left)
        assert float(np.abs(tile - reference_frames[rollout.name]).mean()) < 6


def test_without_the_full_cache_psnr_and_ssim_are_nan_and_no_grid_is_written(vae, tmp_path):
    rollout = make_rollout(tmp_path, "window", seed=1)
    out = tmp_path / "videos"
    run_decode(out, [rollout], vae[1], grid=False)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.csv", "window.mp4"]
    table = read_video_metrics(out / "metrics.csv")
    assert len(table) == PIXEL_FRAMES and set(table["label"]) == {"window B=3"}
    assert table["psnr"].isna().all() and table["ssim"].isna().all()
    assert table["sharpness"].notna().all()


# --- failures: an error naming the file, and nothing written -----------------------------------


def test_latents_of_another_channel_count_are_refused_naming_them_and_the_vae(vae, tmp_path):
    rollouts = [make_rollout(tmp_path, "full", 0), make_rollout(tmp_path, "window", 1, channels=8)]
    out = tmp_path / "videos"
    with pytest.raises(ValueError, match="8 channels") as raised:
        run_decode(out, rollouts, vae[1])
    assert str(rollouts[1].latents) in str(raised.value)
    assert str(vae[1]) in str(raised.value)
    assert_nothing_written(out)


def test_rollouts_of_different_lengths_are_refused(vae, tmp_path):
    rollouts = [make_rollout(tmp_path, "full", 0), make_rollout(tmp_path, "window", 1, (1, 3))]
    out = tmp_path / "videos"
    with pytest.raises(ValueError, match="one shape") as raised:
        run_decode(out, rollouts, vae[1])
    assert "[16, 7, 2, 3]" in str(raised.value) and "[16, 4, 2, 3]" in str(raised.value)
    assert_nothing_written(out)


def test_latents_longer_than_their_frame_table_are_refused(vae, tmp_path):
    rollout = make_rollout(tmp_path, "window", 1)
    save_latents(rollout.latents, random_latents(1, frames=10), {})
    out = tmp_path / "videos"
    with pytest.raises(ValueError, match=re.escape(f"{rollout.latents}: 10 latent frames")):
        run_decode(out, [rollout], vae[1])
    assert_nothing_written(out)


def _z_dim_8(folder: Path) -> Path:
    config = folder / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "z_dim": 8}))
    return config


def _truncated(folder: Path) -> Path:
    weights = folder / "diffusion_pytorch_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return weights


@pytest.mark.parametrize(
    ("breaks", "message"),
    [(_z_dim_8, "a VAE with z_dim 8"), (_truncated, "not a readable safetensors file")],
    ids=["config-z-dim-8", "truncated-weights"],
)
def test_a_broken_vae_is_refused_naming_its_file(vae, tmp_path, breaks, message):
    rollouts = [make_rollout(tmp_path, "full", 0), make_rollout(tmp_path, "window", 1)]
    folder = tmp_path / "broken_vae"
    shutil.copytree(vae[1], folder)
    named = breaks(folder)
    out = tmp_path / "videos"
    with pytest.raises(CheckpointError, match=message) as raised:
        run_decode(out, rollouts, folder)
    assert str(raised.value).startswith(f"{named}: ")
    assert_nothing_written(out)


def test_a_failure_mid_decode_leaves_no_video_and_no_metrics(vae, tmp_path, monkeypatch):
    rollouts = [make_rollout(tmp_path, "full", 0), make_rollout(tmp_path, "window", 1)]
    out = tmp_path / "videos"
    compose = GridComposer.compose
    seen = []

    def failing(self, frames, *, pixel_frame, **kwargs):
        if pixel_frame == 10:
            seen.extend(p.name for p in out.iterdir())  # the partials, mid-write
            raise RuntimeError("the GPU fell off the bus")
        return compose(self, frames, pixel_frame=pixel_frame, **kwargs)

    monkeypatch.setattr(decode.GridComposer, "compose", failing)
    with pytest.raises(RuntimeError, match="fell off the bus"):
        run_decode(out, rollouts, vae[1])
    assert sorted(seen) == ["full.mp4.partial", "grid.mp4.partial", "window.mp4.partial"]
    assert_nothing_written(out)


KILLED = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from sinkscope.extraction.decode import Rollout, decode_videos

    root, vae = Path(sys.argv[1]), sys.argv[2]
    names = ["full", "window", "sink_window"]
    rollouts = [Rollout(n, root / f"{n}.safetensors", n, (3,) * 20) for n in names]
    decode_videos(
        checkpoint_name="ckpt", prompt_name="fox", rollouts=rollouts,
        videos=[root / "videos" / f"{n}.mp4" for n in names], grid=root / "videos" / "grid.mp4",
        metrics=root / "videos" / "metrics.csv", vae=vae, settings={"device": "cpu"},
        progress=False,
    )
    """
)


def test_a_decode_killed_mid_write_leaves_no_complete_looking_video(vae, tmp_path):
    """60 latent frames x 3 rollouts take ~10 s to decode; the kill comes once the partials are
    there (the first frames in), long before."""
    for seed, name in enumerate(["full", "window", "sink_window"]):
        save_latents(tmp_path / f"{name}.safetensors", random_latents(seed, frames=60), {})
    out = tmp_path / "videos"
    process = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path), str(vae[1])])
    try:
        deadline = time.monotonic() + 60
        while not (out.is_dir() and len(list(out.glob("*.partial"))) == 4):
            assert process.poll() is None, "the decode ended before it was killed"
            assert time.monotonic() < deadline, "no partial video appeared"
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == -signal.SIGKILL
    left = sorted(p.name for p in out.iterdir())
    assert left == sorted(
        f"{name}.mp4.partial" for name in ["full", "grid", "sink_window", "window"]
    )
    assert not any(name.endswith(".mp4") or name == "metrics.csv" for name in left)
