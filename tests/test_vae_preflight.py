"""The VAE in the preflight (sinkscope.workflow.preflight): with videos decoded, each decoded
checkpoint's VAE (its own `vae`, else the shared `vae`, else Wan2.1_VAE.pth beside its base) is
checked with the other files, one line each under the key that decides it; `videos: none`
checks none; the demo's VAE is made by a rule and never reported. Torch-free, on the header-only
files of tests/test_onboarding.py."""

from __future__ import annotations

import copy
import json
from contextlib import chdir
from pathlib import Path

import pytest
from snakemake.utils import validate

from sinkscope.wan.layout import CONFIG_NAME
from sinkscope.workflow.preflight import preflight

from .test_config import DEMO, SCHEMA
from .test_onboarding import (
    checked,
    problems_of,
    real_config,
    write_safetensors,
    write_torch_zip,
    write_wan_folder,
)

DEFAULT_KEY = "checkpoints.sf"
NOT_FOUND = (
    "VAE not found (Wan2.1_VAE.pth beside base unless vae or checkpoints.<name>.vae names one; "
    "videos: none decodes nothing):"
)
VAE_WEIGHTS = "diffusion_pytorch_model.safetensors"


def video_config(root: Path, videos: str = "closed_loop") -> dict:
    """tests/test_onboarding.py's real layout (checkpoints sf and base_wan over one Wan folder,
    no VAE in it) with one closed-loop run, sf on fox, decoded as `videos` says."""
    config = real_config(root)
    config["closed_loop"]["policies"] = ["window"]
    config["closed_loop"]["runs"] = [["sf", "fox"]]
    config["videos"] = videos
    return config


def write_vae_folder(folder: Path, **config) -> Path:
    """A diffusers vae/ folder: its config.json and a weights file of a header alone."""
    folder.mkdir(parents=True, exist_ok=True)
    values = {"_class_name": "AutoencoderKLWan", "base_dim": 96, "z_dim": 16, **config}
    (folder / CONFIG_NAME).write_text(json.dumps(values))
    write_safetensors(folder / VAE_WEIGHTS, {})
    return folder


def checked_schema(config: dict) -> dict:
    """The config validated (defaults filled), not checked: what preflight takes."""
    validate(config, SCHEMA)
    return config


def test_the_default_vae_beside_the_base_is_listed_with_the_other_missing_files(tmp_path):
    config = video_config(tmp_path)
    config["checkpoints"]["sf"]["generator"] = str(tmp_path / "missing" / "sf.pt")
    vae = tmp_path / "wan" / "Wan2.1_VAE.pth"
    assert problems_of(config, tmp_path) == [
        f"checkpoints.sf: checkpoint file not found: {tmp_path}/missing/sf.pt",
        f"{DEFAULT_KEY}: {NOT_FOUND} {vae}",
    ]
    # Once the VAE is there, it passes (base_wan is not in the closed loop: not decoded).
    write_torch_zip(vae)
    assert preflight(checked(video_config(tmp_path), tmp_path)) == []


def test_a_missing_base_folder_is_listed_not_raised_with_videos_on(tmp_path):
    config = video_config(tmp_path)
    missing = tmp_path / "missing"
    config["checkpoints"]["sf"] = {
        "base": str(missing / "wan"),
        "generator": str(missing / "sf.pt"),
    }
    problems = preflight(checked_schema(config))
    assert f"checkpoints.sf: checkpoint file not found: {missing}/wan/config.json" in problems
    assert f"checkpoints.sf: checkpoint file not found: {missing}/sf.pt" in problems


def test_videos_none_checks_no_vae(tmp_path):
    config = video_config(tmp_path, videos="none")
    assert preflight(checked(config, tmp_path)) == []
    config = video_config(tmp_path, videos="none")
    config["checkpoints"]["sf"]["generator"] = str(tmp_path / "missing" / "sf.pt")
    config["vae"] = str(tmp_path / "missing" / "vae.pth")
    assert problems_of(config, tmp_path) == [
        f"checkpoints.sf: checkpoint file not found: {tmp_path}/missing/sf.pt"
    ]


def test_videos_all_checks_the_surveyed_checkpoints_vae_once(tmp_path):
    """sf (closed loop and survey) and base_wan (survey) share one base folder: one line."""
    config = video_config(tmp_path, videos="all")
    vae = tmp_path / "wan" / "Wan2.1_VAE.pth"
    assert problems_of(config, tmp_path) == [f"{DEFAULT_KEY}: {NOT_FOUND} {vae}"]
    config = video_config(tmp_path, videos="all")
    config["checkpoints"]["base_wan"]["vae"] = str(tmp_path / "other.pth")
    assert problems_of(config, tmp_path) == [
        f"{DEFAULT_KEY}: {NOT_FOUND} {vae}",
        f"checkpoints.base_wan.vae: {NOT_FOUND} {tmp_path}/other.pth",
    ]


def _not_json(root: Path) -> tuple[str, str]:
    folder = write_vae_folder(root / "vae")
    (folder / CONFIG_NAME).write_text('{"z_dim": 16,')
    return str(folder), f"{folder}/{CONFIG_NAME}: not valid JSON ("


def _z_dim_8(root: Path) -> tuple[str, str]:
    folder = write_vae_folder(root / "vae", z_dim=8)
    return str(folder), f"{folder}/{CONFIG_NAME}: a VAE of z_dim 8; Wan2.1's has z_dim 16"


def _another_class(root: Path) -> tuple[str, str]:
    folder = write_vae_folder(root / "vae", _class_name="AutoencoderKLQwenImage")
    return str(folder), f"{folder}/{CONFIG_NAME}: a AutoencoderKLQwenImage, not Wan's VAE"


def _no_weights(root: Path) -> tuple[str, str]:
    folder = write_vae_folder(root / "vae")
    (folder / VAE_WEIGHTS).unlink()
    return str(folder), f"VAE file not found: {folder}/{VAE_WEIGHTS}"


def _pth_not_torch(root: Path) -> tuple[str, str]:
    path = root / "Wan2.1_VAE.pth"
    path.write_text("<html>404 Not Found</html>")
    return str(path), f"{path}: not a torch checkpoint (neither the zip archive"


def _lfs_safetensors(root: Path) -> tuple[str, str]:
    path = root / "vae.safetensors"
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 507609880\n")
    return str(path), f"{path}: a Git LFS pointer"


def _pipeline_weights_not_safetensors(root: Path) -> tuple[str, str]:
    folder = write_vae_folder(root / "pipeline" / "vae")  # the pipeline folder is named
    (folder / VAE_WEIGHTS).write_bytes(b"garbage!")
    return str(root / "pipeline"), f"{folder}/{VAE_WEIGHTS}: not a readable safetensors file"


BROKEN = {
    "config-not-json": _not_json,
    "config-z-dim-8": _z_dim_8,
    "config-another-class": _another_class,
    "folder-without-weights": _no_weights,
    "pth-not-torch": _pth_not_torch,
    "safetensors-lfs-pointer": _lfs_safetensors,
    "pipeline-weights-not-safetensors": _pipeline_weights_not_safetensors,
}


@pytest.mark.parametrize("breaks", BROKEN.values(), ids=BROKEN.keys())
def test_a_broken_shared_vae_is_named_with_the_key_vae(tmp_path, breaks):
    config = video_config(tmp_path)
    config["vae"], message = breaks(tmp_path)
    (problem,) = problems_of(config, tmp_path)
    assert problem.startswith(f"vae: {message}"), problem


def test_good_vae_layouts_pass(tmp_path):
    for vae in (
        write_vae_folder(tmp_path / "vae"),
        write_vae_folder(tmp_path / "pipeline" / "vae").parent,
        write_torch_zip(tmp_path / "Wan2.1_VAE.pth"),
        write_safetensors(tmp_path / "vae.safetensors", {}),
    ):
        config = video_config(tmp_path)
        config["vae"] = str(vae)
        assert preflight(checked(config, tmp_path)) == [], vae


def test_a_checkpoints_own_vae_overrides_the_shared_one(tmp_path):
    good = write_torch_zip(tmp_path / "good.pth")
    broken = tmp_path / "broken.pth"
    broken.write_bytes(b"")
    config = video_config(tmp_path)
    config["vae"] = str(broken)
    config["checkpoints"]["sf"]["vae"] = str(good)
    assert preflight(checked(config, tmp_path)) == []
    config = video_config(tmp_path)
    config["vae"] = str(good)
    config["checkpoints"]["sf"]["vae"] = str(broken)
    assert problems_of(config, tmp_path) == [f"checkpoints.sf.vae: {broken}: empty file (0 bytes)"]


def test_a_dit_of_other_latent_channels_is_reported(tmp_path):
    config = video_config(tmp_path)
    wan8 = write_wan_folder(tmp_path / "wan8", out_dim=8)
    config["checkpoints"]["sf"]["base"] = str(wan8)
    config["checkpoints"]["sf"]["vae"] = str(write_torch_zip(tmp_path / "Wan2.1_VAE.pth"))
    assert problems_of(config, tmp_path) == [
        "checkpoints.sf.vae: Wan2.1's VAE decodes 16 latent channels; checkpoints.sf makes 8 "
        "(out_dim): set videos: none"
    ]
    config = video_config(tmp_path, videos="none")
    config["checkpoints"]["sf"]["base"] = str(wan8)
    assert preflight(checked(config, tmp_path)) == []


def test_the_demos_vae_is_made_by_a_rule_and_never_reported(tmp_path):
    """In an empty workdir nothing of results/demo exists; the demo's config still passes."""
    config = copy.deepcopy(DEMO)
    assert config.get("videos", "closed_loop") != "none" and "vae" not in config
    checked(config, tmp_path)
    with chdir(tmp_path):
        assert not Path("results").exists()
        assert preflight(config) == []
