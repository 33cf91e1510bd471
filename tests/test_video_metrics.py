"""Pixel-space diagnostics of a decoded rollout (sinkscope.video_metrics) against values
worked out by hand on tiny synthetic frames."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sinkscope import video_metrics as vm


def video(values, size: int = 8) -> np.ndarray:
    """uint8 [T, size, size, 3] frames, each one flat colour (an int or an RGB triple)."""
    colours = [np.broadcast_to(np.asarray(v, dtype=np.uint8), (3,)) for v in values]
    return np.stack([np.broadcast_to(c, (size, size, 3)) for c in colours]).copy()


def checkerboard(size: int = 8, colour=(255, 255, 255)) -> np.ndarray:
    """1-pixel cells: `colour` where row + column is even, black elsewhere."""
    on = (np.add.outer(np.arange(size), np.arange(size)) % 2 == 0)[..., None]
    return np.where(on, np.asarray(colour, dtype=np.uint8), np.uint8(0)).astype(np.uint8)


# --- the layout -----------------------------------------------------------------------------------


# F = 4 latent frames -> 1 + 4 x 3 = 13 pixel frames:
# latent 0 -> 0, 1 -> 1..4, 2 -> 5..8, 3 -> 9..12.
LATENT_OF_PIXEL = [0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]


@pytest.mark.parametrize(
    ("sizes", "blocks"),
    [
        ([2, 2], [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]),  # frames_per_block 2
        ([1, 3], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]),  # a lone first frame, then 3
        ([4], [0] * 13),
    ],
)
def test_the_pixel_frames_of_four_latent_frames(sizes, blocks):
    latent, block = vm.pixel_frame_layout(sizes)
    assert vm.pixel_frame_count(4) == 13
    assert latent.tolist() == LATENT_OF_PIXEL
    assert block.tolist() == blocks
    table = vm.video_metrics(video([0] * 13), sizes, fps=4)
    assert table["pixel_frame"].tolist() == list(range(13))
    assert table["latent_frame"].tolist() == LATENT_OF_PIXEL
    assert table["block"].tolist() == blocks
    assert table["seconds"].tolist() == [t / 4 for t in range(13)]
    assert list(table.columns) == vm.VIDEO_METRIC_COLUMNS


def test_a_frame_count_the_blocks_do_not_decode_to_is_refused():
    with pytest.raises(ValueError, match="decode to 13"):
        vm.video_metrics(video([0] * 12), [2, 2])
    with pytest.raises(ValueError, match="uint8"):
        vm.video_metrics(video([0] * 13).astype(np.float32), [2, 2])
    accumulator = vm.VideoMetricAccumulator([1])
    accumulator.add(video([0])[0])
    with pytest.raises(ValueError, match="only 1 pixel frames"):
        accumulator.add(video([0])[0])


# --- flicker and the block-boundary jump ----------------------------------------------------------


def test_flicker_is_vbenchs_mean_absolute_difference():
    still = vm.video_metrics(video([7] * 13), [2, 2])
    assert np.isnan(still["flicker"][0])
    assert (still["flicker"][1:] == 0).all()
    blinking = vm.video_metrics(video([0, 255] * 6 + [0]), [2, 2])
    assert (blinking["flicker"][1:] == 255).all()
    # One channel of one pixel in four changes by 12: 12 / (4 x 3) = 1.
    a = np.zeros((2, 2, 3), np.uint8)
    b = a.copy()
    b[0, 1, 2] = 12
    assert vm.frame_difference(a, b) == vm.frame_difference(b, a) == 1.0
    # VBench's score of a video: (255 - mean flicker) / 255.
    drift = vm.quality_drift(pd.concat([still.assign(rollout="s"), blinking.assign(rollout="b")]))
    assert drift.set_index("rollout")["flicker_score"].to_dict() == {"s": 1.0, "b": 0.0}
    assert (drift["flicker_mean"] == [0.0, 255.0]).all()


def test_the_boundary_jump_spots_a_planted_jump():
    # [2, 2, 2]: blocks of pixel frames 0..4, 5..12, 13..20; one grey level a frame, and a jump of
    # 20 more into the third block.
    values = [t + 20 * (t >= 13) for t in range(21)]
    table = vm.video_metrics(video(values), [2, 2, 2])
    jumps = table["boundary_jump"]
    assert jumps[5] == 1.0  # as large as the steps inside blocks 0 and 1
    assert jumps[13] == 21.0  # 21 against 1 inside blocks 1 and 2
    assert jumps.drop([5, 13]).isna().all()


def test_the_boundary_jump_is_nan_or_inf_where_the_blocks_hold_still():
    # [1, 3]: block 0 is pixel frame 0 alone, so only block 1's pairs count.
    flat = vm.boundary_jumps(np.r_[np.nan, np.zeros(12)], [1, 3])
    assert np.isnan(flat).all()  # 0 / 0
    step = vm.boundary_jumps(np.r_[np.nan, 5.0, np.zeros(11)], [1, 3])
    assert step[1] == np.inf and np.isnan(np.delete(step, 1)).all()
    mixed = vm.boundary_jumps(np.r_[np.nan, 6.0, np.full(11, 2.0)], [1, 3])
    assert mixed[1] == 3.0
    # [1, 1]: latent frame 1 alone is pixel frames 1..4, three pairs inside.
    assert vm.boundary_jumps(np.array([np.nan, 4.0, 1.0, 2.0, 3.0]), [1, 1])[1] == 2.0


# --- colour ---------------------------------------------------------------------------------------


def test_a_colour_shift_after_the_first_block():
    # [2, 2]: the first block is pixel frames 0..4; red + 10 from frame 5 on.
    values = [(100, 50, 20)] * 5 + [(110, 50, 20)] * 8
    table = vm.video_metrics(video(values), [2, 2])
    assert table["mean_r"].tolist() == [100.0] * 5 + [110.0] * 8
    assert (table["mean_g"] == 50).all() and (table["mean_b"] == 20).all()
    assert table["colour_drift"].tolist() == [0.0] * 5 + [10.0] * 8
    # HSV saturation (max - min) / max: 80 / 100, then 90 / 110.
    np.testing.assert_allclose(table["saturation"], [0.8] * 5 + [90 / 110] * 8)
    np.testing.assert_allclose(
        table["saturation_drift"], [0] * 5 + [90 / 110 - 0.8] * 8, atol=1e-15
    )
    # A shift along every channel: the Euclidean distance of the means.
    shifted = vm.video_metrics(video([(10, 10, 10)] * 5 + [(13, 14, 10)] * 8), [2, 2])
    assert shifted["colour_drift"].tolist() == [0.0] * 5 + [5.0] * 8


def test_saturation_is_zero_on_black_and_grey():
    frame = np.zeros((2, 2, 3), np.uint8)
    frame[0] = (255, 0, 0)  # saturated red on one row, black on the other
    assert vm.hsv_saturation(frame) == 0.5
    frame[1] = (90, 90, 90)
    assert vm.hsv_saturation(frame) == 0.5


# --- sharpness and its drift ----------------------------------------------------------------------


def test_the_laplacian_variance_of_a_checkerboard():
    # Inside an 8 x 8 checkerboard of 0 and 255 every pixel's four neighbours are the other
    # colour: the Laplacian is -4 x 255 on white, +4 x 255 on black, 18 of each over the 6 x 6
    # interior, so mean 0 and variance 1020^2.
    assert vm.laplacian_variance(checkerboard()) == pytest.approx(1020.0**2, rel=1e-12)
    # Grey = 0.299 r + 0.587 g + 0.114 b: a red board is 0.299 as high.
    red = vm.laplacian_variance(checkerboard(colour=(255, 0, 0)))
    assert red == pytest.approx((4 * 0.299 * 255) ** 2, rel=1e-12)
    assert vm.laplacian_variance(video([(30, 60, 90)])[0]) == 0.0


def test_the_laplacian_is_the_kernel_on_the_interior():
    image = np.random.default_rng(0).uniform(0, 255, (9, 12))
    kernel = np.array([[0, 1, 0], [1, -4, 1], [0, 1, 0]])
    by_hand = [[(image[i : i + 3, j : j + 3] * kernel).sum() for j in range(10)] for i in range(7)]
    np.testing.assert_allclose(vm.laplacian(image), by_hand, atol=1e-9)


def test_the_drift_windows():
    assert vm.drift_window(200) == 80  # 5 s at 16 fps
    assert vm.drift_window(160) == 80
    assert vm.drift_window(100) == 50  # half of a shorter video
    assert vm.drift_window(13) == 6
    assert vm.drift_window(13, fps=1) == 5
    assert vm.drift_window(1) == 0


def test_sharpness_drift_first_against_last_frames():
    # 13 frames: 6 in each window. Sharp checkerboards first, flat frames last.
    frames = np.stack([checkerboard()] * 7 + [np.full((8, 8, 3), 128, np.uint8)] * 6)
    table = vm.video_metrics(frames, [2, 2], rollout="r")
    (row,) = vm.quality_drift(table).to_dict("records")
    assert row["rollout"] == "r" and row["pixel_frames"] == 13 and row["window_frames"] == 6
    assert row["sharpness_first"] == pytest.approx(1020.0**2)
    assert row["sharpness_last"] == 0.0
    assert row["sharpness_drift"] == pytest.approx(1020.0**2)
    assert row["sharpness_change"] == -1.0
    assert list(vm.quality_drift(table).columns) == vm.VIDEO_DRIFT_COLUMNS


# --- the sink frames ------------------------------------------------------------------------------


def test_the_sink_distance_drops_where_frames_copy_the_sinks():
    # [2, 2, 2, 2]: 29 pixel frames; the sinks (the first block) are pixel frames 0..4, one image
    # A. Frames 5..20 are noise; frames 21..28 (the last block) copy A: a planted collapse.
    rng = np.random.default_rng(1)
    sink = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    frames = rng.integers(0, 256, (29, 8, 8, 3), dtype=np.uint8)
    frames[:5] = sink
    frames[21:] = sink
    table = vm.video_metrics(frames, [2, 2, 2, 2])
    expected = np.abs(frames - frames[:5].astype(np.float64).mean(axis=0)).mean(axis=(1, 2, 3))
    np.testing.assert_allclose(table["sink_mae"], expected)
    np.testing.assert_allclose(table["sink_distance"], expected / np.median(expected[5:]))
    distance = table["sink_distance"].to_numpy()
    assert (distance[:5] == 0).all() and (distance[21:] == 0).all()
    assert (np.abs(distance[5:21] - 1) < 0.2).all()  # noise: about as far as usual


def test_the_sink_frames_are_the_first_latent_frames_asked_for():
    # sink_frames=1: latent frame 0, pixel frame 0 alone; the median over pixel frames 1..12.
    values = [10] + [20] * 4 + [30] * 8
    table = vm.video_metrics(video(values), [2, 2], sink_frames=1)
    assert table["sink_mae"].tolist() == [0.0] + [10.0] * 4 + [20.0] * 8
    assert table["sink_distance"].tolist() == [0.0] + [0.5] * 4 + [1.0] * 8
    # The default: the first block's latent frames 0 and 1, pixel frames 0..4 (mean 18).
    default = vm.video_metrics(video(values), [2, 2])
    assert default["sink_mae"].tolist() == [8.0] + [2.0] * 4 + [12.0] * 8
    # No frame past the sinks: no median to scale by.
    assert vm.video_metrics(video([5] * 13), [4])["sink_distance"].isna().all()
    with pytest.raises(ValueError, match="sink_frames"):
        vm.VideoMetricAccumulator([2, 2], sink_frames=5)


# --- against the reference ------------------------------------------------------------------------


def test_psnr_of_a_known_mse():
    a = np.zeros((4, 4, 3), np.uint8)
    assert vm.psnr(a + 10, a) == pytest.approx(10 * math.log10(255**2 / 100))  # MSE 100
    b = a.copy()
    b[0, 0, 0] = 255  # MSE = 255^2 / 48
    assert vm.psnr(b, a) == pytest.approx(10 * math.log10(48))
    assert vm.psnr(a, a) == math.inf


def ssim_by_hand(x: np.ndarray, y: np.ndarray) -> float:
    """Wang et al.'s SSIM of two grey images: an 11 x 11 Gaussian window (sigma 1.5) placed only
    where it fits, population (co)variances, K1 = 0.01, K2 = 0.03, L = 255; the mean."""
    taps = np.exp(-(np.arange(-5, 6) ** 2) / (2 * 1.5**2))
    window = np.outer(taps, taps) / taps.sum() ** 2

    def local(image):
        return np.einsum(
            "ijkl,kl->ij", np.lib.stride_tricks.sliding_window_view(image, (11, 11)), window
        )

    x, y = x.astype(np.float64), y.astype(np.float64)
    mx, my = local(x), local(y)
    vx, vy, cxy = local(x * x) - mx**2, local(y * y) - my**2, local(x * y) - mx * my
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    ssim_map = (2 * mx * my + c1) * (2 * cxy + c2) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return float(ssim_map.mean())


def test_ssim_against_an_independent_computation():
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (16, 20, 3), dtype=np.uint8)
    y = np.clip(x.astype(np.int16) + rng.integers(-40, 41, x.shape), 0, 255).astype(np.uint8)
    assert vm.ssim(x, x) == pytest.approx(1.0)

    # of the BT.601 grey frames, unrounded
    def luma(f):
        return f.astype(np.float64) @ np.array([0.299, 0.587, 0.114])

    by_hand = ssim_by_hand(luma(y), luma(x))
    assert vm.ssim(y, x) == pytest.approx(by_hand, rel=1e-9)
    assert 0 < vm.ssim(y, x) < 1
    # Two flat frames: only the luminance term, (2 a b + C1) / (a^2 + b^2 + C1).
    c1 = (0.01 * 255) ** 2
    flat = vm.ssim(np.full((16, 16, 3), 120, np.uint8), np.full((16, 16, 3), 100, np.uint8))
    assert flat == pytest.approx((2 * 100 * 120 + c1) / (100**2 + 120**2 + c1))


def test_the_table_against_a_reference_and_through_a_csv():
    rng = np.random.default_rng(3)
    reference = rng.integers(0, 256, (13, 16, 16, 3), dtype=np.uint8)
    frames = reference.copy()
    frames[6:] = np.clip(reference[6:].astype(np.int16) + 5, 0, 255)
    table = vm.video_metrics(frames, [2, 2], reference=reference, rollout="ckpt/prompt/window")
    assert (table["psnr"][:6] == np.inf).all() and (table["ssim"][:6] == 1.0).all()
    assert (table["psnr"][6:] > 30).all() and (table["ssim"][6:] < 1).all()
    assert vm.video_metrics(frames, [2, 2])[["psnr", "ssim"]].isna().all().all()
    text = table.to_csv(index=False)
    assert ",inf," in text
    back = pd.read_csv(io.StringIO(text))
    pd.testing.assert_frame_equal(back, table, check_exact=False, rtol=1e-12)


def test_frames_fed_one_at_a_time_give_the_same_table():
    rng = np.random.default_rng(4)
    frames = rng.integers(0, 256, (13, 16, 16, 3), dtype=np.uint8)
    reference = rng.integers(0, 256, (13, 16, 16, 3), dtype=np.uint8)
    accumulator = vm.VideoMetricAccumulator([1, 3], sink_frames=2, rollout="x")
    for t, frame in enumerate(frames):
        accumulator.add(frame, reference[t] if t % 2 else None)
        assert accumulator.count == t + 1
    table = accumulator.table()
    whole = vm.video_metrics(frames, [1, 3], reference=reference, sink_frames=2, rollout="x")
    pd.testing.assert_frame_equal(
        table.drop(columns=["psnr", "ssim"]), whole.drop(columns=["psnr", "ssim"])
    )
    assert table["psnr"][::2].isna().all() and (table["psnr"][1::2] == whole["psnr"][1::2]).all()
    with pytest.raises(ValueError, match="12 of the layout's 13"):
        partial = vm.VideoMetricAccumulator([1, 3])
        for frame in frames[:12]:
            partial.add(frame)
        partial.table()


def test_the_data_dictionary_names_every_column():
    text = (Path(__file__).parents[1] / "docs" / "DATA.md").read_text()
    section = text[text.index("### `results/videos/metrics.csv`") :]
    names = [*vm.VIDEO_METRIC_COLUMNS, *vm.VIDEO_DRIFT_COLUMNS]
    assert [name for name in names if f"`{name}`" not in section] == []
