"""The files a config names, checked before any job runs: every missing or malformed file at
once, one line each, each starting with the key that names it (`preflight`).

`check_config` (sinkscope.workflow.checks) raises them together with `raise_problems`. The checks
read headers only (a config.json, a safetensors header, a torch file's first bytes), so they stay
cheap at parse time, and a file cut short in its tensor data still fails in its own job
(`--keep-going`). No torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from sinkscope.wan.cleaning import clean_prompt
from sinkscope.wan.layout import (
    CONFIG_NAME,
    INDEX_NAME,
    CheckpointError,
    is_diffusers,
    read_model_config,
)
from sinkscope.wan.lora_keys import lora_pairs, lora_shapes, torch_file_shapes

from .entries import (
    DEMO_DIR,
    ConfigError,
    checkpoint_inputs,
    is_demo_checkpoint,
    is_demo_encoder,
    is_demo_vae,
    merge_prompts_file,
    model_config,
    prompt_embeddings,
    prompt_segments,
    prompt_text,
    read_prompts_file,
    survey_video_runs,
    uses_text_encoder,
    vae_inputs,
    vae_key,
    vae_path,
    video_runs,
)
from .resources import VAE_Z_DIM  # Wan2.1's VAE: the latent channels it decodes


def raise_problems(problems: list[str]) -> None:
    """One ConfigError for all `problems`: a lone one as it is, several one per line."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        lines = "\n".join(f"  {problem}" for problem in problems)
        raise ConfigError(f"{len(problems)} problems, each with the key that names it:\n{lines}")


def preflight(config: dict) -> list[str]:
    """Every missing or malformed file a schema-validated config names, one line per problem,
    each starting with its key: `prompts_file` (merged into `prompts` here) and the prompts,
    the text encoder and the tokenizer, the checkpoints' files. Empty when all is well. Cheap:
    headers only, no torch (see the module docstring)."""
    return file_problems(config, merge_prompts(config))


def merge_prompts(config: dict) -> list[str]:
    """`entries.merge_prompts_file`, its failure as a problem (the explicit prompts stay)."""
    try:
        merge_prompts_file(config)
    except ConfigError as err:
        config["prompts"] = dict(config.get("prompts") or {})
        return [str(err)]
    if not config["prompts"] and not config.get("prompts_file"):
        return ["prompts: none given; list them under prompts, or name a prompts_file"]
    if not config["prompts"]:
        return [
            f"prompts_file: {config['prompts_file']}: no prompts in it (only blank lines and "
            "lines starting with '#') and none under prompts"
        ]
    return []


def file_problems(config: dict, merged: list[str] | None = None) -> list[str]:
    """The files of `preflight` in the config's order, for prompts already merged (`merged`:
    the problems of the merge)."""
    return [
        *_checkpoint_problems(config),
        *_vae_problems(config),
        *_text_encoder_problems(config),
        *(merged or []),
        *_prompt_problems(config),
    ]


# First bytes of a Git LFS pointer: a clone without `git lfs pull` leaves these small text files
# where the weights should be.
LFS_POINTER = b"version https://git-lfs.github.com/spec/"
# safetensors refuses headers above 100 MB; a first 8 bytes that say more are not a header.
SAFETENSORS_MAX_HEADER = 100_000_000
# The config.json keys without which a DiT's shape rests on defaults (Wan's original config.json
# of every released model carries them; diffusers' WanTransformer3DModel config too).
REQUIRED_MODEL_KEYS = ("dim", "ffn_dim", "num_heads", "num_layers")
REQUIRED_DIFFUSERS_KEYS = ("num_attention_heads", "attention_head_dim", "ffn_dim", "num_layers")
TOKENIZER_FILES = ("tokenizer.json", "spiece.model")
EMBEDDINGS_KEY = "prompt_embeds"  # as sinkscope.wan.text (which imports torch)


def _lfs_or_empty(path: Path, size: int) -> str | None:
    if size == 0:
        return f"{path}: empty file (0 bytes)"
    with open(path, "rb") as handle:
        if handle.read(len(LFS_POINTER)) == LFS_POINTER:
            return (
                f"{path}: a Git LFS pointer ({size} bytes), not the file itself: git lfs pull, "
                "or download it with hf download"
            )
    return None


def safetensors_header(path: Path) -> tuple[dict | None, str | None]:
    """(tensors of the header, None) of a safetensors file, or (None, what is wrong): reads the
    8-byte length and the JSON header only, never the tensors."""
    size = path.stat().st_size
    problem = _lfs_or_empty(path, size)
    if problem:
        return None, problem
    with open(path, "rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else 0
        if len(head) < 8 or not 2 <= length <= min(size - 8, SAFETENSORS_MAX_HEADER):
            return None, (
                f"{path}: not a readable safetensors file: its first 8 bytes give a header of "
                f"{length} bytes in a file of {size}"
            )
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"{path}: not a readable safetensors file: its header is not JSON ({err})"
    tensors = (
        {k: v for k, v in header.items() if k != "__metadata__"}
        if isinstance(header, dict)
        else None
    )
    if tensors is None or not all(
        isinstance(v, dict) and {"dtype", "shape", "data_offsets"} <= v.keys()
        for v in tensors.values()
    ):
        return None, (
            f"{path}: not a readable safetensors file: its header is not a map of tensors "
            "(dtype, shape, data_offsets)"
        )
    return tensors, None


def torch_file_problem(path: Path) -> str | None:
    """What is wrong with a torch.save file, from its first bytes: empty, a Git LFS pointer, or
    neither a zip archive (torch >= 1.6) nor a pickle (older torch.save)."""
    size = path.stat().st_size
    problem = _lfs_or_empty(path, size)
    if problem:
        return problem
    with open(path, "rb") as handle:
        head = handle.read(4)
    if not (head.startswith(b"PK\x03\x04") or head.startswith(b"\x80")):
        return (
            f"{path}: not a torch checkpoint (neither the zip archive of torch.save nor a "
            f"pickle; it starts with {head!r})"
        )
    return None


def _json_object(path: Path) -> tuple[dict | None, str | None]:
    """(the JSON object in `path`, None), or (None, what is wrong)."""
    try:
        values = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"{path}: not valid JSON ({err})"
    if not isinstance(values, dict):
        return None, f"{path}: not a JSON object but a {type(values).__name__}"
    return values, None


def _config_json_problem(path: Path) -> str | None:
    """A DiT config.json that is not JSON, not an object, lacks the keys that fix the model's
    shape, or that the model cannot take (unknown keys, an image-to-video model ...)."""
    values, problem = _json_object(path)
    if problem:
        return problem
    required = REQUIRED_DIFFUSERS_KEYS if is_diffusers(values) else REQUIRED_MODEL_KEYS
    missing = [key for key in required if key not in values]
    if missing:
        return f"{path}: lacks {missing}, which fix the model's shape (has {sorted(values)})"
    try:
        read_model_config(path.parent)
    except CheckpointError as err:
        return str(err)
    except (TypeError, ValueError) as err:  # e.g. "dim": "1536"
        return f"{path}: not a Wan config ({err})"
    return None


def _lora_problem(config: dict, name: str, path: Path) -> str | None:
    """What is wrong with checkpoint `name`'s LoRA file, from its keys and shapes against the
    model's linears (a safetensors header, or a torch.save archive's pickle: no tensor is read;
    a legacy pickle's shapes are checked when the job loads it)."""
    if path.suffix == ".safetensors":
        header, problem = safetensors_header(path)
        if problem:
            return problem
        shapes = {k: tuple(v["shape"]) for k, v in header.items()}
    else:
        problem = torch_file_problem(path)
        if problem:
            return problem
        try:
            state = torch_file_shapes(path)
            if state is None:
                return None
            shapes = lora_shapes(state, str(path))
        except CheckpointError as err:
            return str(err)
    try:
        linears = model_config(config, name).linear_shapes()
        lora_pairs(shapes, linears, str(path))
    except (CheckpointError, ConfigError) as err:
        return str(err)
    return None


def _checkpoint_problems(config: dict) -> list[str]:
    """Missing or malformed files of every checkpoint entry (demo checkpoints are made later)."""
    demo_checkpoints = config.get("demo", {}).get("checkpoints", {})
    problems = []
    for name, entry in config["checkpoints"].items():
        key = f"checkpoints.{name}"
        if is_demo_checkpoint(config, name):
            for file_key in ("generator", "lora"):
                if file_key in entry:
                    problems.append(f"{key}.{file_key}: a demo checkpoint takes no {file_key} file")
            continue
        try:
            paths = [Path(path) for path in checkpoint_inputs(config, name)]
        except ConfigError as err:  # an unreadable shard index
            problems.append(str(err))
            continue
        generator, lora = entry.get("generator"), entry.get("lora")
        for path in paths:
            if not path.is_file():
                hint = (
                    f" (demo checkpoints are made under {DEMO_DIR}/<name> for names in "
                    f"demo.checkpoints: {sorted(demo_checkpoints)})"
                    if demo_checkpoints
                    else ""
                )
                problems.append(f"{key}: checkpoint file not found: {path}{hint}")
                continue
            if lora is not None and path == Path(lora):
                problem, which = _lora_problem(config, name, path), "lora"
            elif generator is not None and path == Path(generator):
                problem, which = torch_file_problem(path), "generator"
            elif path.name == CONFIG_NAME:
                problem, which = _config_json_problem(path), "base"
            elif path.name == INDEX_NAME:
                continue  # read by checkpoint_inputs already
            else:
                problem, which = safetensors_header(path)[1], "base"
            if problem:
                problems.append(f"{key}.{which}: {problem}")
    return problems


def _vae_folder_problem(path: Path) -> str | None:
    """A diffusers VAE config.json: JSON, an AutoencoderKLWan of z_dim 16."""
    values, problem = _json_object(path)
    if problem:
        return problem
    kind = values.get("_class_name", "AutoencoderKLWan")
    if kind != "AutoencoderKLWan":
        return f"{path}: a {kind}, not Wan's VAE (diffusers' AutoencoderKLWan)"
    if values.get("z_dim", VAE_Z_DIM) != VAE_Z_DIM:
        return f"{path}: a VAE of z_dim {values['z_dim']}; Wan2.1's has z_dim {VAE_Z_DIM}"
    return None


def _vae_problems(config: dict) -> list[str]:
    """The VAE of every checkpoint whose rollouts are decoded (`videos`): there, readable
    headers, and a DiT whose latents have the VAE's 16 channels. Each VAE once."""
    try:
        runs = [*video_runs(config), *survey_video_runs(config)]
    except ConfigError:  # a checkpoint's config.json, which _checkpoint_problems reports
        runs = video_runs(config)
    problems, seen = [], set()
    for name in dict.fromkeys(c for c, _ in runs):
        path = vae_path(config, name)
        key = vae_key(config, name)
        try:
            channels = model_config(config, name).out_dim
        except ConfigError:  # reported by _checkpoint_problems
            channels = VAE_Z_DIM
        if channels != VAE_Z_DIM:
            problems.append(
                f"{key}: Wan2.1's VAE decodes {VAE_Z_DIM} latent channels; checkpoints.{name} "
                f"makes {channels} (out_dim): set videos: none"
            )
        if is_demo_vae(path) or path in seen:
            continue
        seen.add(path)
        if not Path(path).exists():
            problems.append(
                f"{key}: VAE not found (Wan2.1_VAE.pth beside base unless vae or "
                f"checkpoints.<name>.vae names one; videos: none decodes nothing): {path}"
            )
            continue
        try:
            files = [Path(file) for file in vae_inputs(path)]
        except ConfigError as err:
            problems.append(f"{key}: {err}")
            continue
        for file in files:
            if not file.is_file():
                problems.append(f"{key}: VAE file not found: {file}")
            elif file.name == CONFIG_NAME:
                problem = _vae_folder_problem(file)
                problems += [f"{key}: {problem}"] if problem else []
            elif file.suffix == ".safetensors":
                problem = safetensors_header(file)[1]
                problems += [f"{key}: {problem}"] if problem else []
            else:
                problem = torch_file_problem(file)
                problems += [f"{key}: {problem}"] if problem else []
    return problems


def _prompt_problems(config: dict) -> list[str]:
    """Prompts that clean to nothing, precomputed embeddings that are missing or malformed."""
    from_file = {}
    if config.get("prompts_file"):
        try:
            from_file = {p.name: p for p in read_prompts_file(config["prompts_file"])}
        except ConfigError:
            pass  # reported by the merge
    problems = []
    for name in config["prompts"]:
        path = prompt_embeddings(config, name)
        if path is not None:
            problem = _embeddings_problem(Path(path))
            if problem:
                problems.append(f"prompts.{name}.embeddings: {problem}")
        try:
            segments = prompt_segments(config, name)
        except ConfigError as err:
            problems.append(str(err))
            continue
        if len(segments) > 1:
            problems += [
                f"prompts.{name}.segments[{index}].text: {segment.text!r} is empty after Wan's "
                "prompt cleaning (HTML entities unescaped, whitespace collapsed)"
                for index, segment in enumerate(segments)
                if not clean_prompt(segment.text)
            ]
            continue
        text = prompt_text(config, name)
        if path is None and not clean_prompt(text):
            origin = from_file.get(name)
            where = (
                f" (prompts_file {config['prompts_file']}, line {origin.line})"
                if origin is not None and origin.text == text
                else ""
            )
            problems.append(
                f"prompts.{name}{where}: {text!r} is empty after Wan's prompt cleaning (HTML "
                "entities unescaped, whitespace collapsed): the encoder would see EOS only"
            )
    return problems


def _embeddings_problem(path: Path) -> str | None:
    """A precomputed embeddings file: present, a safetensors file with `prompt_embeds` of shape
    [L, d] or [1, L, d] (values are checked by the job that reads them)."""
    if not path.is_file():
        return f"file not found: {path}"
    tensors, problem = safetensors_header(path)
    if problem:
        return problem
    if EMBEDDINGS_KEY not in tensors:
        return f"{path}: no '{EMBEDDINGS_KEY}' tensor; it has {sorted(tensors)}"
    shape = tensors[EMBEDDINGS_KEY]["shape"]
    if not (len(shape) == 2 or (len(shape) == 3 and shape[0] == 1)) or 0 in shape:
        return f"{path}: '{EMBEDDINGS_KEY}' must be [L, d] or [1, L, d] with L, d > 0, got {shape}"
    return None


def _text_encoder_problems(config: dict) -> list[str]:
    """The text encoder, when some prompt is encoded: Wan's UMT5 .pth with a tokenizer folder, or
    a transformers folder (config.json; its tokenizer files unless text_encoder.tokenizer)."""
    if not uses_text_encoder(config):
        return []
    encoder = config.get("text_encoder")
    if encoder is None:
        return ["text_encoder: required, since some prompts bring no embeddings"]
    if is_demo_encoder(encoder):
        return []
    problems = []
    path = Path(encoder["path"])
    tokenizer = encoder.get("tokenizer")
    if not path.exists():
        problems.append(f"text_encoder.path: not found: {path}")
    elif path.is_file():
        problem = torch_file_problem(path)
        if problem:
            problems.append(f"text_encoder.path: {problem}")
        if not tokenizer:
            problems.append(
                f"text_encoder.tokenizer: required with Wan's encoder file {path} "
                "(the google/umt5-xxl tokenizer folder)"
            )
    else:
        config_json = path / CONFIG_NAME
        if not config_json.is_file():
            problems.append(
                f"text_encoder.path: {path} has no {CONFIG_NAME}: not a transformers "
                "UMT5EncoderModel folder"
            )
        else:
            try:
                json.loads(config_json.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                problems.append(f"text_encoder.path: {config_json}: not valid JSON ({err})")
    folder = Path(tokenizer or path)
    key = "text_encoder.tokenizer" if tokenizer else "text_encoder.path"
    if tokenizer and not Path(tokenizer).is_dir():
        problems.append(f"text_encoder.tokenizer: directory not found: {tokenizer}")
    elif folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        unset = "" if tokenizer else " (the tokenizer folder, as text_encoder.tokenizer is unset)"
        problems.append(
            f"{key}: {folder}{unset} holds neither {' nor '.join(TOKENIZER_FILES)}: not the "
            "google/umt5-xxl tokenizer files"
        )
    return problems
