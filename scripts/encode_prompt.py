"""Snakemake adapter: rule encode_prompt (encode the text, each segment's of a prompt of
segments; copy it from the prompt cache; or import precomputed embeddings)."""

from sinkscope.extraction.prompts import encode_prompt_job
from sinkscope.logs import job_log
from sinkscope.workflow.gpus import job_device

with job_log(snakemake.log[0]):
    params = snakemake.params
    encode_prompt_job(
        snakemake.output[0],
        params.text,
        params.segments,
        params.encoder,
        embeddings=snakemake.input.get("embeddings"),
        device=params.device,
        dtype=params.dtype,
        # From the config, not params: it decides whether the job fails, not its bytes.
        on_truncate=snakemake.config.get("text_encoder", {}).get("truncate", "warn"),
        claim=job_device,
    )
