"""Rollouts as videos: uint8 frames [H, W, 3] streamed into an H.264 mp4 (yuv420p, 16 fps).

Written with PyAV (`av`), whose wheels ship FFmpeg's libraries with libx264: the frames go to the
encoder in this process, one at a time, as they are decoded (no ffmpeg subprocess and no pipe to
feed and watch, errors raised as exceptions where the frame is written, every frame given an
exact timestamp). imageio-ffmpeg's wheel ships an ffmpeg binary with libx264 as well, but drives
it through a pipe. Both encoders are the same libx264 (GPL, as the wheel's FFmpeg build is; it is
used, never shipped, by sinkscope). Memory: the frame being written, plus the encoder's own
lookahead (a few dozen frames in yuv420p at the default preset), never the whole video.

- Size: yuv420p halves the chroma, so both sides must be even. A frame whose shorter side is
  under `min_side` (128 by default; a demo's frames are a few pixels across) is first scaled
  up by the smallest integer factor that reaches it, nearest neighbour (each pixel a solid
  square, so a person can see a tiny video and nothing is interpolated); an odd side is then
  made even by repeating its last row (at the bottom) or column (at the right): black there
  would bleed into the last real row's or column's colour, as yuv420p shares each chroma sample
  between two rows and two columns. libx264 itself encodes down to 2 x 2; the scaling is for the
  viewer. `encoded_size` gives the size and the factor.
- Quality: `crf` 18 by default (libx264's scale: 0 lossless, 23 its default, 51 worst), about
  visually lossless; the tests write at a lower crf to bound the round trip's error.
- Colour: RGB -> yuv420p here, in numpy (`yuv420`): BT.709 coefficients, limited range, chroma
  sited where H.264 puts it by default (left: on the even columns, between the rows), and the
  stream tagged so (primaries, transfer, matrix, range). swscale's RGB -> yuv420p would site the
  chroma half a pixel off what the decoder assumes (a mean round-trip error of ~1 level on
  smooth colour instead of ~0.4). `read_frames` converts back as the tags and siting say.
- Atomic (`storage.atomic_path`): the video is written to `<path>.partial` and renamed to `path`
  on a clean close; an exception removes the partial, and a kill leaves only the partial (which
  the next write of that path removes), never a file at `path`. The mp4's index is moved to the
  front on close (`+faststart`) so a browser starts playing before it has the whole file.

`read_video_info` and `read_frames` read a video back (the tests' round trip, later checks).
Numpy, av and `storage` only: shared by the GPU jobs and the analysis alike; no torch.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from av.video.reformatter import ColorPrimaries, ColorRange, Colorspace, ColorTrc, Interpolation

from sinkscope.storage import atomic_path

CODEC = "libx264"
PIXEL_FORMAT = "yuv420p"
FPS = 16
CRF = 18
# veryfast: twice medium's speed at CRF 18 for 2 % more bytes on the demo's frames; a long video
# decodes 7 rollouts of thousands of frames, and these are for watching, not for archiving.
PRESET = "veryfast"
MIN_SIDE = 128
PARTIAL_SUFFIX = ".partial"
# What the stream says its frames are: BT.709 primaries, transfer and matrix, limited range.
_COLOUR = {
    "colorspace": Colorspace.ITU709,
    "color_range": ColorRange.MPEG,
    "color_trc": ColorTrc.BT709,
    "color_primaries": ColorPrimaries.BT709,
}
_KR, _KB = 0.2126, 0.0722  # BT.709 luma coefficients
# Back to RGB: swscale's default rounds coarsely and repeats each chroma sample across two
# columns; accurate rounding and full chroma interpolation keep the round trip within a level.
_TO_RGB = Interpolation.BILINEAR | Interpolation.ACCURATE_RND | Interpolation.FULL_CHR_H_INT


@dataclass(frozen=True)
class VideoInfo:
    """What a video file holds: `fps` exact (a Fraction), `codec` the decoder's name ('h264')."""

    frames: int
    fps: Fraction
    width: int
    height: int
    codec: str
    pixel_format: str


def encoded_size(height: int, width: int, min_side: int = MIN_SIDE) -> tuple[int, int, int]:
    """(height, width, scale) of the video that frames of `height` x `width` make: scaled up by
    the integer `scale` until the shorter side is at least `min_side`, then an odd side padded by
    one row or column (a copy of the last)."""
    if height < 1 or width < 1:
        raise ValueError(f"a frame needs at least one pixel, got {height} x {width}")
    scale = max(1, math.ceil(min_side / min(height, width)))
    height, width = height * scale, width * scale
    return height + height % 2, width + width % 2, scale


def yuv420(frame: np.ndarray, scale: int = 1, size: tuple[int, int] | None = None) -> np.ndarray:
    """A uint8 RGB frame [H, W, 3] (H, W even) -> its yuv420p planes stacked [3H/2, W] (Y, then
    Cb and Cr, each [H/2, W/2] laid out as W-wide rows): BT.709, limited range (Y 16-235, C
    16-240), each chroma sample on an even column ([1, 2, 1] / 4 across it) and between two rows
    (their mean), as H.264's default (left) chroma siting puts it.

    `scale` and `size` (height, width): the planes of the frame first repeated `scale` times
    along both axes and then brought to `size` by repeating its last row and column, bit for bit
    what converting that enlarged frame gives: the per-pixel arithmetic runs before the
    enlargement, on scale^2 fewer pixels."""
    rgb = frame.astype(np.float32) / 255
    luma = _KR * rgb[..., 0] + (1 - _KR - _KB) * rgb[..., 1] + _KB * rgb[..., 2]
    full = [luma] + [
        (rgb[..., channel] - luma) / (2 * (1 - k)) for channel, k in ((2, _KB), (0, _KR))
    ]  # Y, Cb, Cr before the chroma subsampling
    if scale > 1:
        full = [plane.repeat(scale, axis=0).repeat(scale, axis=1) for plane in full]
    height, width = size or full[0].shape
    if (height, width) != full[0].shape:
        pad = ((0, height - full[0].shape[0]), (0, width - full[0].shape[1]))
        full = [np.pad(plane, pad, mode="edge") for plane in full]
    planes = [16 + 219 * full[0]]
    for chroma in full[1:]:
        chroma = 0.5 * (chroma[0::2] + chroma[1::2])
        edged = np.pad(chroma, ((0, 0), (1, 1)), mode="edge")
        chroma = 0.25 * edged[:, 0:-2:2] + 0.5 * edged[:, 1:-1:2] + 0.25 * edged[:, 2::2]
        planes.append(128 + 224 * chroma)
    stacked = np.concatenate([plane.ravel() for plane in planes]).reshape(height * 3 // 2, width)
    return np.rint(stacked).clip(0, 255).astype(np.uint8)


class VideoWriter:
    """An H.264 mp4 written frame by frame: `write` takes a uint8 frame [H, W, 3] (RGB) or a
    chunk of them [T, H, W, 3] (a numpy array or anything `np.asarray` takes, e.g. a CPU tensor;
    a GPU tensor goes to the CPU first), `write_all` an iterable of those, consumed one at a time.
    The first frame fixes the size; every later one must match it.

        with VideoWriter(path) as video:
            for frames in decoded_chunks():
                video.write(frames)

    `path` appears only when the block ends without an exception and at least one frame was
    written; `crf` and `preset` are libx264's.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        fps: int | Fraction = FPS,
        crf: int = CRF,
        preset: str = PRESET,
        min_side: int = MIN_SIDE,
    ):
        fps = Fraction(fps)
        if fps <= 0:
            raise ValueError(f"fps must be positive, got {fps}")
        if not 0 <= crf <= 51:
            raise ValueError(f"crf must be in 0..51 (libx264's scale), got {crf}")
        self.path = Path(path)
        self.fps = fps
        self.crf = crf
        self.preset = preset
        self.min_side = min_side
        self.frames_written = 0
        self.frame_size: tuple[int, int] | None = None  # (height, width) as given
        self._stack: contextlib.ExitStack | None = None
        self._container = None
        self._stream = None
        self._scale = 1
        self._size: tuple[int, int] = (0, 0)  # (height, width) encoded

    def __enter__(self) -> VideoWriter:
        with contextlib.ExitStack() as stack:
            partial = stack.enter_context(atomic_path(self.path, PARTIAL_SUFFIX))
            # The partial's name does not say mp4; the muxer is named instead.
            self._container = av.open(
                str(partial), "w", format="mp4", options={"movflags": "+faststart"}
            )
            stack.callback(self._container.close)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        stack, self._stack = self._stack, None
        if kind is not None:
            # Closes the container, then atomic_path removes the partial; the error goes on.
            return stack.__exit__(kind, error, traceback)
        with stack:  # a failure here removes the partial as well
            if not self.frames_written:
                raise ValueError(f"no frames written to {self.path}")
            for packet in self._stream.encode():  # the encoder's delayed frames
                self._container.mux(packet)
        return False

    def write(self, frames) -> None:
        """Encode one uint8 frame [H, W, 3] or a chunk [T, H, W, 3]."""
        if self._stack is None:
            raise RuntimeError("VideoWriter.write outside its `with` block")
        frames = np.asarray(frames)
        if frames.ndim == 3:
            self._encode(frames)
        elif frames.ndim == 4:
            for frame in frames:
                self._encode(frame)
        else:
            raise ValueError(
                f"expected a frame [H, W, 3] or frames [T, H, W, 3], got shape {frames.shape}"
            )

    def write_all(self, frames: Iterable) -> None:
        """Encode frames (or chunks of them) as the iterable gives them."""
        for chunk in frames:
            self.write(chunk)

    def _encode(self, frame: np.ndarray) -> None:
        if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
            raise ValueError(
                f"a frame must be uint8 [H, W, 3] (RGB), got {frame.dtype} {list(frame.shape)}"
            )
        if self._stream is None:
            self._open_stream(*frame.shape[:2])
        elif frame.shape[:2] != self.frame_size:
            raise ValueError(
                f"frame {self.frames_written} of {self.path} is {frame.shape[0]} x "
                f"{frame.shape[1]}, the video's frames {self.frame_size[0]} x {self.frame_size[1]}"
            )
        planes = yuv420(frame, self._scale, self._size)
        picture = av.VideoFrame.from_ndarray(planes, format=PIXEL_FORMAT)
        for name, value in _COLOUR.items():
            setattr(picture, name, value)
        picture.pts = self.frames_written
        for packet in self._stream.encode(picture):
            self._container.mux(packet)
        self.frames_written += 1

    def _open_stream(self, height: int, width: int) -> None:
        self.frame_size = (height, width)
        *self._size, self._scale = encoded_size(height, width, self.min_side)
        stream = self._container.add_stream(
            CODEC, rate=self.fps, options={"crf": str(self.crf), "preset": self.preset}
        )
        stream.height, stream.width = self._size
        stream.pix_fmt = PIXEL_FORMAT
        stream.time_base = 1 / self.fps
        for name, value in _COLOUR.items():
            setattr(stream.codec_context, name, value)
        self._stream = stream
        # The header now, not at libx264's first packet (after its lookahead): the partial is
        # there from the first frame on.
        self._container.start_encoding()


def write_video(path: str | os.PathLike, frames: Iterable, **options) -> Path:
    """Write `frames` (frames or chunks, as `VideoWriter.write` takes them) to `path`."""
    with VideoWriter(path, **options) as video:
        video.write_all(frames)
    return Path(path)


def read_video_info(path: str | os.PathLike) -> VideoInfo:
    """Frame count, exact frame rate, size, codec and pixel format of a video's first video
    stream (frames counted from its packets where the container does not say)."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        context = stream.codec_context
        return VideoInfo(
            frames=frames,
            fps=Fraction(stream.average_rate or stream.guessed_rate),
            width=context.width,
            height=context.height,
            codec=context.name,
            pixel_format=context.pix_fmt,
        )


def read_frames(path: str | os.PathLike) -> Iterator[np.ndarray]:
    """The decoded frames of a video's first video stream, one uint8 RGB [H, W, 3] at a time
    (converted as the stream's colour tags say)."""
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            yield frame.to_ndarray(format="rgb24", interpolation=_TO_RGB)


def read_frames_at(path: str | os.PathLike, indices: Iterable[int]) -> dict[int, np.ndarray]:
    """Frames `indices` of a video's first video stream (uint8 RGB [H, W, 3] each, as
    `read_frames` gives them), decoded in order up to the last one wanted; only those are
    converted to RGB (the conversion, not the decode, is most of a small frame's time)."""
    wanted = {int(index) for index in indices}
    found: dict[int, np.ndarray] = {}
    if not wanted:
        return found
    last = max(wanted)
    with av.open(str(path)) as container:
        for index, frame in enumerate(container.decode(video=0)):
            if index in wanted:
                found[index] = frame.to_ndarray(format="rgb24", interpolation=_TO_RGB)
            if index >= last:
                break
    return found


def write_video_page(
    video: str | os.PathLike, page: str | os.PathLike, *, title: str, note: str = ""
) -> Path:
    """An HTML page that plays `video` inline (the mp4's bytes in the page, base64), so that a
    self-contained report (Snakemake's shows an HTML result in a frame, an mp4 only as a
    download) plays it; written atomically."""
    import base64
    import html

    data = base64.b64encode(Path(video).read_bytes()).decode("ascii")
    info = read_video_info(video)
    text = (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>"
        "<style>body{margin:0;background:#111;color:#eee;font:14px sans-serif}"
        "video{display:block;max-width:100%;height:auto;margin:0 auto}"
        "p{margin:6px 10px}</style></head><body>\n"
        f"<p>{html.escape(title)}: {info.frames} frames, {info.width} x {info.height}, "
        f"{float(info.fps):g} fps. {html.escape(note)}</p>\n"
        f"<video controls loop muted playsinline width='{info.width}' height='{info.height}' "
        f"src='data:video/mp4;base64,{data}'></video>\n</body></html>\n"
    )
    with atomic_path(page) as temporary:
        temporary.write_text(text)
    return Path(page)
