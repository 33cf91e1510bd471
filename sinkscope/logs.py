"""Job logging for Snakemake scripts: everything a job prints goes to its log file."""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

# One line per record in every job log (a store process's child writes to the same file).
LOG_FORMAT = "%(asctime)s %(name)s: %(message)s"


@contextlib.contextmanager
def job_log(path: str | Path | None) -> Iterator[None]:
    """Send logging, stdout and stderr (progress bars) to `path`, warnings to the console as well;
    record a failure's traceback."""
    if path is None:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        yield
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", buffering=1) as handle:
        handler = logging.StreamHandler(handle)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        # Warnings reach the console too (Snakemake shows a local job's stderr; on SLURM its log).
        console = logging.StreamHandler(sys.__stderr__)
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter(f"sinkscope: %(levelname)s ({path}): %(message)s"))
        root = logging.getLogger()
        root.addHandler(handler)
        root.addHandler(console)
        root.setLevel(logging.INFO)
        try:
            with contextlib.redirect_stdout(handle), contextlib.redirect_stderr(handle):
                yield
        except BaseException:
            handle.write(traceback.format_exc())
            raise
        finally:
            root.removeHandler(handler)
            root.removeHandler(console)
