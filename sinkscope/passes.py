"""Which passes of a block are captured: shared by config checks, resources and extraction jobs.

A block runs `num_steps` denoising passes (0 .. num_steps - 1) and then the cache-update pass
(index num_steps). A rollout whose prompt switches under LongLive's recache has one more slot,
num_steps + 1: the recache pass that re-encodes a query frame under the new prompt. No torch, no
numpy: Snakemake calls this while parsing, jobs inside.
"""

from __future__ import annotations

from collections.abc import Sequence


def resolve_passes(
    spec: str | int | Sequence[int | str],
    num_steps: int,
    key: str = "capture.passes",
    recache: bool = False,
) -> list[int]:
    """Pass indices within a block (0..num_steps-1 denoising steps, num_steps = cache pass, and
    with `recache` num_steps + 1 = the recache pass).

    spec: 'all', 'cache', 'last' (the last denoising step), 'recache', an index, or a list of
    those; `key` names the setting in errors. 'recache' where the rollout has no recache pass
    selects nothing (a plain prompt under a recaching sampler).
    """
    cache = num_steps
    last = cache + 1 if recache else cache
    if isinstance(spec, str | int):
        spec = [spec]
    chosen: set[int] = set()
    for item in spec:
        if item == "all":
            chosen.update(range(last + 1))
        elif item == "recache":
            chosen.update(range(cache + 1, last + 1))
        elif item == "cache":
            chosen.add(cache)
        elif item == "last":
            chosen.add(num_steps - 1)
        elif isinstance(item, int) and not isinstance(item, bool) and 0 <= item <= last:
            chosen.add(item)
        else:
            raise ValueError(
                f"{key}: {item!r} is not 'all', 'cache', 'last', 'recache' or a pass index "
                f"0..{last} ({num_steps} denoising steps, then the cache pass"
                f"{', then the recache pass' if recache else ''})"
            )
    return sorted(chosen)
