"""The side-by-side grid (sinkscope.video_grid): its layout worked out by hand, each tile's
pixels against its frame resized independently, the label band's colour switching at the first
eviction, and the header's frame counter."""

from __future__ import annotations

import numpy as np
import pytest

from sinkscope.video_grid import (
    BACKGROUND,
    BAND,
    EVICTING_BAND,
    GAP,
    MAX_WIDTH,
    GridComposer,
    GridTile,
    frame_counter,
)


def tiles(count: int, evicting_from=None) -> list[GridTile]:
    return [GridTile(f"policy{i} B=9", evicting_from) for i in range(count)]


def random_frames(count: int, height: int, width: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(count)]


# (tiles, columns, rows): ceil(sqrt(n)) columns, as many rows as needed.
@pytest.mark.parametrize(
    ("count", "columns", "rows"),
    [(1, 1, 1), (2, 2, 1), (3, 2, 2), (4, 2, 2), (5, 3, 2), (7, 3, 3), (9, 3, 3), (10, 4, 3)],
)
def test_n_tiles_take_the_ceiling_of_their_square_root_in_columns(count, columns, rows):
    composer = GridComposer(tiles(count), (16, 24))
    assert (composer.columns, composer.rows) == (columns, rows)
    # A 16 x 24 frame is enlarged 8 x to 128 x 192 under a band of 16 (the minimum), below a
    # header of 18: the frame's sides from the gaps (4) around and between the cells.
    assert (composer.tile_height, composer.tile_width, composer.band) == (128, 192, 16)
    assert composer.width == columns * (192 + GAP) + GAP
    assert composer.height == 18 + rows * (16 + 128 + GAP) + GAP
    frame = composer.compose(
        random_frames(count, 16, 24), latent_frame=0, pixel_frame=0, counter=""
    )
    assert frame.shape == (composer.height, composer.width, 3) and frame.dtype == np.uint8


@pytest.mark.parametrize(
    ("count", "size", "tile", "enlarge"),
    [
        ((1, (16, 24), (128, 192), True)),  # 8 x: 192 = MIN_TILE_WIDTH
        ((3, (5, 7), (140, 196), True)),  # 28 x, the first multiple of 7 past 192
        ((2, (3, 5), (116, 194), True)),  # 39 x 5 = 195, made even; 3 x 194 / 5 = 116.4
        ((1, (480, 832), (480, 832), True)),  # fits: kept as it is
        ((7, (480, 832), (366, 634), False)),  # 3 columns: (1920 - 4 x 4) // 3 = 634
        ((16, (480, 832), (272, 474), False)),  # 4 columns: 475 -> 474; 273.5 -> 272
    ],
)
def test_tiles_are_enlarged_by_whole_multiples_or_shrunk_to_fit(count, size, tile, enlarge):
    composer = GridComposer(tiles(count), size)
    assert (composer.tile_height, composer.tile_width) == tile
    assert composer.enlarge is enlarge
    assert composer.width <= MAX_WIDTH
    assert composer.width % 2 == 0 and composer.height % 2 == 0
    assert composer.tile_width % 2 == 0 and composer.tile_height % 2 == 0


def test_an_enlarged_tile_holds_its_frame_repeated_nearest_exactly():
    frames = random_frames(3, 16, 24)
    composer = GridComposer(tiles(3), (16, 24), title="demo_a · eagle")
    grid = composer.compose(frames, latent_frame=0, pixel_frame=0, counter="latent 1 / 7")
    # Hand-laid: header 18, gaps 4, band 16; tiles 0, 1 in row 0, tile 2 in row 1.
    origins = [(22, 4), (22, 200), (170, 4)]
    assert [composer.cell_origin(i) for i in range(3)] == origins
    for (top, left), frame in zip(origins, frames, strict=True):
        tile = grid[top + 16 : top + 16 + 128, left : left + 192]
        np.testing.assert_array_equal(tile, frame.repeat(8, axis=0).repeat(8, axis=1))
        assert (grid[top : top + 16, left : left + 192] != frame[0, 0]).any()  # the band
    # The gaps and the empty fourth cell are background.
    assert (grid[22:318, 196:200] == BACKGROUND).all()
    assert (grid[170:318, 200:392] == BACKGROUND).all()
    assert (grid[-GAP:] == BACKGROUND).all()


def test_a_shrunk_tile_is_its_frame_area_averaged():
    """A frame twice the tile's size: each tile pixel is the mean of a 2 x 2 square (rounded)."""
    (frame,) = random_frames(1, 64, 400, seed=3)
    composer = GridComposer(tiles(1), (64, 400), max_width=208)
    assert (composer.tile_height, composer.tile_width, composer.enlarge) == (32, 200, False)
    grid = composer.compose([frame], latent_frame=0, pixel_frame=0, counter="")
    top, left = composer.cell_origin(0)
    tile = grid[top + composer.band : top + composer.band + 32, left : left + 200]
    means = frame.reshape(32, 2, 200, 2, 3).mean(axis=(1, 3))
    assert np.abs(tile.astype(float) - means).max() <= 1


@pytest.mark.parametrize("start", [None, 0, 3])
def test_the_band_turns_red_from_the_first_eviction_on(start):
    composer = GridComposer([GridTile("window B=9", start), GridTile("full")], (16, 24))
    frames = random_frames(2, 16, 24)
    for latent in range(6):
        grid = composer.compose(frames, latent_frame=latent, pixel_frame=latent, counter="")
        evicting = start is not None and latent >= start
        assert composer.evicting(0, latent) is evicting
        assert composer.evicting(1, latent) is False
        for index, colour in ((0, EVICTING_BAND if evicting else BAND), (1, BAND)):
            top, left = composer.cell_origin(index)
            band = grid[top : top + 16, left : left + 192].reshape(-1, 3)
            # The band's own colour everywhere the label's text is not: its top row, its right
            # end, and most of it.
            assert (grid[top, left : left + 192] == colour).all(), (latent, index)
            assert (band == colour).all(axis=1).mean() > 0.6


def test_the_label_says_evicting_once_it_evicts():
    composer = GridComposer([GridTile("window B=9", 2)], (16, 24))
    frames = random_frames(1, 16, 24)
    top, left = composer.cell_origin(0)

    def text_pixels(latent: int) -> int:
        grid = composer.compose(frames, latent_frame=latent, pixel_frame=0, counter="")
        band = grid[top : top + 16, left : left + 192]
        colour = EVICTING_BAND if composer.evicting(0, latent) else BAND
        return int((band != colour).any(axis=2).sum())

    assert text_pixels(2) > text_pixels(1) + 20  # ' · evicting' appended


@pytest.mark.parametrize(
    ("args", "text"),
    [
        ((0, 1, 0, 16), "latent 1 / 1 · frame 1 / 1 · 0.00 s"),
        ((3, 21, 13, 16), "latent 4 / 21 · frame 14 / 81 · 0.81 s"),  # 13 / 16 = 0.8125
        ((20, 21, 80, 16), "latent 21 / 21 · frame 81 / 81 · 5.00 s"),
        ((11, 42, 45, 16), "latent 12 / 42 · frame 46 / 165 · 2.81 s"),
    ],
)
def test_the_frame_counter(args, text):
    assert frame_counter(*args) == text


def test_the_header_shows_the_title_and_the_counter():
    composer = GridComposer(tiles(1), (16, 24), title="demo_a · eagle")
    frames = random_frames(1, 16, 24)
    plain = composer.compose(frames, latent_frame=0, pixel_frame=0, counter="")
    counted = composer.compose(frames, latent_frame=0, pixel_frame=0, counter="latent 1 / 7")
    header = composer.header
    assert (plain[:header] != BACKGROUND).any()  # the title
    assert (plain[header:] == counted[header:]).all()
    changed = np.flatnonzero((plain[:header] != counted[:header]).any(axis=(0, 2)))
    assert changed.size and changed.min() > composer.width // 2  # right-aligned


def test_frames_of_the_wrong_count_or_no_tiles_are_refused():
    with pytest.raises(ValueError, match="at least one rollout"):
        GridComposer([], (16, 24))
    composer = GridComposer(tiles(2), (16, 24))
    with pytest.raises(ValueError, match="1 frames for 2 tiles"):
        composer.compose(random_frames(1, 16, 24), latent_frame=0, pixel_frame=0, counter="")
