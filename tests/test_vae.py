"""Wan2.1's VAE (sinkscope/wan/vae.py): both file layouts, the family's decoding arithmetic,
streaming, encoding, and what a loader must refuse. Tiny random VAEs (base_dim 2)."""

from __future__ import annotations

import json
import re
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from sinkscope.wan import vae as wan_vae
from sinkscope.wan.layout import CheckpointError

# sinkscope.wan.vae imports diffusers on first use (3-5 s): these tests keep to the worker of
# the other diffusers tests, which imports it once.
pytestmark = pytest.mark.xdist_group("diffusers")

# The family's lists (docs: long-video-family.md, "Wan's VAE, as the family decodes it").
MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
        0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]  # fmt: skip
STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
       3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]  # fmt: skip


def latents(frames: int = 5, height: int = 1, width: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randn(16, frames, height, width, generator=torch.Generator().manual_seed(seed))


def original_state(vae) -> dict[str, torch.Tensor]:
    return {wan_vae.diffusers_to_original_key(k): v for k, v in vae.state_dict().items()}


class Payload:
    """Pickled by reference: a file holding one carries code."""


def test_the_statistics_are_the_familys_and_diffusers_defaults():
    assert list(wan_vae.WAN_VAE_MEAN) == MEAN and list(wan_vae.WAN_VAE_STD) == STD
    from diffusers import AutoencoderKLWan

    defaults = AutoencoderKLWan.from_config(wan_vae.tiny_vae_config()).config
    assert list(defaults.latents_mean) == MEAN and list(defaults.latents_std) == STD


def test_the_original_layout_is_the_one_diffusers_converter_reads():
    """diffusers_to_original_key is the inverse of convert_wan_vae_to_diffusers, one to one, on
    all 194 keys."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    vae = wan_vae.random_vae()
    state = vae.state_dict()
    original = original_state(vae)
    assert len(state) == len(original) == 194
    assert not set(original) & set(state)  # every key renamed
    assert "decoder.upsamples.4.shortcut.weight" in original
    assert "decoder.middle.2.residual.6.bias" in original
    converted = convert_wan_vae_to_diffusers(original)
    assert converted.keys() == state.keys()
    assert all(torch.equal(converted[k], state[k]) for k in state)


def test_both_layouts_of_the_same_weights_give_identical_pixels(tmp_path):
    vae = wan_vae.random_vae(seed=0)
    wan_vae.save_original_layout(vae, tmp_path / "Wan2.1_VAE.pth")
    vae.save_pretrained(tmp_path / "pipeline" / "vae")  # diffusers' own writer
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
    # The original layout as a safetensors file (ComfyUI's) loads the same.
    save_file(original_state(vae), str(tmp_path / "wan_2.1_vae.safetensors"))
    comfy = wan_vae.load_wan_vae(
        tmp_path / "wan_2.1_vae.safetensors", config=wan_vae.tiny_vae_config()
    )
    assert torch.equal(frames, wan_vae.decode_latents(comfy, z))


def test_loading_casts_to_the_dtype(tmp_path):
    vae = wan_vae.random_vae()
    wan_vae.save_original_layout(vae, tmp_path / "vae.pth")
    half = wan_vae.load_wan_vae(
        tmp_path / "vae.pth", dtype=torch.bfloat16, config=wan_vae.tiny_vae_config()
    )
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
    vae.post_quant_conv.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
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
    monkeypatch.setattr(vae, "decode", lambda z: types.SimpleNamespace(sample=pixels))
    frames = wan_vae.decode_latents(vae, latents(frames=1))
    assert frames.shape == (1, 2, 4, 3) and frames.dtype == torch.uint8
    for c in range(3):
        assert frames[0, :, :, c].flatten().tolist() == torch.tensor(expected).roll(c).tolist()


def test_streamed_decoding_equals_whole_decoding_bit_for_bit():
    """5 latent frames one at a time through the causal feature cache, against diffusers' own
    decode of the whole video (float32); the uint8 frames two latent frames at a time."""
    vae = wan_vae.random_vae()
    z = latents(frames=5)
    mean = torch.tensor(MEAN).view(1, 16, 1, 1, 1)
    std = torch.tensor(STD).view(1, 16, 1, 1, 1)
    whole = vae.decode(z.unsqueeze(0) / (1 / std) + mean).sample
    assert whole.shape == (1, 3, 17, 8, 16)
    parts = list(wan_vae.iter_decoded_pixels(vae, z))
    assert [p.shape[2] for p in parts] == [1, 4, 4, 4, 4]
    assert torch.equal(torch.cat(parts, 2), whole)
    frames = list(wan_vae.iter_decoded_frames(vae, z, chunk=2))
    assert [f.shape for f in frames] == [(5, 8, 16, 3), (8, 8, 16, 3), (4, 8, 16, 3)]
    assert torch.equal(torch.cat(frames), wan_vae.frames_to_uint8(whole))


def test_a_second_stream_starts_afresh():
    """Each stream has its own cache: decoding a video after another gives the same pixels as
    decoding it first (the original's cached_decode would continue the first)."""
    vae = wan_vae.random_vae()
    first = torch.cat(list(wan_vae.iter_decoded_frames(vae, latents(frames=2, seed=1))))
    list(wan_vae.iter_decoded_frames(vae, latents(frames=2, seed=2)))
    again = torch.cat(list(wan_vae.iter_decoded_frames(vae, latents(frames=2, seed=1))))
    assert torch.equal(first, again)


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


def test_encoding_normalises_the_posterior_mean():
    """(mu - mean) / std of diffusers' posterior mean, on frames mapped x / 255 * 2 - 1."""
    vae = wan_vae.random_vae()
    frames = torch.randint(0, 256, (5, 8, 8, 3), dtype=torch.uint8)
    x = frames.permute(3, 0, 1, 2).unsqueeze(0).float() / 255 * 2 - 1
    mu = vae.encode(x).latent_dist.mean[0]
    expected = (mu - torch.tensor(MEAN).view(16, 1, 1, 1)) / torch.tensor(STD).view(16, 1, 1, 1)
    torch.testing.assert_close(wan_vae.encode_frames(vae, frames), expected, rtol=1e-6, atol=1e-6)


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
    wan_vae.random_vae().save_pretrained(tmp_path / "vae")
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
    other.save_pretrained(tmp_path / "vae")
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
