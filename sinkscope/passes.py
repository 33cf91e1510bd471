"""Which passes of a block are captured: shared by config checks, resources and extraction jobs.

A block runs `num_steps` denoising passes (0 .. num_steps - 1) and then the cache-update pass
(index num_steps). No torch, no numpy: Snakemake calls this while parsing, jobs inside.
"""

from __future__ import annotations

from collections.abc import Sequence


def resolve_passes(
    spec: str | int | Sequence[int | str], num_steps: int, key: str = "capture.passes"
) -> list[int]:
    """Pass indices within a block (0..num_steps-1 denoising steps, num_steps = cache pass).

    spec: 'all', 'cache', 'last' (the last denoising step), an index, or a list of those; `key`
    names the setting in errors.
    """
    cache = num_steps
    if isinstance(spec, str | int):
        spec = [spec]
    chosen: set[int] = set()
    for item in spec:
        if item == "all":
            chosen.update(range(num_steps + 1))
        elif item == "cache":
            chosen.add(cache)
        elif item == "last":
            chosen.add(num_steps - 1)
        elif isinstance(item, int) and not isinstance(item, bool) and 0 <= item <= cache:
            chosen.add(item)
        else:
            raise ValueError(
                f"{key}: {item!r} is not 'all', 'cache', 'last' or a pass index "
                f"0..{cache} ({num_steps} denoising steps, then the cache pass)"
            )
    return sorted(chosen)
