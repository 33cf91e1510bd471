"""Store writers in a process of their own, fed without waiting for the GPU.

The survey writes two float32 chunks per layer and model call (9.4 MB at the real geometry, 9.9 GB
over a 30-layer survey) through zarr and blosc. In the model's process, the writer threads' Python
(zarr's event loop, its codec threads) shares the GIL with the thread that launches the model's
kernels, and every `.cpu()` of a reduction waits for the GPU: on an H200 the stores took 8.6 s and
the copies 1.4 s of a 15.7 s survey whose device work alone took 5.7 s (benchmarks/README.md).

Here the writers (`attention_store.AttentionStoreWriter` and its kin, unchanged) run in a child
process (a
GPU job's: `job.stores_in_a_process`).
Their arguments travel through one shared-memory ring (`memfd`, page-locked for the GPU with
`cudaHostRegister`): a call copies its tensors into the ring on a copy stream of its own and
returns; a sender thread waits for that copy to land and sends the child a small message naming
the call, its other arguments and where the arrays lie. The child calls the writer, then frees
the call's part of the ring (a shared counter); a writer that copies what it keeps
(`copies_arguments`: the attention stores) reads the arrays where they lie, any other gets
copies. Nothing of the store changes: a store written here is the store the writer writes in
process.

If the child fails, the next call raises naming the store; if the parent dies, the child reads the
end of its input and aborts every store it holds (their `.partial` folders are removed).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib
import logging
import math
import mmap
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from sinkscope.logs import LOG_FORMAT

from .store import ClosesOrAborts

log = logging.getLogger(__name__)

ALIGN = 64
# The shared counters ahead of the ring: bytes the child has released (monotonic, as the parent
# counts what it has handed out) and 1 + the key of the first writer that failed (0: none).
CONTROL_BYTES = ALIGN
RELEASED, FAILED = 0, 1
MIN_RING_BYTES = 16 << 20
MAX_RING_BYTES = 1 << 30
READY = -1  # the key of `StoreProcess.ready`'s round trip, no writer's


@dataclasses.dataclass(frozen=True)
class ArrayRef:
    """An argument that lies in the ring: an array of `shape` and `dtype` at `offset`."""

    offset: int
    shape: tuple[int, ...]
    dtype: str

    def view(self, ring) -> np.ndarray:
        """The array where it lies in the ring (read-only: valid until the call is released)."""
        count = math.prod(self.shape)
        array = np.frombuffer(ring, self.dtype, count, self.offset).reshape(self.shape)
        array.flags.writeable = False
        return array

    def read(self, ring) -> np.ndarray:
        """A copy of the array, for a writer that may keep what it is given."""
        return self.view(ring).copy()


def attention_store_process(
    num_heads: int, query_frames: int, keys: int, *, slots: bool, dry_run: bool = False
) -> StoreProcess:
    """A `StoreProcess` for attention stores whose calls hand over `query_frames` frames of
    queries against `keys` keys (`slots`: stores over cache slots, with their labels), its ring
    sized by `ring_bytes`."""
    call = attention_call_bytes(num_heads, query_frames, keys, slots)
    return StoreProcess(ring_bytes(call), dry_run=dry_run)


def ring_bytes(call_bytes: int, calls: int = 16) -> int:
    """A ring that holds `calls` calls of `call_bytes` each (within 16 MB .. 1 GB, and always at
    least two calls): enough for the child to lag a layer-sweep behind without stalling the
    model."""
    return max(MIN_RING_BYTES, min(MAX_RING_BYTES, calls * call_bytes), 2 * call_bytes)


def attention_call_bytes(num_heads: int, query_frames: int, keys: int, slots: bool) -> int:
    """The most bytes one capture call hands an attention store's writer: key_mass and
    key_logit_mean [heads, query frames, keys] in float32, with `slots` a store over slots' five
    labels per head and key (int64 as the caches make them), and a margin for the small arrays
    (entropy, pooled logits, key frames)."""
    labels = 8 * 5 if slots else 0
    return num_heads * keys * (4 * 2 * query_frames + labels) + (1 << 20)


@functools.cache
def _numpy_dtype(dtype) -> str:
    import torch

    return str(torch.empty(0, dtype=dtype).numpy().dtype)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class StoreProcess:
    """A child process that hosts store writers (`open`); a context manager.

    `ring`: the bytes of the shared ring the calls' arrays pass through (`ring_bytes`).
    `dry_run`: the child drops every call's arrays unread (benchmarks/gpu.py measures the
    transport alone with it).
    """

    def __init__(self, ring: int, *, dry_run: bool = False):
        import torch

        self.ring_size = _aligned(ring)
        self._fd = os.memfd_create("sinkscope-stores") if hasattr(os, "memfd_create") else None
        if self._fd is None:  # not Linux: a deleted temporary file holds the ring
            import tempfile

            handle = tempfile.TemporaryFile()
            self._fd = os.dup(handle.fileno())
            handle.close()
        size = CONTROL_BYTES + self.ring_size
        os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)
        self._control = np.frombuffer(self._map, np.int64, 2)
        self._ring = torch.frombuffer(self._map, dtype=torch.uint8, offset=CONTROL_BYTES)
        self._pinned = False
        self._stream = None
        if torch.cuda.is_available():
            cudart = torch.cuda.cudart()
            error = cudart.cudaHostRegister(self._ring.data_ptr(), self.ring_size, 0)
            self._pinned = int(error) == 0
            if not self._pinned:
                log.warning(
                    "could not page-lock the store ring (%s): copies wait for the GPU", error
                )
            self._stream = torch.cuda.Stream()
        self._handed_out = 0
        # The calling thread's seconds in `call`, and of those, waiting for room in the ring (the
        # child, or the GPU's copies, behind): what the model's thread pays (benchmarks/gpu.py).
        self.call_seconds = 0.0
        self.ring_wait_seconds = 0.0
        self._paths: list[Path] = []
        stderr = _log_handle()
        self._child = subprocess.Popen(
            [sys.executable, "-m", __name__, str(self._fd), str(size), str(int(dry_run))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            pass_fds=(self._fd,),
        )
        self._outbox: queue.Queue = queue.Queue()
        self._replies: dict[int, dict] = {}  # by writer key, read ahead of the one awaited
        self._closing: dict[int, RemoteWriter] = {}
        self._send_error: BaseException | None = None
        self._sender = threading.Thread(target=self._send, name="store-sender", daemon=True)
        self._sender.start()
        self._closed = False

    # The parent's side ------------------------------------------------------------------------

    def open(self, writer_class: type, path: str | Path, **options) -> RemoteWriter:
        """A writer of `writer_class` (a class of `sinkscope.extraction.store`) at `path`, built
        in the child with `options`. Without a wait (the child's start overlaps the model's
        first calls): an error in its constructor raises at its next call or its close."""
        key = len(self._paths)
        self._paths.append(Path(path))
        name = f"{writer_class.__module__}:{writer_class.__qualname__}"
        self._outbox.put((None, ("open", key, name, str(path), options)))
        return RemoteWriter(self, key, writer_class, Path(path), options)

    def opener(self, writer_class: type):
        """`open` for one writer class: called with a path and the class's options."""
        return lambda path, **options: self.open(writer_class, path, **options)

    def call(self, key: int, method: str, args: tuple) -> None:
        """Queue `method(*args)` of writer `key`; tensors and arrays in `args` (also inside
        dicts, lists and tuples) go through the ring, the GPU's without a wait."""
        started = time.perf_counter()
        self._check(key)
        copies: list = []
        handed_out = self._handed_out
        try:
            packed = self._pack(args, copies)
        except BaseException:
            self._handed_out = handed_out  # nothing of this call was copied or sent
            raise
        event = self._copy(copies)
        self._outbox.put((event, ("call", key, method, packed, self._handed_out)))
        self.call_seconds += time.perf_counter() - started

    def close_writer(self, writer: RemoteWriter) -> None:
        """Close `writer` in the child after its queued calls, without a wait: the child closes
        its writers side by side and `close` (of this process) waits for them all."""
        self._outbox.put((None, ("close", writer.key)))
        self._closing[writer.key] = writer

    def ready(self) -> None:
        """Wait until the child has done everything queued so far (started, opened its stores,
        written what it was sent): the child answers in order."""
        self._outbox.put((None, ("ready", READY)))
        self._await(READY)

    def abort_writer(self, key: int) -> None:
        """Abort writer `key` in the child (its `.partial` store removed) and wait for it."""
        self._outbox.put((None, ("abort", key)))
        self._await(key)

    def _pack(self, value, copies: list):
        import torch

        if isinstance(value, torch.Tensor | np.ndarray):
            array = value if isinstance(value, torch.Tensor) else torch.from_numpy(value)
            dtype = _numpy_dtype(array.dtype)
            offset = self._reserve(array.numel() * array.element_size())
            copies.append((offset, array))
            return ArrayRef(offset, tuple(array.shape), dtype)
        if isinstance(value, dict):
            return {name: self._pack(item, copies) for name, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._pack(item, copies) for item in value)
        return value

    def _reserve(self, nbytes: int) -> int:
        """Where the next `nbytes` go in the ring; waits while the child still reads there."""
        size = _aligned(max(nbytes, 1))
        if size > self.ring_size:
            raise ValueError(
                f"{nbytes} bytes in one argument: the store ring holds {self.ring_size}"
            )
        offset = self._handed_out % self.ring_size
        if offset + size > self.ring_size:  # never across the end: skip to the start
            self._handed_out += self.ring_size - offset
            offset = 0
        waiting = time.perf_counter()
        while self._handed_out + size - int(self._control[RELEASED]) > self.ring_size:
            self._check(None)
            time.sleep(0.0005)
        self.ring_wait_seconds += time.perf_counter() - waiting
        self._handed_out += size
        return offset

    def _copy(self, copies: list):
        """Copy the call's arrays into the ring: GPU tensors on the copy stream, after what the
        model's stream has queued; the event the sender waits for (None: nothing on a GPU)."""
        import torch

        targets = [
            self._ring[offset : offset + array.numel() * array.element_size()]
            .view(array.dtype)
            .view(array.shape)
            for offset, array in copies
        ]
        if not any(array.is_cuda for _, array in copies):
            for target, (_, array) in zip(targets, copies, strict=True):
                target.copy_(array)
            return None
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for target, (_, array) in zip(targets, copies, strict=True):
                target.copy_(array, non_blocking=self._pinned)
                # The model's allocator must not hand the tensor's memory out before the copy.
                if array.is_cuda:
                    array.record_stream(self._stream)
            # The sender sleeps until the copy lands instead of spinning a core (2,100 waits in
            # a 30-layer survey).
            event = torch.cuda.Event(blocking=True)
            event.record(self._stream)
        return event

    def _send(self) -> None:
        """The sender thread: each message once its arrays have landed, in order."""
        while True:
            item = self._outbox.get()
            if item is None:
                return
            event, message = item
            try:
                if event is not None:
                    event.synchronize()
                if self._send_error is None:
                    pickle.dump(message, self._child.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                    self._child.stdin.flush()
            except BaseException as error:
                self._send_error = error

    def _await(self, key: int) -> dict:
        """The child's reply about writer `key` (replies come in the order the child finishes
        them: those read on the way are kept)."""
        while key not in self._replies:
            try:
                reply = pickle.load(self._child.stdout)
            except (EOFError, OSError, pickle.UnpicklingError) as error:
                path = self._paths[key] if key != READY else "the stores"
                raise RuntimeError(
                    f"the store writer process stopped (exit code {self._child.poll()}) while "
                    f"writing {path}"
                ) from (self._send_error or error)
            self._replies[reply["key"]] = reply
        reply = self._replies.pop(key)
        if reply["error"]:
            raise RuntimeError(f"{self._paths[key]}: {reply['error']}")
        return reply

    def _check(self, key: int | None) -> None:
        failed = int(self._control[FAILED])
        if failed:
            raise RuntimeError(
                f"writing {self._paths[failed - 1]} failed in the store writer process "
                "(its log has the traceback)"
            )
        if self._send_error is not None or self._child.poll() is not None:
            path = self._paths[key] if key is not None else "the stores"
            raise RuntimeError(
                f"the store writer process stopped (exit code {self._child.poll()}) while "
                f"writing {path}"
            ) from self._send_error

    def close(self) -> None:
        """Wait until the child has closed every writer closed here (the first failure raises,
        naming its store), then stop it and release the ring."""
        if self._closed:
            return
        self._closed = True
        try:
            for key, writer in list(self._closing.items()):
                del self._closing[key]
                reply = self._await(key)
                writer.write_seconds = reply["write_seconds"]
                writer.bytes_written = reply["bytes_written"]
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._outbox.put(None)
        self._sender.join()
        try:
            self._child.stdin.close()
        except OSError:
            pass
        try:
            self._child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
        self._child.stdout.close()
        if self._pinned:
            import torch

            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._ring.data_ptr())
        del self._ring, self._control
        try:
            self._map.close()
        except BufferError:  # a view of the ring still lives (a traceback's frame): the GC unmaps
            pass
        os.close(self._fd)

    def __enter__(self) -> StoreProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RemoteWriter(ClosesOrAborts):
    """The parent's handle on one writer in a `StoreProcess`: the writer's write methods, each
    queued without a wait (`takes_tensors`: tensors may stay on the GPU), and `close`/`abort` as
    the writer has them (`close` queues the close: the store is complete, and `write_seconds`
    and `bytes_written` known, once the `StoreProcess` has closed)."""

    takes_tensors = True

    def __init__(self, process: StoreProcess, key: int, writer_class: type, path: Path, options):
        self.process, self.key, self.path = process, key, path
        self.store_kind = writer_class.store_kind
        self.frame_seq_length = options["frame_seq_length"]
        self.tokens = options.get("tokens", True)
        self.precision = options.get("precision", "float32")  # an attention store's
        self.write_seconds = 0.0
        self.bytes_written = 0
        self._closed = False

    def __getattr__(self, method: str):
        if not method.startswith("write_"):
            raise AttributeError(method)
        return lambda *args: self.process.call(self.key, method, args)

    def close(self) -> Path:
        """Queue the store's close; it is complete once its `StoreProcess` has closed."""
        if not self._closed:
            self._closed = True
            self.process.close_writer(self)
        return self.path

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.process.abort_writer(self.key)
            except RuntimeError as error:  # the child is gone: it aborted its stores itself
                log.warning("aborting %s: %s", self.path, error)


def _log_handle():
    """The child's stderr: the job's log file where the job writes to one."""
    try:
        sys.stderr.flush()
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


# The child's side ---------------------------------------------------------------------------


def _unpack(value, ring, copy: bool):
    """The call's arguments, each array a copy out of the ring or (not `copy`) a view of it."""
    if isinstance(value, ArrayRef):
        return value.read(ring) if copy else value.view(ring)
    if isinstance(value, dict):
        return {name: _unpack(item, ring, copy) for name, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_unpack(item, ring, copy) for item in value)
    return value


def _described(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _load_class(name: str) -> type:
    module, qualname = name.split(":")
    if not module.startswith("sinkscope."):
        raise ValueError(f"{name}: the store process builds sinkscope's writers only")
    return getattr(importlib.import_module(module), qualname)


def serve(fd: int, size: int, dry_run: bool, inbox, outbox) -> None:
    """The child: build, feed and finish writers as the parent's messages say, until the parent
    stops sending; then abort any store still open."""
    shared = mmap.mmap(fd, size)
    control = np.frombuffer(shared, np.int64, 2)
    ring = memoryview(shared)[CONTROL_BYTES:]
    writers: dict[int, Any] = {}
    failed: dict[int, str] = {}
    replying = threading.Lock()
    # Closing a store waits for its writer thread and writes what it kept in memory: side by
    # side, 30 stores close in the time of a few.
    closing = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="store-close")

    def reply(key: int, writer=None, error: str | None = None) -> None:
        fields = {
            "key": key,
            "error": error,
            "write_seconds": getattr(writer, "write_seconds", 0.0),
            "bytes_written": getattr(writer, "bytes_written", 0),
        }
        with replying:
            pickle.dump(fields, outbox, protocol=pickle.HIGHEST_PROTOCOL)
            outbox.flush()

    def fail(key: int, error: BaseException) -> None:
        """Writer `key` failed: its later calls are dropped, and the parent learns of it."""
        failed[key] = _described(error)
        if not control[FAILED]:
            control[FAILED] = key + 1

    def finish(what: str, key: int, writer, error: str | None) -> None:
        try:
            if writer is not None:
                if what == "close" and error is None:
                    writer.close()
                else:
                    writer.abort()
        except BaseException as failure:
            log.exception("%s of %s failed", what, writer.path)
            error = _described(failure)
        reply(key, writer, error if what == "close" else None)

    try:
        while True:
            try:
                message = pickle.load(inbox)
            except EOFError:
                return
            what, key = message[0], message[1]
            if what == "call":
                _, _, method, packed, released = message
                if dry_run or key in failed:
                    control[RELEASED] = released
                    continue
                writer = writers[key]
                # A writer that copies what it keeps before a write returns (the attention
                # stores spread their rows into chunks) reads the ring in place: a survey's
                # 5.7 GB of reductions copied once less.
                in_place = getattr(writer, "copies_arguments", False)
                args = _unpack(packed, ring, copy=not in_place)
                if not in_place:
                    control[RELEASED] = released  # the arrays are copied out
                try:
                    getattr(writer, method)(*args)
                except BaseException as error:
                    log.exception("writing %s failed", writer.path)
                    fail(key, error)
                finally:
                    del args
                    control[RELEASED] = released
            elif what == "open":
                _, _, name, path, options = message
                try:
                    writers[key] = _load_class(name)(path, **options)
                except BaseException as error:
                    log.exception("opening %s failed", path)
                    fail(key, error)
            elif what == "close":
                closing.submit(finish, what, key, writers.pop(key, None), failed.pop(key, None))
            elif what == "abort":
                finish(what, key, writers.pop(key, None), failed.pop(key, None))
            elif what == "ready":
                reply(key)
    finally:
        closing.shutdown()
        for writer in writers.values():  # the parent is gone or failed: nothing half-written
            writer.abort()
        control = None  # its view of the map must go before the map closes
        try:
            ring.release()
            shared.close()
        except BufferError:  # a view of the ring still lives (a traceback's frame): the GC unmaps
            pass


def yield_to_the_model() -> None:
    """Leave the parent's threads their cores: 30 stores compressing at once would otherwise take
    every core of the machine (zarr's codec pool is cores + 4 threads), the one whose thread
    launches the model's kernels too. The child runs at a lower priority and compresses on all
    but two of the cores it may use; idle cores are still all its own. (On an H200 it ran so in
    benchmarks/README.md's run 2, with other changes: its own share is not measured apart.)"""
    import zarr

    os.nice(10)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    zarr.config.set({"threading.max_workers": max(1, (cores or 1) - 2)})


def main() -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    yield_to_the_model()
    fd, size, dry_run = (int(value) for value in sys.argv[1:4])
    import torch

    # The writers' float16 casts (attention_store): a millisecond each, one thread each, beside
    # the other writers' threads and the model's process.
    torch.set_num_threads(1)
    serve(fd, size, bool(dry_run), sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    # The messages name this module's classes (ArrayRef) by its import name, not `__main__`'s.
    from sinkscope.extraction.store_process import main as imported_main

    imported_main()
