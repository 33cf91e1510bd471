# Config checks that need files or model facts, names used by every rule, input functions.
import os
import re
import sys

from sinkscope.analysis.figures import closed_loop_figures, compare_figures
from sinkscope.analysis.figures import policy_figures, run_figures
from sinkscope.analysis.figures import survey_compare_figures
from sinkscope.analysis.figures import survey_figures as survey_figure_files
from sinkscope.analysis.figures import video_figures
from sinkscope.workflow.checks import check_config
from sinkscope.workflow.plan import format_plan, job_disk_mb
from sinkscope.workflow.entries import (
    DEMO_VAE_DIR,
    ConfigError,
    closed_loop_rollouts,
    checkpoint_inputs,
    closed_loop_policies,
    closed_loop_runs,
    demo_text_encoder_dir,
    figure_runs,
    frame_layers,
    is_demo_checkpoint,
    prompt_text,
    survey_layers,
    survey_video_runs,
    token_layers,
    token_stores,
    vae_inputs,
    vae_path,
    video_runs,
)
from sinkscope.workflow.params import (
    canonical,
    closed_loop_settings,
    extraction_gpus,
    extraction_threads,
    extraction_settings,
    prompt_encoder,
    prompt_inputs,
    prompt_segment_params,
)
from sinkscope.workflow.prompt_cache import (
    PROMPT_CACHE,
    prompt_cache_inputs,
    prompt_cache_params,
)
from sinkscope.workflow.resources import (
    DECODE_MEM_MB,
    POLICIES_MINUTES,
    REDUCE_MB,
    closed_loop_runtime,
    encode_gpus,
    encode_mem_mb,
    encoder_mem_mb,
    extract_mem_mb,
    extract_runtime,
    reduce_runtime,
    survey_runtime,
    video_runtime,
)

# For envs/*.post-deploy.sh, which install this checkout into the --sdm conda envs.
os.environ.setdefault("SINKSCOPE_SOURCE", workflow.basedir)

try:
    check_config(config)
except ConfigError as err:
    raise WorkflowError(f"config: {err}") from None

CHECKPOINTS = list(config["checkpoints"])
PROMPTS = list(config["prompts"])
# Token stores (`layers`, one extraction job each), attention stores (`capture.survey`, one
# survey job per checkpoint and prompt), and every layer with a frame dataset and statistics.
TOKEN_LAYERS = token_layers(config)
# (checkpoint, prompt, layer) of every token store: capture.token_runs, and unsurveyed layers
TOKEN_STORES = token_stores(config)
SURVEY_LAYERS = survey_layers(config)
LAYERS = frame_layers(config)
# Frame datasets of surveyed layers come from their attention stores, the others' from tokens.
TOKEN_REDUCED_LAYERS = [layer for layer in TOKEN_LAYERS if layer not in SURVEY_LAYERS]
DEMO_CHECKPOINTS = list(config["demo"]["checkpoints"])
# The layers of figures.heads: what figure4 and the compare figures show.
HEAD_LAYERS = sorted({layer for layer, _ in config["figures"]["heads"]})
# Figure files from the registry; run figures keep {checkpoint} and {prompt} as wildcards.
# Per-layer and per-run figures show the token layers (the ones zoomed into) and those of
# figures.heads; figure4 and the compare figures the layers of figures.heads; the survey figures
# every surveyed layer.
RUN_FIGURE_LAYERS = sorted(set(TOKEN_LAYERS) | set(HEAD_LAYERS))
# The (checkpoint, prompt) pairs whose own figures are drawn (figures.runs).
FIGURE_RUNS = figure_runs(config)
RUN_FIGURES = run_figures(
    "results/figures/{checkpoint}/{prompt}",
    RUN_FIGURE_LAYERS,
    HEAD_LAYERS,
    config["figures"]["format"],
)
# Recall of the KV-cache policies, from the run's recall table (every frame layer).
POLICY_FIGURES = policy_figures(
    "results/figures/{checkpoint}/{prompt}", LAYERS, config["figures"]["format"]
)
SURVEY_FIGURES = survey_figure_files(
    "results/figures/{checkpoint}/{prompt}", SURVEY_LAYERS, config["figures"]["format"]
)
SURVEY_COMPARE_FIGURES = survey_compare_figures(
    "results/figures/compare", SURVEY_LAYERS, config["figures"]["format"]
)
COMPARE_FIGURES = compare_figures(
    "results/figures/compare", TOKEN_LAYERS, HEAD_LAYERS, config["figures"]["format"]
)

# The closed loop (Contract 6): policies rolled out, the (checkpoint, prompt) runs they are
# rolled out for, the layers captured inside those rollouts, and the figures across them.
CLOSED_LOOP_POLICIES = closed_loop_policies(config)
CLOSED_LOOP_RUNS = closed_loop_runs(config)
# the rollouts whose attention the closed loop captures (full and the frame-level policies)
CLOSED_LOOP_ROLLOUTS = closed_loop_rollouts(config)
CLOSED_LOOP_SURVEY = config["closed_loop"]["survey"] if CLOSED_LOOP_POLICIES else []
CLOSED_LOOP_FIGURES = (
    closed_loop_figures(
        "results/figures/compare",
        config["figures"]["format"],
        runs=len(CLOSED_LOOP_RUNS),
    )
    if CLOSED_LOOP_POLICIES
    else []
)

# Videos (`videos`): the closed-loop runs whose rollouts are decoded, the runs whose survey
# rollout is decoded too (`videos: all`), and the video figures of each closed-loop run.
VIDEO_RUNS = video_runs(config)
SURVEY_VIDEO_RUNS = survey_video_runs(config)
VIDEO_FIGURES = video_figures(
    "results/figures/{checkpoint}/{prompt}", config["figures"]["format"]
)

# What each extraction job claims of the `gpu` resource: nothing for CPU jobs on this machine.
GPU_PER_JOB = extraction_gpus(config, workflow.local_exec)
EXTRACT_THREADS = extraction_threads(config, workflow.local_exec)

# Before any job runs (and with -n): what the run will write and where; once, not in cluster jobs.
if not (workflow.remote_exec or workflow.subprocess_exec):
    print(format_plan(config), file=sys.stderr)

KEEP_TOKENS = config["capture"]["keep_tokens"]


def token_store(path):
    """Token stores are temp() unless capture.keep_tokens: deleted once reduced."""
    return path if KEEP_TOKENS else temp(path)


def checkpoint_files_input(wildcards):
    """A user's checkpoint files are ancient(): their sha256 in params decides reruns, not their
    mtime. Demo checkpoints are outputs of this workflow, rerun by the usual rules."""
    files = checkpoint_inputs(config, wildcards.checkpoint)
    return files if is_demo_checkpoint(config, wildcards.checkpoint) else ancient(files)


def vae_files_input(wildcards):
    """The files of the checkpoint's VAE: ancient() as a checkpoint's (the demo's are made)."""
    files = vae_inputs(vae_path(config, wildcards.checkpoint))
    return files if is_demo_checkpoint(config, wildcards.checkpoint) else ancient(files)


def closed_loop_stores(policy):
    """Attention stores captured inside a closed-loop rollout of `policy` (closed_loop.survey)."""
    return [
        directory(
            f"results/closed_loop/{{checkpoint}}/{{prompt}}/{policy}/layer{layer}.zarr"
        )
        for layer in CLOSED_LOOP_SURVEY
    ]


def one_of(names):
    return "|".join(map(re.escape, names)) or "(?!)"


wildcard_constraints:
    checkpoint=one_of(CHECKPOINTS),
    prompt=one_of(PROMPTS),
    layer=r"\d+",
