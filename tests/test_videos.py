"""Rollouts as H.264 videos (`sinkscope.videos`): the round trip, streaming, atomic writes, sizes.

H.264 is lossy and yuv420p halves the chroma, so decoded frames are compared within a tolerance:
on smooth content, the mean absolute difference over a frame's pixels and channels stays under
1.5 levels (of 255) at crf 10 and under 2.5 at the default crf 18 (measured: ~0.7 and ~1.0).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import weakref
from fractions import Fraction

import numpy as np
import pytest

from sinkscope.storage import temporary_path
from sinkscope.videos import (
    MIN_SIDE,
    PARTIAL_SUFFIX,
    VideoInfo,
    VideoWriter,
    encoded_size,
    read_frames,
    read_video_info,
    write_video,
    yuv420,
)

FRAMES = 20


def smooth_frames(count: int, height: int, width: int, seed: int = 0):
    """Random but smooth RGB frames: per channel a few low-frequency waves of random direction
    and phase, drifting from frame to frame (as a rollout's content moves)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    waves = [
        (rng.uniform(-0.05, 0.05, 2), rng.uniform(0, 2 * np.pi), rng.uniform(0.1, 0.3))
        for _ in range(3 * 3)
    ]
    for t in range(count):
        channels = []
        for c in range(3):
            value = np.full((height, width), 128, np.float32)
            for (fy, fx), phase, speed in waves[3 * c : 3 * c + 3]:
                value += 35 * np.sin(fy * y + fx * x + phase + speed * t)
            channels.append(value)
        yield np.stack(channels, axis=-1).clip(0, 255).astype(np.uint8)


def mean_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


@pytest.mark.parametrize(("crf", "tolerance"), [(10, 1.5), (None, 2.5)])
def test_frames_round_trip_through_an_h264_yuv420p_mp4_at_16_fps(tmp_path, crf, tolerance):
    path = tmp_path / "rollout.mp4"
    written = list(smooth_frames(FRAMES, 128, 160))
    options = {} if crf is None else {"crf": crf}
    assert write_video(path, written, **options) == path
    assert read_video_info(path) == VideoInfo(
        frames=FRAMES, fps=Fraction(16), width=160, height=128, codec="h264", pixel_format="yuv420p"
    )
    decoded = list(read_frames(path))
    assert len(decoded) == FRAMES
    assert all(frame.dtype == np.uint8 and frame.shape == (128, 160, 3) for frame in decoded)
    errors = [mean_abs_diff(a, b) for a, b in zip(written, decoded, strict=True)]
    assert max(errors) < tolerance, errors
    assert not temporary_path(path, PARTIAL_SUFFIX).exists()


def test_another_frame_rate_is_written_exactly(tmp_path):
    path = write_video(tmp_path / "v.mp4", smooth_frames(6, 128, 128), fps=Fraction(24000, 1001))
    info = read_video_info(path)
    assert (info.frames, info.fps) == (6, Fraction(24000, 1001))


def test_frames_stream_through_one_at_a_time(tmp_path):
    """From a generator, each frame is encoded before the next is asked for, and the writer
    keeps no frame it was given: at most the one before is still alive."""
    alive: list[weakref.ref] = []
    seen = []

    def frames():
        for i, frame in enumerate(smooth_frames(FRAMES, 128, 128)):
            seen.append((i, video.frames_written, sum(ref() is not None for ref in alive)))
            alive.append(weakref.ref(frame))
            yield frame
            del frame

    with VideoWriter(tmp_path / "v.mp4") as video:
        video.write_all(frames())
    assert [written for _, written, _ in seen] == list(range(FRAMES))
    assert max(count for _, _, count in seen) <= 1, seen
    assert read_video_info(tmp_path / "v.mp4").frames == FRAMES


def test_a_chunk_of_frames_is_written_frame_by_frame(tmp_path):
    chunks = [np.stack(list(smooth_frames(4, 128, 128, seed))) for seed in range(3)]
    with VideoWriter(tmp_path / "v.mp4") as video:
        for chunk in chunks:
            video.write(chunk)
        video.write(chunks[0][0])
    assert video.frames_written == 13
    assert read_video_info(tmp_path / "v.mp4").frames == 13


def test_a_failure_mid_write_leaves_neither_the_video_nor_its_partial(tmp_path):
    path = tmp_path / "v.mp4"
    partial = temporary_path(path, PARTIAL_SUFFIX)

    def frames():
        yield from smooth_frames(5, 128, 128)
        assert partial.is_file() and partial.stat().st_size > 0
        assert not path.exists()
        raise RuntimeError("decoder died")

    with pytest.raises(RuntimeError, match="decoder died"):
        write_video(path, frames())
    assert not path.exists() and not partial.exists()
    assert list(tmp_path.iterdir()) == []


def test_a_killed_write_leaves_only_the_partial_which_the_next_write_replaces(tmp_path):
    path = tmp_path / "v.mp4"
    partial = temporary_path(path, PARTIAL_SUFFIX)
    killed = textwrap.dedent(
        f"""
        import os, signal
        import numpy as np
        from sinkscope.videos import VideoWriter
        with VideoWriter({str(path)!r}) as video:
            for i in range(5):
                video.write(np.full((128, 128, 3), 40 * i, np.uint8))
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    run = subprocess.run([sys.executable, "-c", killed], check=False)
    assert run.returncode == -signal.SIGKILL
    assert partial.is_file() and not path.exists()
    write_video(path, smooth_frames(3, 128, 128))
    assert read_video_info(path).frames == 3
    assert not partial.exists()


def test_a_video_without_frames_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no frames written"), VideoWriter(tmp_path / "v.mp4"):
        pass
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (np.zeros((128, 128, 3), np.float32), r"uint8 \[H, W, 3\].*float32 \[128, 128, 3\]"),
        (np.zeros((128, 128, 4), np.uint8), r"uint8 \[128, 128, 4\]"),
        (np.zeros((128, 128), np.uint8), r"got shape \(128, 128\)"),
        (np.zeros((130, 128, 3), np.uint8), "frame 1 of .* is 130 x 128, the video's frames 128 x"),
    ],
)
def test_a_frame_of_another_kind_or_size_is_refused_and_nothing_written(tmp_path, frame, message):
    with pytest.raises(ValueError, match=message), VideoWriter(tmp_path / "v.mp4") as video:
        video.write(np.zeros((128, 128, 3), np.uint8))
        video.write(frame)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("size", "min_side", "expected"),
    [
        ((480, 832), MIN_SIDE, (480, 832, 1)),  # Wan's videos: as they are
        ((8, 16), MIN_SIDE, (128, 256, 16)),  # a demo video, scaled up
        ((3, 5), MIN_SIDE, (130, 216, 43)),  # 129 x 215 after scaling, padded
        ((131, 67), 64, (132, 68, 1)),  # odd sides padded
        ((5, 6), MIN_SIDE, (130, 156, 26)),
        ((1, 1), MIN_SIDE, (128, 128, 128)),
        ((2, 2), 0, (2, 2, 1)),  # libx264's smallest
    ],
)
def test_encoded_size_scales_tiny_frames_up_and_pads_odd_sides(size, min_side, expected):
    assert encoded_size(*size, min_side=min_side) == expected


def test_a_tiny_odd_video_is_scaled_up_nearest_neighbour_and_padded(tmp_path):
    rng = np.random.default_rng(1)
    written = [rng.integers(30, 226, (3, 5, 3), dtype=np.uint8) for _ in range(4)]
    path = write_video(tmp_path / "tiny.mp4", written, crf=10)
    height, width, scale = encoded_size(3, 5)
    info = read_video_info(path)
    assert (info.height, info.width, info.frames) == (height, width, 4) == (130, 216, 4)
    for frame, back in zip(written, read_frames(path), strict=True):
        # Each pixel is a solid scale x scale square: its middle decodes to the pixel's colour.
        squares = back[: 3 * scale, : 5 * scale].reshape(3, scale, 5, scale, 3)
        middles = squares[:, 8:-8, :, 8:-8].astype(np.float32).mean(axis=(1, 3))
        assert np.abs(middles - frame).max() < 4
        # The padding row and column repeat the last ones.
        assert mean_abs_diff(back[-1], back[-2]) < 1 and mean_abs_diff(back[:, -1], back[:, -2]) < 1


def test_an_odd_frame_is_padded_by_a_copy_of_its_last_row_and_column(tmp_path):
    written = list(smooth_frames(3, 131, 67))
    path = write_video(tmp_path / "odd.mp4", written, crf=10, min_side=64)
    info = read_video_info(path)
    assert (info.height, info.width) == (132, 68)
    for frame, back in zip(written, read_frames(path), strict=True):
        assert mean_abs_diff(back[:131, :67], frame) < 1.5
        assert mean_abs_diff(back[131, :67], frame[130]) < 2
        assert mean_abs_diff(back[:131, 67], frame[:, 66]) < 2


def test_yuv420_is_bt709_limited_range():
    frame = np.zeros((2, 4, 3), np.uint8)
    frame[:, :2] = 255  # white | black
    planes = yuv420(frame)
    assert planes.shape == (3, 4)
    luma, chroma = planes[:2], planes[2:].reshape(-1)
    assert luma.tolist() == [[235, 235, 16, 16]] * 2
    assert chroma.tolist() == [128] * 4  # grey has no chroma
    red = yuv420(np.broadcast_to(np.array([255, 0, 0], np.uint8), (2, 2, 3)).copy())
    # BT.709: Y = 16 + 219 * 0.2126, Cb = 128 - 224 * 0.2126 / 1.8556, Cr = 128 + 112
    assert red.reshape(-1).tolist() == [63, 63, 63, 63, 102, 240]


@pytest.mark.parametrize("shape, scale", [((4, 6), 1), ((5, 7), 1), ((6, 10), 2), ((5, 9), 3)])
def test_yuv420_of_a_small_frame_equals_that_of_the_enlarged_frame(shape, scale):
    """The writer converts before enlarging: bit for bit the planes of the enlarged frame."""
    frame = np.random.default_rng(scale).integers(0, 256, (*shape, 3), dtype=np.uint8)
    big = frame.repeat(scale, axis=0).repeat(scale, axis=1)
    height, width = big.shape[0] + big.shape[0] % 2, big.shape[1] + big.shape[1] % 2
    big = np.pad(big, ((0, height - big.shape[0]), (0, width - big.shape[1]), (0, 0)), "edge")
    np.testing.assert_array_equal(yuv420(frame, scale, (height, width)), yuv420(big))
