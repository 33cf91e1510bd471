"""Side-by-side videos: every rollout of a run in one frame, each tile labelled.

`GridComposer` lays out n tiles of one size in a grid of ceil(sqrt(n)) columns, each under a
label band (the rollout's name, e.g. 'window B=9'), below a header band (the run and a frame
counter: latent frame, pixel frame, seconds). A tile's band turns red from the rollout's first
eviction on (the first latent frame whose block saw a cache that had dropped keys) and says
'evicting'. Tiles are resized to `tile_width` (nearest when enlarged, so a tiny demo frame stays
sharp-edged; area-averaged when reduced, so a 480 x 832 frame does not alias); the composed
frame's sides are even (H.264 yuv420p).

Text is drawn with Pillow (matplotlib's own image dependency) in its bundled scalable font, so
no system font is needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from sinkscope.frames import pixel_frame_count

MAX_WIDTH = 1920  # the composed frame's width at most (a full-HD screen)
MIN_TILE_WIDTH = 192  # tiles narrower than this are enlarged (whole multiples)
BACKGROUND = (16, 16, 16)
BAND = (48, 48, 48)
EVICTING_BAND = (170, 20, 20)
TEXT = (240, 240, 240)
GAP = 4  # pixels between tiles


def _even(value: float) -> int:
    return max(2, int(value) // 2 * 2)


@dataclass(frozen=True)
class GridTile:
    """One rollout of the grid: its label and the latent frame from which it evicts (or None)."""

    label: str
    evicting_from: int | None = None


class GridComposer:
    """Composes the grid frame of one pixel frame of every rollout (`compose`)."""

    def __init__(
        self,
        tiles: Sequence[GridTile],
        frame_size: tuple[int, int],
        *,
        title: str = "",
        max_width: int = MAX_WIDTH,
    ):
        if not tiles:
            raise ValueError("a grid needs at least one rollout")
        height, width = (int(side) for side in frame_size)
        if height < 1 or width < 1:
            raise ValueError(f"frames of {height} x {width}")
        self.tiles = list(tiles)
        self.title = title
        self.columns = math.ceil(math.sqrt(len(self.tiles)))
        self.rows = math.ceil(len(self.tiles) / self.columns)
        # Enlarge small frames by whole multiples; shrink large ones to fit max_width.
        scale = max(1, math.ceil(MIN_TILE_WIDTH / width))
        tile_width = min(width * scale, (max_width - GAP * (self.columns + 1)) // self.columns)
        self.tile_width = _even(tile_width)
        self.tile_height = _even(round(height * self.tile_width / width))
        self.enlarge = self.tile_width >= width
        self.band = _even(max(16, round(self.tile_width / 14)))
        self.font = ImageFont.load_default(size=int(self.band * 0.7))
        self.header = self.band + 2
        cell_height = self.band + self.tile_height
        self.width = _even(self.columns * (self.tile_width + GAP) + GAP)
        self.height = _even(self.header + self.rows * (cell_height + GAP) + GAP)
        self._blank: dict[tuple[bool, ...], np.ndarray] = {}

    def cell_origin(self, index: int) -> tuple[int, int]:
        """(top, left) of tile `index`'s label band in the composed frame."""
        row, column = divmod(index, self.columns)
        top = self.header + GAP + row * (self.band + self.tile_height + GAP)
        left = GAP + column * (self.tile_width + GAP)
        return top, left

    def evicting(self, index: int, latent_frame: int) -> bool:
        start = self.tiles[index].evicting_from
        return start is not None and latent_frame >= start

    def compose(
        self, frames: Sequence[np.ndarray], *, latent_frame: int, pixel_frame: int, counter: str
    ) -> np.ndarray:
        """The grid frame [height, width, 3] uint8 of one uint8 frame [H, W, 3] per tile, the
        header saying `counter` (`frame_counter`: 'latent 12 / 42 · frame 45 / 165 · 2.75 s')."""
        if len(frames) != len(self.tiles):
            raise ValueError(f"{len(frames)} frames for {len(self.tiles)} tiles")
        evicting = tuple(self.evicting(index, latent_frame) for index in range(len(self.tiles)))
        canvas = Image.fromarray(self._bands(evicting))  # a copy: the cached one stays blank
        draw = ImageDraw.Draw(canvas)
        draw.text(
            (self.width - GAP, self.header // 2), counter, fill=TEXT, font=self.font, anchor="rm"
        )
        resample = Image.Resampling.NEAREST if self.enlarge else Image.Resampling.BOX
        for index, frame in enumerate(frames):
            top, left = self.cell_origin(index)
            image = Image.fromarray(np.ascontiguousarray(frame))
            image = image.resize((self.tile_width, self.tile_height), resample)
            canvas.paste(image, (left, top + self.band))
        return np.asarray(canvas)

    def _bands(self, evicting: tuple[bool, ...]) -> np.ndarray:
        """The frame without tiles and counter: background, title and every label band in its
        state; drawn once per state (a video has at most one more state than tiles), since
        rendering text is most of a composition's time."""
        if evicting not in self._blank:
            canvas = Image.new("RGB", (self.width, self.height), BACKGROUND)
            draw = ImageDraw.Draw(canvas)
            text_y = self.header // 2
            draw.text((GAP, text_y), self.title, fill=TEXT, font=self.font, anchor="lm")
            for index, (tile, evicts) in enumerate(zip(self.tiles, evicting, strict=True)):
                top, left = self.cell_origin(index)
                draw.rectangle(
                    (left, top, left + self.tile_width - 1, top + self.band - 1),
                    fill=EVICTING_BAND if evicts else BAND,
                )
                label = f"{tile.label} · evicting" if evicts else tile.label
                draw.text(
                    (left + 4, top + self.band // 2), label, fill=TEXT, font=self.font, anchor="lm"
                )
            self._blank[evicting] = np.asarray(canvas)
        return self._blank[evicting]


def frame_counter(latent_frame: int, latent_frames: int, pixel_frame: int, fps: float) -> str:
    """The header's counter: 'latent 12 / 42 · frame 45 / 165 · 2.81 s' (1-based counts, the
    time of the pixel frame from 0)."""
    return (
        f"latent {latent_frame + 1} / {latent_frames} · frame {pixel_frame + 1} / "
        f"{pixel_frame_count(latent_frames)} · {pixel_frame / fps:.2f} s"
    )
