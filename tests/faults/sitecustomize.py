"""Fault injection for tests/test_kills.py, loaded by every Python process of a Snakemake run
that has this folder on PYTHONPATH. With SINKSCOPE_KILL_AT set, a job script (not Snakemake
itself) kills its whole process group, Snakemake included, as a power cut or `kill -9` of the
run would, the first time it reaches that point of a write:

- mid-write: the temporary is partly written (the 3rd zarr chunk or metadata file of a store;
  half the text of a table; the first bytes of a figure);
- before-rename: the temporary is whole, not yet renamed to the output;
- after-rename: the output is in place, the job has not yet reported success.
"""

import os
import signal
import sys

POINT = os.environ.get("SINKSCOPE_KILL_AT")
IS_JOB = any("/.snakemake/scripts/" in arg for arg in sys.argv)


def _kill() -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


if POINT and IS_JOB:
    import pathlib

    from sinkscope import storage

    real_replace = storage.replace

    def replace(temporary, path):
        if POINT == "before-rename":
            _kill()
        result = real_replace(temporary, path)
        if POINT == "after-rename":
            _kill()
        return result

    storage.replace = replace

    if POINT == "mid-write":
        import matplotlib.figure
        from zarr.storage import LocalStore

        real_set = LocalStore.set
        writes = []

        async def set_and_maybe_die(self, key, value):
            await real_set(self, key, value)
            writes.append(key)
            if len(writes) == 3:
                _kill()

        LocalStore.set = set_and_maybe_die

        def write_half(self, data, *args, **kwargs):
            with open(self, "w") as handle:
                handle.write(data[: len(data) // 2])
            _kill()

        pathlib.Path.write_text = write_half

        def save_a_little(self, fname, *args, **kwargs):
            with open(fname, "wb") as handle:
                handle.write(b"<?xml version")
            _kill()

        matplotlib.figure.Figure.savefig = save_a_little
