"""Benchmark: candidate codecs for the token store's logits array, in its real layout.

Layout as in sinkscope.extraction.store: float16, chunks (1, 1, T, T), shards (1, 1, T, N) with
T = 1560 and N = 21 T, fill value NaN, `write_empty_chunks` off, zarr tuned with
sinkscope.storage.tune_zarr().
Seven rows are written, one per block of a 21-frame, 7-block rollout: the last query frame of
block b sees 3 (b + 1) key frames, so 84 visible tiles (409 MB of float16) per codec and data set.

Two data sets:

- model: logits of a narrow random-init Wan DiT (head_dim 16) at real geometry, captured by
  LogitCapture over one block (first denoising step and cache pass), or, with --from-store, the
  widest rows of a token store (e.g. one kept by `benchmarks/capture.py --keep`);
- synthetic: N(0, 2^2) logits plus a per-key-frame bias (+20 on the sink frame 0, U(0, 2) on the
  others), rounded to float16; NaN on unseen tiles.

For each codec and data set: compression ratio (logical bytes of the visible tiles / bytes of the
shard files), write throughput in MB/s of logical bytes, (a) as TokenStoreWriter writes today, one
NaN-padded (T, N) row per shard, and (b) writing only the visible tiles of the row (a partial
selection of the same shard, `write_empty_chunks` on), then read + decompress throughput of whole
(T, N) rows as sinkscope.analysis.reduce reads them; throughputs are the best of --repeat runs.
Files land in the page cache: this measures the codec and zarr, not the disk. Not a test.

The store's codecs, blosc zstd 1 then a crc32c checksum of each compressed chunk (computed in
worker threads: ThreadedCrc32cCodec), are measured next to the same blosc without it and with
zarr's own Crc32cCodec (", in loop"); the cost of the checksum (throughput with / without) is
printed at the end. `--codecs` measures only the named candidates.

    python benchmarks/compression.py
    python benchmarks/compression.py --from-store /tmp/.../capture.zarr
    python benchmarks/compression.py --codecs "blosc zstd 1 shuffle" "blosc zstd 1 shuffle + crc32c"
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from sinkscope.extraction.store import ThreadedCrc32cCodec, logits_compressors
from sinkscope.storage import tune_zarr

LATENT_HEIGHT, LATENT_WIDTH = 60, 104
NUM_FRAMES, FRAMES_PER_BLOCK = 21, 3
HEAD_DIM = 16
TOKENS_PER_FRAME = (LATENT_HEIGHT // 2) * (LATENT_WIDTH // 2)  # the 2 x 2 patch: 1560
SINK_BIAS = 20.0
# The recommendation: the fastest writer (visible tiles, slowest data set) among the codecs that
# save at least this fraction of the bytes on every data set. The writer has to keep pace with
# the GPU (docs/DESIGN.md: 14.7 GB per layer and pass kind); disk is the cheaper resource.
MIN_SAVING = 0.05
# The checksum's cost is printed for this pair of candidates (with / without).
CHECKSUMMED, UNCHECKED = "blosc zstd 1 shuffle + crc32c", "blosc zstd 1 shuffle"


def candidate_codecs() -> dict[str, object]:
    return {
        "none": None,
        "crc32c (no compression)": [Crc32cCodec()],
        "blosc zstd 1 shuffle": BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", typesize=2),
        # The same bytes twice: the checksums computed in worker threads (as the store does), or
        # in zarr's event loop, one chunk after the other (zarr's Crc32cCodec).
        "blosc zstd 1 shuffle + crc32c": [
            BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", typesize=2),
            ThreadedCrc32cCodec(),
        ],
        "blosc zstd 1 shuffle + crc32c, in loop": [
            BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", typesize=2),
            Crc32cCodec(),
        ],
        "blosc zstd 3 shuffle": BloscCodec(cname="zstd", clevel=3, shuffle="shuffle", typesize=2),
        "blosc zstd 5 shuffle": BloscCodec(cname="zstd", clevel=5, shuffle="shuffle", typesize=2),
        "blosc zstd 3 bitshuffle": BloscCodec(
            cname="zstd", clevel=3, shuffle="bitshuffle", typesize=2
        ),
        "blosc lz4 5 shuffle": BloscCodec(cname="lz4", clevel=5, shuffle="shuffle", typesize=2),
        "zstd 3 (no shuffle)": ZstdCodec(level=3),
    }


def codec_dicts(codec) -> list:
    """A candidate (None, one codec or a list of them) as a list of codec dicts."""
    if codec is None:
        return []
    return [c.to_dict() for c in (codec if isinstance(codec, list | tuple) else [codec])]


def default_codec_name(codecs: dict[str, object]) -> str | None:
    """The candidate that is sinkscope.extraction.store's current codec list."""
    current = codec_dicts(logits_compressors())
    for name, codec in codecs.items():
        if codec_dicts(codec) == current:
            return name
    return None


def print_checksum_cost(all_results: dict[str, dict[str, dict]]) -> None:
    """Throughputs with the crc32c checksum over those without, per data set (same run)."""
    for checksummed in (CHECKSUMMED, CHECKSUMMED + ", in loop"):
        print(f"\nchecksum cost: {checksummed} / {UNCHECKED} (throughput ratio; bytes ratio)")
        for data_name, results in all_results.items():
            if checksummed not in results or UNCHECKED not in results:
                continue
            with_, without = results[checksummed], results[UNCHECKED]
            ratios = {k: with_[k] / without[k] for k in ("write_row", "write_visible", "read")}
            print(
                f"  {data_name}: write row {ratios['write_row']:.3f}, write vis "
                f"{ratios['write_visible']:.3f}, read {ratios['read']:.3f}; stored bytes "
                f"{with_['stored'] / without['stored']:.5f}"
            )


# --- data -------------------------------------------------------------------------------------


@dataclass
class Rows:
    """Full NaN-padded (T, N) rows, one per block width, and their visible tile counts."""

    name: str
    rows: list[np.ndarray]
    widths: list[int]  # visible key frames of each row (a prefix of the key frames)
    frame_seq_length: int

    @property
    def logical_bytes(self) -> int:
        t = self.frame_seq_length
        return sum(self.widths) * t * t * 2


def row_widths() -> list[int]:
    blocks = NUM_FRAMES // FRAMES_PER_BLOCK
    return [FRAMES_PER_BLOCK * (b + 1) for b in range(blocks)]


def rows_from_tiles(name: str, tiles: list[np.ndarray], t: int) -> Rows:
    """Rows whose visible tiles cycle through `tiles` (float16 (T, T) each)."""
    rows, widths = [], row_widths()
    index = 0
    for width in widths:
        row = np.full((t, NUM_FRAMES * t), np.nan, dtype=np.float16)
        for frame in range(width):
            row[:, frame * t : (frame + 1) * t] = tiles[index % len(tiles)]
            index += 1
        rows.append(row)
    return Rows(name, rows, widths, t)


class TileCollector:
    """Stands in for a TokenStoreWriter under LogitCapture: keeps the (T, T) tiles."""

    tokens = True  # LogitCapture writes token rows only to writers that want them

    def __init__(self, t: int):
        self.t = t
        self.tiles: list[np.ndarray] = []

    def write_pooled(self, *args, **kwargs) -> None:
        """Frame-level pooled logits are not part of this benchmark."""

    def write_row(self, step, head, query_frame, tiles, key_frames) -> None:
        self.tiles.extend(tile.copy() for tile in tiles)  # [key frames, T, T]


def model_rows(heads: int, seed: int) -> Rows:
    """Logits of a narrow random Wan DiT, real geometry, one block (3 frames), two passes."""
    import torch

    from sinkscope.extraction.capture import LogitCapture
    from sinkscope.extraction.sampling import SELF_FORCING, Geometry, rollout
    from sinkscope.wan.config import WanConfig
    from sinkscope.wan.model import WanModel

    cfg = WanConfig(
        dim=heads * HEAD_DIM,
        ffn_dim=64,
        num_heads=heads,
        num_layers=2,
        freq_dim=32,
        text_dim=32,
        text_len=32,
    )
    model = WanModel(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    model.eval().requires_grad_(False)
    text = torch.randn(1, cfg.text_len, cfg.text_dim, generator=torch.Generator().manual_seed(1))
    t = cfg.tokens_per_frame(LATENT_HEIGHT, LATENT_WIDTH)
    collector = TileCollector(t)
    # The first denoising step (t = 1000) and the cache pass (t = 0) of layer 0.
    capture = LogitCapture({0: collector}, [0, len(SELF_FORCING.steps)], t, cfg.head_dim)
    model.set_capture(capture, {0})
    geometry = Geometry(
        num_frames=FRAMES_PER_BLOCK,
        frames_per_block=FRAMES_PER_BLOCK,
        latent_height=LATENT_HEIGHT,
        latent_width=LATENT_WIDTH,
    )
    rollout(
        model,
        text,
        geometry=geometry,
        schedule=SELF_FORCING,
        seed=seed,
        on_pass=capture.begin_pass,
        progress=False,
    )
    return rows_from_tiles(f"model ({len(collector.tiles)} tiles, 1 block)", collector.tiles, t)


def store_rows(path: Path) -> Rows:
    """The widest rows of a token store: the last query frame, step 0, up to 4 heads."""
    group = zarr.open_group(str(path), mode="r")
    logits = group["logits"]
    _, heads, n, _ = logits.shape
    frames = int(group.attrs.get("num_frames", NUM_FRAMES))
    t = n // frames
    if frames != NUM_FRAMES or t * frames != n:
        raise ValueError(f"{path}: {frames} frames of {n} tokens; this layout has {NUM_FRAMES}")
    tiles = []
    for head in range(min(heads, 4)):
        row = np.asarray(logits[0, head, (frames - 1) * t : frames * t, :])
        for frame in range(frames):
            tile = row[:, frame * t : (frame + 1) * t]
            if not np.isnan(tile).all():
                tiles.append(tile.copy())
    if not tiles:
        raise ValueError(f"{path}: the last query frame has no visible tiles")
    return rows_from_tiles(f"store ({len(tiles)} tiles)", tiles, t)


def synthetic_rows(seed: int, t: int) -> Rows:
    rng = np.random.default_rng(seed)
    bias = rng.uniform(0.0, 2.0, NUM_FRAMES).astype(np.float32)
    bias[0] = SINK_BIAS
    rows, widths = [], row_widths()
    for width in widths:
        row = np.full((t, NUM_FRAMES * t), np.nan, dtype=np.float16)
        for frame in range(width):
            values = rng.standard_normal((t, t), dtype=np.float32) * 2.0 + bias[frame]
            row[:, frame * t : (frame + 1) * t] = values.astype(np.float16)
        rows.append(row)
    return Rows("synthetic N(0, 2^2) + sink bias", rows, widths, t)


# --- the measurement --------------------------------------------------------------------------


def create(path: Path, codec, t: int, *, write_empty_chunks: bool = False):
    n = NUM_FRAMES * t
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    return group.create_array(
        "logits",
        shape=(1, 1, n, n),
        chunks=(1, 1, t, t),
        shards=(1, 1, t, n),
        dtype="float16",
        fill_value=np.nan,
        compressors=codec,
        dimension_names=("step", "head", "query_token", "key_token"),
        config={"write_empty_chunks": write_empty_chunks},
    )


def query_frame(block: int) -> int:
    """The last query frame of a block: it sees 3 (block + 1) key frames."""
    return FRAMES_PER_BLOCK * (block + 1) - 1


def stored_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path / "logits" / "c"):
        total += sum(os.path.getsize(os.path.join(root, name)) for name in files)
    return total


def measure(data: Rows, codecs: dict[str, object], workdir: Path, repeat: int) -> dict:
    """Per codec, the best (highest throughput) of `repeat` runs of `measure_once`; the codecs
    take turns, so that a slower spell of a shared machine hits them alike."""
    runs: dict[str, list[dict]] = {name: [] for name in codecs}
    for run in range(repeat):
        for name, codec in codecs.items():
            print(f"[{time.strftime('%H:%M:%S')}] {data.name}: {name} ({run + 1})", flush=True)
            runs[name].append(measure_once(data, codec, workdir))
    keys = ("write_row", "write_visible", "read")
    return {
        name: {**done[0], **{key: max(one[key] for one in done) for key in keys}}
        for name, done in runs.items()
    }


def measure_once(data: Rows, codec, workdir: Path) -> dict:
    t = data.frame_seq_length
    logical = data.logical_bytes
    # (a) as the store writes today: whole NaN-padded rows, empty inner chunks skipped.
    path = workdir / "row.zarr"
    array = create(path, codec, t)
    started = time.perf_counter()
    for block, row in enumerate(data.rows):
        q = query_frame(block)
        array[0, 0, q * t : (q + 1) * t, :] = row
    write_row = time.perf_counter() - started
    size = stored_bytes(path)
    # Read + decompress whole rows, as the reduction does; the round-trip check is not timed.
    read = 0.0
    for block, row in enumerate(data.rows):
        q = query_frame(block)
        started = time.perf_counter()
        back = array[0, 0, q * t : (q + 1) * t, :]
        read += time.perf_counter() - started
        if not np.array_equal(back, row, equal_nan=True):
            raise AssertionError(f"{codec}: row {block} does not round-trip")
    shutil.rmtree(path)
    # (b) only the visible tiles of each row: a partial selection of the same shard.
    path = workdir / "visible.zarr"
    array = create(path, codec, t, write_empty_chunks=True)
    started = time.perf_counter()
    for block, (row, width) in enumerate(zip(data.rows, data.widths, strict=True)):
        q = query_frame(block)
        array[0, 0, q * t : (q + 1) * t, : width * t] = row[:, : width * t]
    write_visible = time.perf_counter() - started
    if stored_bytes(path) != size:
        raise AssertionError(f"{codec}: visible-only write stored {stored_bytes(path)} != {size}")
    shutil.rmtree(path)
    return {
        "ratio": logical / size,
        "stored": size,
        "write_row": logical / write_row,
        "write_visible": logical / write_visible,
        "read": logical / read,
    }


def print_table(data: Rows, results: dict[str, dict], default: str | None) -> None:
    print(f"\n{data.name}: {len(data.rows)} rows, {data.logical_bytes / 1e6:.0f} MB logical")
    header = (
        f"{'codec':40s} {'ratio':>6s} {'stored MB':>10s} {'write row':>10s} "
        f"{'write vis':>10s} {'read':>10s}"
    )
    print(header)
    print(f"{'':40s} {'':>6s} {'':>10s} {'MB/s':>10s} {'MB/s':>10s} {'MB/s':>10s}")
    for name, r in results.items():
        label = name + (" *" if name == default else "")
        print(
            f"{label:40s} {r['ratio']:6.3f} {r['stored'] / 1e6:10.1f} {r['write_row'] / 1e6:10.0f} "
            f"{r['write_visible'] / 1e6:10.0f} {r['read'] / 1e6:10.0f}"
        )


def slowest_write(all_results: dict[str, dict[str, dict]], name: str) -> float:
    return min(results[name]["write_visible"] for results in all_results.values())


def recommend(all_results: dict[str, dict[str, dict]]) -> str | None:
    """The fastest visible-tile writer (on its slowest data set) among the codecs that save at
    least MIN_SAVING of the bytes on every data set."""
    names = list(next(iter(all_results.values())))
    eligible = [
        name
        for name in names
        if all(1 - 1 / r[name]["ratio"] >= MIN_SAVING for r in all_results.values())
    ]
    if not eligible:
        return None
    return max(eligible, key=lambda name: slowest_write(all_results, name))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--from-store",
        type=Path,
        default=None,
        help="take the model rows from this token store instead of running the model",
    )
    parser.add_argument("--heads", type=int, default=4, help="heads of the narrow model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeat", type=int, default=2, help="runs per codec and data set; the best counts"
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="parent directory for the benchmark data (default: a new temporary directory)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    parser.add_argument(
        "--codecs",
        nargs="+",
        default=None,
        metavar="NAME",
        help="measure only these candidates (names as printed; default: all)",
    )
    args = parser.parse_args(argv)

    tune_zarr()
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="sinkscope-bench-codecs-", dir=args.workdir))
    print(f"workdir {workdir}; load average {os.getloadavg()[0]:.2f}", flush=True)
    codecs = candidate_codecs()
    default = default_codec_name(codecs)
    if args.codecs:
        unknown = sorted(set(args.codecs) - set(codecs))
        if unknown:
            parser.error(f"unknown codecs {unknown}; candidates: {list(codecs)}")
        codecs = {name: codec for name, codec in codecs.items() if name in args.codecs}
    all_results: dict[str, dict[str, dict]] = {}
    started = time.perf_counter()
    try:
        makers = [
            lambda: store_rows(args.from_store) if args.from_store else model_rows(args.heads, 0),
            lambda: synthetic_rows(args.seed, TOKENS_PER_FRAME),
        ]
        for make in makers:
            data = make()
            results = measure(data, codecs, workdir, args.repeat)
            all_results[data.name] = results
            print_table(data, results, default)
            del data
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    best = recommend(all_results)
    fastest = max(all_results[next(iter(all_results))], key=lambda n: slowest_write(all_results, n))
    print_checksum_cost(all_results)
    print(f"\n* = sinkscope.extraction.store.logits_compressors() today: {default}")
    print(
        f"recommended: {best} (the fastest visible-tile writer, on its slowest data set, among "
        f"the codecs that save >= {MIN_SAVING:.0%} of the bytes on every data set); fastest of "
        f"all: {fastest}"
    )
    print(
        f"elapsed {time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.2f}; "
        f"{os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
