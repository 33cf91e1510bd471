"""Pixel-space diagnostics of a decoded rollout, without learned models or downloaded weights: one
row per pixel frame (`VIDEO_METRIC_COLUMNS`, the later `results/videos/metrics.csv`) and one
quality-drift row per rollout (`VIDEO_DRIFT_COLUMNS`); docs/DATA.md describes both tables.

Input: the rollout's uint8 RGB frames [T, H, W, 3] (0-255), optionally the full-cache reference
rollout's frames of the same shape, the latent block layout (`block_sizes`, as the stores hold it),
the frame rate and the sink frames. Wan's causal VAE decodes latent frame 0 to pixel frame 0 and
latent frame f >= 1 to pixel frames 4f-3 .. 4f (`frames.video_frames_of_latent`): F latent frames
give T = 1 + 4(F - 1) pixel frames, and a latent block's pixel frames are its latent frames'.

Every value but `sink_distance` (over the median of the video) and the ones relative to the first
block (`colour_drift`, `saturation_drift`) or across a block boundary (`boundary_jump`) comes from
one frame or one pair of consecutive frames, so `VideoMetricAccumulator` takes the frames as
they come (keeping the previous frame, and the sink frames until the last of them has arrived);
`video_metrics` runs it over a whole array. Definitions (x_t: pixel frame t as floats, 0-255):

- `flicker` (t >= 1): mean over pixels and channels of |x_t - x_{t-1}|, on the 0-255 scale:
  VBench's temporal flickering (`vbench/temporal_flickering.py`: `calculate_mae` on consecutive
  frames), before VBench turns it into a score. VBench reports per video
  (255 - mean over t of flicker) / 255 (higher = steadier; `quality_drift`'s `flicker_score`);
  VBench reads frames with OpenCV (BGR, which leaves the mean unchanged) from an encoded file,
  these are the decoded frames themselves.
- `boundary_jump` (first pixel frame p of each block b >= 1): flicker(p), the difference from the
  last pixel frame of block b - 1 to the first of block b, over the mean flicker of the pairs
  inside blocks b - 1 and b (both frames of the pair in the same block). NaN where those blocks
  hold no such pair or where both are 0; inf where only the denominator is 0.
- `mean_r`, `mean_g`, `mean_b`: the channel's mean (0-255). `saturation`: the mean over pixels of
  HSV saturation (max - min) / max of (r, g, b), 0 where max = 0.
- `colour_drift`: the Euclidean distance of (mean_r, mean_g, mean_b) from its mean over the first
  latent block's pixel frames (0-255); `saturation_drift`: saturation minus its mean over those
  frames (signed).
- `sharpness`: the variance (ddof 0) of the Laplacian of the grey frame, grey = 0.299 r +
  0.587 g + 0.114 b (ITU-R BT.601, as OpenCV's RGB2GRAY, unrounded), Laplacian the 3x3 kernel
  [[0, 1, 0], [1, -4, 1], [0, 1, 0]] (OpenCV's `Laplacian` with ksize 1, scipy's `ndimage.laplace`)
  over the interior pixels only (no border assumption); in (grey levels)^2.
- `sink_mae`: mean over pixels and channels of |x_t - s|, s the mean of the sink frames' pixel
  frames (the sink frames: the first `sink_frames` latent frames, by default the first block's);
  `sink_distance` = sink_mae over its median across the pixel frames past the sink frames'
  (NaN where there are none or that median is 0): near 1 is as far as usual, near 0 a frame that
  copies the sinks (LoL's visible collapse).
- `psnr`: 10 log10(255^2 / MSE) against the reference's frame, MSE over pixels and channels; inf
  for identical frames (the CSV holds `inf`, which pandas reads back as float inf).
- `ssim`: scikit-image's `structural_similarity(grey(ref), grey(frame), data_range=255,
  gaussian_weights=True, sigma=1.5, use_sample_covariance=False)`, Wang et al.'s (2004) SSIM of
  the luminance: an 11-tap Gaussian window (sigma 1.5), K1 = 0.01, K2 = 0.03, population
  covariances; the SSIM map's mean over the grey frame (BT.601, as `sharpness`) less a 5-pixel
  border. Frames need at least 11 x 11 pixels.

`psnr` and `ssim` are NaN without a reference.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

import numpy as np
import pandas as pd

from sinkscope.frames import block_of_frame, pixel_frame_count, video_frames_of_latent

FPS = 16  # Wan's decoded frame rate
DRIFT_SECONDS = 5  # Rolling Forcing compares the first and the last 5 s
LUMA_WEIGHTS = (0.299, 0.587, 0.114)  # ITU-R BT.601 grey
SSIM_SETTINGS = {
    "data_range": 255,
    "gaussian_weights": True,
    "sigma": 1.5,
    "use_sample_covariance": False,
}

# One rollout's per-frame columns (`VideoMetricAccumulator.table`).
VIDEO_METRIC_COLUMNS = [
    "rollout",
    "pixel_frame",
    "latent_frame",
    "block",
    "seconds",
    "flicker",
    "boundary_jump",
    "mean_r",
    "mean_g",
    "mean_b",
    "saturation",
    "colour_drift",
    "saturation_drift",
    "sharpness",
    "sink_mae",
    "sink_distance",
    "psnr",
    "ssim",
]
VIDEO_DRIFT_COLUMNS = [
    "rollout",
    "pixel_frames",
    "window_frames",
    "sharpness_first",
    "sharpness_last",
    "sharpness_drift",
    "sharpness_change",
    "flicker_mean",
    "flicker_score",
]
# What names a decoded rollout in the tables the workflow writes: its run, its name (the video's
# file stem: a closed-loop policy, `full`, or `survey`) and how figures label it.
VIDEO_KEYS = ["checkpoint", "prompt", "rollout", "label"]
# results/videos/{checkpoint}/{prompt}/metrics.csv and results/videos/metrics.csv (docs/DATA.md)
VIDEO_TABLE_COLUMNS = VIDEO_KEYS + VIDEO_METRIC_COLUMNS[1:]
# results/videos/drift.csv
VIDEO_DRIFT_TABLE_COLUMNS = VIDEO_KEYS + VIDEO_DRIFT_COLUMNS[1:]
_TEXT_COLUMNS = {"checkpoint": str, "prompt": str, "rollout": str, "label": str}


# --- the frame layout ---------------------------------------------------------------------------


def pixel_frame_layout(block_sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(latent frame, block) of every pixel frame of a rollout of `block_sizes` latent blocks."""
    sizes = [int(size) for size in block_sizes]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"block sizes must be positive, got {sizes}")
    latent = np.concatenate(
        [np.full(len(video_frames_of_latent(k)), k) for k in range(sum(sizes))]
    ).astype(np.int64)
    return latent, block_of_frame(sizes)[latent].astype(np.int64)


def block_pixel_ranges(block_sizes: Sequence[int]) -> list[range]:
    """The pixel frames of each block."""
    _, block = pixel_frame_layout(block_sizes)
    return [range(int(frames[0]), int(frames[-1]) + 1) for frames in _runs(block)]


def _runs(block: np.ndarray) -> list[np.ndarray]:
    return [np.flatnonzero(block == b) for b in range(int(block[-1]) + 1)]


# --- per frame and per pair ---------------------------------------------------------------------


def _check_frame(frame: np.ndarray, name: str = "frame") -> np.ndarray:
    frame = np.asarray(frame)
    if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[-1] != 3:
        raise ValueError(f"{name} must be uint8 [H, W, 3] RGB, got {frame.dtype} {frame.shape}")
    return frame


def frame_difference(previous: np.ndarray, frame: np.ndarray) -> float:
    """Mean over pixels and channels of |frame - previous| (0-255): VBench's per-pair flicker."""
    frame, previous = _check_pair(frame, previous)
    diff = frame.astype(np.int16) - previous.astype(np.int16)
    return float(np.abs(diff).mean(dtype=np.float64))


def channel_means(frame: np.ndarray) -> np.ndarray:
    """Mean of each of R, G, B (0-255), float64 [3]."""
    return _check_frame(frame).reshape(-1, 3).mean(axis=0, dtype=np.float64)


def hsv_saturation(frame: np.ndarray) -> float:
    """Mean over pixels of HSV saturation (max - min) / max of (r, g, b), 0 where max = 0."""
    pixels = _check_frame(frame).reshape(-1, 3)
    high = pixels.max(axis=1).astype(np.float64)
    low = pixels.min(axis=1).astype(np.float64)
    saturation = np.divide(high - low, high, out=np.zeros_like(high), where=high > 0)
    return float(saturation.mean())


def grey(frame: np.ndarray) -> np.ndarray:
    """BT.601 grey, 0.299 r + 0.587 g + 0.114 b, float64 [H, W], unrounded."""
    return _check_frame(frame).astype(np.float64) @ np.asarray(LUMA_WEIGHTS)


def laplacian(image: np.ndarray) -> np.ndarray:
    """The 3x3 Laplacian [[0, 1, 0], [1, -4, 1], [0, 1, 0]] of a 2-D image on its interior
    pixels ([H - 2, W - 2])."""
    image = np.asarray(image, dtype=np.float64)
    if image.ndim != 2 or min(image.shape) < 3:
        raise ValueError(f"need a 2-D image of at least 3 x 3 pixels, got {image.shape}")
    centre = image[1:-1, 1:-1]
    return image[:-2, 1:-1] + image[2:, 1:-1] + image[1:-1, :-2] + image[1:-1, 2:] - 4.0 * centre


def laplacian_variance(frame: np.ndarray) -> float:
    """Sharpness: the variance (ddof 0) of the grey frame's interior Laplacian, (grey levels)^2."""
    return float(laplacian(grey(frame)).var())


def mean_abs_distance(frame: np.ndarray, target: np.ndarray) -> float:
    """Mean over pixels and channels of |frame - target| (0-255); `target` may be float."""
    return float(np.abs(_check_frame(frame).astype(np.float64) - target).mean())


def _check_pair(frame: np.ndarray, reference: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    frame, reference = _check_frame(frame), _check_frame(reference, "reference")
    if frame.shape != reference.shape:
        raise ValueError(f"frame {frame.shape} and reference {reference.shape} differ")
    return frame, reference


def psnr(frame: np.ndarray, reference: np.ndarray) -> float:
    """10 log10(255^2 / MSE) in dB, MSE over pixels and channels; inf for identical frames."""
    frame, reference = _check_pair(frame, reference)
    diff = frame.astype(np.float64) - reference
    mse = float(np.mean(diff * diff))
    return float("inf") if mse == 0 else float(10.0 * np.log10(255.0**2 / mse))


def ssim(frame: np.ndarray, reference: np.ndarray) -> float:
    """scikit-image's SSIM with Wang et al.'s settings (`SSIM_SETTINGS`) of the grey frames
    (`grey`, unrounded, 0-255), as Wang et al. define it on luminance (a third of the work of
    three channels); frames of at least 11 x 11 pixels."""
    from skimage.metrics import structural_similarity

    frame, reference = _check_pair(frame, reference)
    return float(structural_similarity(grey(reference), grey(frame), **SSIM_SETTINGS))


# --- a rollout ----------------------------------------------------------------------------------


class VideoMetricAccumulator:
    """The per-frame table of one rollout, from its pixel frames in order (`add`), each with the
    reference rollout's frame of the same index or None; `table()` once every frame is in.

    Holds the previous frame, the running sum of the sink frames' pixel frames and those frames
    themselves until the last of them has arrived (their `sink_mae` needs the mean of all).
    `sink_frames`: the first S latent frames are the sinks; None: the first block's.
    """

    def __init__(
        self,
        block_sizes: Sequence[int],
        *,
        sink_frames: int | None = None,
        fps: float = FPS,
        rollout: str = "",
    ):
        self.sizes = [int(size) for size in block_sizes]
        self.latent, self.block = pixel_frame_layout(self.sizes)
        self.frames = len(self.latent)
        sinks = self.sizes[0] if sink_frames is None else int(sink_frames)
        if not 1 <= sinks <= sum(self.sizes):
            raise ValueError(f"sink_frames must be 1 .. {sum(self.sizes)}, got {sink_frames}")
        self.sink_pixels = int(np.searchsorted(self.latent, sinks))  # pixel frames 0 .. this - 1
        if fps <= 0:
            raise ValueError(f"fps must be positive, got {fps}")
        self.fps = float(fps)
        self.rollout = rollout
        self.count = 0
        self._previous: np.ndarray | None = None
        self._sink_sum: np.ndarray | None = None
        self._sink_target: np.ndarray | None = None
        self._held: list[np.ndarray] = []
        self._values: dict[str, list[float]] = {
            name: [] for name in ("flicker", "saturation", "sharpness", "sink_mae", "psnr", "ssim")
        }
        self._means: list[np.ndarray] = []

    def add(self, frame: np.ndarray, reference: np.ndarray | None = None) -> None:
        """Takes the next pixel frame (uint8 [H, W, 3] RGB) and the reference's, if any."""
        frame = _check_frame(frame)
        if self.count == self.frames:
            raise ValueError(f"the layout {self.sizes} has only {self.frames} pixel frames")
        if self._previous is not None and frame.shape != self._previous.shape:
            raise ValueError(f"frame {frame.shape} differs from the first {self._previous.shape}")
        values = self._values
        previous = self._previous
        values["flicker"].append(np.nan if previous is None else frame_difference(previous, frame))
        self._means.append(channel_means(frame))
        values["saturation"].append(hsv_saturation(frame))
        values["sharpness"].append(laplacian_variance(frame))
        values["psnr"].append(np.nan if reference is None else psnr(frame, reference))
        values["ssim"].append(np.nan if reference is None else ssim(frame, reference))
        if self._sink_target is None:
            if self._sink_sum is None:
                self._sink_sum = np.zeros(frame.shape, dtype=np.float64)
            self._sink_sum += frame
            self._held.append(frame)
            if len(self._held) == self.sink_pixels:
                self._sink_target = self._sink_sum / self.sink_pixels
                values["sink_mae"] += [mean_abs_distance(f, self._sink_target) for f in self._held]
                self._held, self._sink_sum = [], None
        else:
            values["sink_mae"].append(mean_abs_distance(frame, self._sink_target))
        self._previous = frame
        self.count += 1

    def table(self) -> pd.DataFrame:
        """The rollout's rows, `VIDEO_METRIC_COLUMNS`."""
        if self.count != self.frames:
            raise ValueError(f"{self.count} of the layout's {self.frames} pixel frames added")
        values = {
            name: np.asarray(series, dtype=np.float64) for name, series in self._values.items()
        }
        means = np.stack(self._means)
        first = self.block == 0
        sink_mae = values["sink_mae"]
        past = sink_mae[self.sink_pixels :]
        median = float(np.median(past)) if past.size else np.nan
        sink_distance = sink_mae / median if median > 0 else np.full_like(sink_mae, np.nan)
        table = pd.DataFrame(
            {
                "rollout": self.rollout,
                "pixel_frame": np.arange(self.frames, dtype=np.int64),
                "latent_frame": self.latent,
                "block": self.block,
                "seconds": np.arange(self.frames) / self.fps,
                "flicker": values["flicker"],
                "boundary_jump": boundary_jumps(values["flicker"], self.sizes),
                "mean_r": means[:, 0],
                "mean_g": means[:, 1],
                "mean_b": means[:, 2],
                "saturation": values["saturation"],
                "colour_drift": np.linalg.norm(means - means[first].mean(axis=0), axis=1),
                "saturation_drift": values["saturation"] - values["saturation"][first].mean(),
                "sharpness": values["sharpness"],
                "sink_mae": sink_mae,
                "sink_distance": sink_distance,
                "psnr": values["psnr"],
                "ssim": values["ssim"],
            }
        )
        return table[VIDEO_METRIC_COLUMNS]


def boundary_jumps(flicker: np.ndarray, block_sizes: Sequence[int]) -> np.ndarray:
    """Per pixel frame: on the first frame p of each block b >= 1, flicker[p] over the mean
    flicker of the pairs inside blocks b - 1 and b; NaN elsewhere, NaN where those blocks have no
    such pair or both numbers are 0, inf where only the mean inside is 0. `flicker[t]`: the
    difference of frames t - 1 and t (`frame_difference`), flicker[0] unused."""
    flicker = np.asarray(flicker, dtype=np.float64)
    ranges = block_pixel_ranges(block_sizes)
    if len(flicker) != ranges[-1].stop:
        raise ValueError(f"{len(flicker)} flicker values for {ranges[-1].stop} pixel frames")
    jumps = np.full(len(flicker), np.nan)
    for before, after in itertools.pairwise(ranges):
        inside = np.concatenate([flicker[before.start + 1 : before.stop], flicker[after][1:]])
        jump = flicker[after.start]
        if inside.size == 0:
            continue
        mean = float(inside.mean())
        if mean > 0:
            jumps[after.start] = jump / mean
        elif jump > 0:
            jumps[after.start] = np.inf
    return jumps


def video_metrics(
    frames: np.ndarray,
    block_sizes: Sequence[int],
    *,
    reference: np.ndarray | None = None,
    sink_frames: int | None = None,
    fps: float = FPS,
    rollout: str = "",
) -> pd.DataFrame:
    """The per-frame table (`VIDEO_METRIC_COLUMNS`) of one rollout's frames, uint8
    [T, H, W, 3] RGB with T = 1 + 4(F - 1) for the F latent frames of `block_sizes`, against
    `reference` (the full-cache rollout's frames, the same shape) where given."""
    frames = np.asarray(frames)
    if frames.ndim != 4:
        raise ValueError(f"frames must be [T, H, W, 3], got {frames.shape}")
    if reference is not None and np.shape(reference) != frames.shape:
        raise ValueError(f"reference {np.shape(reference)} and frames {frames.shape} differ")
    expected = pixel_frame_count(sum(int(size) for size in block_sizes))
    if len(frames) != expected:
        raise ValueError(
            f"{len(frames)} pixel frames, but the blocks {list(block_sizes)} decode to {expected}"
        )
    accumulator = VideoMetricAccumulator(
        block_sizes, sink_frames=sink_frames, fps=fps, rollout=rollout
    )
    for t, frame in enumerate(frames):
        accumulator.add(frame, None if reference is None else reference[t])
    return accumulator.table()


def drift_window(pixel_frames: int, fps: float = FPS, seconds: float = DRIFT_SECONDS) -> int:
    """Frames in each of the quality-drift windows: min(round(seconds x fps), T // 2), so that
    the first and the last window never overlap (80 at 16 fps for a video of 160 frames or more)."""
    return min(round(seconds * fps), pixel_frames // 2)


def quality_drift(
    table: pd.DataFrame, *, fps: float = FPS, seconds: float = DRIFT_SECONDS
) -> pd.DataFrame:
    """One row per rollout of a per-frame table (`VIDEO_DRIFT_COLUMNS`): the mean sharpness of
    the first and of the last `drift_window` pixel frames, their absolute difference (the
    quality drift as Rolling Forcing reports it, first 5 s against last 5 s, here of sharpness)
    and last / first - 1; the mean flicker and VBench's score of it, (255 - mean) / 255."""
    keys = [key for key in VIDEO_KEYS if key in table.columns]
    rows = []
    for key, frames in table.groupby(keys, sort=False):
        frames = frames.sort_values("pixel_frame")
        window = drift_window(len(frames), fps, seconds)
        sharpness = frames["sharpness"].to_numpy(dtype=np.float64)
        first = float(sharpness[:window].mean()) if window else np.nan
        last = float(sharpness[-window:].mean()) if window else np.nan
        flicker = frames["flicker"].to_numpy(dtype=np.float64)[1:]
        flicker_mean = float(flicker.mean()) if flicker.size else np.nan
        rows.append(
            {
                **dict(zip(keys, key, strict=True)),
                "pixel_frames": len(frames),
                "window_frames": window,
                "sharpness_first": first,
                "sharpness_last": last,
                "sharpness_drift": abs(last - first),
                "sharpness_change": last / first - 1 if first > 0 else np.nan,
                "flicker_mean": flicker_mean,
                "flicker_score": (255.0 - flicker_mean) / 255.0,
            }
        )
    return pd.DataFrame(rows, columns=keys + VIDEO_DRIFT_COLUMNS[1:])


def read_video_metrics(paths) -> pd.DataFrame:
    """The per-frame tables `paths` (`VIDEO_TABLE_COLUMNS`, a run's or the stacked one), stacked;
    a missing column, no rows or a (run, rollout, pixel frame) given twice is refused, the file
    named."""
    paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    tables = []
    for path in paths:
        try:
            table = pd.read_csv(path, dtype=_TEXT_COLUMNS, keep_default_na=False, na_values=[""])
        except FileNotFoundError:
            raise FileNotFoundError(f"video metrics not found: {path}") from None
        missing = [column for column in VIDEO_TABLE_COLUMNS if column not in table.columns]
        if missing:
            raise ValueError(
                f"{path}: no columns {missing} (a video metrics table has {VIDEO_TABLE_COLUMNS})"
            )
        if table.empty:
            raise ValueError(f"{path}: no rows")
        tables.append(table[VIDEO_TABLE_COLUMNS])
    if not tables:
        raise ValueError("no video metrics tables given")
    stacked = pd.concat(tables, ignore_index=True)
    twice = stacked.duplicated(["checkpoint", "prompt", "rollout", "pixel_frame"])
    if twice.any():
        row = stacked[twice].iloc[0]
        raise ValueError(
            f"{row['checkpoint']}/{row['prompt']} rollout {row['rollout']} frame "
            f"{row['pixel_frame']} is in the video metrics twice ({[str(p) for p in paths]})"
        )
    return stacked


def write_video_tables(
    paths, metrics: str | os.PathLike, drift: str | os.PathLike, *, fps: float = FPS
) -> pd.DataFrame:
    """The runs' per-frame tables `paths` stacked into `metrics` (results/videos/metrics.csv)
    and their quality drift, one row per rollout, into `drift` (results/videos/drift.csv),
    each atomically; returns the stacked table."""
    from sinkscope.storage import write_csv

    table = read_video_metrics(paths)
    write_csv(metrics, table)
    drifts = quality_drift(table, fps=fps)
    write_csv(drift, drifts[VIDEO_DRIFT_TABLE_COLUMNS])
    return table
