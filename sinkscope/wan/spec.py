"""A checkpoint as one object, from its `checkpoints:` entry to the loader. No torch.

`CheckpointSpec` names the files and the choices that define a model's weights. The workflow
builds it from the config entry, hashes it into the extraction params (so any field's change
re-runs the extractions) and hands it to `sinkscope.wan.checkpoint.load_wan_model`. Adding a key
to a checkpoint entry = the schema (`schemas/config.schema.yaml`) + a field here (+ its use in the
loader); the params and so the reruns follow from the fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .layout import checkpoint_files


@dataclass(frozen=True)
class CheckpointSpec:
    """base: a Wan or diffusers folder (config.json, and the weights unless `generator` is set);
    generator: a Self-Forcing / CausVid `.pt` whose DiT replaces the base weights;
    ema: take its `generator_ema` (True) or `generator` (False) entry;
    lora: a LoRA file (LongLive's PEFT keys, `lora.py`) run unmerged beside those weights, with
    lora_alpha: its alpha (scale alpha / rank; the files do not carry it)."""

    base: str
    generator: str | None = None
    ema: bool = True
    lora: str | None = None
    lora_alpha: float | None = None

    def __post_init__(self):
        if (self.lora is None) != (self.lora_alpha is None):
            raise ValueError("lora and lora_alpha go together: the LoRA file carries no alpha")

    @classmethod
    def from_entry(cls, entry: Mapping) -> CheckpointSpec:
        """The spec of a config entry; keys that are not about the weights (`sampler`) stay out."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in entry.items() if key in names})

    def to_params(self) -> dict:
        """The fields that are set, as plain values: what extraction params record and hash."""
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}

    def files(self) -> list[Path]:
        """Every file whose bytes define the weights (see `layout.checkpoint_files`)."""
        files = checkpoint_files(self.base, self.generator)
        return files if self.lora is None else [*files, Path(self.lora)]
