"""Store writers in a process of their own (`extraction.store_process`): a store written through
the process is the store its writer writes in process, through a ring small enough to wrap and
wait many times; a failure in the child names its store and leaves nothing that looks whole; a
parent that dies takes its half-written stores with it."""

from __future__ import annotations

import io
import mmap
import os
import pickle
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import xarray as xr

from sinkscope.extraction import store_process
from sinkscope.extraction.attention_store import AttentionStoreWriter, SlotStoreWriter
from sinkscope.extraction.store_process import (
    CONTROL_BYTES,
    RELEASED,
    ArrayRef,
    StoreProcess,
    attention_call_bytes,
)
from sinkscope.schedules import BlockPart, ModelCall

from .workflowtools import REPO

HEADS, T, FRAMES, BLOCK = 2, 4, 6, 3
COMMON = {
    "num_heads": HEADS,
    "num_frames": FRAMES,
    "frame_seq_length": T,
    "timesteps": [1.0, 0.0],
    "pass_kinds": ["denoise", "cache"],
    "attrs": {"checkpoint": "tiny"},
    "frames_per_block": BLOCK,
}


def attention_calls(seed: int = 0) -> list[tuple]:
    """The write_pooled and write_block arguments of every pass call of a block-causal rollout."""
    rng = np.random.default_rng(seed)
    calls = []
    for first in range(0, FRAMES, BLOCK):
        key_frames = np.arange(first + BLOCK)
        keys = len(key_frames) * T
        for step in (0, 1):
            mass = rng.random((HEADS, BLOCK, keys), dtype=np.float32)
            calls.append(
                (
                    step,
                    first,
                    key_frames,
                    rng.random((HEADS, BLOCK, len(key_frames)), dtype=np.float32),
                    (key_frames % 3).astype(np.int8),
                    mass / mass.sum(-1, keepdims=True),
                    rng.random((HEADS, BLOCK), dtype=np.float32),
                    rng.normal(size=(HEADS, BLOCK, keys)).astype(np.float32),
                )
            )
    return calls


def write_attention(writer, calls, as_tensors: bool) -> None:
    wrap = torch.from_numpy if as_tensors else (lambda array: array)
    for step, first, frames, pooled, versions, mass, entropy, logit in calls:
        writer.write_pooled(step, first, wrap(frames), wrap(pooled), wrap(versions))
        writer.write_block(step, first, wrap(frames), wrap(mass), wrap(entropy), wrap(logit))


def assert_same_store(path_a, path_b) -> None:
    a, b = xr.open_zarr(path_a), xr.open_zarr(path_b)
    assert sorted(a.variables) == sorted(b.variables)
    for name in a.variables:
        np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)
    # Only the times of the job (and the attributes' checksum over them) differ.
    moment = {"started_at", "completed_at", "attributes_crc32"}
    assert {k: v for k, v in a.attrs.items() if k not in moment} == {
        k: v for k, v in b.attrs.items() if k not in moment
    }


@pytest.mark.parametrize("as_tensors", [True, False], ids=["tensors", "arrays"])
def test_an_attention_store_through_the_process_is_the_store_written_in_process(
    tmp_path, as_tensors
):
    calls = attention_calls()
    with AttentionStoreWriter(tmp_path / "here.zarr", **COMMON) as writer:
        write_attention(writer, calls, as_tensors=False)
    # A ring of 4 KB holds about one call: it wraps and waits for the child on almost every one.
    with StoreProcess(4096) as process:
        assert process.ring_size < 2 * attention_call_bytes(HEADS, BLOCK, FRAMES * T, False)
        remote = process.open(AttentionStoreWriter, tmp_path / "there.zarr", **COMMON)
        with remote:
            write_attention(remote, calls, as_tensors)
        assert not (tmp_path / "there.zarr").exists()  # complete only once the process closed
    assert remote.bytes_written > 0
    assert_same_store(tmp_path / "here.zarr", tmp_path / "there.zarr")


def test_write_call_files_keys_in_any_order_and_derives_versions_and_pooled_logits(tmp_path):
    """What a survey call hands over (`write_call`): the keys in the cache's slot order, here a
    ring that wrapped ([3, 4, 5 | 0, 1, 2] against ascending), through the process and in
    process: one store, whose versions are the hand table's and whose pooled logits are the mean
    of key_logit_mean over each key frame's tokens."""
    rng = np.random.default_rng(3)
    call = ModelCall("denoise", (BlockPart(1, BLOCK, BLOCK, step=1, pass_index=1),))
    frames = np.arange(FRAMES)
    anchor = frames == 0  # as Rolling Forcing's anchor: version 1 whatever else it is
    mass = rng.random((HEADS, BLOCK, FRAMES * T), dtype=np.float32)
    entropy = rng.random((HEADS, BLOCK), dtype=np.float32)
    logit = rng.normal(size=(HEADS, BLOCK, FRAMES * T)).astype(np.float32)
    slots = np.r_[3:6, 0:3]  # slot i holds frame slots[i]
    columns = (slots[:, None] * T + np.arange(T)).ravel()
    with AttentionStoreWriter(tmp_path / "ascending.zarr", **COMMON) as writer:
        writer.write_call(1, BLOCK, call, frames, anchor, mass, entropy, logit)
    with StoreProcess(4096) as process:
        remote = process.open(AttentionStoreWriter, tmp_path / "wrapped.zarr", **COMMON)
        with remote:
            remote.write_call(
                1,
                BLOCK,
                call,
                torch.from_numpy(slots),
                torch.from_numpy(anchor[slots]),
                torch.from_numpy(mass[..., columns]),
                torch.from_numpy(entropy),
                torch.from_numpy(logit[..., columns]),
            )
    assert_same_store(tmp_path / "ascending.zarr", tmp_path / "wrapped.zarr")
    store = xr.open_zarr(tmp_path / "wrapped.zarr")
    queries = slice(BLOCK, 2 * BLOCK)
    # Frames 3-5 are the call's own at step 1 (code 2 + 1), 1-2 clean cached copies, 0 the anchor.
    expected = np.array([[1, 0, 0, 3, 3, 3]] * BLOCK, np.int8)
    np.testing.assert_array_equal(store.key_version.values[1, queries], expected)
    np.testing.assert_array_equal(store.key_mass.values[1, :, queries], mass)
    np.testing.assert_array_equal(store.key_logit_mean.values[1, :, queries], logit)
    pooled = logit.astype(np.float64).reshape(HEADS, BLOCK, FRAMES, T).mean(axis=-1)
    np.testing.assert_allclose(
        store.logit_mean_pooled.values[1, :, queries], pooled, rtol=1e-7, atol=0
    )
    assert np.isnan(store.logit_mean_pooled.values[0]).all()  # step 0: never written


def test_ready_returns_once_the_child_has_done_what_was_queued(tmp_path):
    """`ready` is a round trip behind everything queued: the stores are open (their `.partial`
    folders there) and the calls written when it returns, and the process still takes calls."""
    calls = attention_calls()
    with StoreProcess(1 << 20) as process:
        remote = [
            process.open(AttentionStoreWriter, tmp_path / f"s{i}.zarr", **COMMON) for i in (0, 1)
        ]
        write_attention(remote[0], calls[:2], as_tensors=True)
        process.ready()
        assert all((tmp_path / f"s{i}.zarr.partial").is_dir() for i in (0, 1))
        write_attention(remote[0], calls[2:], as_tensors=True)
        for writer in remote:
            writer.close()
    with AttentionStoreWriter(tmp_path / "here.zarr", **COMMON) as writer:
        write_attention(writer, calls, as_tensors=False)
    assert_same_store(tmp_path / "here.zarr", tmp_path / "s0.zarr")


def test_a_store_over_slots_through_the_process_is_the_store_written_in_process(tmp_path):
    rng = np.random.default_rng(1)
    slots = 3 * BLOCK * T
    options = {**COMMON, "slots": slots}
    calls = []
    for first in range(0, FRAMES, BLOCK):
        keys = (first + BLOCK) * T
        labels = {
            "slot_frame": np.arange(keys) // T,
            "slot_token": np.arange(keys) % T,
            "slot_position": rng.integers(0, FRAMES, size=(keys, HEADS)).T,  # per head, strided
            "slot_kind": np.zeros(keys, np.int64),
            "slot_version": np.full(keys, 2),
        }
        for step in (0, 1):
            mass = rng.random((HEADS, BLOCK, keys), dtype=np.float32)
            entropy = rng.random((HEADS, BLOCK), dtype=np.float32)
            calls.append((step, first, mass, entropy, -mass, labels))

    def write(writer, wrap):
        for step, first, mass, entropy, logit, labels in calls:
            tensors = {name: wrap(values) for name, values in labels.items()}
            writer.write_slots(step, first, wrap(mass), wrap(entropy), wrap(logit), tensors)

    with SlotStoreWriter(tmp_path / "here.zarr", **options) as writer:
        write(writer, lambda array: array)
    with StoreProcess(1 << 16) as process:
        with process.open(SlotStoreWriter, tmp_path / "there.zarr", **options) as remote:
            write(remote, torch.from_numpy)
    assert_same_store(tmp_path / "here.zarr", tmp_path / "there.zarr")


class Recorder:
    """A writer for `serve` that records, per write, what it was given and how many bytes of the
    ring the child had handed back to the parent at that moment (`control`: the shared counters)."""

    copies_arguments = False
    path = "recorder"
    control: np.ndarray
    seen: list

    def __init__(self, path, **options):
        pass

    def write_values(self, values):
        self.seen.append((values.copy(), values.flags.writeable, int(self.control[RELEASED])))

    def close(self):
        pass


class InPlaceRecorder(Recorder):
    copies_arguments = True


@pytest.mark.parametrize("writer_class", [Recorder, InPlaceRecorder])
def test_the_ring_is_released_only_once_a_writer_is_done_with_it(monkeypatch, writer_class):
    """A writer that copies what it keeps (`copies_arguments`) reads its arrays in place: the
    parent may not write over those bytes until the write returns. Any other writer gets copies,
    and the bytes go back before it is called."""
    size = CONTROL_BYTES + 4096
    fd = os.memfd_create("test-ring")
    os.ftruncate(fd, size)
    shared = mmap.mmap(fd, size)
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    offset, end = 128, 128 + values.nbytes
    shared[CONTROL_BYTES + offset : CONTROL_BYTES + end] = values.tobytes()
    messages = [
        ("open", 0, "sinkscope:Recorder", "recorder", {}),
        ("call", 0, "write_values", (ArrayRef(offset, values.shape, "float32"),), end),
        ("close", 0),
    ]
    inbox = io.BytesIO(b"".join(pickle.dumps(message) for message in messages))
    monkeypatch.setattr(store_process, "_load_class", lambda name: writer_class)
    writer_class.control, writer_class.seen = np.frombuffer(shared, np.int64, 2), []
    try:
        store_process.serve(fd, size, False, inbox, io.BytesIO())
        ((given, writeable, released),) = writer_class.seen
        np.testing.assert_array_equal(given, values)
        if writer_class.copies_arguments:
            assert (writeable, released) == (False, 0)  # a view: the bytes still held
        else:
            assert (writeable, released) == (True, end)  # a copy
        assert writer_class.control[RELEASED] == end
    finally:
        del writer_class.control
        shared.close()
        os.close(fd)


def test_a_failing_write_names_its_store_and_leaves_nothing(tmp_path):
    good, bad = tmp_path / "good.zarr", tmp_path / "bad.zarr"
    calls = attention_calls()
    with pytest.raises(RuntimeError, match=r"bad\.zarr") as caught:
        with StoreProcess(1 << 16) as process:
            with process.open(AttentionStoreWriter, good, **COMMON) as writer_good:
                with process.open(AttentionStoreWriter, bad, **COMMON) as writer_bad:
                    write_attention(writer_good, calls[:1], as_tensors=True)
                    # Query frames past the video: the writer in the child raises.
                    step, _, frames, _, _, mass, entropy, logit = calls[0]
                    writer_bad.write_block(step, FRAMES, frames, mass, entropy, logit)
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline:  # the next call after the child failed
                        write_attention(writer_bad, calls[:1], as_tensors=True)
                        time.sleep(0.05)
    assert "failed in the store writer process" in str(caught.value)
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def test_a_writer_that_cannot_open_names_its_store(tmp_path):
    with pytest.raises(RuntimeError, match=r"odd\.zarr: TypeError"):
        with StoreProcess(1 << 16) as process:
            with process.open(AttentionStoreWriter, tmp_path / "odd.zarr", **COMMON, bogus=1):
                pass
    assert not list(tmp_path.iterdir())


def test_an_argument_larger_than_the_ring_is_refused(tmp_path):
    with StoreProcess(4096) as process:
        with pytest.raises(ValueError, match="store ring holds 4096"):
            with process.open(AttentionStoreWriter, tmp_path / "a.zarr", **COMMON) as writer:
                writer.write_block(0, 0, np.arange(3), np.zeros((HEADS, BLOCK, 1024), np.float32))
    assert not list(tmp_path.iterdir())


def test_a_parent_that_dies_takes_its_half_written_stores_with_it(tmp_path):
    """The child reads the end of its input and aborts: no `.partial` folder stays behind."""
    script = textwrap.dedent(
        f"""
        import os, sys, time
        import numpy as np
        sys.path.insert(0, {str(REPO)!r})
        from sinkscope.extraction.attention_store import AttentionStoreWriter
        from sinkscope.extraction.store_process import StoreProcess
        process = StoreProcess(1 << 16)
        writer = process.open(AttentionStoreWriter, {str(tmp_path / "a.zarr")!r}, **{COMMON!r})
        frames = np.arange(3)
        writer.write_pooled(0, 0, frames, np.zeros((2, 3, 3), np.float32))
        deadline = time.monotonic() + 30
        while not os.path.exists({str(tmp_path / "a.zarr.partial")!r}):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        print(process._child.pid, flush=True)
        os._exit(3)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 3, result.stderr
    child = int(result.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while list(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(tmp_path.iterdir())
    # and the child is gone
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child}/stat") as stat:
                if stat.read().split()[2] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the store process outlived its parent")


def assert_a_job_writes_the_same_stores_through_the_process(tmp_path, monkeypatch, run_job):
    """`run_job(name, stores)` once with the stores written in process (the CPU's way) and once
    through a StoreProcess (a GPU job's): the same stores, layer by layer."""
    from sinkscope.extraction import closed_loop, job

    for name, in_process in (("here", False), ("there", True)):
        for module in (job, closed_loop):
            monkeypatch.setattr(module, "stores_in_a_process", lambda device, x=in_process: x)
        run_job(name, [tmp_path / f"{name}{layer}.zarr" for layer in (0, 1)])
    for layer in (0, 1):
        assert_same_store(tmp_path / f"here{layer}.zarr", tmp_path / f"there{layer}.zarr")


def test_a_survey_job_writes_the_same_stores_through_the_process(tmp_path, monkeypatch):
    """... and starts the process before its weights load, so that the child starts and opens
    its stores meanwhile."""
    from sinkscope.extraction import job

    from .test_capture import _write_inputs

    prompt, settings = _write_inputs(tmp_path)
    started, started_at_load = [], []

    def start(*args, start=job.attention_store_process, **kwargs):
        started.append(start(*args, **kwargs))
        return started[-1]

    def load_model(claimed, load=job.ClaimedJob.load_model):
        started_at_load.append(len(started))
        return load(claimed)

    monkeypatch.setattr(job, "attention_store_process", start)
    monkeypatch.setattr(job.ClaimedJob, "load_model", load_model)

    def survey(name, stores):
        job.extract(
            checkpoint_name="tiny",
            prompt_name="p",
            prompt_embeddings=prompt,
            layers=[0, 1],
            outputs=stores,
            settings=settings,
            store="attention",
            progress=False,
        )

    assert_a_job_writes_the_same_stores_through_the_process(tmp_path, monkeypatch, survey)
    assert started_at_load == [0, 1]  # in process: none; through the process: already started


def test_a_closed_loop_writes_the_same_stores_over_slots_through_the_process(tmp_path, monkeypatch):
    from .test_capture import _write_inputs
    from .test_closed_loop import _loop

    video = {"num_frames": 8, "frames_per_block": 2, "latent_height": 4, "latent_width": 6}
    prompt, settings = _write_inputs(tmp_path, video=video)
    common = {"checkpoint_name": "tiny", "prompt_name": "p", "prompt_embeddings": prompt}

    def window(name, stores):
        policy = {"name": "window", "budget": 4}
        _loop(tmp_path, common, settings, name, policy, layers=[0, 1], stores=stores)

    assert_a_job_writes_the_same_stores_through_the_process(tmp_path, monkeypatch, window)
