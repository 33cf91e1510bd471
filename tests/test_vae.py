"""Wan2.1's VAE (sinkscope/wan/vae.py, its network sinkscope/wan/vae_net.py): our `WanVAE`
against diffusers' `AutoencoderKLWan` (keys, shapes, decoded pixels and encoded latents bit for
bit, a folder diffusers loads), both file layouts, the family's decoding arithmetic, streaming,
encoding, and what a loader must refuse. Tiny random VAEs (base_dim 2)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from sinkscope.wan import vae as wan_vae
from sinkscope.wan.layout import CheckpointError
from sinkscope.wan.vae_net import WanVAE

# The tests that import diffusers (3-5 s) keep to one xdist worker, which imports it once.
uses_diffusers = pytest.mark.xdist_group("diffusers")

# The family's lists (docs: long-video-family.md, "Wan's VAE, as the family decodes it").
MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
        0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]  # fmt: skip
STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
       3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]  # fmt: skip


def latents(frames: int = 5, height: int = 1, width: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randn(16, frames, height, width, generator=torch.Generator().manual_seed(seed))


def denormalised(z: torch.Tensor) -> torch.Tensor:
    """The decoder's input of normalised latents [B, C, F, H, W], as the family computes it."""
    return z / (1 / torch.tensor(STD).view(16, 1, 1, 1)) + torch.tensor(MEAN).view(16, 1, 1, 1)


class Payload:
    """Pickled by reference: a file holding one carries code."""


# --- against diffusers' AutoencoderKLWan, the reference -----------------------------------------


def diffusers_vae(config=None, seed: int = 0):
    """diffusers' network of `config` (the tiny one when None), every parameter drawn as
    `random_vae` draws it (gains 1 + noise, biases noise, weights noise / sqrt(fan-in)), in
    diffusers' own parameter order."""
    from diffusers import AutoencoderKLWan

    generator = torch.Generator().manual_seed(seed)
    vae = AutoencoderKLWan.from_config(config or wan_vae.tiny_vae_config())
    with torch.no_grad():
        for name, param in vae.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("gamma"):
                param.copy_(1 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(noise / math.sqrt(math.prod(param.shape[1:])))
    return vae.eval().requires_grad_(False)


def ours_of(reference) -> WanVAE:
    """Our network with the reference's weights, copied through the key map."""
    state = reference.state_dict()
    vae = WanVAE(reference.config)
    vae.load_state_dict({wan_vae.diffusers_to_original_key(k): v for k, v in state.items()})
    return vae.eval().requires_grad_(False)


@pytest.mark.parametrize("config", ["tiny", "wan2.1"])
@uses_diffusers
def test_our_parameters_are_diffusers_renamed(config):
    """The state dict of WanVAE: exactly the keys of AutoencoderKLWan's through
    diffusers_to_original_key, with their shapes (Wan2.1's real width built on the meta
    device), and the inverse map used to write diffusers' layout gives diffusers' names back."""
    from diffusers import AutoencoderKLWan

    values = wan_vae.tiny_vae_config() if config == "tiny" else wan_vae.WAN21_VAE_CONFIG
    with torch.device("meta"):
        reference = AutoencoderKLWan.from_config(values).state_dict()
        ours = WanVAE(values).state_dict()
    mapped = {wan_vae.diffusers_to_original_key(k): tuple(v.shape) for k, v in reference.items()}
    assert len(mapped) == len(reference) == 194
    assert mapped == {k: tuple(v.shape) for k, v in ours.items()}
    assert set(wan_vae._diffusers_names(ours).values()) == set(reference)
    assert "decoder.upsamples.4.shortcut.weight" in ours
    assert "decoder.middle.2.residual.6.bias" in ours
    assert ours["conv2.weight"].shape == (16, 16, 1, 1, 1)  # the post-quant conv


@uses_diffusers
def test_the_statistics_are_the_familys_and_diffusers_defaults():
    assert list(wan_vae.WAN_VAE_MEAN) == MEAN and list(wan_vae.WAN_VAE_STD) == STD
    from diffusers import AutoencoderKLWan

    defaults = AutoencoderKLWan.from_config(wan_vae.tiny_vae_config()).config
    assert list(defaults.latents_mean) == MEAN and list(defaults.latents_std) == STD


@uses_diffusers
def test_the_original_layout_is_the_one_diffusers_converter_reads():
    """diffusers' convert_wan_vae_to_diffusers renames our 194 keys to AutoencoderKLWan's, one
    to one (diffusers_to_original_key is its inverse)."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    reference = diffusers_vae()
    state = reference.state_dict()
    ours = ours_of(reference).state_dict()
    assert not set(ours) & set(state)  # every key renamed
    converted = convert_wan_vae_to_diffusers(ours)
    assert converted.keys() == state.keys()
    assert all(torch.equal(converted[k], state[k]) for k in state)


@uses_diffusers
def test_random_vae_draws_the_weights_it_drew_as_diffusers_network():
    """A seed gives the weights it gave when random_vae built AutoencoderKLWan (the demo VAE's
    pixels stay what they were)."""
    for config, seed in ((None, 0), (wan_vae.tiny_vae_config(1), 5)):
        expected = ours_of(diffusers_vae(config, seed)).state_dict()
        drawn = wan_vae.random_vae(config, seed).state_dict()
        assert drawn.keys() == expected.keys()
        assert all(torch.equal(drawn[k], expected[k]) for k in drawn)


@pytest.mark.parametrize("batch", [1, 2])
@uses_diffusers
def test_streamed_decoding_equals_diffusers_decode_bit_for_bit(batch):
    """5 latent frames of 2 x 3 (a batch of `batch` videos), streamed one latent frame at a
    time through iter_decoded_pixels, against diffusers' decode of the whole video, clamped
    (float32, CPU): torch.equal; WanVAE.decode too; each video's uint8 frames, two latent
    frames at a time through iter_decoded_batch, equal its pixels' in the whole decode."""
    reference = diffusers_vae()
    vae = ours_of(reference)
    z = torch.stack([latents(frames=5, height=2, width=3, seed=s) for s in range(batch)])
    with torch.no_grad():
        whole = reference.decode(denormalised(z)).sample.clamp(-1, 1)
        assert torch.equal(vae.decode(denormalised(z)), whole)
    assert whole.shape == (batch, 3, 17, 16, 24)
    assert 10_000 < whole.unique().numel() and (whole.abs() < 1).float().mean() > 0.9
    parts = list(wan_vae.iter_decoded_pixels(vae, z if batch > 1 else z[0]))
    assert [p.shape[2] for p in parts] == [1, 4, 4, 4, 4]
    assert torch.equal(torch.cat(parts, 2), whole)
    chunks = list(wan_vae.iter_decoded_batch(vae, z, chunk=2))
    for b in range(batch):
        frames = [videos[b] for videos in chunks]
        assert [f.shape for f in frames] == [(5, 16, 24, 3), (8, 16, 24, 3), (4, 16, 24, 3)]
        assert torch.equal(torch.cat(frames), wan_vae.frames_to_uint8(whole[b : b + 1]))


@uses_diffusers
def test_encoding_equals_diffusers_posterior_mean_bit_for_bit():
    """encode_frames: (mu - mean) * (1 / std) of diffusers' posterior mean of frames mapped
    x / 255 * 2 - 1, torch.equal; WanVAE.encode on a batch of 2 videos of 11 frames (the last
    2 dropped) equals latent_dist.mean."""
    reference = diffusers_vae()
    vae = ours_of(reference)
    generator = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (9, 16, 24, 3), dtype=torch.uint8, generator=generator)
    x = frames.permute(3, 0, 1, 2).unsqueeze(0).float() / 255.0 * 2 - 1
    with torch.no_grad():
        mu = reference.encode(x).latent_dist.mean[0]
    mean, std = torch.tensor(MEAN).view(16, 1, 1, 1), torch.tensor(STD).view(16, 1, 1, 1)
    encoded = wan_vae.encode_frames(vae, frames)
    assert encoded.shape == (16, 3, 2, 3)
    assert torch.equal(encoded, (mu - mean) * (1 / std))
    videos = torch.rand(2, 3, 11, 16, 24, generator=generator) * 2 - 1
    with torch.no_grad():
        expected = reference.encode(videos).latent_dist.mean
        assert expected.shape == (2, 16, 3, 2, 3)
        assert torch.equal(vae.encode(videos), expected)


@uses_diffusers
def test_a_folder_we_write_loads_in_diffusers_with_the_same_pixels(tmp_path):
    """save_diffusers_layout (no diffusers import) writes a vae/ folder that
    AutoencoderKLWan.from_pretrained loads, with diffusers' own keys and config."""
    from diffusers import AutoencoderKLWan

    vae = wan_vae.random_vae(seed=1)
    wan_vae.save_diffusers_layout(vae, tmp_path / "vae")
    config = json.loads((tmp_path / "vae" / "config.json").read_text())
    assert config["_class_name"] == "AutoencoderKLWan" and config["base_dim"] == 2
    reference = AutoencoderKLWan.from_pretrained(tmp_path / "vae").eval()
    state = load_file(str(tmp_path / "vae" / "diffusion_pytorch_model.safetensors"))
    assert state.keys() == reference.state_dict().keys()
    z = latents(frames=3, height=2, width=3)
    with torch.no_grad():
        expected = reference.decode(denormalised(z).unsqueeze(0)).sample.clamp(-1, 1)
    assert torch.equal(torch.cat(list(wan_vae.iter_decoded_pixels(vae, z)), 2), expected)
    loaded = wan_vae.load_wan_vae(tmp_path / "vae")
    assert torch.equal(loaded.decode(denormalised(z).unsqueeze(0)), expected)


def test_importing_the_vae_imports_no_diffusers():
    """Importing diffusers cost 5-6.5 s per job: the decode and encode paths never do."""
    code = (
        "import sys; from sinkscope.wan.vae import random_vae, iter_decoded_frames;"
        "import torch; list(iter_decoded_frames(random_vae(), torch.zeros(16, 2, 1, 2)));"
        "assert not any(m.split('.')[0] == 'diffusers' for m in sys.modules), 'diffusers'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- both layouts, the family's arithmetic, streaming -------------------------------------------


def test_both_layouts_of_the_same_weights_give_identical_pixels(tmp_path):
    vae = wan_vae.random_vae(seed=0)
    wan_vae.save_original_layout(vae, tmp_path / "Wan2.1_VAE.pth")
    wan_vae.save_diffusers_layout(vae, tmp_path / "pipeline" / "vae")
    from_original = wan_vae.load_wan_vae(
        tmp_path / "Wan2.1_VAE.pth", config=wan_vae.tiny_vae_config()
    )
    from_folder = wan_vae.load_wan_vae(tmp_path / "pipeline")  # finds vae/
    z = latents(frames=2)
    frames = wan_vae.decode_latents(from_original, z)
    assert frames.shape == (5, 8, 16, 3) and frames.dtype == torch.uint8
    assert torch.equal(frames, wan_vae.decode_latents(from_folder, z))
    assert torch.equal(frames, wan_vae.decode_latents(vae, z))
    assert 30 < frames.unique().numel()  # not saturated: the equality says something
    # The original layout as a safetensors file (ComfyUI's) loads the same, and diffusers'.
    save_file(vae.state_dict(), str(tmp_path / "wan_2.1_vae.safetensors"))
    diffusers_file = tmp_path / "pipeline" / "vae" / "diffusion_pytorch_model.safetensors"
    for file in (tmp_path / "wan_2.1_vae.safetensors", diffusers_file):
        loaded = wan_vae.load_wan_vae(file, config=wan_vae.tiny_vae_config())
        assert torch.equal(frames, wan_vae.decode_latents(loaded, z))


def test_loading_casts_to_the_dtype(tmp_path):
    vae = wan_vae.random_vae()
    wan_vae.save_original_layout(vae, tmp_path / "vae.pth")
    half = wan_vae.load_wan_vae(
        tmp_path / "vae.pth", dtype=torch.bfloat16, config=wan_vae.tiny_vae_config()
    )
    assert isinstance(half, WanVAE) and half.dtype == torch.bfloat16
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in half.parameters()) and not half.training
    frames = wan_vae.decode_latents(half, latents(frames=2))
    assert frames.shape == (5, 8, 16, 3) and frames.dtype == torch.uint8


def test_denormalisation_is_the_originals_form():
    """The decoder's input is z / (1 / std) + mean per channel, in float32, bit for bit (not
    z * std + mean, which is 4e-6 off)."""
    vae = wan_vae.random_vae()
    z = latents(frames=2)
    seen = []
    vae.conv2.register_forward_pre_hook(lambda module, args: seen.append(args[0]))  # post-quant
    wan_vae.decode_latents(vae, z)
    mean = torch.tensor(MEAN).view(16, 1, 1, 1)
    std = torch.tensor(STD).view(16, 1, 1, 1)
    expected = z / (1 / std) + mean
    assert seen[0].shape == (1, 16, 2, 1, 2)
    assert torch.equal(seen[0][0], expected)
    assert not torch.equal(seen[0][0], z * std + mean)  # the test tells the two apart


def test_clamp_and_uint8_follow_the_family(monkeypatch):
    """Decoded x -> (x.clamp(-1, 1) * 0.5 + 0.5).clamp(0, 1) * 255, truncated to uint8 as
    torchvision's write_video casts: the bytes below are worked out by hand."""
    vae = wan_vae.random_vae()
    values = [-2.0, -1.0, -0.999, 0.0, 0.5, 0.99, 1.0, 3.0]
    expected = [0, 0, 0, 127, 191, 253, 255, 255]  # 0.1275, 127.5, 191.25, 253.725 truncated
    pixels = torch.empty(1, 3, 1, 2, 4)
    for c in range(3):  # channel c holds the values shifted by c, to check the layout
        pixels[0, c, 0] = torch.tensor(values).roll(c).view(2, 4)
    monkeypatch.setattr(vae, "decode", lambda z: pixels)
    frames = wan_vae.decode_latents(vae, latents(frames=1))
    assert frames.shape == (1, 2, 4, 3) and frames.dtype == torch.uint8
    for c in range(3):
        assert frames[0, :, :, c].flatten().tolist() == torch.tensor(expected).roll(c).tolist()


def test_a_second_stream_starts_afresh():
    """Each stream has its own cache: decoding a video after another gives the same pixels as
    decoding it first (the original's cached_decode would continue the first)."""
    vae = wan_vae.random_vae()
    first = torch.cat(list(wan_vae.iter_decoded_frames(vae, latents(frames=2, seed=1))))
    list(wan_vae.iter_decoded_frames(vae, latents(frames=2, seed=2)))
    again = torch.cat(list(wan_vae.iter_decoded_frames(vae, latents(frames=2, seed=1))))
    assert torch.equal(first, again)


def test_a_stream_takes_one_latent_frame_a_call():
    stream = wan_vae.random_vae().decode_stream()
    with pytest.raises(ValueError, match="one latent frame"):
        stream(torch.zeros(1, 16, 2, 1, 2))


@pytest.mark.parametrize(("pixel_frames", "latent_frames"), [(9, 3), (11, 3), (1, 1)])
def test_encode_then_decode_keeps_the_shapes(pixel_frames, latent_frames):
    vae = wan_vae.random_vae()
    generator = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (pixel_frames, 8, 16, 3), dtype=torch.uint8, generator=generator)
    z = wan_vae.encode_frames(vae, frames)
    assert z.shape == (16, latent_frames, 1, 2) and z.dtype == torch.float32
    assert latent_frames == 1 + (pixel_frames - 1) // 4
    decoded = wan_vae.decode_latents(vae, z)
    assert decoded.shape == (4 * latent_frames - 3, 8, 16, 3)


# --- refusals ---------------------------------------------------------------------------------


def load_original(path):
    return wan_vae.load_wan_vae(path, config=wan_vae.tiny_vae_config())


def refused(path, pattern: str, load=load_original) -> str:
    with pytest.raises(CheckpointError) as caught:
        load(path)
    message = str(caught.value)
    assert str(path) in message, message
    assert re.search(pattern, message), message
    return message


def original_state(vae: WanVAE) -> dict[str, torch.Tensor]:
    return dict(vae.state_dict())


def test_a_file_missing_a_key_is_refused_naming_the_key(tmp_path):
    state = original_state(wan_vae.random_vae())
    del state["decoder.head.2.weight"]
    torch.save(state, tmp_path / "vae.pth")
    refused(tmp_path / "vae.pth", r"missing \['decoder\.head\.2\.weight'\]")


def test_an_unexpected_key_is_refused_naming_it(tmp_path):
    state = original_state(wan_vae.random_vae())
    state["decoder.head.9.weight"] = torch.zeros(3)
    torch.save(state, tmp_path / "vae.pth")
    refused(tmp_path / "vae.pth", r"unexpected \['decoder\.head\.9\.weight'\]")


def test_a_wrong_shape_is_refused_naming_the_key(tmp_path):
    state = original_state(wan_vae.random_vae())
    state["decoder.conv1.weight"] = torch.zeros(8, 16, 3, 3, 1)
    torch.save(state, tmp_path / "vae.pth")
    refused(tmp_path / "vae.pth", r"decoder\.conv1\.weight: file \[8, 16, 3, 3, 1\]")


def test_a_folder_missing_a_key_is_refused(tmp_path):
    """diffusers' from_single_file would load it without a word."""
    wan_vae.save_diffusers_layout(wan_vae.random_vae(), tmp_path / "vae")
    weights = tmp_path / "vae" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    del state["decoder.mid_block.attentions.0.proj.bias"]
    save_file(state, str(weights))
    missing = r"missing \['decoder\.mid_block\.attentions\.0\.proj\.bias'\]"
    refused(tmp_path / "vae", missing, load=wan_vae.load_wan_vae)


def test_another_z_dim_is_refused_naming_both(tmp_path):
    other = wan_vae.random_vae({**wan_vae.tiny_vae_config(), "z_dim": 4})
    wan_vae.save_original_layout(other, tmp_path / "vae.pth")
    refused(tmp_path / "vae.pth", r"z_dim 4\b.*z_dim 16\b")
    wan_vae.save_diffusers_layout(other, tmp_path / "vae")
    assert json.loads((tmp_path / "vae" / "config.json").read_text())["z_dim"] == 4
    with pytest.raises(CheckpointError) as caught:
        wan_vae.load_wan_vae(tmp_path / "vae")
    assert str(tmp_path / "vae" / "config.json") in str(caught.value)
    assert re.search(r"z_dim 4\b.*z_dim 16\b", str(caught.value)), caught.value
    with pytest.raises(CheckpointError, match=r"z_dim 4\b.*z_dim 16\b"):
        wan_vae.load_wan_vae(tmp_path / "vae.pth", config=other.config)


def test_a_missing_file_is_named(tmp_path):
    refused(tmp_path / "Wan2.1_VAE.pth", r"not found")
    refused(tmp_path / "nowhere", r"not found", load=wan_vae.load_wan_vae)
    (tmp_path / "empty").mkdir()
    message = refused(tmp_path / "empty", r"not found", load=wan_vae.load_wan_vae)
    assert "config.json" in message


def test_pickled_code_is_refused_naming_the_file(tmp_path):
    state = original_state(wan_vae.random_vae())
    torch.save({**state, "payload": Payload()}, tmp_path / "vae.pth")
    refused(tmp_path / "vae.pth", r"refused to unpickle.*Payload")


def test_a_file_mixing_both_layouts_is_refused_naming_both_keys(tmp_path):
    state = original_state(wan_vae.random_vae())
    state["decoder.conv_in.bias"] = state["decoder.conv1.bias"].clone()
    save_file(state, str(tmp_path / "vae.safetensors"))
    refused(
        tmp_path / "vae.safetensors",
        r"'decoder\.conv1\.bias' and 'decoder\.conv_in\.bias' are both.*mixing",
    )


def test_wan22s_vae_is_refused_naming_the_config(tmp_path):
    config = tmp_path / "vae" / "config.json"
    wan_vae.save_diffusers_layout(wan_vae.random_vae(), tmp_path / "vae")
    for change in ({"patch_size": 2}, {"is_residual": True}, {"attn_scales": [0.5]}):
        config.write_text(json.dumps({**wan_vae.tiny_vae_config(), **change}))
        refused(
            config, r"Wan2\.2's|attn_scales", load=lambda _: wan_vae.load_wan_vae(config.parent)
        )
        with pytest.raises(ValueError, match=r"Wan2\.2's|attn_scales"):
            WanVAE({**wan_vae.tiny_vae_config(), **change})
