# Config checks that need files or model facts, names used by every rule, input functions.
import re

from sinkscope.workflow.checks import check_config
from sinkscope.workflow.entries import (
    ConfigError,
    checkpoint_inputs,
    demo_text_encoder_dir,
    is_demo_checkpoint,
    prompt_text,
)
from sinkscope.workflow.params import (
    canonical,
    extraction_gpus,
    extraction_settings,
    prompt_encoder,
    prompt_inputs,
)
from sinkscope.workflow.resources import (
    REDUCE_MB,
    encode_gpus,
    encode_mem_mb,
    extract_mem_mb,
    extract_runtime,
    reduce_runtime,
)

try:
    check_config(config)
except ConfigError as err:
    raise WorkflowError(f"config.yaml: {err}") from None

CHECKPOINTS = list(config["checkpoints"])
PROMPTS = list(config["prompts"])
LAYERS = sorted(config["layers"])
FIGURE_FORMAT = config["figures"]["format"]
DEMO_CHECKPOINTS = list(config["demo"]["checkpoints"])
COMPARE_FIGURES = expand(
    "results/figures/compare/{name}.{fmt}",
    name=["checkpoints", "prompts", "passes"],
    fmt=FIGURE_FORMAT,
)


def token_store(path):
    """Token stores are temp() unless capture.keep_tokens: deleted once reduced."""
    return path if config["capture"]["keep_tokens"] else temp(path)


def checkpoint_files_input(wildcards):
    """A user's checkpoint files are ancient(): their sha256 in params decides reruns, not their
    mtime. Demo checkpoints are outputs of this workflow, rerun by the usual rules."""
    files = checkpoint_inputs(config, wildcards.checkpoint)
    return files if is_demo_checkpoint(config, wildcards.checkpoint) else ancient(files)


def one_of(names):
    return "|".join(map(re.escape, names)) or "(?!)"


wildcard_constraints:
    checkpoint=one_of(CHECKPOINTS),
    prompt=one_of(PROMPTS),
    layer=r"\d+",
