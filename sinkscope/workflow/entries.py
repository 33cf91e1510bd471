"""The schema-validated config read as objects: checkpoint specs and model configs, prompts,
sampler settings, the demo's folders. Shared by the checks and the rule params; runs while
Snakemake parses, so no torch.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import NamedTuple

from sinkscope.cache_choices import (
    PARTICIPATIVE_POLICIES,
    RECENT_POLICIES,
    SINK_POLICIES,
    TURNING_POLICIES,
)
from sinkscope.segments import Segment, SegmentError, parse_segments
from sinkscope.wan.config import WanConfig
from sinkscope.wan.layout import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    read_model_config,
    vae_dir,
    weight_files,
)
from sinkscope.wan.spec import CheckpointSpec

DEMO_DIR = "results/demo"
DEMO_WEIGHT_FILES = (CONFIG_NAME, WEIGHTS_NAME)


class ConfigError(ValueError):
    """A config.yaml problem; the message names the key or file."""


def demo_checkpoint_dir(name: str) -> str:
    return f"{DEMO_DIR}/{name}"


def demo_text_encoder_dir() -> str:
    return f"{DEMO_DIR}/text_encoder"


def checkpoint_spec(config: dict, name: str) -> CheckpointSpec:
    """The weights of checkpoint `name`, as the loader takes them."""
    return CheckpointSpec.from_entry(config["checkpoints"][name])


def _is_demo_path(config: dict, path: str) -> bool:
    made = {demo_checkpoint_dir(n) for n in config.get("demo", {}).get("checkpoints", {})}
    return Path(path).as_posix().rstrip("/") in made


def is_demo_checkpoint(config: dict, name: str) -> bool:
    """Whether checkpoint `name` is one the workflow makes itself (rule make_demo_models)."""
    return _is_demo_path(config, checkpoint_spec(config, name).base)


def demo_seed(config: dict, name: str) -> int:
    """The init seed of demo checkpoint `name` (demo.checkpoints)."""
    return config["demo"]["checkpoints"][Path(checkpoint_spec(config, name).base).name]


def checkpoint_inputs(config: dict, name: str) -> list[str]:
    """Files whose bytes define checkpoint `name`: the inputs of its extraction jobs."""
    spec = checkpoint_spec(config, name)
    if is_demo_checkpoint(config, name):
        return [f"{spec.base}/{file}" for file in DEMO_WEIGHT_FILES]
    try:
        files = spec.files()
    except CheckpointError as err:
        raise ConfigError(f"checkpoints.{name}: {err}") from None
    return [str(path) for path in files]


def model_config(config: dict, name: str) -> WanConfig:
    """The DiT config of a checkpoint: its config.json, or the demo model it will be made from."""
    if is_demo_checkpoint(config, name):
        from sinkscope.wan.demo import DEMO_MODEL

        return WanConfig.from_dict({**DEMO_MODEL, **config["demo"].get("model", {})}, "demo.model")
    try:
        return read_model_config(checkpoint_spec(config, name).base)
    except CheckpointError as err:
        raise ConfigError(f"checkpoints.{name}.base: {err}") from None


def token_layers(config: dict) -> list[int]:
    """Layers with token stores (`layers`), one extraction job each."""
    return sorted(config["layers"])


def listed_runs(config: dict, section: str, key: str = "runs") -> list[tuple[str, str]]:
    """The (checkpoint, prompt) pairs `config[section][key]` lists, or every pair without it."""
    runs = config[section].get(key)
    if runs is None:
        return [(c, p) for c in config["checkpoints"] for p in config["prompts"]]
    return [(c, p) for c, p in runs]


def token_runs(config: dict) -> list[tuple[str, str]]:
    """(checkpoint, prompt) pairs with a token store of every token layer:
    `capture.token_runs`, or every pair; none without token layers."""
    return listed_runs(config, "capture", "token_runs") if token_layers(config) else []


def token_stores(config: dict) -> list[tuple[str, str, int]]:
    """(checkpoint, prompt, layer) of every token store, one extraction job each: the token
    layers of `token_runs`, and in every run the token layers that are not surveyed (their frame
    datasets come from the token store)."""
    if not token_layers(config):
        return []
    runs = set(token_runs(config))
    surveyed = set(survey_layers(config))
    return [
        (c, p, layer)
        for c in config["checkpoints"]
        for p in config["prompts"]
        for layer in token_layers(config)
        if (c, p) in runs or layer not in surveyed
    ]


def survey_layers(config: dict) -> list[int]:
    """Layers with attention stores (`capture.survey`): none, every layer of the model (`all`,
    the same for every checkpoint), or the listed ones."""
    survey = config["capture"].get("survey", "none")
    if survey == "none":
        return []
    if survey != "all":
        return sorted(survey)
    counts = {name: model_config(config, name).num_layers for name in config["checkpoints"]}
    if len(set(counts.values())) > 1:
        raise ConfigError(
            f"capture.survey: all needs checkpoints with the same number of layers, got {counts}; "
            "list the layers to survey instead"
        )
    return list(range(next(iter(counts.values()))))


def frame_layers(config: dict) -> list[int]:
    """Every layer with a frame dataset and statistics: token layers and surveyed ones."""
    return sorted(set(token_layers(config)) | set(survey_layers(config)))


def closed_loop_policies(config: dict) -> list[str]:
    """The KV-cache policies rolled out in the closed loop (`closed_loop.policies`)."""
    return list(config.get("closed_loop", {}).get("policies", []))


def figure_runs(config: dict) -> list[tuple[str, str]]:
    """(checkpoint, prompt) pairs whose own figures are drawn: `figures.runs`, or every pair."""
    return listed_runs(config, "figures")


def closed_loop_runs(config: dict) -> list[tuple[str, str]]:
    """(checkpoint, prompt) pairs of the closed loop: `closed_loop.runs`, or every pair; none
    without policies."""
    return listed_runs(config, "closed_loop") if closed_loop_policies(config) else []


def closed_loop_rollouts(config: dict) -> list[str]:
    """The closed loop's rollouts of a run, in rollout order (every one captured with
    `closed_loop.survey`): the full-cache reference first (`closed_loop.reference: full`), then
    every policy; none without policies."""
    policies = closed_loop_policies(config)
    if not policies:
        return []
    reference = config["closed_loop"].get("reference", "full") == "full"
    return ["full", *policies] if reference else policies


def closed_loop_policy(config: dict, name: str) -> dict:
    """What the closed loop's policy `name` keeps (sinkscope.extraction.cache_policies): only the
    settings it uses, so that changing another policy's reruns nothing of it."""
    if name == "full":
        return {"name": "full"}
    loop, offline = config["closed_loop"], config["policies"]
    entry = {"name": name, "budget": loop.get("budget", offline["budget"])}
    if name in SINK_POLICIES:
        entry["sink_frames"] = loop["sink_frames"]
    if name in RECENT_POLICIES:
        entry["recent_frames"] = offline["recent_frames"]
    if name in PARTICIPATIVE_POLICIES:
        entry["capacity"] = offline["capacity"]
        entry["reuse_cap"] = offline["reuse_cap"]
    if name in TURNING_POLICIES:
        entry["turn"] = loop["sink_turn"]
    if name == "head_jitter":
        entry["jitter"] = loop["jitter"]
    if name == "logit_bias":
        entry["bias"] = loop["bias"]
    return entry


def sampler_settings(config: dict, name: str) -> dict:
    """The global sampler with the checkpoint's overrides."""
    return {**config["sampler"], **config["checkpoints"][name].get("sampler", {})}


# A prompts file: one prompt a line, as Self-Forcing's prompt lists (MovieGenVideoBench.txt).
PROMPT_NAME_WORDS = 5  # words of the prompt in its generated name
PROMPT_NAME_CHARS = 40  # at most, for those words


class FilePrompt(NamedTuple):
    """A prompt of `prompts_file`: its generated name, its text and its line (1-based)."""

    name: str
    text: str
    line: int


def prompt_file_name(index: int, text: str, width: int = 3) -> str:
    """`p{index}_{first words}`: the prompt's 0-based index among the file's prompts,
    zero-padded to `width`, then up to PROMPT_NAME_WORDS words of its text (accents dropped,
    lowercased, ASCII letters and digits only, joined by '_', at most PROMPT_NAME_CHARS
    characters). Depends on nothing but these arguments (no library version), so the same file
    always gives the same names; the index alone makes them unique."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    words = re.findall(r"[a-z0-9]+", ascii_text.lower())[:PROMPT_NAME_WORDS]
    slug = ""
    for word in words:
        longer = f"{slug}_{word}" if slug else word
        if len(longer) > PROMPT_NAME_CHARS:
            break
        slug = longer
    if not slug and words:  # a first word longer than the limit: cut it
        slug = words[0][:PROMPT_NAME_CHARS]
    number = f"p{index:0{width}d}"
    return f"{number}_{slug}" if slug else number


def read_prompts_file(path: str | Path, limit: int | None = None) -> list[FilePrompt]:
    """The prompts of a text file, one per line: surrounding whitespace stripped, blank lines and
    lines starting with '#' skipped; the first `limit` prompts if given. Names come from
    `prompt_file_name`, their index zero-padded to 3 digits or to the digits the file's whole
    count needs (so `limit` does not change them)."""
    path = Path(path)
    try:
        # Universal newlines (\n, \r\n, \r), as Python's `for line in file`; a BOM is dropped.
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ConfigError(f"prompts_file: not found: {path}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"prompts_file: {path}: not UTF-8 text (byte {err.start}: {err.reason})"
        ) from None
    except OSError as err:
        raise ConfigError(f"prompts_file: {path}: unreadable ({err.strerror})") from None
    found = [
        (number, line.strip())
        for number, line in enumerate(text.split("\n"), start=1)
        if line.strip() and not line.strip().startswith("#")
    ]
    width = max(3, len(str(len(found) - 1)))
    prompts = [
        FilePrompt(prompt_file_name(index, line, width), line, number)
        for index, (number, line) in enumerate(found)
    ]
    return prompts if limit is None else prompts[:limit]


def merge_prompts_file(config: dict) -> dict:
    """Add the prompts of `prompts_file` (first `prompts_limit`) after those of `prompts` and set
    `config["prompts"]` to the result, which every rule then reads; returns it. Idempotent: a
    name already there with the same text is kept. Raises ConfigError for an unreadable file or
    a generated name that `prompts` gives another text."""
    prompts = dict(config.get("prompts") or {})
    path = config.get("prompts_file")
    if path:
        limit = config.get("prompts_limit")
        limit = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
        for prompt in read_prompts_file(path, limit):
            if prompt.name in prompts and prompts[prompt.name] != prompt.text:
                raise ConfigError(
                    f"prompts_file: {path} line {prompt.line} is named {prompt.name!r}, which "
                    f"prompts.{prompt.name} gives another text; rename that prompt"
                )
            prompts[prompt.name] = prompt.text
    config["prompts"] = prompts
    return prompts


def repeated_prompts(config: dict) -> list[str]:
    """One line per text that several prompts share once `prompts_file` is merged (each of them
    a run of its own, the same video under one seed, twice the jobs), naming each by its file
    line or its `prompts` key. Warned, not refused: a prompt list may repeat a line on purpose,
    and the file's names follow its lines, so dropping one would rename the others."""
    lines = {}
    path = config.get("prompts_file")
    if path:
        lines = {prompt.name: prompt.line for prompt in read_prompts_file(path)}
    by_text: dict[str, list[str]] = {}
    for name in config["prompts"]:
        by_text.setdefault(prompt_text(config, name), []).append(name)
    warnings = []
    for text, names in by_text.items():
        if len(names) < 2:
            continue
        places = [
            f"{path} line {lines[name]} ({name})" if name in lines else f"prompts.{name}"
            for name in names
        ]
        shown = text if len(text) <= 60 else text[:57] + "..."
        warnings.append(
            f"{' and '.join(places)} have the same text ({shown!r}): {len(names)} runs of one "
            "video under one seed, each with its own jobs; delete all but one to run it once"
        )
    return warnings


def prompt_text(config: dict, name: str) -> str:
    """A prompt's text; a prompt of segments: their texts joined by ' | ' (as names and
    warnings show it; each segment is encoded on its own)."""
    return " | ".join(segment.text for segment in prompt_segments(config, name))


def prompt_segments(config: dict, name: str) -> list[Segment]:
    """A prompt's segments (`sinkscope.segments`): one from frame 0 for a plain prompt. Raises
    ConfigError naming `prompts.{name}` for a schedule that cannot run."""
    try:
        return parse_segments(config["prompts"][name], f"prompts.{name}")
    except SegmentError as err:
        raise ConfigError(str(err)) from None


def prompt_embeddings(config: dict, name: str) -> str | None:
    """The precomputed embeddings file of a prompt, if it brings one."""
    entry = config["prompts"][name]
    return entry.get("embeddings") if isinstance(entry, dict) else None


def uses_text_encoder(config: dict) -> bool:
    """Whether some prompt must be encoded (brings no precomputed embeddings); a prompts_file's
    prompts always are."""
    if config.get("prompts_file"):
        return True
    return any(prompt_embeddings(config, name) is None for name in config.get("prompts", {}))


def is_demo_encoder(encoder: dict) -> bool:
    """Whether text_encoder.path is the one rule make_demo_text_encoder writes."""
    return Path(encoder["path"]).as_posix().rstrip("/") == demo_text_encoder_dir()


# The token-sized exports of one run in results/export/{checkpoint}/{prompt}/ (rule export_run),
# by the name the rule and sinkscope.exports.notebooks give them; beside them layer{L}.pt.
EXPORT_TOKEN_FILES = {
    "figure4": "attention_cache_figure4.pt",
    "logit_cache": "attention_cache_wan_base.pt",
    "shapes_cache": "attention_cache.pt",
}


def token_passes(config: dict):
    """The passes the token stores capture (`capture.token_passes`, by default
    `capture.passes`): a spec for `resolve_passes`."""
    capture = config["capture"]
    spec = capture.get("token_passes")
    return capture["passes"] if spec is None else spec


def kept_token_layers(config: dict) -> list[int]:
    """Token layers whose token store holds logits and stays on disk after its reduction."""
    capture = config.get("capture", {})
    if not capture.get("keep_tokens", True) or not capture.get("tokens", True):
        return []
    return token_layers(config)


def export_layers(config: dict) -> list[int]:
    """Layers of the token-sized exports (`export.layers`): by default every kept token store."""
    layers = config.get("export", {}).get("layers")
    return kept_token_layers(config) if layers is None else sorted(layers)


def export_token_files(config: dict) -> dict[str, str]:
    """EXPORT_TOKEN_FILES, or none when no layer is exported."""
    return dict(EXPORT_TOKEN_FILES) if export_layers(config) else {}


# --- videos (Wan's VAE) -------------------------------------------------------------------------

DEMO_VAE_DIR = f"{DEMO_DIR}/vae"  # the demo's tiny VAE, a diffusers folder (rule make_demo_models)
VAE_FILE = "Wan2.1_VAE.pth"  # beside the base model, as the family's READMEs lay it out
VIDEO_SETTINGS = ("closed_loop", "all", "none")


def videos_setting(config: dict) -> str:
    """What is decoded to video (`videos`): the closed loop's rollouts, those and the surveys'
    (`all`), or nothing."""
    return config.get("videos", "closed_loop")


def vae_path(config: dict, name: str) -> str:
    """The VAE that decodes checkpoint `name`'s latents: its `vae`, else the shared `vae`, else
    the demo's VAE for a demo checkpoint, else `Wan2.1_VAE.pth` in its base folder."""
    own = config["checkpoints"][name].get("vae")
    if own:
        return own
    if config.get("vae"):
        return config["vae"]
    if is_demo_checkpoint(config, name):
        return DEMO_VAE_DIR
    return f"{Path(checkpoint_spec(config, name).base).as_posix().rstrip('/')}/{VAE_FILE}"


def vae_key(config: dict, name: str) -> str:
    """The config key that decides checkpoint `name`'s VAE, for messages."""
    if config["checkpoints"][name].get("vae"):
        return f"checkpoints.{name}.vae"
    if config.get("vae"):
        return "vae"
    return f"checkpoints.{name}"  # the default: Wan2.1_VAE.pth in its base folder


def is_demo_vae(path: str) -> bool:
    return Path(path).as_posix().rstrip("/") == DEMO_VAE_DIR


def vae_inputs(path: str) -> list[str]:
    """The files of a VAE: the file itself (Wan's .pth, a .safetensors), or a diffusers folder's
    config.json and weights (the folder, or a pipeline folder's vae/)."""
    if is_demo_vae(path):
        return [f"{DEMO_VAE_DIR}/{file}" for file in DEMO_WEIGHT_FILES]
    if not Path(path).is_dir():
        return [path]
    folder = vae_dir(path)
    try:
        weights = weight_files(folder)
    except CheckpointError as err:
        raise ConfigError(str(err)) from None
    return [str(folder / CONFIG_NAME), *map(str, weights)]


def video_runs(config: dict) -> list[tuple[str, str]]:
    """(checkpoint, prompt) pairs whose closed-loop rollouts are decoded (`videos` not none)."""
    return closed_loop_runs(config) if videos_setting(config) != "none" else []


def survey_video_runs(config: dict) -> list[tuple[str, str]]:
    """(checkpoint, prompt) pairs whose survey rollout is decoded (`videos: all`)."""
    if videos_setting(config) != "all" or not survey_layers(config):
        return []
    return [(c, p) for c in config["checkpoints"] for p in config["prompts"]]
