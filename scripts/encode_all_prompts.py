"""Snakemake adapter: rule encode_all_prompts (every prompt into the prompt cache, the encoder
loaded once)."""

from sinkscope.extraction.prompts import fill_prompt_cache
from sinkscope.logs import job_log
from sinkscope.workflow.gpus import job_device

with job_log(snakemake.log[0]):
    fill_prompt_cache(
        snakemake.output[0],
        snakemake.params.cache["prompts"],
        snakemake.params.cache["encoder"],
        device=snakemake.params.device,
        dtype=snakemake.params.dtype,
        on_truncate=snakemake.config.get("text_encoder", {}).get("truncate", "warn"),
        claim=job_device,
    )
