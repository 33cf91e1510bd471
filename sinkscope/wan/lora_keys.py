"""LoRA files by their keys and shapes alone, without torch: what the loader (`lora.py`) and the
workflow's checks before any job (`workflow/preflight.py`) both refuse.

LongLive (NVlabs/LongLive) saves PEFT's state dict of a LoRA on the linears of every block,
under `generator_lora` in its `.pt` or bare: keys
`base_model.model.blocks.{i}.{self_attn,cross_attn}.{q,k,v,o}.lora_{A,B}.weight` and
`base_model.model.blocks.{i}.ffn.{0,2}.lora_{A,B}.weight` (some PEFT versions write the adapter's
name, `.lora_A.default.weight`; those load too), A [r, in] and B [out, r], no bias. Neither the
rank nor alpha is in the file: the rank is A's first dimension, alpha comes from the config.

A file without the `base_model.model.` prefix loads nothing in LongLive (its base model runs
silently); here it is refused, as is every key that adapts no linear of the model, an A without
its B, shapes that do not fit the linear they adapt, and ranks that differ.
"""

from __future__ import annotations

import collections
import pickle
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .layout import CheckpointError

LORA_ENTRY = "generator_lora"
PEFT_PREFIX = "base_model.model."
# <module>.lora_A[.<adapter name>].weight
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<half>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")


@dataclass(frozen=True)
class LoraPair:
    """One adapted linear: `module`, the DiT's name of the linear (`blocks.0.self_attn.q`), the
    file's keys of its down projection A [rank, in] and up projection B [out, rank]."""

    module: str
    down_key: str
    up_key: str
    rank: int

    @property
    def keys(self) -> tuple[str, str]:
        """(B's key, A's key): the order of the product B A."""
        return self.up_key, self.down_key


def lora_pairs(
    shapes: dict[str, tuple[int, ...]], linears: dict[str, tuple[int, int]], source: str
) -> list[LoraPair]:
    """The (A, B) pairs of a LoRA state dict given as key -> shape, checked against the model's
    linears (`WanConfig.linear_shapes`: name -> [out, in]). Every problem is a CheckpointError
    naming `source` and the key."""
    if not shapes:
        raise CheckpointError(f"{source}: the LoRA state dict is empty")
    halves: dict[str, dict[str, str]] = {}
    for key in shapes:
        if not key.startswith(PEFT_PREFIX):
            raise CheckpointError(
                f"{source}: key '{key}' lacks PEFT's '{PEFT_PREFIX}' prefix (LongLive would load "
                "nothing of such a file and run the base model)"
            )
        match = _LORA_KEY.match(key.removeprefix(PEFT_PREFIX))
        if match is None:
            raise CheckpointError(
                f"{source}: key '{key}' is not a LoRA weight (<module>.lora_A.weight or "
                "<module>.lora_B.weight)"
            )
        module, half = match["module"], match["half"]
        if module not in linears:
            raise CheckpointError(
                f"{source}: key '{key}' adapts '{module}', which is no linear of the Wan DiT"
            )
        found = halves.setdefault(module, {})
        if half in found:
            raise CheckpointError(
                f"{source}: '{module}' has two lora_{half} tensors: '{found[half]}' and '{key}'"
            )
        found[half] = key
    pairs = []
    for module, found in sorted(halves.items()):
        for half, other in (("A", "B"), ("B", "A")):
            if half in found and other not in found:
                raise CheckpointError(f"{source}: '{found[half]}' has no lora_{other} beside it")
        down_key, up_key = found["A"], found["B"]
        down, up = tuple(shapes[down_key]), tuple(shapes[up_key])
        out_features, in_features = linears[module]
        if len(down) != 2 or len(up) != 2:
            raise CheckpointError(
                f"{source}: '{down_key}' {list(down)} and '{up_key}' {list(up)} must be matrices"
            )
        if down[0] != up[1]:
            raise CheckpointError(
                f"{source}: rank mismatch: '{down_key}' {list(down)} has rank {down[0]}, "
                f"'{up_key}' {list(up)} rank {up[1]}"
            )
        if down[1] != in_features or up[0] != out_features:
            raise CheckpointError(
                f"{source}: '{down_key}' {list(down)} and '{up_key}' {list(up)} do not fit "
                f"'{module}' [{out_features}, {in_features}] (A must be [r, {in_features}], "
                f"B [{out_features}, r]): a LoRA for another model width?"
            )
        pairs.append(LoraPair(module, down_key, up_key, down[0]))
    ranks = {pair.rank: pair for pair in pairs}
    if len(ranks) > 1:
        named = ", ".join(f"{rank} at '{pair.down_key}'" for rank, pair in sorted(ranks.items()))
        raise CheckpointError(f"{source}: the adapters' ranks differ ({named}): one alpha / r")
    return pairs


# --- shapes of a torch.save file without torch ---------------------------------------------------


@dataclass(frozen=True)
class _TensorShape:
    shape: tuple[int, ...]


class _Storage:
    """Stands for a torch storage class (`torch.BFloat16Storage` ...) in the pickle."""


def _rebuild_tensor(storage, offset, size, *rest):
    return _TensorShape(tuple(size))


class _ShapeUnpickler(pickle.Unpickler):
    """Reads a torch.save pickle's containers and tensor shapes, never the tensor bytes; any
    other global is refused (as `torch.load(weights_only=True)` would refuse most)."""

    _GLOBALS: ClassVar[dict] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): lambda data, *rest: data,
        ("collections", "OrderedDict"): collections.OrderedDict,
    }

    def find_class(self, module, name):
        if (module, name) in self._GLOBALS:
            return self._GLOBALS[module, name]
        if module == "torch" and name.endswith("Storage"):
            return _Storage
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return pid  # ('storage', storage class, key, location, numel): the bytes stay unread


def torch_file_shapes(path: Path) -> object | None:
    """The object a torch.save zip archive holds, every tensor replaced by its shape (an object
    with `.shape`), read from the archive's `data.pkl` alone; None for a legacy (pre-zip) file,
    whose shapes only the job's loader sees. A CheckpointError names what cannot be read."""
    if not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as archive:
        names = [name for name in archive.namelist() if name.endswith("/data.pkl")]
        if len(names) != 1:
            raise CheckpointError(f"{path}: not a torch.save archive (no single */data.pkl)")
        with archive.open(names[0]) as handle:
            try:
                return _ShapeUnpickler(handle).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as err:
                raise CheckpointError(f"{path}: cannot read its tensor shapes ({err})") from None


def lora_entry(
    state: object, source: str, is_tensor: Callable[[object], bool]
) -> dict[str, object]:
    """The LoRA state dict of what a file holds: bare or under `generator_lora`, names to
    values that `is_tensor` accepts (tensors for the loader, shapes for the checks)."""
    if isinstance(state, dict) and LORA_ENTRY in state:
        state = state[LORA_ENTRY]
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and is_tensor(v) for k, v in state.items()
    ):
        raise CheckpointError(
            f"{source}: not a LoRA state dict (name -> tensor), bare or under '{LORA_ENTRY}'"
        )
    return state


def lora_shapes(state: object, source: str) -> dict[str, tuple[int, ...]]:
    """key -> shape of a LoRA state dict read by `torch_file_shapes` (bare or under
    `generator_lora`)."""
    entry = lora_entry(state, source, lambda value: isinstance(value, _TensorShape))
    return {key: value.shape for key, value in entry.items()}
