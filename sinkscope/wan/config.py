"""Wan2.1 DiT hyper-parameters, read from and written to Wan's original `config.json`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Every released Wan2.1 DiT has head_dim 128: 1.3B (dim 1536) 12 heads, 14B (dim 5120) 40 heads.
WAN_HEAD_DIM = 128
WAN_HEADS_BY_DIM = {1536: 12, 5120: 40}

# Keys the original config.json (or WanModel.__init__) may carry that do not change the T2V DiT.
_IGNORED_KEYS = {"_class_name", "_diffusers_version", "_name_or_path"}


@dataclass(frozen=True)
class WanConfig:
    """Defaults are Wan2.1-T2V-1.3B (WanModel.__init__ defaults + its config.json)."""

    dim: int = 1536
    ffn_dim: int = 8960
    num_heads: int = 12
    num_layers: int = 30
    freq_dim: int = 256
    text_dim: int = 4096
    text_len: int = 512
    in_dim: int = 16
    out_dim: int = 16
    patch_size: tuple[int, int, int] = (1, 2, 2)
    window_size: tuple[int, int] = (-1, -1)
    qk_norm: bool = True
    cross_attn_norm: bool = True
    eps: float = 1e-6
    model_type: str = "t2v"

    def __post_init__(self):
        if self.dim % self.num_heads:
            raise ValueError(f"dim={self.dim} is not divisible by num_heads={self.num_heads}")
        if self.head_dim % 2 or self.head_dim < 6:
            raise ValueError(f"head_dim={self.head_dim} must be even and >= 6 for 3D RoPE")
        if self.model_type != "t2v":
            raise ValueError(
                f"model_type={self.model_type!r}: only text-to-video ('t2v') is supported"
            )
        if tuple(self.window_size) != (-1, -1):
            raise ValueError(f"window_size={self.window_size}: only global attention is supported")
        if not (self.qk_norm and self.cross_attn_norm):
            raise ValueError(
                "qk_norm and cross_attn_norm must be true (as in every Wan2.1 T2V model)"
            )

    def num_heads_doubt(self) -> tuple[str | None, str | None]:
        """(error, warning) about num_heads. The weights cannot check it: q, k, v, o and the
        qk-norm span the full width, so a wrong count loads and silently splits the attention
        into other heads. A released model's width fixes it (error); otherwise a head_dim other
        than Wan's 128 is suspicious but cannot be decided (warning)."""
        expected = WAN_HEADS_BY_DIM.get(self.dim)
        if expected is not None and self.num_heads != expected:
            return (
                f"num_heads={self.num_heads}, but every Wan2.1 model of dim {self.dim} has "
                f"{expected} heads of {WAN_HEAD_DIM} channels",
                None,
            )
        if self.head_dim != WAN_HEAD_DIM:
            # Wan's qk-norm is one RMSNorm over the whole width (norm_q.weight has dim entries),
            # so no tensor has a per-head shape that would decide the count.
            return None, (
                f"num_heads={self.num_heads} gives head_dim={self.head_dim}, where every released "
                f"Wan2.1 model has {WAN_HEAD_DIM}. sinkscope uses num_heads={self.num_heads} as "
                f"given; the weights cannot tell (q, k, v, o and the qk-norm span the whole width "
                f"of {self.dim}, with no per-head trace). Check num_heads against the "
                "configuration the model was trained with (its training config or model card): "
                "a wrong count loads and silently splits the attention into other heads"
            )
        return None, None

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def num_parameters(self) -> int:
        """Parameters of the DiT (1,418,996,800 for Wan2.1-T2V-1.3B), counted from its shapes
        without building it: what the weights take on a GPU, at 2 bytes each in bf16."""
        d, f = self.dim, self.ffn_dim
        patch = self.patch_size[0] * self.patch_size[1] * self.patch_size[2]
        # Per block: self and cross attention (q, k, v, o with biases; RMS qk-norm weights),
        # norm3 (affine LayerNorm), the FFN and the 6 modulation vectors.
        block = 2 * (4 * (d * d + d) + 2 * d) + 2 * d + (d * f + f + f * d + d) + 6 * d
        patch_embedding = self.in_dim * d * patch + d  # a Conv3d
        text_embedding = self.text_dim * d + d + d * d + d
        time_embedding = self.freq_dim * d + d + d * d + d
        time_projection = d * 6 * d + 6 * d
        embed = patch_embedding + text_embedding + time_embedding + time_projection
        head = d * self.out_dim * patch + self.out_dim * patch + 2 * d  # head, its modulation
        return self.num_layers * block + embed + head

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """The DiT's linear layers by parameter name (less `.weight`), with their weight shapes
        [out, in]: what a LoRA may adapt (`lora_keys.py`), known without building the model."""
        d = self.dim
        shapes = {
            "text_embedding.0": (d, self.text_dim),
            "text_embedding.2": (d, d),
            "time_embedding.0": (d, self.freq_dim),
            "time_embedding.2": (d, d),
            "time_projection.1": (6 * d, d),
            "head.head": (
                self.patch_size[0] * self.patch_size[1] * self.patch_size[2] * self.out_dim,
                d,
            ),
        }
        for i in range(self.num_layers):
            for attention in ("self_attn", "cross_attn"):
                for name in "qkvo":
                    shapes[f"blocks.{i}.{attention}.{name}"] = (d, d)
            shapes[f"blocks.{i}.ffn.0"] = (self.ffn_dim, d)
            shapes[f"blocks.{i}.ffn.2"] = (d, self.ffn_dim)
        return shapes

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> WanConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields - _IGNORED_KEYS)
        if unknown:
            raise ValueError(
                f"{source}: unknown Wan config keys {unknown}; known: {sorted(fields)}"
            )
        kwargs = {k: v for k, v in values.items() if k in fields}
        for key in ("patch_size", "window_size"):
            if key in kwargs:
                kwargs[key] = tuple(kwargs[key])
        return cls(**kwargs)

    def to_dict(self) -> dict:
        values = dataclasses.asdict(self)
        values["patch_size"] = list(self.patch_size)
        values["window_size"] = list(self.window_size)
        return {"_class_name": "WanModel", **values}

    def token_grid(self, latent_height: int, latent_width: int) -> tuple[int, int]:
        """(height, width) in tokens of one latent frame after patchify (30 x 52 for 60 x 104)."""
        _, ph, pw = self.patch_size
        if latent_height % ph or latent_width % pw:
            raise ValueError(
                f"latent grid {latent_height}x{latent_width} is not divisible by patch {ph}x{pw}"
            )
        return latent_height // ph, latent_width // pw

    def tokens_per_frame(self, latent_height: int, latent_width: int) -> int:
        """Tokens of one latent frame after patchify (1560 for a 60 x 104 latent)."""
        height, width = self.token_grid(latent_height, latent_width)
        return height * width
